"""`RunFault`: how a run that went wrong ends, whichever layer found it.

A fault is not a crash to debug but a cause to report: bad data from an env, an update that diverged, a
checkpoint that could not be written, a rank that stopped making progress. Each layer raises its own
subclass with a one-line message; the launcher prints that line (no traceback unless
PPO_FABRIC_TRACEBACK is set) and exits non-zero on every rank, so the supervisor's `restarts=N` relaunches
from the last good checkpoint as for any other failure. It lives beside `ConfigError` because every layer
raises one and this package is the one every layer may import.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from ppo_fabric.config.values import SUPERVISED_ENV

FAULT_EXIT = 1  # the exit status of a run that ended on a fault (a failure the supervisor may restart)
# The same stop signal again within this many seconds is one request delivered twice (a cluster signals every
# process, and each supervisor forwards it too), not a second request to end at once.
SIGNAL_REPEAT_S = 2.0
# The signals that ask a run to stop at its next update boundary with a checkpoint and end with 128 + N, never
# restarted: Ctrl+C, a cluster's preemption (SIGTERM), a closed terminal or ssh session (SIGHUP), and the
# warning a scheduler sends ahead of its kill when asked (SLURM's `--signal=USR1@90`, or USR2). Their default
# action ended the process at once: no checkpoint, no line, a stale lock. A process started with SIGHUP
# ignored (`nohup`) leaves it ignored, as do the processes it starts: the user asked the run to outlive the
# terminal.
_STOPS = tuple(
    getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2") if hasattr(signal, n)
)
_NOHUP = hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
STOP_SIGNALS: tuple[signal.Signals, ...] = tuple(s for s in _STOPS if not (_NOHUP and s == signal.SIGHUP))
SIGNAL_STOPS = frozenset(128 + int(s) for s in _STOPS)  # the exit statuses of those stops
# An evaluation episode (a game: its moves) of an env with no time limit of its own ends here, truncated: a
# greedy policy that never reaches a terminal state would otherwise hold the run for ever while every step
# counts as progress. Read at call time (tests lower it).
EVAL_MAX_EPISODE_STEPS = 100_000
FAILED_CHILD = ".failed-rank"  # in the run directory: a launcher child's cause, for the supervisor to read


class RunFault(RuntimeError):
    """A run that cannot go on; `str(fault)` is the one line the user reads."""


class RunComplete(Exception):
    """`resume=auto` found its run already at `algo.total_steps`: a requeued job that has nothing left to
    do. Not a failure: the entry points print its one line and exit 0, so a cluster job that runs the same
    command every time ends cleanly once the run is done."""


def launcher_child() -> bool:
    """Whether this process is a rank that Fabric's launcher started as a child of its node's first
    process (LOCAL_RANK > 0, no torchrun agent). That first process watches its children every 5 s and
    SIGKILLs itself as soon as one has exited non-zero."""
    return int(os.environ.get("LOCAL_RANK", "0") or 0) > 0 and "TORCHELASTIC_RUN_ID" not in os.environ


def fault_status(run_dir: Path, line: str | None) -> int:
    """The exit status of a rank of a multi-process job that failed: FAULT_EXIT. A launcher child of a
    supervised job first leaves its cause in the run directory: its exit gets the first process SIGKILLed
    by Fabric's launcher when that process has not ended by itself within the launcher's next look (exit
    137, the status of an out-of-memory kill), and the supervisor reads the file to report the job's
    failure as the failure it was (`failed_child`). Only a cause is recorded: a rank that failed because
    another process ended (its collective's peer gone) does not call this, so a killed rank 0 stays 137."""
    if launcher_child() and os.environ.get(SUPERVISED_ENV):
        with contextlib.suppress(OSError):  # a full disk: the job still fails, with 137
            (run_dir / FAILED_CHILD).write_text((line or "a rank failed") + "\n")
    return FAULT_EXIT


def failed_child(run_dir: Path) -> bool:
    return (run_dir / FAILED_CHILD).is_file()


def forget_failed_child(run_dir: Path) -> None:
    """Before an attempt: a previous attempt's cause is not this one's."""
    with contextlib.suppress(OSError):
        (run_dir / FAILED_CHILD).unlink(missing_ok=True)
