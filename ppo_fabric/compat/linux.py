"""Linux process controls (`prctl`), no-ops elsewhere: the supervisor's tie to its job and the evaluator's
to its player. The standard library has no `prctl`; libc's is called through ctypes."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
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
