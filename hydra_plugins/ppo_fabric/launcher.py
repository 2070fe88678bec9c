"""`hydra/launcher=ppo_fabric`, the default launcher of `python -m ppo_fabric -m ...`: each job runs as
`python -m ppo_fabric <job overrides> hydra.run.dir=<job dir>`, a process of its own (see ppo_fabric/app/sweep.py).

Hydra only instantiates launchers defined under `hydra_plugins`; the work is done in `ppo_fabric.app.sweep`.
No `from __future__ import annotations`: Hydra executes plugin modules outside sys.modules, where a
dataclass with string annotations cannot be built.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher


@dataclass
class ProcessLauncherConf:
    _target_: str = "hydra_plugins.ppo_fabric.launcher.ProcessLauncher"
    n_jobs: int = 1  # jobs running at the same time (each with its fabric.devices processes)


ConfigStore.instance().store(
    group="hydra/launcher", name="ppo_fabric", node=ProcessLauncherConf, provider="ppo-fabric"
)


class ProcessLauncher(Launcher):
    def __init__(self, n_jobs: int = 1) -> None:
        from ppo_fabric.app.sweep import Sweep

        self.sweep = Sweep(n_jobs)

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        self.sweep.setup(hydra_context, config)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        return self.sweep.launch(job_overrides, initial_job_idx)
