"""`RunFault`: how a run that went wrong ends, whichever layer found it.

A fault is not a crash to debug but a cause to report: bad data from an env, an update that diverged, a
checkpoint that could not be written, a rank that stopped making progress. Each layer raises its own
subclass with a one-line message; the launcher prints that line (no traceback unless
PPO_FABRIC_TRACEBACK is set) and exits non-zero on every rank, so the supervisor's `restarts=N` relaunches
from the last good checkpoint as for any other failure. It lives beside `ConfigError` because every layer
raises one and this package is the one every layer may import.
"""

from __future__ import annotations

FAULT_EXIT = 1  # the exit status of a run that ended on a fault (a failure the supervisor may restart)


class RunFault(RuntimeError):
    """A run that cannot go on; `str(fault)` is the one line the user reads."""


class RunComplete(Exception):
    """`resume=auto` found its run already at `algo.total_steps`: a requeued job that has nothing left to
    do. Not a failure: the entry points print its one line and exit 0, so a cluster job that runs the same
    command every time ends cleanly once the run is done."""
