"""What the command-line process needs of a process's life without importing torch or Lightning: quieting
the libraries' warnings and leaving the process. The supervisor, which is no rank, imports only this, so
`python -m ppo_fabric` pays Lightning's import (seconds) once per rank, not once more for itself."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import NoReturn

from ppo_fabric.compat.linux import drop_hung_up_terminal
from ppo_fabric.config.faults import STOP_SIGNALS, launcher_child
from ppo_fabric.runs import deadman


def one_line_warnings(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
) -> str:
    """ppo-fabric's own warnings (`ppo-fabric: ...`) as the one line they are, as its errors print; any
    other as Python prints it (file, line and source)."""
    text = str(message)
    if text.startswith("ppo-fabric: "):
        return text + "\n"
    return _python_format(message, category, filename, lineno, line)


_python_format = warnings.formatwarning


QUIETED_LOGGERS = ("lightning_fabric", "lightning_fabric.utilities.seed")
# Tracing a compiled step (algo.compile=true) of a DDP-wrapped model, dynamo warns once per process that
# DDP's profiler `record_function` is ignored (nothing is lost: it only labels a profiler trace), a raw
# `[rank1]:W1207 ... Profiler record function ... will be ignored` line from every training rank.
DYNAMO_CONTEXTS = "torch._dynamo.variables.ctx_manager"
PROFILER_NOTE = "Profiler record function"


def _not_profiler_note(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(PROFILER_NOTE)


def quiet_libraries() -> None:
    warnings.formatwarning = one_line_warnings
    warnings.filterwarnings("ignore", message=".*is not a supported pipeline.*")
    warnings.filterwarnings("ignore", category=UserWarning, module="lightning_fabric.*")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    if not os.environ.get("PPO_FABRIC_TRACEBACK"):
        # An async vector env's worker that raised: gymnasium says so in ~25 lines (the worker's traceback
        # and its shutdown), then raises the error in this process, which ends the run in its one line.
        warnings.filterwarnings(
            "ignore",
            message=r".*ERROR: (Received the following error from Worker|Traceback|Raising the last exception)",
            category=UserWarning,
            module="gymnasium.vector.async_vector_env",
        )
    for name in QUIETED_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    contexts = logging.getLogger(DYNAMO_CONTEXTS)
    if _not_profiler_note not in contexts.filters:
        contexts.addFilter(_not_profiler_note)


def end_process(code: int = 0) -> NoReturn:
    """Leave the process without the interpreter's shutdown.

    A finished 2-process LunarLander run left its second rank stuck at exit for good: an exit hook of
    pygame (which gymnasium's Box2D module imports) was loading a C extension during finalisation, and the
    orphaned rank held its parent's output pipes open, so the launching command never returned. Everything
    a run owns (envs, logger, process group, checkpoints) is closed or written before this is called.
    """
    deadman.disarm()  # its file is this process's to remove (the timer's, when C code hangs the process)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream: nothing left to say there
            stream.flush()
    os._exit(code)


_ENDING = threading.Lock()  # held by whichever thread ends the process on a start-up stop


def _stop_during_startup(signum: int, _frame: object) -> None:
    if not _ENDING.acquire(blocking=False):  # the other thread (`stops_reach_blocking_waits`) ends it
        return
    try:
        name = signal.Signals(signum).name
        if signum == signal.SIGHUP:
            drop_hung_up_terminal()
        if launcher_child():  # its 128+N got its node's first process SIGKILLed (137): that one says it
            with contextlib.suppress(OSError):  # and stops too when the signal reached this child alone
                os.kill(os.getppid(), signum)
        else:
            os.write(2, f"ppo-fabric: stopped by {name} during start-up, before training began\n".encode())
        os._exit(stop_status(signum))
    finally:  # reached only where os._exit is a test's stand-in
        _ENDING.release()


def stop_quietly_during_startup() -> None:
    """Until a run's own handlers take over (the supervisor's, a sweep's, the ranks' STOP): a stop signal
    ends the process with one line and status 128+N, where Ctrl+C printed a KeyboardInterrupt traceback
    from whatever was importing and SIGTERM ended it without a word. Nothing is written yet. A child of
    Fabric's launcher passes the signal to its node's first process and leaves with 0 (`stop_status`)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _stop_during_startup)


@contextlib.contextmanager
def stops_reach_blocking_waits() -> Iterator[None]:
    """A block in which the main thread waits inside C code (the job's processes meeting in torch's
    rendezvous, up to `collectives.timeout`): Python runs a signal's handler only once such a call returns,
    so a SIGTERM was answered minutes later, by the timeout's error. The C-level handler writes the signal's
    number to the wakeup fd at once; a thread reading it runs the start-up stop while that handler is the
    signal's. Main thread only (elsewhere, as is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for signum in os.read(read_fd, 64):
                if not done.is_set() and signal.getsignal(signum) is _stop_during_startup:
                    _stop_during_startup(signum, None)

    watcher = threading.Thread(target=watch, name="ppo-fabric start-up signals", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        signal.set_wakeup_fd(previous)
        os.write(write_fd, b"\0")  # wakes the watcher, which sees `done`
        watcher.join(timeout=5)
        os.close(read_fd)
        os.close(write_fd)


def stop_status(signum: int) -> int:
    """The exit status of a rank stopped by signal `signum` after its stop checkpoint: 128 + N, as a shell
    reports a signal, except 0 for a rank that Fabric's launcher started as a child of its node's first
    process (LOCAL_RANK > 0, no torchrun agent). That process watches its children and SIGKILLs itself as
    soon as one has exited non-zero: a child exiting 128 + N while rank 0 was still writing the summary and
    the learning curve cut rank 0 short (exit 137, nothing said). The first process carries the job's
    status, 128 + N, to the supervisor or the shell."""
    return 0 if launcher_child() else 128 + signum
