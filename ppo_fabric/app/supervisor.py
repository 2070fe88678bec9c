"""The process `python -m ppo_fabric` and `ppo-fabric` run as: a parent that is not a rank.

Under Fabric's own launcher the command-line process is rank 0: Lightning SIGKILLs it when another rank
exits non-zero, a terminal's Ctrl+C reaches only some processes, and nothing outlives a crash to restart
the job. So the command-line process checks the config, fixes the run directory once, and starts the job
(`python -m ppo_fabric ... hydra.run.dir=<that dir>`, which runs today's launch path) as a process group
of its own. It forwards SIGTERM/SIGINT to that group, leaves no process of it behind, and relaunches a
failed job from its newest checkpoint up to `restarts` times. Neither `fabric run`/torchrun (whose agent
plays this part) nor the in-process `ppo_fabric.run()` has one.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from ppo_fabric.app import prestart
from ppo_fabric.app.process import quiet_libraries
from ppo_fabric.compat.linux import PR_SET_CHILD_SUBREAPER, die_with_parent, drop_hung_up_terminal, prctl
from ppo_fabric.config.faults import (
    FAULT_EXIT,
    SIGNAL_REPEAT_S,
    SIGNAL_STOPS,
    STOP_SIGNALS,
    failed_child,
    forget_failed_child,
)
from ppo_fabric.config.tuned import override_value
from ppo_fabric.config.values import OWN_RUN_DIR_ENV, SUPERVISED_ENV, ConfigError, under_fabric_run
from ppo_fabric.runs import deadman, lock
from ppo_fabric.runs.metrics_file import read_rows, series, write_json

if TYPE_CHECKING:
    from ppo_fabric.app.hydra_app import Invocation

SUPERVISOR_PID_ENV = "PPO_FABRIC_SUPERVISOR_PID"  # the job's first process only: die with this parent
CALLER_PID_ENV = (
    "PPO_FABRIC_CALLER_PID"  # a job `ppo_fabric.run()` started: its supervisor dies with the caller
)
CONFIG_REFUSED = 2  # a relaunch whose config was refused fails the same way every time
GRACE_S = 5.0  # how long the job's other processes may outlive its first one before they are killed


def wanted() -> bool:
    """Whether this command-line process should supervise: not under `fabric run`/torchrun, not inside a
    job a supervisor started."""
    return not under_fabric_run() and not os.environ.get(SUPERVISED_ENV)


def job_environment() -> dict[str, str]:
    """The environment of the job's first process: supervised, and told which process to die with."""
    return dict(os.environ, **{SUPERVISED_ENV: "1", SUPERVISOR_PID_ENV: str(os.getpid())})


def say(text: str) -> None:
    os.write(2, f"ppo-fabric: {text}\n".encode())  # one write: never interleaved with a rank's line


def bind_to_supervisor() -> None:
    """In the job's first process: die with the supervisor, so a SIGKILLed supervisor leaves no job behind
    (the other ranks then lose rank 0 and end as they always did). The variable is removed so that ranks
    this process launches do not look for a parent they do not have."""
    pid = os.environ.pop(SUPERVISOR_PID_ENV, None)
    if pid is None:
        return
    if not die_with_parent(int(pid)):  # the supervisor died before the signal was armed: nobody watches
        os._exit(137)


def bind_to_caller() -> None:
    """In a supervisor that `ppo_fabric.run()` started (`jobs.run_attached`): die with the calling process
    (a notebook kernel restarted, a script killed), and the job with it, instead of training on unwatched
    in a session of its own. Popped, so that the job's processes do not inherit it."""
    pid = os.environ.pop(CALLER_PID_ENV, None)
    if pid is not None and not die_with_parent(int(pid)):
        os._exit(137)


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _value(path: Path) -> str:
    """A path as an override value: quoted when Hydra's grammar would read its characters otherwise."""
    return override_value(str(path))


def with_override(args: list[str], key: str, value: Path) -> list[str]:
    """`args` with every override of `key` replaced by one setting it to `value`."""
    return [a for a in args if _key(a) != key] + [f"{key}={_value(value)}"]


def exit_status(returncode: int) -> int:
    """A process status as a shell reports it: killed by signal N -> 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def last_logged_step(metrics_csv: Path) -> int | None:
    """The env step of metrics.csv's last row: how far the failed attempt had come."""
    steps = series(read_rows(metrics_csv), "step")
    return int(steps[-1][0]) if steps else None


def record_restarts(summary_json: Path, restarts: int, redone: int | None) -> None:
    """Add the restarts and the env steps trained twice (None: not known, no metrics.csv to tell) to the
    run's summary, keeping its other keys."""
    if not summary_json.is_file():
        return
    summary = json.loads(summary_json.read_text())
    summary.update(restarts=restarts, env_steps_redone=redone)
    write_json(summary_json, summary)


def restarted_line(summary_json: Path, restarts: int, redone: int | None) -> str:
    """What a job that ended well after restarts did, after its last attempt's final line (which counts
    that attempt's session alone: a command that trained 4,096 -> 20,224 env steps said 5,888)."""
    try:
        total = f" reached {int(json.loads(summary_json.read_text())['total_env_steps']):,} env steps"
    except (OSError, ValueError, KeyError, TypeError):
        total = " ended"
    twice = "not known" if redone is None else f"{redone:,}"
    return (
        f"the run{total} after {restarts} restart{'s' if restarts > 1 else ''} ({twice} env steps trained "
        "twice); the line above counts its last attempt alone"
    )


class Job:
    """One attempt at a time of the job, as a process group, and the signals meant for it."""

    def __init__(self, run_dir: Path, timeout_s: float) -> None:
        """`timeout_s`: how long a job may take to stop after a forwarded signal before it is killed (its
        ranks finish the rollout and the update, then checkpoint; `job_stop_timeout`)."""
        self.run_dir, self.timeout_s = run_dir, timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.stop_signal: int | None = None  # the first stop signal received
        self.first_signal_at = 0.0
        self.signals = 0
        self.kill_at: float | None = None  # after a forwarded signal: when waiting longer is pointless
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_signal)
        # (Linux; elsewhere the ranks' own timeouts) ranks orphaned by rank 0's death come back to be reaped here
        self.reaper = prctl(PR_SET_CHILD_SUBREAPER, 1)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        now = time.monotonic()
        if signum == signal.SIGHUP:
            drop_hung_up_terminal()
        if signum == self.stop_signal and now - self.first_signal_at < SIGNAL_REPEAT_S:
            return  # the same request delivered twice (the cluster's, and a sweep's or tuner's forward)
        self.signals += 1
        if self.stop_signal is None:
            self.stop_signal, self.first_signal_at = signum, now
        self._forward()

    def _forward(self) -> None:
        """The first signal goes to every process of the job as it is; a later one (or another signal)
        kills them at once, with a line: the checkpoints stay as the job last wrote them."""
        if self.proc is None or self.stop_signal is None:
            return
        if self.signals > 1:
            saved = (self.run_dir / "checkpoints" / "last.ckpt").is_file()
            kept = "its checkpoints stay as it last wrote them" if saved else "it had written no checkpoint"
            os.write(2, f"ppo-fabric: a second stop signal: killed the job at once; {kept}\n".encode())
        self._kill_group(self.stop_signal if self.signals == 1 else signal.SIGKILL)
        if self.kill_at is None:
            self.kill_at = time.monotonic() + self.timeout_s + GRACE_S

    def _kill_group(self, signum: int) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signum)

    def run(self, args: list[str]) -> int:
        """Start `python -m ppo_fabric args` as a new process group, wait for it, end what is left of the
        group; returns the job's exit status."""
        if self.stop_signal is not None:
            return 128 + self.stop_signal
        env = job_environment()
        env[OWN_RUN_DIR_ENV] = str(self.run_dir)
        forget_failed_child(self.run_dir)
        self.proc = prestart.take(args, env)  # the first attempt's process, started before the checks
        if self.proc is None:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ppo_fabric", *args], env=env, start_new_session=True
            )
        self._forward()  # a signal that came while the process was being started
        status = exit_status(self._wait())
        if status == 128 + signal.SIGKILL and self.stop_signal is None and failed_child(self.run_dir):
            status = FAULT_EXIT  # Fabric's launcher killed the first process after a rank's failure
        if status != 0:
            hung = deadman.report(self.run_dir)  # a process C code held, ended by its watchdog's timer
            if hung is not None:
                say(f"error: {hung}")
        failed = status != 0 and status not in SIGNAL_STOPS and self.stop_signal is None
        self._end_group(0.0 if failed else min(GRACE_S, self.timeout_s))
        self.proc = None
        return status

    def _wait(self) -> int:
        assert self.proc is not None
        while True:
            try:
                return self.proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                if self.kill_at is not None and time.monotonic() > self.kill_at:
                    self.kill_at = None
                    say(f"the job had not stopped {self.timeout_s + GRACE_S:.0f} s after the signal "
                        "(collectives.timeout + stall_timeout): killed; its checkpoints stay as they were")  # fmt: skip
                    self._kill_group(signal.SIGKILL)

    def _end_group(self, grace_s: float) -> None:
        """Give the group's other processes `grace_s` to finish, then SIGKILL what remains and wait until
        it is gone, so that a relaunch never meets processes of the previous attempt."""
        assert self.proc is not None
        deadline = time.monotonic() + grace_s
        while self._group_alive():
            if time.monotonic() >= deadline:
                self._kill_group(signal.SIGKILL)
                if time.monotonic() > deadline + 10:
                    say(f"processes of the job (group {self.proc.pid}) survived SIGKILL for 10 s")
                    return
            time.sleep(0.05)

    def _group_alive(self) -> bool:
        """Whether a process of the job's group is left. Asked of the processes that descend from this
        one (its subreaper), not of the group id: the job's first process is reaped by now, so once its
        group is empty the kernel may give its pid to an unrelated new session (pid_max is 32768 on many
        machines), and `killpg` would take that session for the job's and kill it."""
        assert self.proc is not None
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0] > 0:  # reap orphaned ranks (this process is their reaper)
                pass
        members = group_descendants(self.proc.pid) if self.reaper else None
        if members is not None:
            return bool(members)
        try:  # no /proc to read, or orphans not ours: the group id is all there is to ask
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def group_descendants(pgid: int) -> list[int] | None:
    """Pids of this process's descendants in process group `pgid` (None without a readable /proc): the
    members whose parent is this process, or another such member."""
    parents: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for name in entries:
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{name}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
            if fields[0] != b"Z" and int(fields[2]) == pgid:  # state, ppid, pgrp
                parents[int(name)] = int(fields[1])
    found: set[int] = set()
    grown = {os.getpid()}
    while grown:
        grown = {pid for pid, parent in parents.items() if parent in grown and pid not in found}
        found |= grown
    return sorted(found)


def supervise(cfg: DictConfig, run_dir: Path, invocation: Invocation) -> int:
    """Run the job of a checked config under supervision in `run_dir`; returns the exit status for the
    command. The job is the same command line (`--config-*` flags, overrides) with `hydra.run.dir` fixed.

    The supervisor holds the run directory's lock (`runs.lock`) for all attempts, so that no other run
    writes there between a failure and its relaunch; the job's processes do not lock. A directory in use by
    a live run is refused like a config mistake: one line, status 2 (returned: a sweep goes on). In a
    multi-node job only node 0's supervisor locks: the other nodes' commands name the same directory (a
    shared file system: one run), and were refused as "in use" while node 0 waited for them until
    `collectives.timeout`."""
    quiet_libraries()
    run_dir = Path(run_dir).resolve()
    held: lock.RunDirLock | None = None
    try:
        if lock.node_rank() == 0:
            held = lock.acquire(run_dir)
        try:
            config = run_config(cfg, run_dir, list(invocation.overrides), invocation.checked)
        except BaseException:
            if held is not None:
                held.release()
            raise
        # NODE_RANK set, yet one node: with `resume=auto` another node's command line may leave
        # fabric.num_nodes to the checkpoint, so the run's own config decides
        if held is None and int(config.fabric.num_nodes) == 1:
            held = lock.acquire(run_dir)
    except ConfigError as exc:
        print(f"ppo-fabric: error: {exc}", file=sys.stderr, flush=True)  # as config.arguments.fail
        return CONFIG_REFUSED
    with held if held is not None else contextlib.nullcontext():
        return _attempts(config, run_dir, invocation)


def run_config(
    cfg: DictConfig, run_dir: Path, overrides: list[str], checked: dict[str, Any] | None = None
) -> DictConfig:
    """The config the job runs, whose `restarts` and timeouts the supervisor keeps: a resume continues its
    checkpoint's (what the command line, `overrides`, may change on top, as the job's own checks make it),
    not the command line's defaults: `checked`, where the job's first process ran the checks (it read the
    checkpoint, and this process need not import torch to read it again). The command line's where the
    checkpoint cannot be read: the job says why."""
    if cfg.get("resume") is None:
        return cfg
    if checked is not None:
        run = OmegaConf.create(checked)
        OmegaConf.set_struct(run, True)
        return run
    from hydra.core.hydra_config import HydraConfig

    from ppo_fabric.app.preflight import continue_run
    from ppo_fabric.config.values import composer
    from ppo_fabric.runs.resume import resolve_auto

    run = copy.deepcopy(cfg)
    name = str(HydraConfig.get().job.config_name) if HydraConfig.initialized() else "config"
    try:
        auto = resolve_auto(run, str(run_dir))
        if run.resume is not None:
            continue_run(run, overrides, composer(None, name), auto, str(run_dir))
    except Exception:  # noqa: BLE001 - the job's checks report it in one line
        return cfg
    return run


def continuation(run_dir: Path, env_id: Any = None) -> str:
    """The end of a failed job's last line: how to go on from its last checkpoint, where it wrote one (a
    rank killed by the OOM killer or a signal says nothing of its own), naming a module env's id as its
    resume must. `resume=auto` passes over a checkpoint that does not load or holds non-finite values."""
    if not (run_dir / "checkpoints" / "last.ckpt").is_file():
        return ""
    from ppo_fabric.envs.make import trust_override  # gymnasium: only at a failed job's end

    return f"; continue from its last checkpoint with resume=auto hydra.run.dir={run_dir}{trust_override(env_id)}"


def _start_step(cfg: DictConfig) -> int:
    """The env step the job's first attempt started from: its own `resume=` checkpoint's, else 0."""
    if cfg.get("resume") is None:
        return 0
    from ppo_fabric.runs import checkpoint as ckpt

    try:
        return int(ckpt.load(str(cfg.resume), env_state="fresh")["env_step"])
    except (OSError, ValueError, KeyError):  # unreadable: the job itself said why
        return 0


def job_stop_timeout(cfg: DictConfig) -> float:
    """Seconds a signalled job may take to stop: its ranks finish a rollout, an update, an evaluation and
    the checkpoint, each of which may take up to `stall_timeout` without a sign of progress before their
    own watchdog ends the job, and each wait for a peer up to `collectives.timeout`."""
    return float(cfg.collectives.timeout) + float(cfg.stall_timeout or 0)


def _attempts(cfg: DictConfig, run_dir: Path, invocation: Invocation) -> int:
    """The job's first attempt and its relaunches; returns the exit status for the command."""
    allowed = int(cfg.restarts)
    flags = invocation.flags
    base = with_override(list(invocation.overrides), "hydra.run.dir", run_dir)
    job = Job(run_dir, job_stop_timeout(cfg))
    attempt, restarts = base, 0
    known: int | None = 0  # the env steps trained twice, while metrics.csv can tell
    started = time.time()  # a checkpoint older than this is not the job's own (another branch, a past job)
    while True:
        status = job.run([*flags, *attempt])
        if status == 0:
            if lock.node_rank() == 0:  # node 0 writes the summary; another node's restarts are its own
                record_restarts(run_dir / "summary.json", restarts, known)
                if restarts:
                    say(restarted_line(run_dir / "summary.json", restarts, known))
            return 0
        if job.stop_signal is not None or status in SIGNAL_STOPS:
            return status
        if status == CONFIG_REFUSED:
            if restarts:  # the config passed before: what the checks build (the env) failed this time
                say(
                    f"the relaunched job's checks refused it (exit {status}; its line above says why); not restarting"
                )
            else:
                say(f"the job's config was refused (exit {status}); not restarting")
            return status
        if restarts >= allowed:
            if allowed or status != FAULT_EXIT:  # exit 1 without restarts: the rank's own line said it all
                why = "restarts=0" if allowed == 0 else f"all {allowed} restarts used"
                then = continuation(run_dir, OmegaConf.select(cfg, "env.id"))
                say(f"rank failure (exit {status}); not restarting ({why}){then}")
            return status
        restarts += 1
        from ppo_fabric.runs.resume import newest_checkpoint, report_skipped  # torch: only for a relaunch

        newest = newest_checkpoint(
            run_dir, lambda path, why: report_skipped(run_dir, path, why, by="restart")
        )
        found = newest
        if found is not None and found[0].stat().st_mtime < started:
            found = None  # the job wrote none yet: what the directory holds may be another lineage's
        if found is not None:
            resumed_at = found[1]
        elif str(cfg.get("resume")) == "auto" and newest is not None:  # the checkpoint resume=auto found
            resumed_at = newest[1]
        else:
            resumed_at = _start_step(cfg)
        metrics = run_dir / "metrics.csv"
        # without metrics.csv (logger=none, logger.csv=false) how far the attempt came is not known: 0 said
        # nothing was trained twice
        reached = (last_logged_step(metrics) or 0) if metrics.is_file() else None
        known = None if known is None or reached is None else known + max(reached - resumed_at, 0)
        if found is None:
            attempt = base  # the user's own `resume` (or none), as the job started
            where = "as it started (it wrote no checkpoint yet)"
        else:
            # `resume=auto` finds that same file (the newest valid one, the job's own) and, as any resume=auto
            # that finds one, continues the run's config: the tuned options the command line composes with
            # are not taken for the user's overrides (with `resume=<file>` they were, and reset their keys)
            attempt = with_override(base, "resume", "auto")
            where = f"from {found[0]} at {resumed_at:,} env steps"
        say(f"rank failure (exit {status}); restart {restarts}/{allowed} {where}")
