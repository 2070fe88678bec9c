"""The Hydra application behind `python -m ppo_fabric`, `ppo-fabric` and `fabric run ppo_fabric/<strategy>.py`.

Hydra's own argument parser and entry (`get_args_parser`, `_run_hydra`, what `@hydra.main` calls) give the
whole Hydra command line: `-m/--multirun`, `--cfg`, `--resolve`, `--info`, `--help`, `--config-path`,
`--config-name`, `--config-dir` and launcher/sweeper plugins. This module adds what Hydra does not do:

- a config mistake is one line and exit 2 *before* Hydra creates the run directory and before any
  process starts (Hydra's run mode makes the output directory before it calls the task function);
- a relative `--config-path` is relative to the working directory (Hydra would read it relative to the
  `ppo_fabric` package), and `version_base` 1.3 keeps the working directory (relative `resume=` paths work);
- under `fabric run`/torchrun, where every rank runs this same command line, `-m` is refused (each rank
  would run the whole sweep) and `--cfg`/`--info` print on rank 0 only.

It imports no strategy: the command line (`cli`) and the strategy files (`launch.run_script`) hand their
task function in.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from ppo_fabric.app import prestart
from ppo_fabric.compat.private import hydra_args_parser, run_hydra
from ppo_fabric.config.arguments import fail
from ppo_fabric.config.faults import FAULT_EXIT, RunComplete
from ppo_fabric.config.tuned import quoted, with_tuned_values
from ppo_fabric.config.values import (
    ConfigError,
    check_values,
    compose,
    composer,
    config_dir,
    make_plugins_discoverable,
    under_fabric_run,
    without_sweeps,
)
from ppo_fabric.runs import lock

VERSION_BASE = "1.3"  # hydra.job.chdir defaults to false: the run keeps the user's working directory
CONFIG_NAME = "config"


@dataclass
class Invocation:
    """What the command line asked for, as a job's own command line needs it again."""

    overrides: list[str]
    config_path: str | None = None  # absolute, or pkg://...; None: ours
    config_name: str | None = None
    config_dir: str | None = None
    status: int = 0  # the task's exit status, set by the task function
    multirun: bool = False  # -m: a sweep, whose jobs' failures the command line reads after it (cli.main)
    checked: dict[str, Any] | None = (
        None  # the config as the job's first process checked it (a resume's, continued)
    )

    @property
    def flags(self) -> list[str]:
        """`--config-path/--config-name/--config-dir` for a job started with this invocation's config."""
        flags = []
        for name in ("config_path", "config_name", "config_dir"):
            value = getattr(self, name)
            if value is not None:
                flags.append(f"--{name.replace('_', '-')}={value}")
        return flags


Task = Callable[[DictConfig, Invocation], int]


def _absolute(path: str | None) -> str | None:
    if path is None or path.startswith(("pkg://", "file://")) or os.path.isabs(path):
        return path
    return os.path.abspath(path)


def parser() -> argparse.ArgumentParser:
    """Hydra's own parser; its usage errors become our one line and exit 2."""
    args_parser = hydra_args_parser()
    args_parser.prog = "python -m ppo_fabric"
    args_parser.error = lambda message: fail(f"{message}; see python -m ppo_fabric --help")  # type: ignore[method-assign]
    return args_parser


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0)


def settled_overrides(
    overrides: list[str], config_path: str | None = None, config_name: str | None = None
) -> list[str]:
    """The command line as every process of the run sees it: the env id's tuned values first
    (`tuned.with_tuned_values`, which reads a user's own primary config), and for `resume=<checkpoint>` without `hydra.run.dir` the checkpoint's
    own run directory, so that a resumed run goes on writing one metrics.csv, plot and summary (a
    checkpoint kept outside a `<run>/checkpoints/` folder starts a new directory as any run does)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    settled = with_tuned_values(list(overrides), config_path, config_name)
    try:
        parsed = OverridesParser.create().parse_overrides(settled)
    except Exception:  # Hydra's grammar errors have no common base; composing names the override
        return settled
    keys = {o.key_or_group for o in parsed}
    resume = [o for o in parsed if o.key_or_group == "resume" and not o.is_sweep_override()]
    if not resume or "hydra.run.dir" in keys:
        return settled
    value = resume[-1].value()
    if not isinstance(value, str) or value == "auto":
        return settled
    checkpoint = Path(value).resolve()
    if checkpoint.parent.name != "checkpoints" or not checkpoint.is_file():
        return settled
    return [*settled, f"hydra.run.dir={quoted(str(checkpoint.parent.parent))}"]


def precheck(invocation: Invocation, full: bool, sweep: bool = False) -> None:
    """One line and exit 2 for a config that cannot run, before Hydra makes any directory.

    `full`: a run (not a sweep, not `--cfg`): every check of `preflight.load`, environment included. A
    sweep's shared overrides are composed here; each job is checked by the launcher before any starts."""
    path, name = invocation.config_path, invocation.config_name or CONFIG_NAME
    try:
        # Composing first: a mistake in the command line itself is reported before torch and gymnasium
        # are imported for the checks that need them (seconds; `--cfg` and sweeps never need them).
        cfg, run_dir = compose(without_sweeps(list(invocation.overrides)), path, name, sweep=sweep)
        if sweep:
            check_sweep_values(list(invocation.overrides), path, name)
        if full and cfg.get("resume") is None:  # what `load` checks first, needing no torch: a mistaken
            # value is refused at once, not once the job's first process has imported torch to check it
            if lock.speaks_first():
                lock.refuse_if_held(run_dir)
            check_values(cfg)
        if full:
            invocation.checked = _checked_by_the_job(list(invocation.overrides), path, name)
        if full and invocation.checked is None:
            from ppo_fabric.app.preflight import load

            load(list(invocation.overrides), path, name)
    except ConfigError as exc:
        fail(str(exc))
    except RunComplete as done:  # a requeued `resume=auto` job whose run is finished: nothing to do
        if _rank() == 0:
            os.write(2, f"ppo-fabric: {done}\n".encode())
        raise SystemExit(0) from None


def precheck_searched(invocation: Invocation) -> None:
    """A run with `--config-dir`: the command line composed with that directory on the search path (as
    `hydra.searchpath`) and its values checked, one line and exit 2 before Hydra makes any directory. Hydra's
    own multi-line errors (exit 1), a YAML traceback, or an empty run directory came instead; the job does
    the checks that build the env."""
    assert invocation.config_dir is not None
    searched = [
        *without_sweeps(list(invocation.overrides)),
        f"hydra.searchpath=['file://{invocation.config_dir}']",
    ]
    try:
        cfg, _ = compose(searched, invocation.config_path, invocation.config_name or CONFIG_NAME)
        if cfg.get("resume") is None:
            check_values(cfg)
    except ConfigError as exc:
        fail(str(exc))


def _checked_by_the_job(overrides: list[str], path: str | None, name: str) -> dict[str, Any] | None:
    """The config as the job's first process, started before these checks (app/prestart.py), checked it
    for this process (a resume's: the run's own, continued): it has imported torch, which the checks need
    and this process then never does. Raises what they raise; None where no such process answered (the
    checks then run here)."""
    request = {"overrides": overrides, "config_path": path, "config_name": name, "env": dict(os.environ)}
    reply = prestart.ask(request)
    if reply is None or reply.get("unanswered"):
        return None
    if reply.get("said"):  # a check's stall timeout ended it, and it said why in one line
        raise SystemExit(FAULT_EXIT)
    if "exited" in reply:  # it could not check (a failed import, killed): the checks run here
        return None
    if "error" in reply:
        raise ConfigError(str(reply["error"]))
    if "complete" in reply:
        raise RunComplete(str(reply["complete"]))
    return dict(reply["config"])


def answer_check(request: dict[str, Any]) -> dict[str, Any]:
    """In the job's first process: `preflight.load` for its supervisor's `_checked_by_the_job`."""
    from ppo_fabric.app.preflight import load

    try:
        cfg, _, _ = load(list(request["overrides"]), request["config_path"], str(request["config_name"]))
    except ConfigError as exc:
        return {"error": str(exc)}
    except RunComplete as done:
        return {"complete": str(done)}
    except Exception:  # noqa: BLE001 - the supervisor checks again in-process: its traceback, as ever
        return {"unanswered": True}
    return {"config": OmegaConf.to_container(cfg)}


def check_sweep_values(overrides: list[str], path: str | None, name: str) -> None:
    """Every value of every sweep override composed, the other sweeps at their first value: a value that
    cannot compose (`model=mlp,nosuch`, `algo.nosuch=1,2`) ends the sweep in one line naming its first job,
    before Hydra makes the sweep's directory (its sweeper printed a many-line error, exit 1, and left the
    directory). Whole jobs are checked by the launcher before the first starts."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    lines = [o.input_line or "" for o in parsed]
    sweeps: dict[int, list[str]] = {}
    for i, override in enumerate(parsed):
        if override.is_sweep_override():
            try:
                sweeps[i] = [f"{override.get_key_element()}={v}" for v in override.sweep_string_iterator()]
            except Exception:  # a sweep the basic sweeper does not expand (interval): the launcher's to check
                return
    later = 1  # jobs run in itertools.product order: a value of sweep k is first at index * later sweeps
    for i in reversed(sweeps):
        values, stride = sweeps[i], later
        later *= len(values)
        for index, value in enumerate(values):
            job = [sweeps[j][0] if j in sweeps else line for j, line in enumerate(lines)]
            job[i] = value
            try:
                compose(job, path, name, sweep=True)
            except ConfigError as exc:
                shown = " ".join(o for o in job if not o.lstrip("+~").startswith("hydra."))
                fail(f"job {index * stride} ({shown}): {exc}")


def _resumes(invocation: Invocation) -> bool:
    given = [o.split("=", 1)[1] for o in invocation.overrides if o.startswith("resume=")]
    return bool(given) and given[-1] not in ("null", "None", "")


def resumed_config(invocation: Invocation) -> DictConfig:
    """What `--cfg job` shows for a resume: the config the run continues (its checkpoint's, with what the
    command line may change on top, as the run's checks make it), where Hydra would print the command
    line's defaults (CartPole's, for an Acrobot run resumed without repeating its overrides)."""
    from ppo_fabric.app.preflight import continue_run
    from ppo_fabric.runs.resume import resolve_auto

    path, name = invocation.config_path, invocation.config_name or CONFIG_NAME
    overrides = list(invocation.overrides)
    try:
        cfg, run_dir = compose(overrides, path, name)
        auto = resolve_auto(cfg, run_dir)
        if cfg.resume is not None:
            continue_run(cfg, overrides, composer(path, name), auto, run_dir)
    except ConfigError as exc:
        fail(str(exc))
    except RunComplete:
        pass  # the config it would have continued, shown as it stands
    return cfg


def run_app(argv: list[str], task: Task, check: bool = True) -> Invocation:
    """Run Hydra's command line `argv` with `task` as its task function; returns the invocation, whose
    `status` the task set. `check=False` leaves the run's checks to the task: a supervised job and its
    ranks, whose supervisor checked the same command line already (a rank that starts slower than
    `collectives.timeout` fails the job's rendezvous, so ranks do no work twice)."""
    from hydra import version

    args_parser = parser()
    args = args_parser.parse_intermixed_args(argv)  # flags anywhere: `env=x -m seed=1,2` works too
    if args.experimental_rerun is not None:
        fail("--experimental-rerun is not supported: it unpickles a file; rerun the overrides instead")
    modes = {"--run": args.run, "--multirun": args.multirun, "--cfg": args.cfg is not None,
             "--info": args.info is not None, "--shell-completion": args.shell_completion}  # fmt: skip
    if sum(map(bool, modes.values())) > 1:  # Hydra raised this as a traceback, exit 1
        fail(f"{' and '.join(k for k, v in modes.items() if v)} cannot be given together: choose one of "
             "--run, --multirun (-m), --cfg, --info and --shell-completion")  # fmt: skip
    args.config_path = _absolute(args.config_path)
    args.config_dir = _absolute(args.config_dir)
    if not args.multirun:  # a sweep's jobs settle their own command lines
        try:
            args.overrides = settled_overrides(list(args.overrides), args.config_path, args.config_name)
        except ConfigError as exc:
            fail(str(exc))
    invocation = Invocation(list(args.overrides), args.config_path, args.config_name, args.config_dir)
    shows = args.cfg is not None or args.info is not None or args.shell_completion
    if under_fabric_run():
        if args.multirun:
            fail(
                "-m/--multirun cannot run under fabric run/torchrun (every rank would run the whole sweep); "
                "run the sweep with python -m ppo_fabric -m ... and fabric.devices=N"
            )
        if (shows or args.help or args.hydra_help) and _rank() != 0:
            return invocation  # rank 0 prints it once
    # A run is checked whole; a sweep's shared overrides and --cfg are composed. --config-dir adds to the
    # search path in a way our compose cannot repeat: such a run's task does the checks.
    helps = args.help or args.hydra_help or args.info is not None or args.shell_completion
    if check and args.config_dir is None and not helps:
        precheck(invocation, full=not args.multirun and args.cfg is None, sweep=bool(args.multirun))
    elif check and not helps and not args.multirun and args.cfg is None:
        precheck_searched(invocation)
    if args.cfg in ("job", "all") and not args.multirun and args.config_dir is None and _resumes(invocation):
        if args.cfg == "all":  # Hydra would show the command line's job config, not the one the run continues
            fail("--cfg all with resume= shows the command line's config; --cfg job shows the config the "
                 "resumed run continues, --cfg hydra Hydra's own")  # fmt: skip
        shown = resumed_config(invocation)  # the run's, not the command line's
        if args.package:
            missing = object()
            shown = OmegaConf.select(shown, args.package, default=missing)
            if shown is missing:
                fail(f"--package {args.package}: no such key in the config the resumed run continues")
            print(f"# @package {args.package}")
        is_node = isinstance(shown, (DictConfig, ListConfig))
        print(OmegaConf.to_yaml(shown) if is_node else f"{shown}\n", end="")
        return invocation

    def task_function(cfg: DictConfig) -> Any:
        status = task(cfg, invocation)
        if not args.multirun:
            invocation.status = status
            return status
        # a job of a launcher that runs it in this process (basic): the sweep's status is its first failure,
        # and a job stopped by a signal stops the sweep
        invocation.status = invocation.status or status
        if status >= 128:
            raise SystemExit(status)
        return status

    version.setbase(VERSION_BASE)
    make_plugins_discoverable()
    run_hydra(
        args=args,
        args_parser=args_parser,
        task_function=task_function,
        config_path=str(config_dir()),
        config_name=CONFIG_NAME,
    )
    invocation.multirun = bool(args.multirun)
    return invocation
