"""The statistics Agarwal et al. 2021 (`rliable`) recommend for a few seeds, in NumPy alone: the interquartile
mean (IQM), stratified bootstrap confidence intervals, the probability of improvement and performance
profiles, each task's raw scores alone. How to read them: benchmarks/README.md, "`stats.py`".

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
Scores = Mapping[str, ArrayLike]  # task -> the final scores of its runs
Batch = Mapping[str, Floats]  # task -> (batch, runs): a batch of resampled score sets, one row each
Score = Callable[[Mapping[str, Any]], float | None]  # a report run -> its score, None for none

REPS = 2000  # bootstrap resamples in the reports (rliable's own default for profiles; 50,000 for intervals)
LEVEL = 0.95
PAIRS = (("pipelined", "coupled"), ("pipelined", "sb3"), ("coupled", "sb3"))  # P(first > second), if both ran
VARIANTS = ("coupled", "pipelined", "sb3")  # the reports' variants, in their order


def _runs(scores: ArrayLike, task: str = "") -> Floats:
    """One task's runs as a 1-D float array, refusing what would make a figure silently wrong (none, NaN)."""
    a = np.asarray(scores, dtype=np.float64).ravel()
    where = f" (task {task!r})" if task else ""
    if a.size == 0:
        raise ValueError(f"no runs{where}")
    if np.isnan(a).any():
        raise ValueError(f"a score is NaN{where}: leave out runs without a final score")
    return a


def _trimmed(a: Floats) -> Floats:
    """The IQM along the last axis: `floor(n / 4)` values cut from each end of the sorted runs, rounded down,
    never interpolated (rliable's, `scipy.stats.trim_mean(a, 0.25)`), so with n < 4 the plain mean."""
    n = a.shape[-1]
    cut = int(0.25 * n)
    return np.sort(a, axis=-1)[..., cut : n - cut].mean(axis=-1)


def iqm(scores: ArrayLike) -> float:
    """Interquartile mean of runs, every value pooled: one odd seed moves it less than it moves the mean."""
    return float(_trimmed(_runs(scores)))


def _pooled(batch: Batch) -> Floats:
    return np.concatenate(list(batch.values()), axis=-1)


def _profile_statistic(taus: Floats) -> Callable[[Batch], Floats]:
    """The fraction of runs (every task's pooled) scoring strictly above each of `taus`: (batch, taus)."""
    return lambda batch: (_pooled(batch)[..., :, None] > taus).mean(axis=-2)


def _improvement(bx: Batch, by: Batch) -> Floats:
    """P(X > Y) of each score set: per task the share of the n*m pairs in which x's run is higher, a tie
    counting 1/2 (Mann-Whitney U / nm, rliable's), averaged over the tasks."""
    pairs = [(bx[task][..., :, None], by[task][..., None, :]) for task in bx]
    return np.mean(
        [(a > b).mean(axis=(-2, -1)) + 0.5 * (a == b).mean(axis=(-2, -1)) for a, b in pairs], axis=0
    )


def _bootstrap(
    stat: Callable[..., Floats], samples: Sequence[Scores], reps: int, level: float, seed: int
) -> tuple[Any, Any, Any]:
    """(point, low, high): `stat` of the samples' runs and its percentile interval at `level` from
    rliable's stratified bootstrap: each of `reps` resamples draws, within every task of every sample, as
    many runs as it has with replacement from its own (a task never lends runs to another, so a few seeds
    per task keep their spread); the same `seed` gives the same interval."""
    if reps < 1:
        raise ValueError(f"reps must be at least 1, not {reps}")
    if not 0 < level < 1:
        raise ValueError(f"level must be between 0 and 1, not {level}")
    data = [{task: _runs(runs, task) for task, runs in sorted(s.items())} for s in samples]
    if not all(data):
        raise ValueError("no tasks")
    rng = np.random.default_rng(seed)
    point = stat(*({t: r[None, :] for t, r in d.items()} for d in data))[0]
    draws = stat(*({t: r[rng.integers(0, r.size, (reps, r.size))] for t, r in d.items()} for d in data))
    low, high = np.percentile(draws, [50 * (1 - level), 50 * (1 + level)], axis=0)
    return point, low, high


def stratified_bootstrap_ci(
    scores_by_task: Scores, reps: int = REPS, level: float = LEVEL, seed: int = 0
) -> tuple[float, float, float]:
    """(point, low, high): the IQM of every task's runs pooled, with its stratified bootstrap interval."""
    point, low, high = _bootstrap(lambda b: _trimmed(_pooled(b)), [scores_by_task], reps, level, seed)
    return float(point), float(low), float(high)


def probability_of_improvement(
    x_by_task: Scores, y_by_task: Scores, reps: int = REPS, seed: int = 0
) -> tuple[float, float, float]:
    """(point, low, high): P(X > Y) on a task picked at random (rliable's `probability_of_improvement`), its
    interval resampling X's runs and Y's independently. 0.5: neither is better. Both need the same tasks."""
    if set(x_by_task) != set(y_by_task):
        raise ValueError(f"x and y have different tasks: {sorted(x_by_task)} vs {sorted(y_by_task)}")
    point, low, high = _bootstrap(_improvement, [x_by_task, y_by_task], reps, LEVEL, seed)
    return float(point), float(low), float(high)


# ----------------------------------------------------------------------- the reports' table and profiles
def final_score(run: Mapping[str, Any]) -> float | None:
    """A report run's score: its final evaluation return where it was evaluated during training, else its
    final training mean return; None for a run stopped before its budget, whose return is not final."""
    value = run.get("final_eval_return", run.get("final_mean_return"))
    return None if run.get("stopped") or value is None else float(value)


def _table(
    runs: Sequence[Mapping[str, Any]], group: str, score: Score, tasks: Sequence[str], variants: Sequence[str]
) -> tuple[dict[str, dict[str, list[float]]], list[str], list[str]]:
    """`{variant: {task: scores}}` of a report's runs (the task is the run's `group` field), leaving out runs
    without a score, and its variants and tasks, those in `variants` and `tasks` first, in that order, the
    rest as they first appear. With the default score, a report where some runs were evaluated during
    training ranks only those: one kind of return per table."""
    if score is final_score and any("final_eval_return" in r for r in runs):
        runs = [r for r in runs if "final_eval_return" in r]
    table: dict[str, dict[str, list[float]]] = {}
    for r in runs:
        if (value := score(r)) is not None:
            table.setdefault(r["variant"], {}).setdefault(r[group], []).append(value)

    def ordered(found: Sequence[str], first: Sequence[str]) -> list[str]:
        return [x for x in first if x in found] + [x for x in found if x not in first]

    found = list(dict.fromkeys(t for by_task in table.values() for t in by_task))
    return table, ordered(list(table), variants), ordered(found, tasks)


def _interval(point: float, low: float, high: float, spec: str) -> str:
    return f"{point:{spec}} [{low:{spec}}, {high:{spec}}]"


def markdown_table(
    runs: Sequence[Mapping[str, Any]],
    group: str,
    pairs: Sequence[tuple[str, str]] = PAIRS,
    score: Score = final_score,
    reps: int = REPS,
    seed: int = 0,
    tasks: Sequence[str] = (),
    variants: Sequence[str] = (),
    spec: str = ".1f",
) -> list[str]:
    """Markdown lines (the figures formatted with `spec`): one row per task (`group`: env, workload) with
    each variant's IQM over its seeds and its 95% interval, then P(first > second) for each of `pairs`
    where both ran the task; a last row averages P over the tasks both ran, where there are several. No
    lines without scores."""
    table, names, rows = _table(runs, group, score, tasks, variants)
    if not table:
        return []
    # with evaluated runs only those are ranked: a variant never evaluated (SB3 in time_to_score --eval)
    # leaves the table, and says so below it
    unranked = [v for v in dict.fromkeys(str(r["variant"]) for r in runs) if v not in table]
    pairs = [(a, b) for a, b in pairs if a in table and b in table]
    shared = {(a, b): [t for t in rows if t in table[a] and t in table[b]] for a, b in pairs}

    def iqm_cell(v: str, task: str) -> str:
        n, ci = len(table[v][task]), stratified_bootstrap_ci({task: table[v][task]}, reps=reps, seed=seed)
        return f"{ci[0]:{spec}} ({n})" if n == 1 else f"{_interval(*ci, spec)} ({n})"

    def p_cell(a: str, b: str, over: list[str]) -> str:
        x, y = ({t: table[v][t] for t in over} for v in (a, b))
        return _interval(*probability_of_improvement(x, y, reps, seed), ".2f")

    pct = f"{LEVEL:.0%}"
    lines = [
        f"| {group} | " + " | ".join(f"IQM {v} [{pct} CI] (runs)" for v in names)
        + "".join(f" | P({a} > {b}) [{pct} CI]" for a, b in pairs) + " |",
        "|---|" + "---:|" * (len(names) + len(pairs)),
    ]  # fmt: skip
    for task in rows:
        cells = [iqm_cell(v, task) if task in table[v] else "" for v in names]
        cells += [p_cell(a, b, [task]) if task in shared[a, b] else "" for a, b in pairs]
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    several = any(len(both) > 1 for both in shared.values())
    if several:
        cells = [""] * len(names) + [
            f"{p_cell(a, b, both)} ({len(both)} {group}s)" if len(both) > 1 else ""
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
    tasks: Sequence[str] = (),
    variants: Sequence[str] = (),
    reps: int = 500,
) -> bool:
    """Performance profiles of the final scores to a PNG, one panel per task (raw returns: the suites record
    no reference to normalise them by), one curve per variant with its bootstrap band (`reps` resamples),
    over 101 thresholds spanning the panel's scores; False (nothing written) without scores."""
    table, names, rows = _table(runs, group, final_score, tasks, variants)
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = dict.fromkeys(v for t in rows for v in names if t in table[v])  # a variant keeps its colour
    colours = dict(zip(found, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    fig, axes = plt.subplots(1, len(rows), figsize=(5.5 * len(rows), 4.2), squeeze=False)
    for ax, task in zip(axes[0], rows, strict=True):
        data = {v: _runs(table[v][task], task) for v in names if task in table[v]}
        every = np.concatenate(list(data.values()))
        low, high = float(every.min()), float(every.max())
        pad = 0.05 * (high - low) or 1.0
        grid = np.linspace(low - pad, high + pad, 101)
        for variant, scores in data.items():
            point, lo, hi = _bootstrap(_profile_statistic(grid), [{task: scores}], reps, LEVEL, 0)
            colour = colours.get(variant)  # None past the colour cycle
            ax.fill_between(grid, lo, hi, color=colour, alpha=0.2, step="post", linewidth=0)
            label = f"{variant} ({scores.size} runs)"
            ax.plot(grid, point, color=colour, drawstyle="steps-post", label=label)
        ax.set(title=task, xlabel="final return", ylabel="fraction of runs scoring above", ylim=(-0.02, 1.02))
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("reports", nargs="+", type=Path, help="learning_<suite>.json or time_to_score.json")
    parser.add_argument("--out", type=Path, help="folder of the outputs (default: the report's)")
    parser.add_argument("--reps", type=int, default=REPS, help="bootstrap resamples (1 or more)")
    parser.add_argument("--seed", type=int, default=0, help="the bootstrap's seed")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps {args.reps}: 1 or more resamples")
    for path in args.reports:
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError) as exc:  # a missing file, a markdown report, a truncated one: one line
            parser.error(f"{path}: not a readable JSON report ({type(exc).__name__})")
        runs = (report.get("runs") if isinstance(report, dict) else None) or [{}]
        group = next((key for key in ("env", "workload") if key in runs[0]), None)
        if group is None:
            parser.error(
                f"{path}: not a learning or time-to-score report (its runs have neither env nor workload)"
            )
        out = args.out or path.parent
        md, png = out / f"{path.stem}_stats.md", out / f"{path.stem}_stats.png"
        table = markdown_table(runs, group, reps=args.reps, seed=args.seed, variants=VARIANTS)
        out.mkdir(parents=True, exist_ok=True)
        plotted = plot_profiles(runs, group, png, variants=VARIANTS)
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
