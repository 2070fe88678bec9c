"""Linux process controls (`prctl`), no-ops elsewhere: the supervisor's tie to its job and the evaluator's
to its player. The standard library has no `prctl`; libc's is called through ctypes."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36


def prctl(option: int, value: int) -> None:
    """libc's `prctl(option, value)` on Linux; elsewhere nothing (callers have a fallback)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def die_with_parent(parent: int) -> bool:
    """Have the kernel SIGKILL this process when its parent (pid `parent`) dies, whatever it is doing then
    (Linux); False when the parent is already gone (it died before the signal was armed)."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    return os.getppid() == parent
