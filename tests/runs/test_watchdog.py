"""The watchdog's end of a job among its processes, in one process: who claims it, and when the processes
that answer a claim may leave (the job-level runs are in tests/strategies/test_faults_distributed.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from ppo_fabric.runs import watchdog as watchdog_module
from ppo_fabric.runs.watchdog import Watchdog, seconds_text


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
    from ppo_fabric.wire.progress import PROGRESS

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
