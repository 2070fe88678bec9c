"""Command line: `python -m ppo_fabric` and the `ppo-fabric` script, a Hydra app (app.py) whose plain run
supervises the job (supervisor.py) and whose multirun runs each job as a process of its own (sweep.py);
and `ppo_fabric.run([...])`, the run in-process. Every path trains through one `train(cfg)`;
`fabric run ppo_fabric/<strategy>.py` reaches it through `launch.run_script` in the strategy's own file.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from omegaconf import DictConfig

from ppo_fabric.app import supervisor
from ppo_fabric.app.hydra_app import Invocation, run_app
from ppo_fabric.app.process import end_process
from ppo_fabric.config.arguments import fail
from ppo_fabric.config.faults import FAULT_EXIT, RunFault
from ppo_fabric.config.values import ConfigError, check_values, compose, under_fabric_run

if TYPE_CHECKING:
    from ppo_fabric.app.launch import StrategyMain


def strategy_of(cfg: DictConfig) -> StrategyMain:
    """The strategy's `main`, imported here: the supervising process never imports a strategy (nor
    Lightning, seconds of every command's start)."""
    if str(cfg.strategy) == "decoupled":
        from ppo_fabric.ppo_decoupled import main
    else:
        from ppo_fabric.ppo import main
    return main


def train(cfg: DictConfig, run_dir: str | Path | None = None) -> dict[str, Any]:
    """Train the composed `cfg` in this process (Fabric launches more for fabric.devices>1) and return rank
    0's summary; `run_dir` defaults to the Hydra run's output directory. Raises `ConfigError`."""
    from ppo_fabric.app import launch

    return launch.train(cfg, strategy_of(cfg), run_dir)


def run(overrides: list[str]) -> dict[str, Any]:
    """Train in this process; returns rank 0's summary. This is the Python API: `ppo_fabric.run([...])`.

    Raises `ConfigError` for a config that cannot run."""
    cfg, run_dir = compose(list(overrides))
    check_values(cfg)
    if int(cfg.restarts) > 0:
        raise ConfigError(
            f"restarts={cfg.restarts} needs the supervisor of python -m ppo_fabric / ppo-fabric; "
            "ppo_fabric.run() trains in this process"
        )
    return train(cfg, run_dir)


def _task(cfg: DictConfig, invocation: Invocation) -> int:
    """The Hydra app's task function. The command-line process (checked before Hydra made the run
    directory, see app.precheck) supervises the job; the job, and each of its ranks, trains."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    if supervisor.wanted():
        if hydra_cfg.mode == RunMode.MULTIRUN:  # a job of another launcher (e.g. basic): its own overrides
            invocation = replace(invocation, overrides=list(hydra_cfg.overrides.task))
        return supervisor.supervise(cfg, run_dir, invocation)
    try:
        train(cfg, run_dir)
    except ConfigError as exc:
        fail(str(exc))
    except RunFault as fault:  # a 1-process run that went wrong: its cause in one line, exit non-zero
        supervisor.say(f"error: {fault}")
        return FAULT_EXIT
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m ppo_fabric` and `ppo-fabric`: Hydra's command line; a config mistake is one line and
    status 2; returns the exit status. `main()` may run in-process (tests, notebooks)."""
    args = list(sys.argv[1:] if argv is None else argv)
    supervised = not supervisor.wanted()
    if supervised:
        supervisor.bind_to_supervisor()
    return run_app(args, _task, check=not supervised or under_fabric_run()).status


def console_main() -> NoReturn:
    """`ppo-fabric` and `python -m ppo_fabric`: `main()`, then `end_process()` (a process of its own, unlike
    `main()`, which tests and notebooks may call in-process)."""
    end_process(main())
