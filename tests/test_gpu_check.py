"""benchmarks/gpu_check.py without CUDA: every check is skipped, one line each, and the script exits 0 (so
CI and CPU machines can run `make gpu-check`); the checks themselves need a GPU or `--device cpu`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_gpu_check_skips_every_check_without_cuda(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no device even on a GPU machine
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--out", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    names = [
        "resume_round_trip",
        "cpu_to_gpu_resume",
        "gpu_to_cpu_resume",
        "sigterm",
        "compile_on_off",
        "envpool_pong",
        "decoupled_gpu_trainer",
        "decoupled_two_gpu_trainers",
    ]
    assert [line.split(":")[0] for line in lines] == [f"SKIP {name}" for name in names], proc.stdout
    assert all("no CUDA device" in line for line in lines)
    report = json.loads(out.read_text())
    assert [c["status"] for c in report["checks"]] == ["SKIP"] * len(names)
