"""The resumable learning reports: a run trained by one benchmark is reported by another instead of being
trained twice, and SB3 runs stopped at the threshold or the wall cap never pass for a final return."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_gpu_check import _script


def _tts_run(overrides: list[str], **extra: object) -> dict:
    return {"overrides": overrides, "commit": "abc1234", "total_env_steps": 1_001_472, "final_mean_return": 1800.0,
            "wall_seconds": 140.0, "sps": 7100.0, "curve": [[2048, 1.0, -300.0], [1_001_472, 140.0, 1800.0]],
            **extra}  # fmt: skip


def test_learning_takes_a_run_with_the_same_overrides(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    learning = _script(monkeypatch, "learning")
    task = learning.SUITES["mujoco"][1]  # Hopper-v5
    same = [*task.overrides, *learning.VARIANTS["pipelined"], "seed=2"]
    report = tmp_path / "time_to_score.json"
    report.write_text(json.dumps({"runs": [
        _tts_run([*task.overrides, *learning.VARIANTS["coupled"], "seed=2"]),  # another variant
        _tts_run([*task.overrides, *learning.VARIANTS["pipelined"], "seed=3"]),  # another seed
        _tts_run(same),
    ]}))  # fmt: skip
    r = learning.reused_record(task, "pipelined", 2, None, [report, tmp_path / "missing.json"])
    assert r is not None and (r["env"], r["variant"], r["seed"], r["run_by"]) == ("Hopper-v5", "pipelined", 2,
                                                                                  "time_to_score.json")  # fmt: skip
    assert r["final_mean_return"] == 1800.0 and r["overrides"] == same and r["commit"] == "abc1234"
    assert learning.reused_record(task, "pipelined", 1, None, [report]) is None
    assert learning.reused_record(task, "pipelined", 2, 50_000, [report]) is None  # another budget
    report.write_text(json.dumps({"runs": [_tts_run(same, stopped="threshold")]}))
    assert learning.reused_record(task, "pipelined", 2, None, [report]) is None  # never reached its budget


def test_stopped_sb3_runs_show_no_final_return(monkeypatch: pytest.MonkeyPatch) -> None:
    tts = _script(monkeypatch, "time_to_score")

    def run(variant: str, seed: int, final: float, wall_at: float | None, **extra: object) -> dict:
        return {"workload": "halfcheetah", "variant": variant, "seed": seed, "commit": "abc1234",
                "final_mean_return": final, "best_mean_return": final, "wall_at_threshold": wall_at,
                "step_at_threshold": None if wall_at is None else 400_000, "wall_seconds": 300.0, "sps": 700.0,
                "load": [1.0, 1.1], **extra}  # fmt: skip

    runs = [run("pipelined", 1, 1800.0, 60.0), run("sb3", 1, 1510.0, 290.0, stopped="threshold"),
            run("sb3", 2, 900.0, None, stopped="wall cap")]  # fmt: skip
    md = tts.markdown({"runs": runs, "machine": {"cpu": "x", "cores": 2, "torch": "t"}}, "cmd")
    sb3 = next(line for line in md.splitlines() if line.startswith("| sb3 "))
    cells = [c.strip() for c in sb3.strip("|").split("|")]
    assert cells[2] == "290 (1/2)" and cells[4] == cells[5] == "stopped"
    assert "sb3 seed 1 at 300 s (threshold); sb3 seed 2 at 300 s (wall cap)" in md
    capped = tts.markdown({"runs": runs[2:], "machine": {"cpu": "x", "cores": 2, "torch": "t"}}, "cmd")
    assert "| sb3 | 2 | > 300 (cap) | never |" in capped
    pipelined = next(line for line in md.splitlines() if line.startswith("| pipelined "))
    assert "1800" in pipelined
