"""Wall-clock to a score, side by side: ppo-fabric coupled, ppo-fabric decoupled pipelined and SB3's PPO.

The figure the decoupled design exists for: on this machine, in one sitting, how long until the mean return
of the last 20 episodes first reaches a threshold near the published score. Each (workload, variant, seed)
is one run in a fresh process, one at a time:

| variant | what runs |
|---|---|
| `coupled` | `python -m ppo_fabric <workload> strategy=coupled fabric.devices=1` (1 process) |
| `pipelined` | `... strategy=decoupled fabric.devices=2 algo.players=1 algo.pipeline=true` (1 player + 1 trainer) |
| `sb3` | Stable-Baselines3 `PPO` configured from the same composed config (`sb3_baseline.sb3_settings`), 1 process |
| `synchronous`, `pipelined_1_2`, `synchronous_1_2` | the other layouts of `common.LAYOUTS` (1+1 without the pipeline, 1 player + 2 trainers) |

Workloads (threshold): `cartpole` (`exp=cleanrl_cartpole`, CleanRL's workload at 200k steps, 475: the
throughput comparison, each variant's median SPS against SB3's under its table), `fast` (`exp=fast`, the
high-throughput recipe, 475), `default` (the default config: CartPole-v1 with RL-Zoo's values, 475: does it
solve in every layout), `lunarlander` (`env=lunarlander`, 200), `pendulum` (`env=pendulum`, -200: a policy
that swings up and balances from every start), `halfcheetah` (`exp=mujoco`, 1500),
`hopper` (`exp=mujoco env.id=Hopper-v5`, 2000), `breakout` (`exp=minatar`, 12: below the 15 the recipe reached
at 5M on seed 1, with no published PPO figure at that budget; SB3's features extractor there is ppo-fabric's
own `GridCNN`, as SB3's CNN needs 36x36 frames). SB3 gets the recipe's normalisation through `VecNormalize`
(observations and rewards, both clipped at 10, as ppo-fabric's). Wall time: ppo-fabric's `time/wall_s` (since the run started, start-up of
the interpreter excluded) and, for SB3, seconds since the env was built, read at the end of each rollout.
Results accumulate in `<out>/time_to_score.json` keyed by (workload, variant, seed): a run already there is
skipped (`--force` re-runs), so a sitting can be split; timings compare only within one sitting on an idle
machine, which the report's load column shows.

    python -m benchmarks time_to_score --workloads lunarlander --seeds 3
    python -m benchmarks time_to_score --workloads halfcheetah hopper --seeds 3 --sb3-stop --sb3-cap 900
    python -m benchmarks time_to_score --workloads default --seeds 1 --variants coupled pipelined synchronous \
        pipelined_1_2 synchronous_1_2 --name cartpole_solve         # a report of its own: results/NAME.*

`--sb3-stop` ends an SB3 run once it reaches the threshold and `--sb3-cap S` after S seconds (a full SB3
MuJoCo run takes ~15 minutes on 2 cores); such runs show their time to the threshold, not a final return.
    python -m benchmarks time_to_score --workloads lunarlander --seeds 1 --steps 20000 --out /tmp/tts   # smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import sb3_baseline  # noqa: E402
import stats  # noqa: E402
from common import RESULTS, run_once  # noqa: E402

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
VARIANTS: dict[str, list[str]] = {**{name: list(o) for name, o in common.LAYOUTS.items()}, "sb3": []}
DEFAULT_VARIANTS = ["coupled", "pipelined", "sb3"]  # what --variants runs unless told


EVALUATION = common.EVALUATION


def run_record(
    workload: str,
    variant: str,
    seed: int,
    steps: int | None,
    sb3_stop: bool = False,
    sb3_cap: float | None = None,
    variants: dict[str, list[str]] = VARIANTS,
    evaluate: bool = False,
) -> dict[str, Any]:
    base, threshold = WORKLOADS[workload]
    overrides = [*base, *variants[variant], f"seed={seed}", *([f"algo.total_steps={steps}"] if steps else [])]
    if evaluate and variant != "sb3":
        overrides += EVALUATION
    load_before = os.getloadavg()[0]
    commit = common.git_commit()  # the code the run starts with (a sitting outlasts commits made beside it)
    if variant == "sb3":
        s = sb3_baseline.run(overrides, seed, threshold if sb3_stop else None, sb3_cap)
    else:
        s = run_once(overrides, threshold, curve=True)
    meta = {"workload": workload, "variant": variant, "seed": seed, "overrides": overrides}
    figures = common.threshold_figures(s, threshold)
    stopped = {"stopped": s["stopped"]} if s.get("stopped") else {}
    return {
        **meta,
        "commit": commit,
        "machine": common.machine()["cpu"],  # each run's own: a report gathers sittings of several machines
        **figures,
        **stopped,
        "load": [load_before, os.getloadavg()[0]],
    }


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
        lines += [
            "Evaluated during training (`" + " ".join(EVALUATION) + "`): final eval is the mean return of 10 "
            "deterministic episodes on envs of their own at the run's last update, best eval the best of its "
            "~16 evaluations (mean ± std over seeds); wall s at the threshold leaves out the time spent "
            "evaluating before it.",
            "",
        ]
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
        for variant in variants:
            rows = sorted((r for r in mine if r["variant"] == variant), key=lambda r: r["seed"])
            if not rows:
                continue
            whole = [
                r for r in rows if not r.get("stopped")
            ]  # final and best only of runs that ran their budget
            final = common.mean_std(
                [r["final_mean_return"] for r in whole if r["final_mean_return"] is not None]
            )
            best = common.mean_std(
                [r["best_mean_return"] for r in whole if r["best_mean_return"] is not None]
            )
            # evaluated runs' time to the threshold leaves out their evaluations; SB3's have none to leave out
            wall_at = common.mean_reached(
                [r.get("wall_at_threshold_no_eval", r["wall_at_threshold"]) for r in rows], ".0f"
            )
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
    commits = sorted({r["commit"] for r in runs})
    lines += [
        f"Commits of the runs: {', '.join(commits)} (each run's own is in `{name}.json`). "
        f"The last sitting: `{command}`.",
        "",
        f"![return against wall time]({name}.png)",
        "",
    ]
    return "\n".join(lines)


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


def candidate(text: str) -> tuple[str, list[str]]:
    """`NAME=BASE:override,override`: a variant that runs the layout `BASE` with these overrides."""
    name, _, rest = text.partition("=")
    base, _, overrides = rest.partition(":")
    if not name or name in VARIANTS or base not in common.LAYOUTS:
        raise argparse.ArgumentTypeError(
            f"--candidate {text!r}: NAME=LAYOUT:override,... (LAYOUT of {', '.join(common.LAYOUTS)})"
        )
    return name, [*VARIANTS[base], *(o for o in overrides.split(",") if o)]


def main() -> None:
    parser = common.argument_parser(__doc__)
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=["lunarlander"])
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, help=f"of {', '.join(VARIANTS)} "
                        "and the --candidate names (default: coupled pipelined sb3)")  # fmt: skip
    parser.add_argument("--seeds", type=int, default=3, help="seeds FIRST..N")
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument("--eval", action="store_true", help="evaluate during training; report its returns")
    parser.add_argument("--name", default="time_to_score", help="the report's file name (results/NAME.json)")
    parser.add_argument("--candidate", type=candidate, action="append", default=[],
                        help="NAME=coupled|pipelined:override,...: another variant (repeatable)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=None, help="env steps per run (default: the recipe's)")
    parser.add_argument("--force", action="store_true", help="re-run runs already in the results")
    parser.add_argument("--sb3-stop", action="store_true", help="SB3 runs stop once they reach the threshold")
    parser.add_argument("--sb3-cap", type=float, default=None, help="SB3 runs stop after this many seconds")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    variants = VARIANTS | dict(args.candidate)
    if unknown := [v for v in args.variants if v not in variants]:
        parser.error(f"unknown variants {unknown}: of {list(variants)}")
    path = args.out / f"{args.name}.json"
    report = common.load_report(path, {"runs": []}, ("workload", "variant", "seed"))
    report["machine"] = common.machine()
    command = common.command_line(__file__)
    if args.first_seed > args.seeds:
        parser.error(f"--first-seed {args.first_seed} --seeds {args.seeds}: no seed to run (seeds FIRST..N)")
    for seed in range(args.first_seed, args.seeds + 1):  # seed-major, the variants alternating within a seed
        for workload in args.workloads:
            for variant in args.variants:
                done = common.runs_to_replace(
                    report, args.force, workload=workload, variant=variant, seed=seed
                )
                if done is None:
                    continue
                r = run_record(
                    workload, variant, seed, args.steps, args.sb3_stop, args.sb3_cap, variants, args.eval
                )
                common.replace_runs(report, done, r)
                print(f"{workload} {variant} seed {seed}: wall at {r['threshold']:g}: {r['wall_at_threshold']}, "
                      f"final {r['final_mean_return']}, {r['wall_seconds']:.0f} s", flush=True)  # fmt: skip
                common.write_report(args.out, args.name, report, markdown(report, command, args.name))
                workloads = [w for w in WORKLOADS if any(x["workload"] == w for x in report["runs"])]
                thresholds = {w: t for w, (_, t) in WORKLOADS.items()}
                common.plot_curves(report["runs"], "workload", workloads, tuple(variants), 1, "wall time (s)",
                                   args.out / f"{args.name}.png", thresholds)  # fmt: skip
                stats.plot_profiles(report["runs"], "workload", args.out / f"{args.name}_profile.png",
                                    tasks=workloads, variants=list(variants))  # fmt: skip
    if report["runs"]:  # every run done already: the report as today's code writes it
        common.write_report(args.out, args.name, report, markdown(report, command, args.name))


if __name__ == "__main__":
    main()
