"""The job's first process, started while the supervisor still checks the command line.

A supervised `python -m ppo_fabric` checks the command line before the job may do anything (compose, build
the env and the model, the run directory's lock: ~2 s on a 2-core CPU machine, ~7 s on a GPU node's image),
and the job spends as long again importing torch, Lightning and a strategy. Started at once, the job imports
while the supervisor checks, and then waits: it does nothing a run can see (no directory, no line, no rank)
until the supervisor hands it the settled command line and environment through a pipe. A command the
checks refuse closes the pipe and kills the waiting process, so a refused command still ends in one line
and leaves nothing behind.

The checks themselves need torch (the model for the env's spaces, the devices, the checkpoint to resume):
~2 s of CPU to import, ~220 MB the supervisor would hold for the whole run without using them again. The
waiting process imports torch anyway, so the supervisor asks it to run them (`ask`), in the supervisor's own
environment, and reports what it answers: the command's one line, as before, or the config the job runs (a
resume's, continued from its checkpoint). The supervisor then does not import torch unless it restarts a
failed job (it looks for the newest checkpoint). Where no process waits, or it ends without answering, the
supervisor checks in-process. The price: the checks no longer overlap the imports (~0.2 s a command here).

Only the first attempt is started this way; a relaunch after a failure starts as before. Sweeps, help and
`--cfg` never start one (they run no job, or run each job as a process of its own).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ppo_fabric.compat.private import hydra_args_parser

GATE_ENV = "PPO_FABRIC_GATE_FD"  # in the waiting process: the pipe its command line comes through
ANSWER_ENV = "PPO_FABRIC_ANSWER_FD"  # in the waiting process: the pipe its answers to `ask` go back through
# Hydra's flags under which the command runs no job of its own (a sweep runs each job as a process)
NO_JOB = ("multirun", "help", "hydra_help", "cfg", "info", "shell_completion", "experimental_rerun")


MAX_HANDOVER = 1 << 24  # bytes: far above any real environment, far below what fcntl's C int can hold


class _Unparsable(Exception):
    pass


@dataclass
class Waiting:
    proc: subprocess.Popen[bytes]
    gate: int  # the pipe's write end
    answer: int = -1  # the read end of the pipe its answers come back through (-1: none)


_waiting: Waiting | None = None
_answering = -1  # in the waiting process, while it checks for its supervisor: the pipe its answer goes to


def runs_a_job(argv: list[str]) -> bool:
    """Whether `argv` (the command line's arguments) asks for a run rather than a sweep, help or a config.
    Read by Hydra's own parser, so that its abbreviations (`--multi`, `--hel`, `-cjob`) count as Hydra
    counts them; a command line it cannot parse starts nothing (the checks refuse it in one line)."""
    args_parser = hydra_args_parser()

    def refuse(message: str) -> None:
        raise _Unparsable(message)

    args_parser.error = refuse
    try:
        args = args_parser.parse_args(argv)
    except _Unparsable:
        return False
    if any(getattr(args, flag) for flag in NO_JOB):
        return False
    sweeps = (
        o.split("=", 1)[1].strip().upper() == "MULTIRUN"
        for o in args.overrides
        if o.startswith("hydra.mode=")
    )
    return not any(sweeps)


def start(argv: list[str], env: dict[str, str]) -> None:
    """Start the job's first process with `argv` as its visible command line (what `ps` shows) and `env`;
    it imports, then waits to be handed its real one (`take`). Called once, by the supervising process."""
    global _waiting
    try:
        read, write = os.pipe()
    except OSError:
        return  # out of file descriptors: the job starts the usual way
    try:
        answer_read, answer_write = os.pipe()
    except OSError:
        os.close(read)
        os.close(write)
        return
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ppo_fabric", *argv],
            env={**env, GATE_ENV: str(read), ANSWER_ENV: str(answer_write)},
            pass_fds=(read, answer_write),
            start_new_session=True,
        )
    except OSError:
        os.close(write)
        os.close(answer_read)
        return  # the job starts the usual way
    finally:
        os.close(read)
        os.close(answer_write)
    _waiting = Waiting(proc, write, answer_read)


def ask(request: dict[str, Any]) -> dict[str, Any] | None:
    """The waiting process's answer to `request` (JSON), which it computes once its imports are done; None
    when no process waits. A process that ends without answering (killed, out of memory, a failed import)
    is reaped and forgotten: `{"exited": status}`, and the job then starts the usual way. One that a
    check's stall timeout ends answers `{"said": true}` first: it has said why in one line (`said`)."""
    global _waiting
    waiting = _waiting
    if waiting is None or waiting.answer < 0:
        return None
    line = b""
    try:
        _write_all(waiting.gate, json.dumps({"check": request}).encode() + b"\n")
        while not line.endswith(b"\n"):
            chunk = os.read(waiting.answer, 65536)
            if not chunk:
                break
            line += chunk
    except OSError:
        line = b""
    if line.endswith(b"\n"):
        return json.loads(line)
    _waiting = None
    _end(waiting)
    return {"exited": waiting.proc.returncode}


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def take(args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes] | None:
    """The waiting process, handed `args` and `env`, once; None when there is none (a relaunch, or
    none was started) or it died waiting: the caller then starts the job itself."""
    global _waiting
    waiting, _waiting = _waiting, None
    if waiting is None:
        return None
    message = json.dumps({"argv": args, "env": env}).encode() + b"\n"
    with contextlib.suppress(OSError):
        os.close(waiting.answer)
    waiting.answer = -1
    if not _fits(waiting.gate, len(message)):  # the write would wait for the importing process to read,
        _end(waiting)  # and signals meanwhile would reach no job: start it the usual way instead
        return None
    try:
        with os.fdopen(waiting.gate, "wb") as gate:
            gate.write(message)
    except OSError:  # it is gone (killed, or out of memory while importing)
        _kill(waiting.proc)
        return None
    return waiting.proc


def _fits(fd: int, size: int) -> bool:
    """Whether `size` bytes go into the empty pipe `fd` without waiting for a reader, growing the pipe
    where it is too small (Linux: 64 KiB by default, down to one page for a user over
    `pipe-user-pages-soft`; an HPC environment can be larger than either)."""
    if size > MAX_HANDOVER:
        return False
    if not hasattr(fcntl, "F_GETPIPE_SZ"):  # not Linux: the pipe's size cannot be read
        return size <= 16384  # the macOS and BSD pipe's buffer before it grows
    with contextlib.suppress(OSError):  # above pipe-max-size or the user's quota: keeps its size
        if fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ) < size:
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, size)
    return fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ) >= size


def discard() -> None:
    """End a process that was never handed a command line (the checks refused the command, or it ran no
    job): close its pipe and kill it, so nothing of the command outlives it."""
    global _waiting
    waiting, _waiting = _waiting, None
    if waiting is not None:
        _end(waiting)


def _end(waiting: Waiting) -> None:
    for fd in (waiting.gate, waiting.answer):
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
    _kill(waiting.proc)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.returncode is None:  # not reaped: its pid, and so its group's id, is still its own
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def gate() -> tuple[int, int] | None:
    """In a process `start` began: the pipe its command line will come through and the one its answers go
    back through (-1: none), both taken out of the environment, so that the ranks it launches do not wait
    too; None in any other process."""
    fd = os.environ.pop(GATE_ENV, None)
    answer = os.environ.pop(ANSWER_ENV, None)
    if fd is None:
        return None
    fds = (int(fd), -1 if answer is None else int(answer))
    for one in fds:  # passed to this process alone: no process it starts (an env's, a rank) holds them,
        if one >= 0:  # so the supervisor reads the end of the answers when this process ends
            with contextlib.suppress(OSError):
                os.set_inheritable(one, False)
    return fds


Checker = Callable[[dict[str, Any]], dict[str, Any]]


def await_handover(
    fd: int,
    inherited: Mapping[str, str],
    answer: int = -1,
    check: Checker | None = None,
    accepted: Callable[[], None] | None = None,
) -> None:
    """Wait for the command line and environment on pipe `fd` and take them as this process's own.
    `inherited`: the environment it started with; of it only what the handed one leaves out goes, so
    what its imports set for themselves (Lightning's `PYTORCH_NVML_BASED_CUDA_CHECK`, pygame's banner
    switch, ...) stays, as in a job started after the checks. Leaves at once, silently, when the pipe
    closes empty (the command ran no job, or was refused).

    Before the handover the supervisor may `ask` for its checks: each request is answered by `check`
    on pipe `answer`, in the environment the request carries (the supervisor's own, taken as the handover
    takes one), which is put back afterwards. `accepted` runs once an answer that lets the run start is
    sent: the job's own imports, which a refused command never needs, overlap the supervisor's last steps."""
    global _answering
    with os.fdopen(fd, "rb") as pipe:
        for line in pipe:
            message = json.loads(line)
            if "check" not in message:
                break
            request = message["check"]
            answered = json.dumps({"unanswered": True})
            runs = False
            if check is not None:
                saved = dict(os.environ)
                _take_environment(request.get("env", saved), inherited)
                _answering = answer
                try:
                    reply = check(request)
                    answered = json.dumps(reply)
                    runs = "config" in reply
                except Exception:  # noqa: BLE001 - e.g. a config value JSON cannot hold: the supervisor checks
                    pass
                finally:
                    _answering = -1
                    os.environ.clear()
                    os.environ.update(saved)
            try:
                _write_all(answer, answered.encode() + b"\n")
            except (
                OSError
            ):  # the supervisor is gone (this process outlives it only where it cannot die with it)
                os._exit(0)
            if runs and accepted is not None:
                accepted()
        else:
            os._exit(0)
    if answer >= 0:
        with contextlib.suppress(OSError):
            os.close(answer)
    _take_environment(message["env"], inherited)
    sys.argv[1:] = message["argv"]


def said() -> None:
    """In the waiting process, while it checks for its supervisor: the check's stall timeout has said why in
    one line and ends this process, so the supervisor ends the command with its status, saying nothing more
    (any other end of this process, it takes for one that cannot check, and checks in-process)."""
    if _answering >= 0:
        with contextlib.suppress(OSError):
            _write_all(_answering, json.dumps({"said": True}).encode() + b"\n")


def _take_environment(handed: Mapping[str, str], inherited: Mapping[str, str]) -> None:
    for key in inherited.keys() - handed.keys():
        os.environ.pop(key, None)
    os.environ.update(handed)
