"""The job's first process, started while the supervisor still checks the command line.

A supervised `python -m ppo_fabric` checks the command line before the job may do anything (compose, build
the env and the model, the run directory's lock: ~2 s on a 2-core CPU machine, ~7 s on a GPU node's image),
and the job spends as long again importing torch, Lightning and a strategy. Started at once, the job imports
while the supervisor checks, and then waits: it does nothing a run can see (no directory, no line, no rank)
until the supervisor hands it the settled command line and environment through a pipe. A command the
checks refuse closes the pipe and kills the waiting process, so a refused command still ends in one line
and leaves nothing behind.

Only the first attempt is started this way; a relaunch after a failure starts as before. Sweeps, help and
`--cfg` never start one (they run no job, or run each job as a process of its own).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass

GATE_ENV = "PPO_FABRIC_GATE_FD"  # in the waiting process: the pipe its command line comes through
# Hydra's flags under which the command runs no job of its own (a sweep runs each job as a process)
NO_JOB = ("-m", "--multirun", "-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "-sc",
          "--shell-completion", "--experimental-rerun")  # fmt: skip


@dataclass
class Waiting:
    proc: subprocess.Popen[bytes]
    gate: int  # the pipe's write end


_waiting: Waiting | None = None


def runs_a_job(argv: list[str]) -> bool:
    """Whether `argv` (the command line's arguments) asks for a run rather than a sweep, help or a config."""
    return not any(arg.split("=", 1)[0] in NO_JOB for arg in argv)


def start(argv: list[str], env: dict[str, str]) -> None:
    """Start the job's first process with `argv` as its visible command line (what `ps` shows) and `env`;
    it imports, then waits to be handed its real one (`take`). Called once, by the supervising process."""
    global _waiting
    read, write = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ppo_fabric", *argv],
            env={**env, GATE_ENV: str(read)},
            pass_fds=(read,),
            start_new_session=True,
        )
    except OSError:
        os.close(write)
        return  # the job starts the usual way
    finally:
        os.close(read)
    _waiting = Waiting(proc, write)


def take(args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes] | None:
    """The waiting process, handed `args` and `env`, once; None when there is none (a relaunch, or
    none was started) or it died waiting: the caller then starts the job itself."""
    global _waiting
    waiting, _waiting = _waiting, None
    if waiting is None:
        return None
    message = json.dumps({"argv": args, "env": env}).encode()
    try:
        with os.fdopen(waiting.gate, "wb") as gate:
            gate.write(message)
    except OSError:  # it is gone (killed, or out of memory while importing)
        _kill(waiting.proc)
        return None
    return waiting.proc


def discard() -> None:
    """End a process that was never handed a command line (the checks refused the command, or it ran no
    job): close its pipe and kill it, so nothing of the command outlives it."""
    global _waiting
    waiting, _waiting = _waiting, None
    if waiting is not None:
        with contextlib.suppress(OSError):
            os.close(waiting.gate)
        _kill(waiting.proc)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def gate() -> int | None:
    """In a process `start` began: the pipe its command line will come through (taken out of the
    environment, so that the ranks it launches do not wait too); None in any other process."""
    fd = os.environ.pop(GATE_ENV, None)
    return None if fd is None else int(fd)


def await_handover(fd: int) -> None:
    """Wait for the command line and environment on pipe `fd` and take them as this process's own.
    Leaves at once, silently, when the pipe closes empty (the command ran no job, or was refused)."""
    with os.fdopen(fd, "rb") as pipe:
        message = pipe.read()
    if not message:
        os._exit(0)
    handed = json.loads(message)
    os.environ.clear()
    os.environ.update(handed["env"])
    sys.argv[1:] = handed["argv"]
