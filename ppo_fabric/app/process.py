"""What the command-line process needs of a process's life without importing torch or Lightning: quieting
the libraries' warnings and leaving the process. The supervisor, which is no rank, imports only this, so
`python -m ppo_fabric` pays Lightning's import (seconds) once per rank, not once more for itself."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import NoReturn

from ppo_fabric.config.faults import FAULT_EXIT
from ppo_fabric.config.values import SUPERVISED_ENV

FAILED_CHILD = ".failed-rank"  # in the run directory: a launcher child's cause, for the supervisor to read


def quiet_libraries() -> None:
    warnings.filterwarnings("ignore", message=".*is not a supported pipeline.*")
    warnings.filterwarnings("ignore", category=UserWarning, module="lightning_fabric.*")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    for name in ("lightning_fabric", "lightning_fabric.utilities.seed"):
        logging.getLogger(name).setLevel(logging.WARNING)


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
    failure as the failure it was (`failed_child`)."""
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


def stop_status(signum: int) -> int:
    """The exit status of a rank stopped by signal `signum` after its stop checkpoint: 128 + N, as a shell
    reports a signal, except 0 for a rank that Fabric's launcher started as a child of its node's first
    process (LOCAL_RANK > 0, no torchrun agent). That process watches its children and SIGKILLs itself as
    soon as one has exited non-zero: a child exiting 128 + N while rank 0 was still writing the summary and
    the learning curve cut rank 0 short (exit 137, nothing said). The first process carries the job's
    status, 128 + N, to the supervisor or the shell."""
    return 0 if launcher_child() else 128 + signum
