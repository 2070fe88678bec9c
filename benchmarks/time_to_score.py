"""Wall-clock to a score, side by side: ppo-fabric's layouts (`common.LAYOUTS`) and Stable-Baselines3's PPO.

How long until the mean return of the last 20 episodes first reaches a threshold near the published score,
on this machine, in one sitting: one run per (workload, variant, seed), seed-major, each in a fresh process;
the runs accumulate in `<out>/<name>.{json,md,png}` (a run already there is skipped unless `--force`). The
workloads, the variants and the figures: benchmarks/README.md, "time_to_score.py".

    python -m benchmarks time_to_score --workloads cartpole --variants coupled sb3 --steps 8192 --out /tmp/t
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import sb3_baseline  # noqa: E402
import stats  # noqa: E402
from common import run_once  # noqa: E402

WORKLOADS: dict[str, tuple[list[str], float]] = {
    "cartpole": (["exp=cleanrl_cartpole"], 475.0),  # CleanRL's workload, 200k steps: the SPS comparison
    "fast": (["exp=fast"], 475.0),  # 64 envs x 32 steps, 500k: what the throughput recipe buys
    "default": ([], 475.0),  # the default config (CartPole-v1, RL-Zoo's values, 200k)
    "lunarlander": (["env=lunarlander"], 200.0),
    "pendulum": (["env=pendulum"], -200.0),  # no official threshold; the best policies average about -150
    "halfcheetah": (["exp=mujoco"], 1500.0),
    "hopper": (["exp=mujoco", "env.id=Hopper-v5"], 2000.0),
    "breakout": (["exp=minatar"], 12.0),
}
VARIANTS: dict[str, tuple[str, ...]] = {**common.LAYOUTS, "sb3": ()}  # sb3: sb3_baseline.sb3_settings
DEFAULT_VARIANTS = ["coupled", "pipelined", "sb3"]  # what --variants runs unless told


def run_record(
    workload: str,
    variant: str,
    seed: int,
    steps: int | None,
    sb3_stop: bool,
    sb3_cap: float | None,
    evaluate: bool,
) -> dict[str, Any]:
    """One run's record (`common.record`) and the 1-minute load average before and after it."""
    base, threshold = WORKLOADS[workload]
    overrides = common.overrides(base, VARIANTS[variant], seed, steps, evaluate and variant != "sb3")
    load_before = os.getloadavg()[0]
    if variant == "sb3":
        train = lambda: sb3_baseline.run(overrides, seed, threshold if sb3_stop else None, sb3_cap)  # noqa: E731
    else:
        train = lambda: run_once(overrides, curve=True)  # noqa: E731
    return {**common.record(overrides, train, threshold), "load": [load_before, os.getloadavg()[0]]}


def markdown(report: dict[str, Any], command: str, name: str = "time_to_score") -> str:
    runs, m = report["runs"], report["machine"]
    variants = list(dict.fromkeys([*DEFAULT_VARIANTS, *(r["variant"] for r in runs)]))
    evaluated = any("final_eval_return" in r for r in runs)
    lines = [
        "# Time to score: the layouts and Stable-Baselines3",
        "",
        f"Machine: {common.machines_line(runs, m)}. Pipelined: 1 player + 1 trainer. "
        "Wall s at the threshold: mean over the seeds that reached it (how many in brackets). Final and "
        "best: mean return of the last 20 episodes, mean ± std over seeds. Load: the 1-minute load average "
        "before and after each run, highest of the row (above ~2.2 on 2 cores something else ran).",
        "",
    ]
    if evaluated:
        lines += [f"Evaluated during training (`{' '.join(common.EVALUATION)}`): final eval is the mean return of 10 "
                  "deterministic episodes on envs of their own at the run's last update, best eval the best of its "
                  "~16 evaluations (mean ± std over seeds); wall s at the threshold leaves out the time spent "
                  "evaluating before it.", ""]  # fmt: skip
    for workload, (_, threshold) in WORKLOADS.items():
        mine = [r for r in runs if r["workload"] == workload]
        if not mine:
            continue
        lines += [
            f"### {workload} (threshold {threshold:g})",
            "",
            f"| variant | seeds | wall s at {threshold:g} | env step at {threshold:g} | final | best | wall s (run) "
            "| SPS | load |"
            + (f" final eval | best eval | eval s | env step at {threshold:g} (eval) |" if evaluated else ""),
            "|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|---:|" if evaluated else ""),
        ]
        stopped = []
        for _, variant, rows in common.groups(mine, "workload", [workload], variants):
            whole = [r for r in rows if not r.get("stopped")]  # final and best: runs that ran their budget
            final, best = (common.mean_std([r[k] for r in whole if r[k] is not None])
                           for k in ("final_mean_return", "best_mean_return"))  # fmt: skip
            # evaluated runs' time to the threshold leaves out their evaluations; SB3's have none to leave out
            wall_at = common.mean_reached([r.get("wall_at_threshold_no_eval", r["wall_at_threshold"]) for r in rows],
                                          ".0f")  # fmt: skip
            if all(r["wall_at_threshold"] is None and r.get("stopped") == "wall cap" for r in rows):
                wall_at = (
                    f"> {min(r['wall_seconds'] for r in rows):.0f} (cap)"  # stopped before getting there
                )
            lines.append(
                f"| {variant} | {','.join(str(r['seed']) for r in rows)} "
                f"| {wall_at} "
                f"| {common.mean_reached([r['step_at_threshold'] for r in rows], ',.0f')} "
                f"| {final if whole else 'stopped'} | {best if whole else 'stopped'} "
                f"| {statistics.mean(r['wall_seconds'] for r in rows):.0f} "
                f"| {statistics.mean(r['sps'] for r in rows):,.0f} | {max(max(r['load']) for r in rows):.1f} |"
                + (evaluation_cells(whole, threshold) if evaluated else "")
            )
            stopped += [f"{variant} seed {r['seed']} at {r['wall_seconds']:.0f} s ({r['stopped']})"
                        for r in rows if r.get("stopped")]  # fmt: skip
        lines += ["", *sps_line(mine)]
        if stopped:
            lines += ["Stopped before their budget (`--sb3-stop`: at the threshold; `--sb3-cap`: at the wall "
                      "cap, the threshold not reached): " + "; ".join(stopped) + ".", ""]  # fmt: skip
    pairs = [*stats.PAIRS, *((v, "coupled") for v in variants if v not in DEFAULT_VARIANTS)]
    table = stats.markdown_table(runs, "workload", pairs, tasks=list(WORKLOADS), variants=variants)
    if table:
        what = "final evaluation return" if evaluated else "final return"
        lines += [f"### The {what} over seeds: IQM and probability of improvement", "", *table[:-1],
                  table[-1] + " Runs stopped before their budget have no final return and are left out.", "",
                  f"![performance profiles of the {what}]({name}_profile.png)", ""]  # fmt: skip
    return "\n".join([*lines, *common.footer(runs, name, command, "return against wall time")])


def sps_line(rows: list[dict[str, Any]]) -> list[str]:
    """Each variant's median SPS over its seeds, with its ratio to SB3's where SB3 ran: the throughput
    comparison, one process each for coupled and SB3 (one torch thread both), two for pipelined."""
    medians = {
        v: statistics.median(r["sps"] for r in rows if r["variant"] == v)
        for v in dict.fromkeys(r["variant"] for r in rows)
    }
    sb3 = medians.get("sb3")
    cells = [f"{v} {sps:,.0f}" + ("" if v == "sb3" or sb3 is None else f" ({sps / sb3:.2f}x SB3)")
             for v, sps in medians.items()]  # fmt: skip
    return [f"SPS, median over the seeds: {', '.join(cells)}.", ""]


def evaluation_cells(rows: list[dict[str, Any]], threshold: float) -> str:
    """The final and best evaluation return (mean ± std over seeds), the mean seconds spent evaluating, and
    the env step of the first evaluation at or above `threshold` (mean over the runs that got there): the
    deterministic policy's time to the score, which the noisy training return's crossing only estimates."""
    final = [r["final_eval_return"] for r in rows if "final_eval_return" in r]
    best = [r["best_eval_return"] for r in rows if "best_eval_return" in r]
    spent = [r["eval_seconds"] for r in rows if "eval_seconds" in r]
    reached = [
        next((e[0] for e in r["eval_curve"] if e[2] >= threshold), None) for r in rows if "eval_curve" in r
    ]
    return (
        f" {common.mean_std(final)} | {common.mean_std(best)} "
        f"| {statistics.mean(spent) if spent else float('nan'):.1f} | {common.mean_reached(reached, ',.0f')} |"
    )


def main() -> None:
    parser = common.argument_parser(__doc__)
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=["lunarlander"])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=DEFAULT_VARIANTS)
    common.sweep_arguments(parser, seeds=3)
    parser.add_argument(
        "--name",
        default="time_to_score",
        type=common.file_name,
        help="the report's file name (results/NAME.json)",
    )
    parser.add_argument("--sb3-stop", action="store_true", help="SB3 runs stop once they reach the threshold")
    parser.add_argument("--sb3-cap", type=float, default=None, help="SB3 runs stop after this many seconds")
    args = parser.parse_args()
    report = common.load_report(args.out / f"{args.name}.json", {"runs": []}, ("workload", "variant", "seed"))
    report["machine"] = common.machine()
    command = common.command_line(__file__)

    def run(workload: str, variant: str, seed: int) -> dict[str, Any]:
        return run_record(workload, variant, seed, args.steps, args.sb3_stop, args.sb3_cap, args.eval)

    def write(report: dict[str, Any]) -> None:
        common.write_report(args.out, args.name, report, markdown(report, command, args.name))
        workloads = [w for w in WORKLOADS if any(x["workload"] == w for x in report["runs"])]
        thresholds = {w: t for w, (_, t) in WORKLOADS.items()}
        variants = tuple(
            dict.fromkeys([*VARIANTS, *(r["variant"] for r in report["runs"])])
        )  # and retired ones
        common.plot_curves(report["runs"], "workload", workloads, variants, 1, args.out / f"{args.name}.png",
                           thresholds)  # fmt: skip
        stats.plot_profiles(report["runs"], "workload", args.out / f"{args.name}_profile.png", tasks=workloads,
                            variants=list(variants))  # fmt: skip

    cells = common.cells(args, workload=args.workloads, variant=args.variants)  # variants alternate in a seed
    common.sweep(report, cells, args.force, run, write)


if __name__ == "__main__":
    main()
