"""The watchdog's end of a job among its processes, in one process: who claims it, and when the processes
that answer a claim may leave (the job-level runs are in tests/strategies/test_faults_distributed.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from ppo_fabric.runs import watchdog as watchdog_module
from ppo_fabric.runs.watchdog import Watchdog


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
