"""Command line: `python -m ppo_fabric` and the `ppo-fabric` script, a Hydra app (app.py) whose plain run
supervises the job (supervisor.py) and whose multirun runs each job as a process of its own (sweep.py);
and `ppo_fabric.run([...])`, the run in-process. Every path trains through one `train(cfg)`;
`fabric run ppo_fabric/<strategy>.py` reaches it through `launch.run_script` in the strategy's own file.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from omegaconf import DictConfig

from ppo_fabric.app import prestart, supervisor
from ppo_fabric.app.hydra_app import Invocation, answer_check, run_app, settled_overrides
from ppo_fabric.app.process import end_process, stop_quietly_during_startup
from ppo_fabric.compat.imports import skip_torchmetrics_probe
from ppo_fabric.config.arguments import fail
from ppo_fabric.config.faults import FAULT_EXIT, SIGNAL_STOPS, RunComplete, RunFault
from ppo_fabric.config.tuned import quoted
from ppo_fabric.config.values import (
    ConfigError,
    check_values,
    compose,
    launched_world_size,
    under_fabric_run,
)

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


def train(
    cfg: DictConfig,
    run_dir: str | Path | None = None,
    overrides: list[str] | None = None,
    *,
    python_api: bool = False,
) -> dict[str, Any]:
    """Train the composed `cfg` in this process (Fabric launches more for fabric.devices>1) and return rank
    0's summary; `run_dir` defaults to the Hydra run's output directory, `overrides` (what a resume may
    change of the run's own config) to the Hydra run's; `python_api`: `run()`'s call. Raises `ConfigError`."""
    from ppo_fabric.app import launch

    return launch.train(cfg, strategy_of, run_dir, overrides, python_api=python_api)


def unpartial(env: Any) -> tuple[Any, dict[str, str]]:
    """(the factory, its keyword arguments as override values) for `functools.partial(factory, k=v)`: the
    keywords become `env.kwargs`, which every process and `load_policy` pass to the factory as a command
    line's `+env.kwargs.k=v` are. Positional arguments, and values no config can hold, are refused."""
    if not isinstance(env, functools.partial):
        return env, {}
    inner, kwargs = unpartial(env.func)
    if env.args:
        raise ConfigError(
            f"env={env!r}: give the partial's arguments as keywords; they reach the factory as env.kwargs"
        )
    for name, value in env.keywords.items():
        kwargs[name] = _override_literal(env, name, value)
    return inner, kwargs


def _override_literal(env: Any, name: str, value: Any) -> str:
    if isinstance(value, list | tuple) and not isinstance(value, str):
        return "[" + ",".join(_override_literal(env, name, v) for v in value) + "]"
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, int | float) and math.isfinite(value):
        return repr(value)
    if isinstance(value, str):
        return quoted(value)
    raise ConfigError(
        f"env={env!r}: {name}={value!r} cannot be written in the run's config (a number, a string, a bool, "
        "None or a list of them can); build it inside the factory"
    )


def env_reference(env: Any) -> str:
    """`env.id` for an env factory handed in from Python: `module:name`, which every process of the run
    (and `load_policy` later) rebuilds by importing, so only a module-level function or class will do."""
    if isinstance(env, str):
        return env
    module, name = getattr(env, "__module__", None), getattr(env, "__qualname__", "")
    if not callable(env) or module is None or not name.isidentifier():
        raise ConfigError(
            f"env={env!r} is not a module-level function or class; every process rebuilds the env by "
            "importing it, so define the factory at the top level of a module (a notebook's own cells count)"
        )
    found = getattr(sys.modules.get(module), name, None)
    if found is not env:
        raise ConfigError(f"env={env!r}: {module}.{name} does not name it; define it at a module's top level")
    return f"{module}:{name}"


def run(overrides: list[str], env: Any = None) -> dict[str, Any]:
    """Train in this process (a job of several processes: in a child, `_run_processes`); returns rank 0's
    summary. This is the Python API: `ppo_fabric.run([...])`.

    `env`: an env factory (a module-level function or class returning a gymnasium env), the same as
    `env.id=module:name`. Raises `ConfigError` for a config that cannot run; a `resume=auto` run that is
    complete says so and returns its summary."""
    if isinstance(overrides, str | bytes) or not all(isinstance(o, str) for o in overrides):
        # a string was read one character at a time ("cannot parse override 'a'")
        raise ConfigError(
            f"run() takes its overrides as a list of strings, e.g. run([{overrides!r}]); got {overrides!r}"
            if isinstance(overrides, str)
            else f"run() takes its overrides as a list of strings; got {overrides!r}"
        )
    with _aside_from_the_callers_hydra():
        return _run_here(list(overrides), env)


@contextmanager
def _aside_from_the_callers_hydra() -> Iterator[None]:
    """`run()` called from a user's own Hydra app (inside its `@hydra.main` function): Hydra is initialised
    there with the app's primary config, and composing ours raised "GlobalHydra is already initialized".
    The caller's Hydra is set aside for the run and given back after it, as it was."""
    from hydra.core.global_hydra import GlobalHydra

    callers = GlobalHydra.instance().hydra
    GlobalHydra.instance().clear()
    try:
        yield
    finally:
        GlobalHydra.instance().clear()
        if callers is not None:
            GlobalHydra.instance().initialize(callers)


def _run_here(overrides: list[str], env: Any) -> dict[str, Any]:
    if env is not None:
        given = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] == "env.id"]
        if given:  # the env argument won silently
            raise ConfigError(f"run() was given both env={env!r} and {given[0]}; pass one of them")
        factory, kwargs = unpartial(env)
        overrides.append(f"env.id={quoted(env_reference(factory))}")
        overrides.extend(f"+env.kwargs.{name}={value}" for name, value in kwargs.items())
    overrides = settled_overrides(overrides)
    cfg, run_dir = compose(overrides)
    check_values(cfg)
    if launched_world_size(cfg) > 1 and not under_fabric_run():
        return _run_processes(cfg, overrides, Path(run_dir))
    if int(cfg.restarts) > 0:
        raise ConfigError(
            f"restarts={cfg.restarts} needs the supervisor of python -m ppo_fabric / ppo-fabric; "
            "ppo_fabric.run() trains in this process (or give fabric.devices=2 or more)"
        )
    from ppo_fabric.app.launch import NeedsProcesses, callers_process_kept

    try:
        with callers_process_kept():  # the caller's threads, warnings and log levels, as they were
            return train(cfg, run_dir, overrides, python_api=True)
    except NeedsProcesses:  # a resumed run's own config asks for several processes
        return _run_processes(cfg, overrides, Path(run_dir))
    except RunComplete as done:
        supervisor.say(str(done))
        # A later session that failed before its first checkpoint moved the summary aside (runs/session.py)
        # and left the run where that summary says it ended.
        for name in ("summary.json", "summary.previous.json"):
            summary = Path(run_dir) / name
            if summary.is_file():
                return json.loads(summary.read_text())
        return {}


def _run_processes(cfg: DictConfig, overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """`ppo_fabric.run()` of a job of several processes: the job runs as `python -m ppo_fabric` would run
    it, in a child process with its supervisor, its output copied here. Launched from this process,
    Lightning would start the other ranks by running the caller's script again (every `run()` before this
    one trained again) or the notebook's kernel. Its failure is raised as the in-process run's would be."""
    import signal

    from ppo_fabric.app.jobs import run_attached

    if str(cfg.env.id).startswith("__main__:"):
        raise ConfigError(
            f"env.id={cfg.env.id}: a job of {launched_world_size(cfg)} processes rebuilds the env in each, and "
            "they cannot import the calling script or notebook; define the factory in a module (a .py file)"
        )
    status, lines = run_attached(overrides, run_dir, sys.stdout)
    # the cause: the first error a rank reported (the supervisor's last line says only that a rank failed)
    errors = [line for line in lines if line.startswith("ppo-fabric: error: ")]
    said = (errors or lines or [""])[0 if errors else -1].removeprefix("ppo-fabric: ").removeprefix("error: ")
    if status == 0:
        summary = run_dir.resolve() / "summary.json"
        return json.loads(summary.read_text()) if summary.is_file() else {}
    if status == 2:
        raise ConfigError(said or "the job refused its config (exit 2)")
    if status == 128 + signal.SIGINT:
        raise KeyboardInterrupt(said)
    # SIGTERM, SIGHUP, SIGUSR1/2: the job stopped with a checkpoint; end as the process would
    if status in SIGNAL_STOPS:
        raise SystemExit(status)
    raise RunFault(said or f"the job ended with exit status {status}")


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
    except RunComplete as done:  # checked before Hydra made the directory; here for a fabric-run rank
        supervisor.say(str(done))
        return 0
    except RunFault as fault:  # a 1-process run that went wrong: its cause in one line, exit non-zero
        if os.environ.get("PPO_FABRIC_TRACEBACK"):  # as the ranks of a multi-process job print theirs
            traceback.print_exc()
        supervisor.say(f"error: {fault}")
        return FAULT_EXIT
    except OSError as exc:  # the machine's, not the run's: a full disk or a lost permission while writing
        # metrics.csv or summary.json; one line, as every rank of a multi-process job reports any failure
        if os.environ.get("PPO_FABRIC_TRACEBACK"):
            traceback.print_exc()
        supervisor.say(f"error: {type(exc).__name__}: {exc}".splitlines()[0])
        return FAULT_EXIT
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m ppo_fabric` and `ppo-fabric`: Hydra's command line; a config mistake is one line and
    status 2; returns the exit status. `main()` may run in-process (tests, notebooks)."""
    args = list(sys.argv[1:] if argv is None else argv)
    supervised = not supervisor.wanted()
    if supervised:
        supervisor.bind_to_supervisor()
    invocation = run_app(args, _task, check=not supervised or under_fabric_run())
    if invocation.multirun:  # our launcher's jobs ran as processes: the sweep fails if one of them did
        from ppo_fabric.app.sweep import failed_jobs

        failed = failed_jobs()
        if failed:
            more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
            supervisor.say(f"{failed[0]}{more}")
            return invocation.status or 1
    return invocation.status


def _import_strategies() -> None:
    from ppo_fabric import ppo, ppo_decoupled  # noqa: F401  Lightning (~1 s): what the run itself needs


def console_main() -> NoReturn:
    """`ppo-fabric` and `python -m ppo_fabric`: `main()`, then `end_process()` (a process of its own, unlike
    `main()`, which tests and notebooks may call in-process). Lightning's import skips its torchmetrics
    probe here, in a process of ppo-fabric's own (compat/imports.py: ~9 s per process on a CUDA image).
    A supervising process starts its job's first process before its checks (app/prestart.py), so the
    job imports while they run: torch for the checks it answers, then Lightning and the strategies once
    they let the run start (a refused command ends ~1 s sooner, never importing them)."""
    stop_quietly_during_startup()
    supervisor.bind_to_caller()
    skip_torchmetrics_probe()
    gate = prestart.gate()
    if gate is not None:  # a job's first process, started before its supervisor's checks
        inherited = dict(os.environ)
        supervisor.bind_to_supervisor()
        from ppo_fabric.app import preflight  # noqa: F401  torch, gymnasium: what the checks it answers need

        prestart.await_handover(gate[0], inherited, gate[1], answer_check, _import_strategies)
        _import_strategies()  # handed over unasked (the supervisor checked in-process): the run needs them
    if supervisor.wanted() and prestart.runs_a_job(sys.argv[1:]):
        prestart.start(sys.argv[1:], supervisor.job_environment())
    try:
        code = main()
    finally:
        prestart.discard()  # not handed over: the command ran no job, or its checks refused it
    end_process(code)
