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


HUNG_UP = """
import os, pty, sys
from ppo_fabric.compat.linux import drop_hung_up_terminal
master, slave = pty.openpty()
os.dup2(slave, 1)
before = drop_hung_up_terminal()  # a terminal still there keeps stdout
os.close(master)  # the terminal goes away
try:
    os.write(1, b"x")
    failed = "no"
except OSError as exc:
    failed = exc.strerror
dropped = drop_hung_up_terminal()
print("unseen")  # to /dev/null now, where it raised before
sys.stdout.flush()
os.write(2, f"{before} {failed} {dropped} {drop_hung_up_terminal()}".encode())
"""


def test_a_hung_up_terminal_is_dropped_and_a_live_one_kept() -> None:
    """Writes to a terminal that hung up fail (EIO); `drop_hung_up_terminal` points that stdout at /dev/null
    so a run's stop can still print on its way to the checkpoint, and leaves a live terminal, a pipe or a
    file alone."""
    proc = subprocess.run([sys.executable, "-c", HUNG_UP], capture_output=True, text=True, timeout=30,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    # stderr, a pipe here, is kept: the line reached it
    assert proc.stderr == "False Input/output error True False", proc.stderr


def test_the_stop_signals_leave_nohups_hangup_ignored() -> None:
    """A run stops with its checkpoint on SIGHUP (a closed terminal), SIGUSR1/2 (a scheduler's warning) as
    on SIGTERM and SIGINT, except where the process started with SIGHUP ignored (`nohup`): the user asked
    the run to outlive the terminal, and it (with the processes it starts) keeps ignoring it."""
    probe = "from ppo_fabric.config.faults import STOP_SIGNALS, SIGNAL_STOPS as X; print(sorted(map(int, STOP_SIGNALS)), sorted(X))"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    kept = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30, env=env)
    nohup = subprocess.run(
        ["nohup", sys.executable, "-c", probe], capture_output=True, text=True, timeout=30, env=env
    )
    stops = [signal.SIGHUP, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM]
    statuses = sorted(128 + int(s) for s in stops)  # a stop's exit status, under nohup too
    assert kept.stdout == f"{sorted(map(int, stops))} {statuses}\n", kept.stdout + kept.stderr
    assert nohup.stdout == f"{sorted(int(s) for s in stops if s != signal.SIGHUP)} {statuses}\n", nohup.stderr
