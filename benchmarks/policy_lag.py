"""What the decoupled pipeline's one-update policy lag costs in learning, and what the lag correction wins back.

Runs each workload once per (variant, seed), each run in a fresh process, one at a time:

| variant | overrides |
|---|---|
| `coupled` | `strategy=coupled fabric.devices=1` |
| `synchronous` | `strategy=decoupled fabric.devices=2 algo.pipeline=false` (1 player + 1 trainer) |
| `pipelined_uncorrected` | the pipeline with `algo.lag_refresh_advantages=false algo.lag_objective=false` |
| `pipelined` | the pipeline as shipped (advantages recomputed with the trainers' critic, decoupled objective) |
| `pipelined_vtrace` | the pipeline with `algo.lag_vtrace=true` (V-trace's truncated traces in the recomputation; the default until they measured worse on LunarLander) |
| `pipelined_objective_only` | the pipeline with `algo.lag_refresh_advantages=false` (ablation) |
| `pipelined_refresh_only` | the pipeline with `algo.lag_objective=false` (ablation) |
| `synchronous_lambda0.93` | `synchronous` with `algo.gae_lambda=0.93` (diagnosis: V-trace's traces, ~0.95 a step, shorten LunarLander's lambda of 0.98 about this much) |

Retired variants keep their rows in the table (their runs stay in the results) but cannot be run again:
`pipelined_lag0.5` (commit 3057e6f, removed after it measured worse): the players waited for the trainers'
parameters half-way through each update's gradient steps and collected with those, halving the lag.

Workloads: `lunarlander` (`env=lunarlander`, 1M steps, threshold 200) and `halfcheetah` (`exp=mujoco`,
HalfCheetah-v5, 1M steps, threshold 1500). Per run: the final and the best mean return of the last 20
episodes, and the env step and wall time (`time/wall_s`: seconds since the run started) at which that mean
first reached the threshold. Results accumulate in `<out>/<name>.json`, keyed by (workload, variant, seed):
a run already there is skipped, so a long benchmark can be run over several sittings (`--force` re-runs).
Each write rebuilds `<name>.md` (the table) and `<name>.png` (mean return against wall time).

    .venv/bin/python benchmarks/policy_lag.py                                  # both workloads, 3 seeds, 4 variants
    .venv/bin/python benchmarks/policy_lag.py --workloads lunarlander --seeds 1 --variants pipelined synchronous
    .venv/bin/python benchmarks/policy_lag.py --workloads lunarlander --steps 50000 --out /tmp/lag   # smoke test

LunarLander needs Box2D and HalfCheetah MuJoCo (the bench and mujoco extras). Timings are only comparable
between runs of one sitting on an otherwise idle machine; every run records its commit and the machine.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import RESULTS, run_once  # noqa: E402

WORKLOADS: dict[str, tuple[list[str], float]] = {
    "lunarlander": (["env=lunarlander"], 200.0),
    "halfcheetah": (["exp=mujoco"], 1500.0),
}
DECOUPLED = list(common.DECOUPLED_1_1)
VARIANTS: dict[str, list[str]] = {
    "coupled": list(common.LAYOUTS["coupled"]),
    "synchronous": list(common.LAYOUTS["synchronous"]),
    "pipelined_uncorrected": [
        *DECOUPLED,
        "algo.pipeline=true",
        "algo.lag_refresh_advantages=false",
        "algo.lag_objective=false",
    ],
    "pipelined": list(common.LAYOUTS["pipelined"]),
    "pipelined_vtrace": [*DECOUPLED, "algo.pipeline=true", "algo.lag_vtrace=true"],
    "pipelined_objective_only": [*DECOUPLED, "algo.pipeline=true", "algo.lag_refresh_advantages=false"],
    "pipelined_refresh_only": [*DECOUPLED, "algo.pipeline=true", "algo.lag_objective=false"],
    "synchronous_lambda0.93": [*DECOUPLED, "algo.pipeline=false", "algo.gae_lambda=0.93"],
}
RETIRED = ("pipelined_lag0.5",)  # the module docstring says what each was
DEFAULT_VARIANTS = ["coupled", "synchronous", "pipelined_uncorrected", "pipelined"]


def run_record(workload: str, variant: str, seed: int, steps: int | None) -> dict[str, Any]:
    """One training run and the figures the table needs."""
    base, threshold = WORKLOADS[workload]
    overrides = [*base, *VARIANTS[variant], f"seed={seed}"]
    if steps:
        overrides.append(f"algo.total_steps={steps}")
    s = run_once(overrides, solved_return=threshold, curve=True)
    meta = {"workload": workload, "variant": variant, "seed": seed, "overrides": overrides}
    return {**meta, "commit": common.git_commit(), **common.threshold_figures(s, threshold)}


def late_mean(curve: list[list[float]]) -> float | None:
    """Mean return over the last third of a run's env steps: where a run settles, steadier than the last
    point (one noisy mean of 20 episodes) or the best one (the top of an oscillation)."""
    if not curve:
        return None
    tail = [point[2] for point in curve if point[0] >= curve[-1][0] * 2 / 3]
    return statistics.mean(tail)


def table(runs: list[dict[str, Any]], workload: str) -> list[str]:
    threshold = WORKLOADS[workload][1]
    lines = [
        f"### {workload} (threshold {threshold:g})",
        "",
        f"| variant | seeds | final | best | last third | reached {threshold:g} | env step at {threshold:g} | "
        f"wall s at {threshold:g} | wall s (run) | SPS |",
        "|---|---|---:|---:|---:|:---:|---:|---:|---:|---:|",
    ]
    for variant in (*VARIANTS, *RETIRED):
        mine = sorted(
            (r for r in runs if r["workload"] == workload and r["variant"] == variant),
            key=lambda r: r["seed"],
        )
        if not mine:
            continue
        reached = sum(r["step_at_threshold"] is not None for r in mine)
        lines.append(
            f"| {variant} | {','.join(str(r['seed']) for r in mine)} "
            f"| {common.mean_std([r['final_mean_return'] for r in mine if r['final_mean_return'] is not None])} "
            f"| {common.mean_std([r['best_mean_return'] for r in mine if r['best_mean_return'] is not None])} "
            f"| {common.mean_std([v for v in (late_mean(r['curve']) for r in mine) if v is not None])} "
            f"| {reached}/{len(mine)} | {common.mean_reached([r['step_at_threshold'] for r in mine], ',.0f')} "
            f"| {common.mean_reached([r['wall_at_threshold'] for r in mine], '.0f')} "
            f"| {statistics.mean(r['wall_seconds'] for r in mine):.0f} "
            f"| {statistics.mean(r['sps'] for r in mine):,.0f} |"
        )
    return [*lines, ""]


def markdown(report: dict[str, Any], command: str) -> str:
    runs, m = report["runs"], report["machine"]
    commits = sorted({r["commit"] for r in runs})
    seeds = max(r["seed"] for r in runs)
    ran = " ".join(v for v in VARIANTS if any(r["variant"] == v for r in runs))
    workloads = " ".join(w for w in WORKLOADS if any(r["workload"] == w for r in runs))
    again = (
        f".venv/bin/python benchmarks/policy_lag.py --workloads {workloads} --seeds {seeds} --variants {ran}"
    )
    lines = [
        "# Policy lag: coupled, synchronous and pipelined decoupled",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}. Decoupled runs: 1 player + 1 trainer. "
        "Final and best: mean return of the last 20 episodes (mean ± std over seeds); last third: its mean "
        "over the last third of the run's env steps; the step and wall "
        "time at the threshold are means over the seeds that reached it. Wall times are the runs' own "
        "`time/wall_s` (process start-up excluded).",
        "",
        *(
            line
            for workload in WORKLOADS
            if any(r["workload"] == workload for r in runs)
            for line in table(runs, workload)
        ),
        f"Commits of the runs: {', '.join(commits)} (each run's own is in `{report['name']}.json`). "
        f"The runs accumulated over sittings; all of them again: `{again} --force`. "
        f"The last sitting: `{command}`.",
        "",
        f"![return against wall time]({report['name']}.png)",
        "",
    ]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """Mean return (last 20 episodes) against wall time, one panel per workload, one colour per variant."""
    workloads = [w for w in WORKLOADS if any(r["workload"] == w for r in report["runs"])]
    thresholds = {w: t for w, (_, t) in WORKLOADS.items()}
    common.plot_curves(
        report["runs"], "workload", workloads, (*VARIANTS, *RETIRED), 1, "wall time (s)", path, thresholds
    )


def main() -> None:
    parser = common.argument_parser(__doc__)
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=DEFAULT_VARIANTS)
    parser.add_argument("--seeds", type=int, default=3, help="seeds 1..N")
    parser.add_argument(
        "--steps", type=int, default=None, help="env steps per run (default: the recipe's 1M)"
    )
    parser.add_argument("--force", action="store_true", help="re-run runs already in the results")
    parser.add_argument("--name", default="policy_lag")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    path = args.out / f"{args.name}.json"
    report = json.loads(path.read_text()) if path.is_file() else {"name": args.name, "runs": []}
    report |= {"name": args.name, "machine": common.machine()}
    command = common.command_line(__file__)
    for seed in range(1, args.seeds + 1):  # seed-major: a partial sitting covers every variant
        for workload in args.workloads:
            for variant in args.variants:
                done = common.runs_to_replace(
                    report, args.force, workload=workload, variant=variant, seed=seed
                )
                if done is None:
                    continue
                r = run_record(workload, variant, seed, args.steps)
                common.replace_runs(report, done, r)
                print(
                    f"{workload} {variant} seed {seed}: final {r['final_mean_return']}, best "
                    f"{r['best_mean_return']}, at threshold step {r['step_at_threshold']} wall "
                    f"{r['wall_at_threshold']}, {r['wall_seconds']:.0f} s",
                    flush=True,
                )
                common.write_report(args.out, args.name, report, markdown(report, command))
                plot(report, args.out / f"{args.name}.png")


if __name__ == "__main__":
    main()
