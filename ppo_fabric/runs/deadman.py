"""The watchdog's own watchdog: a process stuck in C code that holds the interpreter lock for ever.

The stall watchdog (`runs/watchdog.py`) is a Python thread, and a thread cannot run while C code holds the
GIL: a simulator stuck inside its C step, or a C extension spinning, hung a 1-process run for ever, and a
multi-process job too when that process was rank 0 (Lightning's launcher watches its ranks from a Python
thread of rank 0 as well). `faulthandler.dump_traceback_later` keeps a timer in a C thread that needs no
lock: the watchdog re-arms it every second (`arm`), so it fires only when the watchdog itself could not run
for `stall_timeout` + `GRACE_S`. It then writes every thread's stack into this process's file in the run
directory (`.hang-<pid>.txt`, created when first armed, its first line naming the process) and ends the
process, exit 1. The supervisor names it in one line (`report`) and moves the stacks into a `stall-*`
directory, as the watchdog's own stalls leave them; a process that ends any other way removes its file
(`disarm`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

GRACE_S = 30.0  # the most the timer waits past stall_timeout (the watchdog's own end of a job: ~15 s)
PATTERN = ".hang-*.txt"


class _Armed:
    file: IO[str] | None = None
    path: Path | None = None
    header: str = ""
    seconds: float = 0.0
    forks_watched: bool = False


_ARMED = _Armed()
_LOCK = threading.Lock()  # arming and disarming, from the watchdog's thread and the main thread


def _before_fork() -> None:
    """A child forked while the timer is armed inherits the lock its C thread holds, but not the thread:
    the child's interpreter, ending, waits on that lock for ever (a plain `os.fork()` child that exits
    normally hung). The timer is off across the fork, back on in the parent at once; held across it, the
    lock keeps the watchdog's thread from arming it meanwhile."""
    _LOCK.acquire()
    if _ARMED.file is not None:
        faulthandler.cancel_dump_traceback_later()


def _after_fork_in_parent() -> None:
    try:
        if _ARMED.file is not None:
            faulthandler.dump_traceback_later(_ARMED.seconds, file=_ARMED.file, exit=True)
    finally:
        _LOCK.release()


def _after_fork_in_child() -> None:
    global _LOCK
    _LOCK = threading.Lock()  # the parent's, held across the fork
    _ARMED.file, _ARMED.path, _ARMED.header = None, None, ""  # the parent's: never this process's to remove


def grace(timeout_s: float) -> float:
    """How long past `timeout_s` the timer waits: GRACE_S, less for a short stall_timeout, but at least
    10 s: on a loaded machine the watchdog's thread may wait seconds for a core, and the timer must not
    take that for C code holding the interpreter lock."""
    return min(GRACE_S, max(timeout_s, 10.0))


def arm(run_dir: Path, label: str, seconds: float, live: Callable[[], bool] = lambda: True) -> None:
    """(Re-)arm the timer: end this process, its stacks written, unless `arm` is called again within
    `seconds`. Nothing when the file cannot be created (a read-only or full disk), or when `live()` says
    the caller has been stopped (a watchdog's thread that woke as its `stop()` disarmed it)."""
    with _LOCK:
        if live():
            _arm(run_dir, label, seconds)


def _arm(run_dir: Path, label: str, seconds: float) -> None:
    if _ARMED.file is None:
        path = run_dir / f".hang-{os.getpid()}.txt"
        try:
            _ARMED.file = path.open("w")  # noqa: SIM115  kept open: the C thread writes to its descriptor
        except OSError:
            return
        _ARMED.path = path
    header = json.dumps({"label": label, "seconds": seconds}) + "\n"
    if header != _ARMED.header:  # the first, or a role named since (a decoupled rank's label)
        with contextlib.suppress(OSError):
            _ARMED.file.seek(0)
            _ARMED.file.write(header)
            _ARMED.file.truncate()
            _ARMED.file.flush()
            _ARMED.header = header
    if not _ARMED.forks_watched:
        os.register_at_fork(
            before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
        )
        _ARMED.forks_watched = True
    _ARMED.seconds = seconds
    faulthandler.dump_traceback_later(seconds, file=_ARMED.file, exit=True)


def armed() -> bool:
    return _ARMED.file is not None


def disarm() -> None:
    """Cancel the timer and remove this process's file (it ends, or its watchdog stops)."""
    with _LOCK:
        _disarm()


def _disarm() -> None:
    if _ARMED.file is None:
        return
    faulthandler.cancel_dump_traceback_later()
    with contextlib.suppress(OSError):
        _ARMED.file.close()
    if _ARMED.path is not None:
        with contextlib.suppress(OSError):
            _ARMED.path.unlink(missing_ok=True)
    _ARMED.file, _ARMED.path, _ARMED.header = None, None, ""


def report(run_dir: Path) -> str | None:
    """After a job ended: the line naming a process the timer ended (its stacks moved into a `stall-*`
    directory), or None; the files of processes that ended otherwise (killed) are removed."""
    said = None
    target = run_dir / f"stall-{time.strftime('%Y%m%d-%H%M%S')}"
    for path in sorted(run_dir.glob(PATTERN)):
        try:
            header, _, stacks = path.read_text().partition("\n")
            info = json.loads(header)
        except (OSError, ValueError):
            info, stacks = None, ""
        if info is None or not stacks.strip():
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            continue
        label = str(info.get("label", "a process"))
        where = path
        with contextlib.suppress(OSError):  # every such process's stacks kept; the first named
            target.mkdir(exist_ok=True)
            where = target / f"{label.replace(' ', '-')}.txt"
            path.rename(where)
        if said is None:
            said = (
                f"{label}: no progress for {float(info.get('seconds', 0)):.0f} s, and its watchdog could not "
                f"run: C code held the interpreter lock (a simulator stuck in its C step?); stacks in {where}"
            )
    return said
