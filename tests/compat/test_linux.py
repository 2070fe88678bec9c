"""Linux process controls: the kernel's answer is read, and the death signal really kills."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ppo_fabric.compat.linux import PR_SET_PDEATHSIG, prctl

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")

REPO = Path(__file__).resolve().parents[2]


def test_prctl_says_whether_the_kernel_took_it() -> None:
    assert prctl(9999, 0) is False  # an option no kernel has: libc returns -1, ctypes raises nothing
    assert prctl(PR_SET_PDEATHSIG, 0) is True  # 0: no death signal, as this process had


def _alive(pid: int) -> bool:
    """Running or sleeping: not gone and not a zombie nobody reaped yet (a container's pid 1 may not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.multiprocess
def test_a_process_tied_to_its_parent_dies_with_it() -> None:
    """What the supervisor and the evaluator rely on: a child that called `die_with_parent` is SIGKILLed
    by the kernel when its parent is, whatever it is doing."""
    child = (
        "import os, sys, time; from ppo_fabric.compat.linux import die_with_parent; "
        "print(os.getpid() if die_with_parent(os.getppid()) else -1, flush=True); time.sleep(60)"
    )
    parent = (
        "import subprocess, sys, time; "
        f"p = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=sys.stdout); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        pid = int(proc.stdout.readline())  # type: ignore[union-attr]
        assert pid > 0 and _alive(pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), "the child outlived its SIGKILLed parent"
    finally:
        proc.kill()
        if "pid" in locals() and _alive(pid):
            os.kill(pid, signal.SIGKILL)
