"""Which rank a job's line blames when a rank sees only a closed connection: the process that launched the
ranks (its node's first) names the one that ended without a line of its own (`launch.ended_peer`); the
multi-process runs are in tests/app/test_supervisor.py and tests/strategies/test_faults_distributed.py."""

from __future__ import annotations

from types import SimpleNamespace

from ppo_fabric.app.launch import ended_line, ended_peer


class Ended:
    def __init__(self, code: int | None) -> None:
        self.code = code

    def poll(self) -> int | None:
        return self.code


def _launcher(*codes: int | None, rank: int = 0) -> SimpleNamespace:
    procs = [Ended(code) for code in codes]
    return SimpleNamespace(global_rank=rank, strategy=SimpleNamespace(launcher=SimpleNamespace(procs=procs)))


def test_a_signal_is_named_first_and_a_ranks_own_failure_never() -> None:
    """Local ranks 1-3: rank 1 ended 1 after its own line (it lost a peer), rank 2 ended 3 with no line, rank
    3 was SIGKILLed: the kill is the cause; rank 1's exit 1 was read as "ended with no line of its own"."""
    assert ended_peer(_launcher(1, 3, -9), wait_s=0) == (3, -9)  # type: ignore[arg-type]
    assert ended_peer(_launcher(1, 3, None), wait_s=0) == (2, 3)  # type: ignore[arg-type]
    assert ended_peer(_launcher(1, 0, None), wait_s=0) is None  # type: ignore[arg-type]
    assert ended_peer(_launcher(None, -15, rank=4), wait_s=0) == (6, -15)  # type: ignore[arg-type]
    assert ended_peer(SimpleNamespace(global_rank=0, strategy=SimpleNamespace()), wait_s=0) is None  # type: ignore[arg-type]


def test_the_lines() -> None:
    assert ended_line(2, -9, "rank 0") == (
        "rank 2 was killed by SIGKILL (the out-of-memory killer, or kill -9); rank 0 lost contact with it"
    )
    assert ended_line(1, -15, "rank 0") == "rank 1 was killed by SIGTERM; rank 0 lost contact with it"
    assert ended_line(1, 3, "rank 0") == (
        "rank 1 ended with exit status 3 and no line of its own; rank 0 lost contact with it"
    )
