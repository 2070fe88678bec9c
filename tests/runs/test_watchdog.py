"""The watchdog's end of a job among its processes, in one process: who claims it, and when the processes
that answer a claim may leave (the job-level runs are in tests/strategies/test_faults_distributed.py)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ppo_fabric.runs import deadman
from ppo_fabric.runs import watchdog as watchdog_module
from ppo_fabric.runs.watchdog import Watchdog, seconds_text
from ppo_fabric.wire.progress import PROGRESS


def test_one_process_claims_the_end_and_the_other_answers_into_its_directory(tmp_path: Path) -> None:
    first, second = Watchdog(tmp_path, 0, 2), Watchdog(tmp_path, 0, 2)
    target = first._claim()
    assert target is not None and first.claimed == target
    assert second._claim() is None and second.claimed is None
    assert second._claimed() == target
    second._answer(target)
    assert [p.name for p in target.glob("*.txt")] and second.answered == target.name


def test_an_answering_process_leaves_only_once_the_claiming_one_has_printed_its_line(tmp_path: Path) -> None:
    """Under Fabric's launcher an answering child's exit gets rank 0 SIGKILLed within 5 s: a claiming
    rank 0 that had not printed yet ended with -9 and nothing said. The answerer waits for `spoke()`."""
    claimant, answerer = Watchdog(tmp_path, 0, 2), Watchdog(tmp_path, 0, 2)
    target = claimant._claim()
    assert target is not None
    answerer._answer(target)
    waited: list[bool] = []
    thread = threading.Thread(target=lambda: waited.append(answerer.wait_for_line(target)), daemon=True)
    thread.start()
    time.sleep(0.5)
    assert thread.is_alive(), "the answering process left before the claiming one printed its line"
    claimant.spoke()
    thread.join(timeout=2)
    assert not thread.is_alive() and waited == [True]


def test_an_answering_process_leaves_anyway_when_the_claiming_one_never_speaks(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(watchdog_module, "SETTLE_S", -4.8)  # a 0.2-s bound instead of SETTLE_S + 5 s
    claimant, answerer = Watchdog(tmp_path, 0, 2), Watchdog(tmp_path, 0, 2)
    target = claimant._claim()
    assert target is not None
    target.mkdir()
    started = time.monotonic()
    assert answerer.wait_for_line(target) is False
    assert 0.15 < time.monotonic() - started < 2
    Watchdog(tmp_path, 0, 2).spoke()  # a process that claimed nothing says nothing
    assert not (target / watchdog_module.SAID).exists()


def test_a_launcher_child_ending_the_job_leaves_after_its_parent(tmp_path: Path, monkeypatch) -> None:
    """Its parent, Fabric's first process, SIGKILLs itself at its next look once a child has exited
    non-zero: the child waits until it is reparented (the parent gone), and only when the watchdog ends
    the job (a rank failing on its own leaves at once, its cause recorded for the supervisor)."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    parents = iter([100] * 5 + [1] * 100)  # the parent leaves after the child's fifth look
    looks: list[int] = []
    monkeypatch.setattr(watchdog_module.os, "getppid", lambda: looks.append(1) or next(parents))
    exits: list[int] = []
    monkeypatch.setattr(watchdog_module.os, "_exit", exits.append)
    bystander = Watchdog(tmp_path, 0, 2)
    bystander.leave(3)
    assert exits == [3] and not looks
    answering = Watchdog(tmp_path, 0, 2)
    answering.answered = "stall-x"
    answering.leave(1)
    assert exits == [3, 1] and len(looks) == 6
    monkeypatch.setenv("LOCAL_RANK", "0")  # the first process itself leaves at once
    looks.clear()
    answering.leave(1)
    assert exits == [3, 1, 1] and not looks


def test_a_tracker_that_never_answers_is_a_stall_and_a_peer_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wait on a tracker's server is bounded by nothing else: past `stall_timeout` it ends the run (it
    hung a one-process run for ever while counted as waiting); a wait on a peer rank stays a wait, which
    the peer's own watchdog and `collectives.timeout` bound."""
    monkeypatch.setattr(watchdog_module, "POLL_S", 0.05)
    ended: list[str] = []
    dog = Watchdog(tmp_path, 0.3, 1)
    monkeypatch.setattr(dog, "end_job", ended.append)
    dog.start()
    try:
        with PROGRESS.waiting_for("params from the trainers"):
            time.sleep(0.8)
        assert ended == []
        with PROGRESS.waiting_for("the tracker", peer=False):
            deadline = time.monotonic() + 5
            while not ended and time.monotonic() < deadline:
                time.sleep(0.05)
        assert ended and "no progress for" in ended[0] and "waiting for the tracker" in ended[0], ended
        assert "no progress for 0 s" not in ended[0], ended  # a stall_timeout under 10 s keeps a decimal
    finally:
        dog.stop()
        PROGRESS.mark("test over")


def test_seconds_keep_a_decimal_below_ten() -> None:
    assert [seconds_text(s) for s in (0.24, 3.06, 9.94, 10.4, 600.2)] == ["0.2", "3.1", "9.9", "10", "600"]


def test_stop_leaves_no_watchdog_thread_running(tmp_path: Path) -> None:
    """A caller that goes on after a run (a notebook's kernel, the next run in its process) finds the
    thread gone when `stop()` returns: it was still ending a moment later (a stall test saw it)."""
    dog = Watchdog(tmp_path, 5.0, 1).start()
    assert dog._thread is not None and dog._thread.is_alive()
    dog.stop()
    assert not dog._thread.is_alive()


def test_a_stall_on_a_full_disk_is_still_said_and_ends_the_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The claim file and the stacks cannot be written (ENOSPC): the watchdog thread died with a traceback,
    and a 1-process run stuck in its env was never ended. The line is said without the stacks."""
    real_open = os.open

    def full(path: object, *args: object, **kwargs: object) -> int:
        if str(path).startswith(str(tmp_path)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(watchdog_module.os, "open", full)
    left: list[int] = []
    dog = Watchdog(tmp_path, 0, 1)
    monkeypatch.setattr(dog, "leave", lambda status: left.append(status))
    dog.end_job("rank 0: no progress for 3.0 s, in env.step")
    assert left == [1]
    assert capfd.readouterr().err == (
        "ppo-fabric: error: rank 0: no progress for 3.0 s, in env.step (its stacks could not be written: "
        "No space left on device)\n"
    )
    assert dog.collective_timeout("its wait outlasted collectives.timeout=5 s") == (
        "rank 0: its wait outlasted collectives.timeout=5 s (no stacks: No space left on device)"
    )


def test_the_timer_that_stands_in_for_the_watchdog_is_armed_while_it_runs_and_gone_after(
    tmp_path: Path,
) -> None:
    """`runs/deadman.py`: armed when the watchdog starts (before its thread first runs) in this process's
    file; `stop()` cancels it and removes the file; a run in its caller's process is never armed."""
    dog = Watchdog(tmp_path, 5.0, 1).start()
    try:
        (hang,) = tmp_path.glob(".hang-*.txt")
        assert json.loads(hang.read_text()) == {"label": PROGRESS.label, "seconds": 15.0}
    finally:
        dog.stop()
    assert not list(tmp_path.glob(".hang-*")) and not deadman.armed()
    caller = Watchdog(tmp_path, 5.0, 1).interrupting().start()
    caller.stop()
    assert not list(tmp_path.glob(".hang-*"))


@pytest.mark.multiprocess  # a process of its own, which the timer ends
def test_the_timer_ends_a_process_held_in_c_code_and_the_supervisor_names_it(tmp_path: Path) -> None:
    """A process whose main thread never leaves C code that holds the GIL: its watchdog thread cannot run,
    the timer writes every thread's stack and ends it, exit 1; `report` names it in one line and moves the
    stacks into a stall directory; the files of processes that ended otherwise are removed."""
    code = (
        "import re, sys; from pathlib import Path; from ppo_fabric.runs.watchdog import Watchdog; "
        "from ppo_fabric.wire.progress import PROGRESS; PROGRESS.label = 'player rank 2'; "
        "Watchdog(Path(sys.argv[1]), 0.5, 1).start(); re.match(r'(a+)+$', 'a' * 64 + 'b')"
    )
    (tmp_path / ".hang-1.txt").write_text('{"label": "rank 1", "seconds": 2.5}\n')  # killed: no stacks
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, timeout=60)
    assert proc.returncode == 1 and time.monotonic() - started < 30, proc.stderr[-2000:]
    line = deadman.report(tmp_path)
    assert line is not None and line.startswith(
        "player rank 2: no progress for 10 s, and its watchdog could not run: C code held the interpreter lock"
    ), line
    (stall,) = tmp_path.glob("stall-*")
    assert line.endswith(f"stacks in {stall / 'player-rank-2.txt'}")
    assert "line 1 in <module>" in (stall / "player-rank-2.txt").read_text()
    assert not list(tmp_path.glob(".hang-*")) and deadman.report(tmp_path) is None


@pytest.mark.parametrize(("idle", "said"), [(0.1, "still making progress"), (30.0, "no progress for 30 s")])
def test_a_wait_that_outlasts_a_peer_still_making_progress_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, idle: float, said: str
) -> None:
    """Rank 1's wait at the update boundary outlasts its limit while rank 0 plays a long evaluation: the line
    named rank 0 stuck with "no progress for 0.1 s"; it says rank 0 was still at work, and what to raise.
    A rank idle for long is named stuck as before."""
    monkeypatch.setattr(PROGRESS, "label", "rank 1")
    monkeypatch.setattr(watchdog_module, "SETTLE_S", 0.1)
    dog = Watchdog(tmp_path, 0, 2)
    claim = dog._claim

    def with_rank_0_busy() -> Path | None:
        target = claim()
        assert target is not None
        target.mkdir(parents=True, exist_ok=True)
        status = {
            "label": "rank 0",
            "waiting": False,
            "idle_s": idle,
            "where": "evaluation env.step (x.py:9, in step)",
        }
        (target / "rank-0.txt").write_text(json.dumps(status) + "\n")
        return target

    monkeypatch.setattr(dog, "_claim", with_rank_0_busy)
    line = dog.collective_timeout(
        "its wait outlasted collectives.timeout + stall_timeout = 785 s at the update boundary"
    )
    assert line is not None and said in line, line
    if idle < 1:
        assert line.startswith(
            "rank 1's wait outlasted collectives.timeout + stall_timeout = 785 s at the update boundary, while rank 0 "
            "was still making progress, in evaluation env.step (x.py:9, in step) (a long evaluation or a slow step: "
            "raise collectives.timeout); stacks in "
        ), line


@pytest.mark.multiprocess  # processes of its own
def test_a_child_forked_while_the_timer_is_armed_ends_normally(tmp_path: Path) -> None:
    """faulthandler's timer holds a lock its C thread releases: a child forked while it was armed (a user's
    env forking a helper) waited on that lock for ever at its interpreter's end. The parent's timer is
    still armed after the fork."""
    code = (
        "import os, sys, time; from pathlib import Path; from ppo_fabric.runs import deadman\n"
        "deadman.arm(Path(sys.argv[1]), 'rank 0', 60)\n"
        "pid = os.fork()\n"
        "if pid == 0: sys.exit(0)\n"
        "deadline = time.time() + 10\n"
        "while time.time() < deadline and not os.waitpid(pid, os.WNOHANG)[0]: time.sleep(0.05)\n"
        "print('ended' if time.time() < deadline else 'hung', flush=True)\n"
        "deadman.arm(Path(sys.argv[1]), 'rank 0', 0.5); time.sleep(30)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert proc.stdout == "ended\n" and proc.returncode == 1, (proc.stdout, proc.stderr[-2000:])
    (hang,) = tmp_path.glob(".hang-*.txt")
    assert "Timeout" in hang.read_text()


def test_a_status_file_is_seen_only_once_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The claiming process reads each status file's first line as soon as it exists: one read while its
    process was still writing it was empty and dropped, and the wrong rank was named stuck."""
    seen: list[list[str]] = []
    real = watchdog_module.faulthandler.dump_traceback

    def dump(fh: object, all_threads: bool = True) -> None:  # mid-write: what the claimant would glob
        seen.append(sorted(p.name for p in (tmp_path / "stall").glob("*.txt")))
        real(fh, all_threads=all_threads)  # type: ignore[arg-type]

    monkeypatch.setattr(watchdog_module.faulthandler, "dump_traceback", dump)
    monkeypatch.setattr(PROGRESS, "label", "rank 1")
    Watchdog(tmp_path, 0, 2)._answer(tmp_path / "stall")
    assert seen == [[]] and [p.name for p in (tmp_path / "stall").iterdir()] == ["rank-1.txt"]
