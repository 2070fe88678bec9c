"""The GPU scripts on a machine without CUDA; with CUDA, `pytest -m gpu` runs the GPU check whole.

benchmarks/gpu_check.py: every check is skipped, one line each, and the script exits 0 (so CI and CPU
machines can run `make gpu-check`); the checks themselves need a GPU or `--device cpu`, but what a device
job brings back is tested here: the report as it stands after every check, a failed run's output, why the
EnvPool check skips. benchmarks/gpu_strategies.py: its rows."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import benchmark_script

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.multiprocess
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
        "graph_step",
        "envpool_pong",
        "decoupled_gpu_trainer",
        "decoupled_two_gpu_trainers",
    ]
    assert [line.split(":")[0] for line in lines] == [f"SKIP {name}" for name in names], proc.stdout
    assert all("no CUDA device" in line for line in lines)
    report = json.loads(out.read_text())
    assert [c["status"] for c in report["checks"]] == ["SKIP"] * len(names)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device: the CPU suite cannot prove these"
)
def test_every_cuda_path_passes_on_a_gpu(tmp_path: Path) -> None:
    """On a machine with CUDA, `pytest -m gpu` runs the whole GPU check: resume on the GPU and across
    devices, SIGTERM, compile, the decoupled GPU trainers (EnvPool's Pong may skip, saying why)."""
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    statuses = {c["name"]: c["status"] for c in json.loads(out.read_text())["checks"]}
    assert "FAIL" not in statuses.values(), statuses
    assert all(status == "PASS" for name, status in statuses.items() if name != "envpool_pong"), statuses


@pytest.fixture
def gc(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    return benchmark_script(monkeypatch, "gpu_check")


def test_report_is_rewritten_after_every_check_and_keeps_failure_output(
    gc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A device job may be killed part way: the report on disk holds every check finished so far. A failed
    run's output tail (its traceback) is printed under the FAIL line and kept in the report."""
    out = tmp_path / "report.json"
    seen_during_second: list[dict] = []

    def second(runs):  # type: ignore[no-untyped-def]
        seen_during_second.append(json.loads(out.read_text()))
        raise gc.CheckFailed(
            "run 'x' exited 1: RuntimeError: boom", "Traceback (most recent call last):\nRuntimeError: boom"
        )

    monkeypatch.setitem(gc.CHECK_FUNCTIONS, "resume_round_trip", lambda runs: {"max_abs_diff": 0.0})
    monkeypatch.setitem(gc.CHECK_FUNCTIONS, "sigterm", second)
    status = gc.main(["--device", "cpu", "--only", "resume_round_trip", "sigterm", "--out", str(out)])
    assert status == 1
    [partial] = seen_during_second
    assert partial["finished"] is False
    assert [(c["name"], c["status"]) for c in partial["checks"]] == [("resume_round_trip", "PASS")]
    final = json.loads(out.read_text())
    assert final["finished"] is True
    assert [c["status"] for c in final["checks"]] == ["PASS", "FAIL"]
    assert final["checks"][1]["details"]["log_tail"].endswith("RuntimeError: boom")
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("FAIL sigterm: run 'x' exited 1: RuntimeError: boom")
    assert lines[at + 1 : at + 3] == ["    Traceback (most recent call last):", "    RuntimeError: boom"]


@pytest.mark.slow
def test_a_failing_run_carries_its_output(gc, tmp_path: Path) -> None:
    """Runs.train: a run that exits non-zero fails the check with its last line, and its output tail."""
    runs = gc.Runs(tmp_path, "cpu", 2)
    with pytest.raises(gc.CheckFailed) as failed:
        runs.train("bad", ["algo.total_steps=-5"])
    assert "exited 2" in str(failed.value) and "algo.total_steps" in str(failed.value)
    assert "ppo-fabric: error" in failed.value.log


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (ModuleNotFoundError("No module named 'envpool'", name="envpool"), "needs EnvPool"),
        (
            ModuleNotFoundError("No module named 'dm_env'", name="dm_env"),
            "does not import (No module named 'dm_env')",
        ),
    ],
)
def test_envpool_check_says_why_it_skips(
    gc, monkeypatch: pytest.MonkeyPatch, error: ImportError, expected: str
) -> None:
    """A wheel copied without its dependencies is found but does not import: the skip names what is missing."""

    real = importlib.import_module

    def fail(name: str, *args):  # type: ignore[no-untyped-def]
        if name == "envpool":
            raise error
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", fail)
    assert expected in gc.envpool_missing()
    with pytest.raises(gc.CheckSkipped, match="EnvPool"):
        gc.envpool_pong(None)


# ------------------------------------------------------------------------------- gpu_strategies.py
@pytest.fixture
def gs(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    return benchmark_script(monkeypatch, "gpu_strategies")


def test_gpu_strategies_has_a_compiled_row(gs) -> None:  # type: ignore[no-untyped-def]
    """Issue 17 asks for compile on/off among the GPU rows: `--variants gpu` includes it, on the GPU (on
    the CPU in a dry run)."""
    table = gs.variants(1, [1, 2])
    gpu_rows = gs.chosen(table, ["gpu"])
    assert gpu_rows == [
        "coupled-gpu",
        "coupled-gpu-compile",
        "decoupled-gpu-1",
        "decoupled-gpu-2",
        "decoupled-gpuplay-1",
        "decoupled-gpuplay-2",
        "decoupled-gpu-2-compile",
    ]
    assert table["decoupled-gpu-2-compile"][1] == [*table["decoupled-gpu-2"][1], "algo.compile=true"]
    _, overrides, on_cpu = table["coupled-gpu-compile"]
    assert overrides == ["strategy=coupled", "fabric=gpu", "algo.compile=true"] and not on_cpu
    assert gs.variants(1, [1], dry_run=True)["coupled-gpu-compile"][1][1] == "fabric=cpu"


def test_layouts_run_in_the_order_named_and_envpool_players_share_the_cores(gs, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A lease cut short has run the rows named first; EnvPool players act on the GPU and split the cores
    left after one core per process among their pools."""
    monkeypatch.setattr(gs.os, "cpu_count", lambda: 16)
    table = gs.variants(1, [4, 14], envpool_players=(2,))
    asked = ["decoupled-envpool-2", "decoupled-gpu-14", "decoupled-gpuplay-14", "decoupled-gpu-4"]
    assert gs.chosen(table, asked) == asked
    assert gs.chosen(table, ["decoupled-gpu-4", "gpu"])[:2] == ["decoupled-gpu-4", "coupled-gpu"]
    name, overrides, on_cpu = table["decoupled-envpool-2"]
    assert "2 EnvPool players (6 threads each)" in name and not on_cpu
    assert {"algo.players=2", "fabric.devices=3", "algo.player_device=auto", "algo.trainer_device=cuda",
            "env.backend=envpool", "env.envpool.num_threads=6"} <= set(overrides)  # fmt: skip
    assert "algo.player_device=auto" in table["decoupled-gpuplay-14"][1]
    assert "algo.player_device=cpu" in table["decoupled-gpu-14"][1]
    dry = gs.variants(1, [4], dry_run=True, envpool_players=(2,))
    assert {"algo.player_device=cpu", "algo.trainer_device=cpu"} <= set(dry["decoupled-envpool-2"][1])


def test_a_rerun_replaces_its_own_rows_and_keeps_the_others(gs, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A report split over several jobs keeps the rows a job does not redo; rerunning `--only envpool`
    replaces the EnvPool rows (they once had no variant key, so every rerun added two more), and
    `--envpool-dry-run` runs their commands on the CPU for one batch, writing nothing."""
    summary = {"steps_this_run": 2048, "total_env_steps": 2048, "sps": 100.0, "wall_seconds": 2.0,
               "final_mean_return": -21.0, "time_split": {"collect": 1.0, "train": 0.5}, "curve": []}  # fmt: skip
    runs: list[list[str]] = []
    monkeypatch.setattr(gs, "run_once", lambda overrides, curve, timeout: runs.append(overrides) or summary)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name in ("ale_py", "cv2", "envpool") else real(name, *a),
    )
    report = tmp_path / "gpu-strategies-dryrun.json"

    def sitting(*argv: str) -> list[tuple[str, str]]:
        monkeypatch.setattr(sys, "argv", ["gpu_strategies.py", "--dry-run", *argv, "--out", str(tmp_path)])
        gs.main()
        return [(r["key"], r["variant_key"]) for r in json.loads(report.read_text())["rows"]]

    cartpole = ("cartpole", "coupled-gpu")
    pooled = [("envpool", "gymnasium-async"), ("envpool", "envpool")]
    assert sitting("--only", "cartpole", "--variants", "coupled-gpu") == [cartpole]
    assert sitting("--only", "envpool") == [cartpole, *pooled]
    assert all("fabric=cpu" in run and "fabric=gpu" not in run for run in runs[-2:])  # a dry run: on the CPU
    assert sitting("--only", "envpool") == [cartpole, *pooled]
    assert sitting("--only", "cartpole", "--variants", "coupled-gpu") == [*pooled, cartpole]
    written = {f.name: f.read_text() for f in tmp_path.iterdir()}
    monkeypatch.setattr(sys, "argv", ["gpu_strategies.py", "--envpool-dry-run", "--envpool-variants", "envpool",
                                      "--out", str(tmp_path)])  # fmt: skip
    gs.main()
    assert {f.name: f.read_text() for f in tmp_path.iterdir()} == written
    assert runs[-1] == ["exp=atari", "env.num_envs=32", "strategy=coupled", "env.backend=envpool", "fabric=cpu",
                        "algo.total_steps=4096"]  # fmt: skip


def test_a_layout_that_logged_nothing_leaves_a_note_and_the_next_runs(
    gs, tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """A job whose processes take longer to start than `--run-timeout` gives no figures: the report says so
    and the benchmark goes on to the next layout instead of ending (one lease lost three rows that way)."""
    summary = {"steps_this_run": 4096, "total_env_steps": 4096, "sps": 100.0, "wall_seconds": 40.0,
               "final_mean_return": 9.0, "time_split": {"collect": 1.0, "train": 0.5}, "curve": []}  # fmt: skip

    def run_once(overrides: list[str], curve: bool, timeout: float | None = None) -> dict:
        assert timeout == 5.0
        if "algo.players=1" in overrides:
            raise gs.common.LoggedNothing(
                "benchmark run stopped after 5 s before it logged an update", "0.1 up\n"
            )
        return summary

    monkeypatch.setattr(gs, "run_once", run_once)
    monkeypatch.setattr(sys, "argv", ["gpu_strategies.py", "--dry-run", "--only", "cartpole", "--players", "1",
                                      "--variants", "decoupled-gpu-1", "coupled-gpu", "--run-timeout", "5",
                                      "--out", str(tmp_path)])  # fmt: skip
    gs.main()
    report = json.loads((tmp_path / "gpu-strategies-dryrun.json").read_text())
    assert [r["variant_key"] for r in report["rows"]] == ["coupled-gpu"]
    assert any("1 CPU player: no row, benchmark run stopped after 5 s" in n for n in report["notes"])
    assert (tmp_path / "trace-decoupled-gpu-1.log").read_text() == "0.1 up\n"  # what the stopped run wrote


def test_minibatch_step_run_alone_keeps_the_other_variants_rows(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`--variants graph` in a process of its own adds its row to the eager and compiled rows of the same
    device and sizes; a report of other sizes is not mixed in."""
    import argparse

    import torch

    ms = benchmark_script(monkeypatch, "minibatch_step")
    sizes = {"batch": 64, "minibatch": 32, "epochs": 1, "updates": 2}
    old = {"eager": {"ms_per_step": 3.0}, "compiled": {"ms_per_step": 1.5}}
    (tmp_path / "minibatch_step_cpu_dry_run.json").write_text(
        json.dumps({"device": ms.device_name(torch.device("cpu")), "args": sizes, "rows": old})
    )
    args = argparse.Namespace(out=tmp_path, variants=["compiled"], **sizes)
    assert ms.earlier_rows(args, torch.device("cpu")) == {"eager": {"ms_per_step": 3.0}}
    args.variants = list(ms.VARIANTS)  # every variant: nothing kept
    assert ms.earlier_rows(args, torch.device("cpu")) == {}
    args.variants, args.batch = ["graph"], 128  # other sizes: nothing kept
    assert ms.earlier_rows(args, torch.device("cpu")) == {}


def test_minibatch_step_dry_run_times_the_package_update_and_its_graph(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """On the CPU, `eager`, `compile-graph` and `graph` (the `WholeStepGraph` an `algo.compile=graph` update
    of `exp=atari`'s learner keeps, run uncaptured) each give a row, even where an update has fewer
    minibatch steps than the graph's warm-up."""
    ms = benchmark_script(monkeypatch, "minibatch_step")
    monkeypatch.setattr(sys, "argv", ["minibatch_step.py", "--device", "cpu", "--batch", "32", "--minibatch", "16",
                                      "--epochs", "1", "--updates", "1", "--variants", "eager", "compile-graph",
                                      "graph", "--out", str(tmp_path)])  # fmt: skip
    ms.main()
    rows = json.loads((tmp_path / "minibatch_step_cpu_dry_run.json").read_text())["rows"]
    assert list(rows) == ["eager", "compile-graph", "graph"]
    assert all(row["ms_per_step"] > 0 for row in rows.values())
