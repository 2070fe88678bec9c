"""Command line: compose and validate the config, build Fabric, launch (or join) the processes, run.

Three entry points share this: `python -m ppo_fabric`, the `ppo-fabric` script (both let Fabric launch
`fabric.devices` processes) and `fabric run ... ppo_fabric/ppo.py` (processes exist already; Fabric
reads accelerator/devices/strategy from the `fabric run` flags and must not launch again).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any, NoReturn

USAGE = """usage: python -m ppo_fabric [KEY=VALUE ...]   (also: ppo-fabric, fabric run ppo_fabric/ppo.py)

Hydra overrides, for example:
  env=lunarlander                  config group option (groups: algo env model fabric logger exp)
  env.id=Acrobot-v1                any gymnasium id, or my.module:MyEnv-v0
  algo.total_steps=1e6 algo.lr=3e-4
  fabric.devices=2                 two processes (gloo on CPU, NCCL on CUDA)
  strategy=decoupled               player and trainer ranks
  hydra.run.dir=runs/my-run        where outputs go
  resume=runs/my-run/checkpoints/last.ckpt
"""


def _fail(message: str, code: int = 2) -> None:
    print(f"ppo-fabric: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


class ArgError(ValueError):
    """A bad `key=value` argument of the evaluate/export tools; `str()` is one line for the user."""


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def parse_key_values(argv: list[str], spec: dict[str, tuple[type, Any]]) -> dict[str, Any]:
    """Parse `key=value` arguments (the training CLI's syntax, without Hydra's composition machinery:
    these tools take a handful of flat keys) into typed values.

    `spec` maps each key to (type, default); a default of `...` makes the key required. Types are
    str, int and bool (true/false/1/0/yes/no). Raises ArgError naming the argument and the fix.
    """
    values: dict[str, Any] = {}
    for arg in argv:
        key, sep, raw = arg.partition("=")
        key = key.strip().lstrip("+")
        if not sep or not key:
            raise ArgError(f"cannot parse argument {arg!r}; write arguments as key=value")
        if key not in spec:
            raise ArgError(f"{key}: unknown argument; known: {', '.join(spec)}")
        kind = spec[key][0]
        if kind is bool:
            if raw.strip().lower() not in (*_TRUE, *_FALSE):
                raise ArgError(f"{key}={raw} must be true or false")
            values[key] = raw.strip().lower() in _TRUE
        elif kind is int:
            try:
                values[key] = int(float(raw)) if float(raw).is_integer() else int(raw)
            except ValueError:
                raise ArgError(f"{key}={raw} must be a whole number") from None
        else:
            values[key] = raw
    for key, (_, default) in spec.items():
        if key not in values:
            if default is ...:
                raise ArgError(f"{key} is required; set {key}=VALUE")
            values[key] = default
    return values


def _quiet_libraries() -> None:
    warnings.filterwarnings("ignore", message=".*is not a supported pipeline.*")
    warnings.filterwarnings("ignore", category=UserWarning, module="lightning.fabric.*")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    import logging

    for name in ("lightning.fabric", "lightning_fabric", "lightning.fabric.utilities.seed"):
        logging.getLogger(name).setLevel(logging.WARNING)


def describe_failure(exc: BaseException) -> str:
    """One line for a rank's failure; a broken collective means another rank died first."""
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    lost = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "timed out", "Timeout")
    if any(marker in text for marker in lost) or type(exc).__name__ == "DistBackendError":
        return f"lost contact with another rank (it failed, was killed, or is stuck): {text}"
    return text


def build_fabric(cfg: Any, world_size: int) -> Any:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    from ppo_fabric.collectives import GroupDDPStrategy

    timeout = datetime.timedelta(seconds=float(cfg.collectives.timeout))
    under_cli = bool(os.environ.get("LT_CLI_USED"))
    kwargs: dict[str, Any] = {}
    if not under_cli:  # `fabric run` flags decide these, and passing others would conflict
        kwargs = {
            "accelerator": cfg.fabric.accelerator,
            "devices": int(cfg.fabric.devices),
            "num_nodes": int(cfg.fabric.num_nodes),
            "precision": cfg.fabric.precision,
        }
    if world_size > 1 and cfg.fabric.strategy in ("auto", "ddp") and not os.environ.get("LT_STRATEGY"):
        ddp = GroupDDPStrategy if cfg.strategy == "decoupled" else DDPStrategy
        kwargs["strategy"] = ddp(timeout=timeout, start_method="popen")
    elif not under_cli:
        kwargs["strategy"] = cfg.fabric.strategy
    return Fabric(**kwargs)


def launch(cfg: Any, run_dir_template: str, facts: dict[str, Any]) -> dict[str, Any]:
    """Start the processes and run the chosen strategy on each; returns this rank's summary."""
    import torch

    if int(cfg.torch_threads) > 0:
        torch.set_num_threads(int(cfg.torch_threads))
    fabric = build_fabric(cfg, facts["world_size"])
    if not os.environ.get("LT_CLI_USED"):  # under `fabric run` the processes exist and are set up already
        fabric.launch()
    # Every process composed the config itself (at its own time); rank 0's run directory wins.
    run_dir = Path(fabric.broadcast(str(Path(run_dir_template).resolve()), src=0))
    from lightning.fabric.utilities.seed import seed_everything

    seed_everything(int(cfg.seed) + fabric.global_rank, verbose=False)
    if cfg.strategy == "decoupled":
        from ppo_fabric import ppo_decoupled as strategy
    else:
        from ppo_fabric import ppo as strategy
    try:
        summary = strategy.main(fabric, cfg, run_dir)
    except KeyboardInterrupt:
        if fabric.global_rank == 0:
            last = run_dir / "checkpoints" / "last.ckpt"
            hint = f"; continue with resume={last}" if last.exists() else ""
            os.write(2, f"ppo-fabric: interrupted{hint}\n".encode())
        os._exit(130)
    except Exception as exc:
        if fabric.world_size == 1:
            raise
        rank = fabric.global_rank
        if os.environ.get("PPO_FABRIC_TRACEBACK"):
            traceback.print_exc()
        # one write per line: ranks failing together must not interleave their messages
        os.write(2, f"ppo-fabric: error on rank {rank}: {describe_failure(exc)}\n".encode())
        os._exit(1)  # do not wait in atexit hooks for peers that may be stuck in a collective
    if fabric.global_rank == 0:
        ret = summary.get("final_mean_return")
        ret_text = "n/a" if ret is None else f"{ret:.1f}"
        print(
            f"ppo-fabric: {summary['strategy']} {summary['env_id']}: {summary['total_env_steps']} steps in "
            f"{summary['wall_seconds']:.1f}s ({summary['sps']:,.0f} steps/s), final mean return {ret_text}; "
            f"outputs in {run_dir}",
            flush=True,
        )
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return summary


def run(overrides: list[str]) -> dict[str, Any]:
    """Train in this process (Fabric launches more for fabric.devices>1); returns rank 0's summary.

    Raises `ConfigError` for a config that cannot run. This is the Python API: `ppo_fabric.run([...])`.
    """
    from ppo_fabric.config import load

    cfg, run_dir, facts = load(list(overrides))
    return launch(cfg, run_dir, facts)


def main(argv: list[str] | None = None, strategy: str | None = None) -> None:
    """Entry point of `python -m ppo_fabric` and `ppo-fabric`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(USAGE)
        return
    if strategy is not None:
        args = [a for a in args if not a.startswith("strategy=")] + [f"strategy={strategy}"]
    _quiet_libraries()
    from ppo_fabric.config import ConfigError

    try:
        run(args)
    except ConfigError as exc:
        _fail(str(exc))


def end_process(code: int = 0) -> NoReturn:
    """Leave the process without the interpreter's shutdown.

    A finished 2-process LunarLander run left its second rank stuck at exit for good: an exit hook of
    pygame (which gymnasium's Box2D module imports) was loading a C extension during finalisation, and the
    orphaned rank held its parent's output pipes open, so the launching command never returned. Everything
    a run owns (envs, logger, process group, checkpoints) is closed or written before this is called.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream: nothing left to say there
            stream.flush()
    os._exit(code)


def console_main() -> NoReturn:
    """`ppo-fabric` and `python -m ppo_fabric`: `main()`, then `end_process()` (a process of its own, unlike
    `main()`, which tests and notebooks may call in-process)."""
    main()
    end_process(0)


def run_script(strategy: str) -> NoReturn:
    """`fabric run ppo_fabric/<strategy file>.py [overrides]`: the file fixes the strategy."""
    given = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("strategy=")]
    if given and given[-1] != strategy:
        _fail(f"strategy={given[-1]} conflicts with the launched file, which runs strategy={strategy}")
    main(strategy=strategy)
    end_process(0)
