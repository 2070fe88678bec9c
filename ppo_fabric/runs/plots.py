"""The learning curve written to the run directory when training ends (rank 0 only).

Drawn with matplotlib's object API on an Agg canvas, never through pyplot: pyplot would pick (or switch)
a process-wide GUI backend, which a library called from a notebook or a headless node must not touch.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from ppo_fabric.runs.metrics_file import EVALUATIONS_CSV, METRICS_CSV, read_rows, series

RETURN_KEY = "rollout/episode_return"
MEAN20_KEY = "rollout/return_mean20"
EVAL_KEY, EVAL_STD_KEY = "eval/return_mean", "eval/return_std"
FILENAME = "learning_curve.png"


def _read_series(path: Path, key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows of metrics.csv that have `key` (rows without finished episodes don't)."""
    points = series(read_rows(path), key)
    return [s for s, _ in points], [v for _, v in points]


def plot_learning_curve(run_dir: Path, title: str | None = None) -> Path | None:
    """Episode return against env steps from `run_dir/metrics.csv`, and the evaluations during training from
    `run_dir/evaluations.csv`, saved as `run_dir/learning_curve.png`.

    Returns the PNG's path, or None when the run kept no metrics.csv (`logger.csv=false`).
    """
    metrics = Path(run_dir) / METRICS_CSV
    if not metrics.is_file():
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    steps, returns = _read_series(metrics, RETURN_KEY)
    if steps:
        ax.plot(
            steps, returns, color="tab:blue", alpha=0.5, lw=1, label="mean return of the update's episodes"
        )
        mean_steps, mean20 = _read_series(metrics, MEAN20_KEY)
        if mean_steps:
            ax.plot(mean_steps, mean20, color="tab:blue", lw=2, label="mean of the last 20 episodes")
    evaluations = Path(run_dir) / EVALUATIONS_CSV
    eval_steps, eval_means = _read_series(evaluations, EVAL_KEY)
    if eval_steps:  # evaluation during training (eval.every): its own episodes, the policy as it stood
        _, eval_stds = _read_series(evaluations, EVAL_STD_KEY)
        ax.errorbar(eval_steps, eval_means, yerr=eval_stds or None, color="tab:orange", marker="o", ms=4,
                    lw=1.5, capsize=2, label="evaluation (mean +- std of its episodes)")  # fmt: skip
    if steps or eval_steps:
        ax.legend(loc="lower right", fontsize="small")
    if not steps and not eval_steps:
        ax.text(0.5, 0.5, "no episode finished", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("env steps")
    ax.set_ylabel("episode return")
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title)
    out = Path(run_dir) / FILENAME
    fig.savefig(out)
    return out


def save_learning_curve(run_dir: Path, title: str | None = None) -> Path | None:
    """`plot_learning_curve` for the end of training: a figure is a convenience, so any failure (no
    matplotlib, unreadable CSV, full disk) becomes a warning and never fails a run that has finished."""
    try:
        return plot_learning_curve(run_dir, title)
    except Exception as exc:  # anything at all: the run's real outputs are already written
        warnings.warn(f"ppo-fabric: could not plot the learning curve: {exc!r}", stacklevel=2)
        return None
