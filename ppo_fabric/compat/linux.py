"""Linux process controls (`prctl`), no-ops elsewhere: the supervisor's tie to its job and the evaluator's
to its player. The standard library has no `prctl`; libc's is called through ctypes."""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import stat
import sys

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36


def prctl(option: int, value: int) -> bool:
    """libc's `prctl(option, value)` on Linux: whether the kernel took it (ctypes raises nothing for a
    refused call: libc returns -1, a seccomp profile or an unknown option); elsewhere nothing, False
    (callers have a fallback)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    return False


def die_with_parent(parent: int) -> bool:
    """Have the kernel SIGKILL this process when its parent (pid `parent`) dies, whatever it is doing then
    (Linux); False when the parent is already gone (it died before the signal was armed). A Linux kernel
    that refuses the signal leaves the tie to the parent's own cleanup: one line says so."""
    if not prctl(PR_SET_PDEATHSIG, signal.SIGKILL) and sys.platform.startswith("linux"):
        os.write(2, f"ppo-fabric: warning: prctl(PR_SET_PDEATHSIG) was refused (errno {ctypes.get_errno()}): "
                    f"this process outlives a parent killed with SIGKILL\n".encode())  # fmt: skip
    return os.getppid() == parent


def drop_hung_up_terminal() -> bool:
    """Point stdout and stderr at /dev/null where they are a terminal that has hung up (its window or ssh
    session closed: the SIGHUP a run then gets asks it to stop with a checkpoint). Every later write to
    such a terminal fails with EIO, and the first progress line or `ppo-fabric:` line raised it on the
    way to that checkpoint. A terminal still there (a `kill -HUP` typed in it) keeps them. Whether any was
    dropped."""
    dropped = False
    for fd in (1, 2):
        with contextlib.suppress(OSError, ValueError):
            if not stat.S_ISCHR(os.fstat(fd).st_mode):  # a file or a pipe: not a terminal (isatty fails
                continue  # once the terminal has hung up)
            poller = select.poll()
            poller.register(fd, select.POLLOUT)
            if any(events & (select.POLLHUP | select.POLLERR) for _, events in poller.poll(0)):
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, fd)
                os.close(null)
                dropped = True
    return dropped
