"""`python -m ppo_fabric.evaluate` and the learning curve written at the end of training.

The evaluation must replay the checkpoint's own env and model with nothing repeated on the command line,
report statistics that agree with the per-episode returns it stores, and turn every bad input into one line
on stderr with exit status 2 (the training CLI's contract).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ppo_fabric
from ppo_fabric.policy import evaluate
from ppo_fabric.runs import plots
from tests.conftest import assert_cli_failure

HAS_AV = importlib.util.find_spec("av") is not None


def _ckpt(run_dir: Path) -> str:
    return str(run_dir / "checkpoints" / "last.ckpt")


# ----------------------------------------------------------------------------------------- learning curve
def test_training_writes_the_learning_curve(tiny_run: Path) -> None:
    png = tiny_run / "learning_curve.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_logger_plot_false_draws_no_curve(tmp_path: Path) -> None:
    """`logger.plot=false`: the run's other outputs, no figure (the first costs a process ~0.5 s of CPU)."""
    ppo_fabric.run(["algo.total_steps=256", "logger.tensorboard=false", "logger.plot=false", "eval.every=0",
                    f"hydra.run.dir={tmp_path}"])  # fmt: skip
    assert (tmp_path / "summary.json").is_file() and (tmp_path / "metrics.csv").is_file()
    assert not (tmp_path / "learning_curve.png").exists()


def test_a_plotting_failure_only_warns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(run_dir: Path, title: str | None = None) -> Path:
        raise RuntimeError("no fonts")

    monkeypatch.setattr(plots, "plot_learning_curve", broken)
    with pytest.warns(UserWarning, match="could not plot the learning curve"):
        assert plots.save_learning_curve(tmp_path) is None


def test_the_curve_draws_the_evaluations_from_their_own_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Training returns from metrics.csv, evaluation points (mean +- std) from evaluations.csv."""
    from matplotlib.axes import Axes

    (tmp_path / "metrics.csv").write_text("step,rollout/episode_return\n256,10\n512,20\n")
    (tmp_path / "evaluations.csv").write_text("step,eval/return_mean,eval/return_std\n256,30,1\n512,40,2\n")
    drawn: list[tuple] = []
    errorbar = Axes.errorbar
    monkeypatch.setattr(
        Axes, "errorbar", lambda ax, x, y, **kw: drawn.append((x, y, kw["yerr"])) or errorbar(ax, x, y, **kw)
    )
    assert plots.plot_learning_curve(tmp_path) == tmp_path / plots.FILENAME
    assert drawn == [([256.0, 512.0], [30.0, 40.0], [1.0, 2.0])]


def test_plot_without_episodes_or_csv(tmp_path: Path) -> None:
    assert plots.plot_learning_curve(tmp_path) is None  # logger.csv=false: nothing to plot
    (tmp_path / "metrics.csv").write_text("step,loss/policy\n256,0.1\n")
    assert plots.plot_learning_curve(tmp_path) == tmp_path / plots.FILENAME


# ------------------------------------------------------------------------------------------------ evaluate
def test_a_seed_past_32_bits_evaluates(tiny_run: Path, tmp_path: Path) -> None:
    """Only a negative seed is refused: a tuner's trial evaluates at its run's seed plus an offset, which
    passes 2**32 for the largest seeds training takes."""
    evaluate.main([f"checkpoint={_ckpt(tiny_run)}", "episodes=1", f"seed={2**32 + 5}", f"out={tmp_path}"])
    assert json.loads((tmp_path / "eval.json").read_text())["seed"] == 2**32 + 5


def test_evaluate_in_process(tiny_run: Path, tmp_path: Path) -> None:
    result = evaluate.main([f"checkpoint={_ckpt(tiny_run)}", "episodes=4", "seed=7", f"out={tmp_path}"])
    assert result is not None
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert saved["env_id"] == "CartPole-v1" and saved["episodes"] == 4 and saved["deterministic"] is True
    assert saved["env_step"] == 512 and saved["video"] is None
    returns = saved["returns"]
    assert len(returns) == len(saved["lengths"]) == 4
    assert saved["mean_return"] == pytest.approx(np.mean(returns))
    assert saved["std_return"] == pytest.approx(np.std(returns))
    assert saved["min_return"] <= saved["mean_return"] <= saved["max_return"]
    assert returns == [float(n) for n in saved["lengths"]]  # CartPole: +1 per step
    # Deterministic actions and seeded resets: the same call gives the same episodes.
    again = evaluate.evaluate(_ckpt(tiny_run), episodes=4, seed=7, out=tmp_path / "again")
    assert again["returns"] == returns
    stochastic = evaluate.evaluate(_ckpt(tiny_run), episodes=2, deterministic=False, out=tmp_path / "s")
    assert stochastic["deterministic"] is False and len(stochastic["returns"]) == 2


@pytest.mark.multiprocess
def test_evaluate_cli(tiny_run: Path, tmp_path: Path) -> None:
    """The real command, from an unrelated directory, given the run directory: eval.json lands in it."""
    env = {k: v for k, v in os.environ.items() if k not in ("LT_CLI_USED", "WORLD_SIZE")}
    proc = subprocess.run(
        [sys.executable, "-m", "ppo_fabric.evaluate", f"checkpoint={tiny_run}", "episodes=3"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and "mean return" in lines[0] and "over 3 episodes" in lines[0], proc.stdout
    saved = json.loads((tiny_run / "eval.json").read_text())
    assert saved["episodes"] == 3 and f"{saved['mean_return']:.2f}" in lines[0]


@pytest.mark.skipif(not HAS_AV, reason="video extra not installed: pip install 'ppo-fabric[video]'")
def test_evaluate_records_a_video(tiny_run: Path, tmp_path: Path) -> None:
    import av

    result = evaluate.evaluate(_ckpt(tiny_run), episodes=2, video=True, out=tmp_path)
    video = tmp_path / "eval.mp4"
    assert result["video"] == str(video) and video.stat().st_size > 0
    with av.open(str(video)) as container:
        frames = sum(1 for _ in container.decode(video=0))
    assert frames == result["lengths"][0] + 1  # the reset frame, then one per step of the first episode


def test_video_without_the_extra_names_it(
    tiny_run: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "av", None)  # makes `import av` fail
    assert_cli_failure(
        capsys,
        evaluate.main,
        [f"checkpoint={_ckpt(tiny_run)}", "video=true"],
        "pip install 'ppo-fabric[video]'",
    )


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        pytest.param(["checkpoint={missing}"], "no such checkpoint file", id="missing-checkpoint"),
        pytest.param(["checkpoint={config}"], "not a readable checkpoint", id="not-a-checkpoint"),
        pytest.param(["checkpoint={ckpt}", "episodes=0"], "episodes=0 must be > 0", id="zero-episodes"),
        pytest.param(["checkpoint={ckpt}", "episodes=-3"], "must be > 0", id="negative-episodes"),
        pytest.param(["checkpoint={ckpt}", "episodes=two"], "whole number", id="episodes-not-a-number"),
        pytest.param(["checkpoint={ckpt}", "deterministic=maybe"], "true or false", id="bad-bool"),
        pytest.param(["checkpoint={ckpt}", "seed=-1"], "seed=-1 must be >= 0", id="negative-seed"),
        pytest.param(["checkpoint={ckpt}", "epsiodes=3"], "epsiodes: unknown argument", id="unknown-key"),
        pytest.param(["checkpoint={ckpt}", "episodes"], "key=value", id="no-equals"),
        pytest.param(["episodes=3"], "checkpoint is required", id="no-checkpoint"),
        pytest.param(
            ["checkpoint={ckpt}", "out={config}"], "is a file; out= names the directory", id="out-a-file"
        ),
    ],
)
def test_bad_input(
    tiny_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], fragment: str
) -> None:
    paths = {"missing": tmp_path / "nope.ckpt", "config": tiny_run / "config.yaml", "ckpt": _ckpt(tiny_run)}
    assert_cli_failure(capsys, evaluate.main, [a.format(**paths) for a in args], fragment)
