"""Command line: `python -m ppo_fabric` and the `ppo-fabric` script (a supervisor process that starts the
job, in which Fabric launches `fabric.devices` processes; see supervisor.py), and `ppo_fabric.run([...])`,
the job in-process without a supervisor. `fabric run ppo_fabric/<strategy>.py` starts
through `launch.run_script` in the strategy's own file.
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn

from omegaconf import DictConfig

from ppo_fabric import ppo, ppo_decoupled, supervisor
from ppo_fabric.config import ConfigError
from ppo_fabric.launch import StrategyMain, end_process, launch, start
from ppo_fabric.preflight import load

USAGE = """usage: python -m ppo_fabric [KEY=VALUE ...]   (also: ppo-fabric, fabric run ppo_fabric/ppo.py)

Hydra overrides, for example:
  env=lunarlander                  config group option (groups: algo env model fabric logger exp)
  env.id=Acrobot-v1                any gymnasium id, or my.module:MyEnv-v0
  algo.total_steps=1e6 algo.lr=3e-4
  fabric.devices=2                 two processes (gloo on CPU, NCCL on CUDA)
  strategy=decoupled               player and trainer ranks
  hydra.run.dir=runs/my-run        where outputs go
  resume=runs/my-run/checkpoints/last.ckpt
  resume=auto hydra.run.dir=runs/my-run   continue that run if it has a checkpoint, else start it
  restarts=2                       relaunch a failed job from its last checkpoint up to 2 times
"""

STRATEGIES: dict[str, StrategyMain] = {"coupled": ppo.main, "decoupled": ppo_decoupled.main}


def strategy_of(cfg: DictConfig) -> StrategyMain:
    return STRATEGIES[str(cfg.strategy)]


def run(overrides: list[str]) -> dict[str, Any]:
    """Train in this process (Fabric launches more for fabric.devices>1); returns rank 0's summary.

    Raises `ConfigError` for a config that cannot run. This is the Python API: `ppo_fabric.run([...])`.
    """
    cfg, run_dir, facts = load(list(overrides))
    if int(cfg.restarts) > 0:
        raise ConfigError(
            f"restarts={cfg.restarts} needs the supervisor of python -m ppo_fabric / ppo-fabric; "
            "ppo_fabric.run() trains in this process"
        )
    return launch(cfg, run_dir, facts, strategy_of(cfg))


def main(argv: list[str] | None = None) -> int:
    """`python -m ppo_fabric` and `ppo-fabric`: a config mistake is one line and status 2; returns the exit
    status. The command-line process supervises (a job of its own, restarts); the job it starts, and every
    process under `fabric run`, runs the strategy here directly."""
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(USAGE)
        return 0
    if supervisor.wanted():
        return supervisor.supervise(args)
    supervisor.bind_to_supervisor()
    start(args, strategy_of)
    return 0


def console_main() -> NoReturn:
    """`ppo-fabric` and `python -m ppo_fabric`: `main()`, then `end_process()` (a process of its own, unlike
    `main()`, which tests and notebooks may call in-process)."""
    end_process(main())
