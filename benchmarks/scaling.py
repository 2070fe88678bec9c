"""Throughput as a function of env.num_envs and fabric.devices (coupled strategy on CPU), on CartPole-v1 and
LunarLander-v3: one run per (env, devices, num_envs), the same update settings in every run and a budget that
grows with sqrt(num_envs). Options, the workload and what a run records: benchmarks/README.md, "scaling.py".
Writes benchmarks/results/scaling.{json,md,png}.

    .venv/bin/python benchmarks/scaling.py [--quick] [--envs 4 8 16] [--devices 1 2] [-- extra overrides]
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import RESULTS, run_once  # noqa: E402

# env config group -> (gymnasium id, env-step budget of a run with num_envs=4). The budgets give ~10-20 s
# runs on two cores: LunarLander's Box2D step costs several times CartPole's, so it gets fewer steps.
ENVS: dict[str, tuple[str, int]] = {
    "cartpole": ("CartPole-v1", 150_000),
    "lunarlander": ("LunarLander-v3", 60_000),
}
NUM_ENVS = (4, 8, 16, 32, 64)
DEVICES = (1, 2)
ROLLOUT_STEPS = 128
UPDATE_EPOCHS = 4
MINIBATCHES = 4


def layout(num_envs: int, devices: int, budget: int, min_updates: int) -> dict[str, int]:
    """Batch, minibatch and total_steps of one run. `budget` is for num_envs=4 and grows with
    sqrt(num_envs / 4), then is rounded up to whole updates so that every run does the work it reports
    (ppo-fabric drops a partial last update)."""
    batch = ROLLOUT_STEPS * num_envs * devices
    updates = max(min_updates, math.ceil(budget * math.sqrt(num_envs / 4) / batch))
    return {
        "batch": batch,
        "minibatch": batch // MINIBATCHES,
        "updates": updates,
        "total_steps": updates * batch,
    }


def plot(results: list[dict[str, Any]], env_groups: list[str], out: Path) -> None:
    """Two panels (one per env): SPS against num_envs on a log2 axis, one line per devices value.
    Drawn through the object API on an Agg canvas, as ppo_fabric/runs/plots.py does, so no GUI backend is
    ever picked on a headless machine."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5 * len(env_groups), 4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(env_groups), squeeze=False)[0]
    for ax, group in zip(axes, env_groups, strict=True):
        for devices in sorted({r["devices"] for r in results}):
            points = sorted((r["num_envs"], r["sps"]) for r in results
                            if r["env"] == group and r["devices"] == devices)  # fmt: skip
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o", label=f"devices={devices}")
        ax.set_xscale("log", base=2)
        xticks = sorted({r["num_envs"] for r in results})
        ax.set_xticks(xticks, [str(x) for x in xticks])
        ax.set_xlabel("env.num_envs (per rank)")
        ax.set_ylabel("env steps / s")
        ax.set_ylim(bottom=0)
        ax.set_title(ENVS[group][0])
        ax.grid(alpha=0.3)
        if ax.lines:  # an env with no run yet (the report is drawn after every run) has no legend
            ax.legend(loc="upper left", fontsize="small")
    fig.savefig(out)


def markdown(report: dict[str, Any], command: str) -> str:
    """The report as a table, one row per run, in the order the runs were made."""
    m = report["machine"]
    lines = [
        "# Throughput vs env.num_envs and fabric.devices (coupled strategy, CPU)",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, Python {m['python']}; "
        f"code {report['commit']}. Every run: rollout_steps={ROLLOUT_STEPS}, update_epochs={UPDATE_EPOCHS}, "
        f"minibatch = batch / {MINIBATCHES}, torch_threads=1 per process, sync vector envs; the budget is "
        + ", ".join(f"{report['budgets'][g]:,} env steps for {ENVS[g][0]}" for g in report["budgets"])
        + f" at num_envs=4, times sqrt(num_envs / 4), rounded up to whole updates (at least {report['min_updates']}). SPS = env steps over all "
        "ranks / training wall time; collect and train are rank 0's seconds. Load = 1-minute load "
        "average before the run (above the process count, another program shared the CPU).",
        "",
        "| env | num_envs | devices | batch | updates | env steps | SPS | collect s | train s | "
        "collect % | load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        split = r["time_split"]
        collect, train = split.get("collect", 0.0), split.get("train", 0.0)
        share = 100 * collect / (collect + train) if collect + train else float("nan")
        lines.append(
            f"| {ENVS[r['env']][0]} | {r['num_envs']} | {r['devices']} | {r['batch']:,} | {r['updates']} | "
            f"{r['total_env_steps']:,} | {r['sps']:,.0f} | {collect:.2f} | {train:.2f} | {share:.0f} | "
            f"{r['load_before']:.2f} |"
        )
    lines += ["", "![SPS vs num_envs](scaling.png)", "", f"Command: `{command}`", ""]
    return "\n".join(lines)


def main() -> None:
    parser = common.argument_parser(__doc__)
    parser.add_argument("--envs", type=int, nargs="+", default=list(NUM_ENVS), help="env.num_envs values")
    parser.add_argument("--devices", type=int, nargs="+", default=list(DEVICES), help="fabric.devices values")
    parser.add_argument("--only", choices=sorted(ENVS), help="one environment only")
    parser.add_argument("--steps-scale", type=float, default=1.0, help="multiplies every env's budget")
    parser.add_argument("--min-updates", type=int, default=8, help="floor on updates per run")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: num_envs 4 and 64, a quarter of the budget, floor of 4 updates")  # fmt: skip
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("extra", nargs="*", help="overrides applied to every run")
    args = parser.parse_args()
    if args.quick:
        args.envs, args.steps_scale, args.min_updates = [4, 64], args.steps_scale / 4, 4

    commit = common.git_commit()  # the code the sitting starts with (commits made beside it are not its)
    groups = [args.only] if args.only else list(ENVS)
    budgets = {g: int(ENVS[g][1] * args.steps_scale) for g in groups}
    command = common.command_line(__file__)
    report = {"settings": {"rollout_steps": ROLLOUT_STEPS, "update_epochs": UPDATE_EPOCHS,
                           "minibatches": MINIBATCHES, "strategy": "coupled", "vector": "sync"},
              "budgets": budgets, "min_updates": args.min_updates, "quick": args.quick, "seed": args.seed,
              "extra_overrides": args.extra, "machine": common.machine(), "commit": commit,
              "command": command, "results": []}  # fmt: skip

    def run(env: str, devices: int, num_envs: int) -> dict[str, Any]:
        lay = layout(num_envs, devices, budgets[env], args.min_updates)
        overrides = [
            f"env={env}", f"env.num_envs={num_envs}", "env.vector=sync",
            "strategy=coupled", "fabric=cpu", f"fabric.devices={devices}", f"seed={args.seed}",
            f"algo.rollout_steps={ROLLOUT_STEPS}", f"algo.update_epochs={UPDATE_EPOCHS}",
            f"algo.minibatch_size={lay['minibatch']}", f"algo.total_steps={lay['total_steps']}",
            *args.extra,
        ]  # fmt: skip
        load_before = os.getloadavg()[0]
        s = run_once(overrides)
        print(f"{ENVS[env][0]:15s} num_envs {num_envs:3d} devices {devices}: {s['sps']:9,.0f} SPS "
              f"in {s['wall_seconds']:5.1f} s, split {dict((k, round(v, 2)) for k, v in s['time_split'].items())}",
              flush=True)  # fmt: skip
        return {"env_id": ENVS[env][0], **lay, "total_env_steps": s["total_env_steps"], "sps": s["sps"],
                "wall_seconds": s["wall_seconds"], "time_split": s["time_split"],
                "process_seconds": s["process_seconds"], "final_mean_return": s["final_mean_return"],
                "ranks_in_sync": s.get("ranks_in_sync"), "load_before": load_before,
                "load_after": os.getloadavg()[0], "overrides": overrides}  # fmt: skip

    def write(report: dict[str, Any]) -> None:
        args.out.mkdir(parents=True, exist_ok=True)
        plot(report["results"], groups, args.out / "scaling.png")
        common.write_report(args.out, "scaling", report, markdown(report, command))

    cells = [{"env": g, "devices": d, "num_envs": n} for g in groups for d in args.devices for n in args.envs]
    # written once, at the end: a sitting stopped part-way leaves the full report of the last one in place
    common.sweep(report, cells, True, run, lambda report: None, field="results", say=lambda cell, r: None)
    write(report)


if __name__ == "__main__":
    main()
