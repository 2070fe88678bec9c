"""Statistics over a few seeds as Agarwal et al. 2021 (`rliable`) recommend, in NumPy alone: the interquartile
mean (IQM), stratified bootstrap confidence intervals, the probability of improvement and performance profiles.
Scores come as `{task: the final scores of its runs}`, raw: the reports give each task's figures alone (P of
improvement also averaged over tasks), so no score is normalised across tasks.

    python -m benchmarks stats benchmarks/results/learning_classic.json        # -> learning_classic_stats.{md,png}
    python -m benchmarks stats benchmarks/results/time_to_score.json --out /tmp/s --reps 5000
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

Floats = NDArray[np.float64]
Batch = Mapping[str, Floats]  # task -> (batch, runs): a batch of resampled score sets, one row each
Statistic = Callable[[Batch], Floats]  # a batch of score sets -> (batch,) or (batch, k)

REPS = 2000  # bootstrap resamples in the reports (rliable's own default for profiles; 50,000 for intervals)
LEVEL = 0.95


# ------------------------------------------------------------------------------------------- point figures
def _trimmed(a: Floats) -> Floats:
    """The interquartile mean along the last axis: sort, cut `floor(n / 4)` values from each end, average."""
    n = a.shape[-1]
    cut = int(0.25 * n)
    return np.sort(a, axis=-1)[..., cut : n - cut].mean(axis=-1)


def _runs(scores: ArrayLike, task: str = "") -> Floats:
    """One task's runs as a 1-D float array: at least one, none NaN."""
    a = np.asarray(scores, dtype=np.float64).ravel()
    where = f" (task {task!r})" if task else ""
    if a.size == 0:
        raise ValueError(f"no runs{where}")
    if np.isnan(a).any():
        raise ValueError(f"a score is NaN{where}: leave out runs without a final score")
    return a


def _tasks(scores_by_task: Mapping[str, ArrayLike]) -> dict[str, Floats]:
    if not scores_by_task:
        raise ValueError("no tasks")
    return {task: _runs(runs, task) for task, runs in sorted(scores_by_task.items())}


def iqm(scores: ArrayLike) -> float:
    """Interquartile mean of runs: the mean of the middle 50%, rliable's `aggregate_iqm`, which is
    `scipy.stats.trim_mean(scores, 0.25, axis=None)` (every value pooled, whatever the shape).

    `k = floor(n / 4)` runs are cut from each end of the sorted scores and the `n - 2k` left are averaged. A
    fractional cut is rounded down, never interpolated: n = 8 averages the middle 4, n = 10 the middle 6
    (`floor(2.5) = 2`), n = 5 the middle 3, n = 6 the middle 4, and n < 4 cuts nothing (the plain mean).
    So when n is not a multiple of 4 more than half of the runs count."""
    return float(_trimmed(_runs(scores)))


def improvement_probability(x: ArrayLike, y: ArrayLike) -> float:
    """P(X > Y) on one task: the share of the n*m pairs (a run of x, a run of y) in which x's run scores
    higher, a tie counting 1/2. That is the Mann-Whitney U statistic of x divided by n*m, rliable's figure
    (which sets 0.5 where the two arrays are equal, the value this gives anyway)."""
    a, b = _runs(x)[:, None], _runs(y)[None, :]
    return float((a > b).mean() + 0.5 * (a == b).mean())


# ------------------------------------------------------------------------------------ batched statistics
def aggregate_iqm(batch: Batch) -> Floats:
    """IQM of every task's runs pooled, for each score set of the batch (a `Statistic`)."""
    return _trimmed(np.concatenate(list(batch.values()), axis=-1))


def _profile_statistic(taus: Floats) -> Statistic:
    def profile(batch: Batch) -> Floats:
        pooled = np.concatenate(list(batch.values()), axis=-1)  # (batch, runs)
        return (pooled[..., :, None] > taus).mean(axis=-2)  # (batch, taus)

    return profile


# -------------------------------------------------------------------------------- the stratified bootstrap
def _resample(data: Mapping[str, Floats], reps: int, rng: np.random.Generator) -> dict[str, Floats]:
    """`reps` score sets: within each task, as many runs as it has, drawn with replacement from its own."""
    return {task: runs[rng.integers(0, runs.size, size=(reps, runs.size))] for task, runs in data.items()}


def _percentiles(point: Floats, draws: Floats, level: float) -> tuple[Floats, Floats, Floats]:
    low, high = np.percentile(draws, [50 * (1 - level), 50 * (1 + level)], axis=0)
    return point, low, high


def _check(reps: int, level: float) -> None:
    if reps < 1:
        raise ValueError(f"reps must be at least 1, not {reps}")
    if not 0 < level < 1:
        raise ValueError(f"level must be between 0 and 1, not {level}")


def _interval(
    data: Mapping[str, Floats], statistic: Statistic, reps: int, level: float, seed: int
) -> tuple[Floats, Floats, Floats]:
    _check(reps, level)
    point = statistic({t: v[None, :] for t, v in data.items()})[0]
    draws = statistic(_resample(data, reps, np.random.default_rng(seed)))
    return _percentiles(point, draws, level)


def stratified_bootstrap_ci(
    scores_by_task: Mapping[str, ArrayLike],
    reps: int = REPS,
    level: float = LEVEL,
    seed: int = 0,
) -> tuple[float, float, float]:
    """(point, low, high): the IQM of every task's runs pooled and its percentile confidence interval at `level` from
    rliable's stratified bootstrap. Each of `reps` resamples draws, within every task independently, as many
    runs as the task has, with replacement from that task's own runs (a task never lends runs to another);
    the IQM is computed on each resampled set and the interval is the `(1 - level) / 2` and
    `(1 + level) / 2` percentiles of those values (NumPy's linear interpolation). The same `seed` gives the
    same interval. Runs that are all equal give `low == point == high`."""
    point, low, high = _interval(_tasks(scores_by_task), aggregate_iqm, reps, level, seed)
    return float(point), float(low), float(high)


def probability_of_improvement(
    x_by_task: Mapping[str, ArrayLike],
    y_by_task: Mapping[str, ArrayLike],
    reps: int = REPS,
    level: float = LEVEL,
    seed: int = 0,
) -> tuple[float, float, float]:
    """(point, low, high): P(X > Y), the probability that a run of X scores above a run of Y on a task picked
    at random, i.e. `improvement_probability` on each task averaged over the tasks (rliable's
    `probability_of_improvement`), with its stratified bootstrap percentile interval: each resample draws the
    runs of X and those of Y independently, within each task. 0.5: neither is better; an interval that
    includes 0.5 means these runs cannot tell the two apart. Both must have the same tasks."""
    if set(x_by_task) != set(y_by_task):
        raise ValueError(f"x and y have different tasks: {sorted(x_by_task)} vs {sorted(y_by_task)}")
    _check(reps, level)
    x, y = _tasks(x_by_task), _tasks(y_by_task)

    def statistic(bx: Batch, by: Batch) -> Floats:
        per_task = []
        for task in bx:
            a, b = bx[task][..., :, None], by[task][..., None, :]
            per_task.append((a > b).mean(axis=(-2, -1)) + 0.5 * (a == b).mean(axis=(-2, -1)))
        return np.mean(per_task, axis=0)

    point = statistic({t: v[None, :] for t, v in x.items()}, {t: v[None, :] for t, v in y.items()})[0]
    rng = np.random.default_rng(seed)
    draws = statistic(_resample(x, reps, rng), _resample(y, reps, rng))
    p, low, high = _percentiles(point, draws, level)
    return float(p), float(low), float(high)


def plot_performance_profiles(
    panels: Mapping[str, Mapping[str, Mapping[str, ArrayLike]]],
    path: Path,
    reps: int = 500,
    level: float = LEVEL,
    seed: int = 0,
) -> None:
    """Performance profiles to a PNG: one panel per key of `panels` (an env, or a suite), in it one curve per
    variant, `{variant: {task: runs}}`, with its stratified bootstrap band at `level` (`reps` resamples:
    0 draws no band), over 101 thresholds from the panel's lowest score to its highest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not panels:
        raise ValueError("no panels to plot")
    variants = list(dict.fromkeys(v for by_variant in panels.values() for v in by_variant))
    colours = dict(zip(variants, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (title, by_variant) in zip(axes[0], panels.items(), strict=True):
        data = {v: _tasks(s) for v, s in by_variant.items()}
        every = np.concatenate([r for d in data.values() for r in d.values()])
        low, high = float(every.min()), float(every.max())
        pad = 0.05 * (high - low) or 1.0
        grid = np.linspace(low - pad, high + pad, 101)
        for variant, d in data.items():
            runs = sum(r.size for r in d.values())
            colour = colours.get(variant)
            if reps > 0:
                point, lo, hi = _interval(d, _profile_statistic(grid), reps, level, seed)
                ax.fill_between(grid, lo, hi, color=colour, alpha=0.2, step="post", linewidth=0)
            else:
                point = _profile_statistic(grid)({t: v[None, :] for t, v in d.items()})[0]
            ax.plot(grid, point, color=colour, drawstyle="steps-post", label=f"{variant} ({runs} runs)")
        ax.set_title(title)
        ax.set_xlabel("final return")
        ax.set_ylabel("fraction of runs scoring above")
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------- the reports' table and profiles
PAIRS = (("pipelined", "coupled"), ("pipelined", "sb3"), ("coupled", "sb3"))  # P(first > second), if both ran
VARIANTS = ("coupled", "pipelined", "sb3")  # the reports' variants, in their order


def final_score(run: Mapping[str, Any]) -> float | None:
    """A report run's score: its final evaluation return (`final_eval_return`, the evaluation at its last
    update) where it was evaluated during training, else its final training mean return; None for a run
    stopped before its budget (`stopped`) or without one."""
    value = run.get("final_eval_return", run.get("final_mean_return"))
    return None if run.get("stopped") or value is None else float(value)


def scores(
    runs: Sequence[Mapping[str, Any]],
    group: str,
    score: Callable[[Mapping[str, Any]], float | None] = final_score,
) -> dict[str, dict[str, list[float]]]:
    """`{variant: {task: scores}}` of a report's runs (the task is the run's `group` field: env, workload),
    leaving out runs without a score; the order is that of first appearance. With the default score, a
    report where some runs were evaluated during training ranks only those (one kind of return per table)."""
    if score is final_score and any("final_eval_return" in r for r in runs):
        runs = [r for r in runs if "final_eval_return" in r]
    out: dict[str, dict[str, list[float]]] = {}
    for r in runs:
        value = score(r)
        if value is not None:
            out.setdefault(r["variant"], {}).setdefault(r[group], []).append(value)
    return out


def _ordered(found: Sequence[str], first: Sequence[str]) -> list[str]:
    """`found` with those named in `first` first, in that order."""
    return [x for x in first if x in found] + [x for x in found if x not in first]


def _ci(point: float, low: float, high: float, runs: int, spec: str = ".1f") -> str:
    return (
        f"{point:{spec}} ({runs})" if runs == 1 else f"{point:{spec}} [{low:{spec}}, {high:{spec}}] ({runs})"
    )


def _p(x: Mapping[str, Sequence[float]], y: Mapping[str, Sequence[float]], reps: int, seed: int) -> str:
    p, low, high = probability_of_improvement(x, y, reps, seed=seed)
    return f"{p:.2f} [{low:.2f}, {high:.2f}]"


def markdown_table(
    runs: Sequence[Mapping[str, Any]],
    group: str,
    pairs: Sequence[tuple[str, str]] = PAIRS,
    score: Callable[[Mapping[str, Any]], float | None] = final_score,
    reps: int = REPS,
    seed: int = 0,
    tasks: Sequence[str] = (),
    variants: Sequence[str] = (),
    spec: str = ".1f",
) -> list[str]:
    """Markdown lines (the figures formatted with `spec`): one row per task (`group`: env, workload; those in `tasks` first, in that order) with
    each variant's IQM of the scores over its seeds and its 95% stratified bootstrap interval (those in
    `variants` first), then P(first > second) for each of `pairs` where both ran the task; a last row
    averages P over the tasks both ran, where there are several. No lines without scores."""
    table = scores(runs, group, score)
    if not table:
        return []
    # with evaluated runs only those are ranked: a variant never evaluated (SB3 in time_to_score --eval)
    # leaves the table, and says so below it
    unranked = [v for v in dict.fromkeys(str(r["variant"]) for r in runs) if v not in table]
    names = _ordered(list(table), variants)
    rows = _ordered(list(dict.fromkeys(t for by_task in table.values() for t in by_task)), tasks)
    pairs = [(a, b) for a, b in pairs if a in table and b in table]
    shared = {(a, b): [t for t in rows if t in table[a] and t in table[b]] for a, b in pairs}
    pct = f"{LEVEL:.0%}"
    lines = [
        f"| {group} | " + " | ".join(f"IQM {v} [{pct} CI] (runs)" for v in names)
        + "".join(f" | P({a} > {b}) [{pct} CI]" for a, b in pairs) + " |",
        "|---|" + "---:|" * (len(names) + len(pairs)),
    ]  # fmt: skip
    for task in rows:
        cells = [
            _ci(
                *stratified_bootstrap_ci({task: table[v][task]}, reps=reps, seed=seed),
                len(table[v][task]),
                spec,
            )
            if task in table[v]
            else ""
            for v in names
        ]
        cells += [
            _p({task: table[a][task]}, {task: table[b][task]}, reps, seed) if task in shared[a, b] else ""
            for a, b in pairs
        ]
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    several = any(len(both) > 1 for both in shared.values())
    if several:
        cells = [""] * len(names) + [
            f"{_p({t: table[a][t] for t in both}, {t: table[b][t] for t in both}, reps, seed)} "
            f"({len(both)} {group}s)"
            if len(both) > 1
            else ""
            for (a, b), both in shared.items()
        ]
        lines.append(f"| all {group}s | " + " | ".join(cells) + " |")
    return [
        *lines,
        "",
        "IQM: the interquartile mean of the final returns over seeds (the final evaluation return where runs were evaluated), the mean of the middle 50% (floor(n/4) "
        "runs cut from each end, so with 3 seeds it is the plain mean), with its stratified bootstrap "
        f"{pct} interval ({reps:,} resamples of the seeds) and the number of runs. P(A > B): the probability "
        "that a run of A ends above a run of B (ties count half), with its bootstrap interval (the runs of "
        "both resampled); an interval that includes 0.5 means these seeds cannot tell A and B apart. The "
        "converse needs more runs: when every run of A ends above every run of B the interval is [1.00, 1.00] "
        "however few they are (3 against 3: a two-sided Mann-Whitney p of 0.10), so with fewer than about 5 "
        "runs a side an interval without 0.5 is no evidence of a difference."
        + (" The last row averages P over the tasks both ran." if several else "")
        + " Agarwal et al. 2021 (rliable), computed by `benchmarks/stats.py`."
        + (
            f" Left out (no run with a final score of the table's kind, or stopped short): {', '.join(unranked)}."
            if unranked
            else ""
        ),
    ]  # fmt: skip


def plot_profiles(
    runs: Sequence[Mapping[str, Any]],
    group: str,
    path: Path,
    score: Callable[[Mapping[str, Any]], float | None] = final_score,
    reps: int = 500,
    tasks: Sequence[str] = (),
    variants: Sequence[str] = (),
) -> bool:
    """The performance profile of each variant's final scores (those in `variants` first), one panel per
    task (those in `tasks` first; raw returns, so no normalisation), to `path`; False (nothing written)
    without scores."""
    table = scores(runs, group, score)
    panels = {
        t: {v: {t: table[v][t]} for v in _ordered(list(table), variants) if t in table[v]}
        for t in _ordered(list(dict.fromkeys(t for by_task in table.values() for t in by_task)), tasks)
    }
    if not panels:
        return False
    plot_performance_profiles(panels, path, reps=reps)
    return True


def report_group(report: Mapping[str, Any]) -> str:
    """The task field of a report's runs: `env` (learning.py) or `workload` (time_to_score.py)."""
    runs = report.get("runs") or [{}]
    for key in ("env", "workload"):
        if key in runs[0]:
            return key
    raise ValueError("not a learning or time-to-score report: its runs have neither `env` nor `workload`")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("reports", nargs="+", type=Path, help="learning_<suite>.json or time_to_score.json")
    parser.add_argument(
        "--out", type=Path, default=None, help="folder of the outputs (default: the report's)"
    )
    parser.add_argument("--reps", type=int, default=REPS, help="bootstrap resamples")
    parser.add_argument("--seed", type=int, default=0, help="the bootstrap's seed")
    args = parser.parse_args(argv)
    for path in args.reports:
        report = json.loads(path.read_text())
        group = report_group(report)
        out = args.out or path.parent
        md, png = out / f"{path.stem}_stats.md", out / f"{path.stem}_stats.png"
        table = markdown_table(report["runs"], group, reps=args.reps, seed=args.seed, variants=VARIANTS)
        out.mkdir(parents=True, exist_ok=True)
        plotted = plot_profiles(report["runs"], group, png, variants=VARIANTS)
        text = "\n".join([
            f"# Statistics over seeds: {path.name}", "",
            *(table or ["No run with a final return."]), "",
            *([f"![performance profiles: fraction of runs whose final return is above each value]({png.name})", ""]
              if plotted else []),
        ])  # fmt: skip
        md.write_text(text)
        print(text)


if __name__ == "__main__":
    main()
