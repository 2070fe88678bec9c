"""Throughput of the strategies on one workload, measured in one run on one machine.

Runs CleanRL's CartPole workload (`exp=cleanrl_cartpole`: 4 sync envs x 128 steps, 4 epochs x 4
minibatches, 64x64 tanh MLPs) as
  - coupled, 1 process,
  - decoupled, 1 player + 1 trainer, pipeline on,
  - decoupled, 1 player + 1 trainer, pipeline off,
each `--repeats` times, interleaved so that machine drift hits every variant alike, one run at a time.
SPS is the run's own figure (env steps / training wall time, process start-up excluded). Writes
benchmarks/results/decoupled_vs_coupled.{json,md}.

    .venv/bin/python benchmarks/decoupled_vs_coupled.py [--steps 200000] [--repeats 3] [-- extra overrides]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import RESULTS, run_once  # noqa: E402

VARIANTS = {
    "coupled (1 process)": common.LAYOUTS["coupled"],
    "decoupled 1+1 pipelined": common.LAYOUTS["pipelined"],
    "decoupled 1+1 synchronous": common.LAYOUTS["synchronous"],
}


def main() -> None:
    parser = common.argument_parser(__doc__)
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("extra", nargs="*", help="overrides applied to every variant")
    args = parser.parse_args()

    rows: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for repeat in range(args.repeats):
        for name, overrides in VARIANTS.items():
            workload = ["exp=cleanrl_cartpole", f"algo.total_steps={args.steps}", f"seed={repeat + 1}"]
            summary = run_once([*workload, *overrides, *args.extra])
            rows[name].append(summary)
            print(f"{name:28s} seed {repeat + 1}: {summary['sps']:8,.0f} SPS, "
                  f"return {summary['final_mean_return']:.1f}", flush=True)  # fmt: skip

    base = statistics.median(s["sps"] for s in rows["coupled (1 process)"])
    table = []
    for name, runs in rows.items():
        sps = statistics.median(s["sps"] for s in runs)
        split = runs[-1]["time_split"]
        table.append({"variant": name, "median_sps": sps, "ratio_vs_coupled": sps / base,
                      "sps_each": [s["sps"] for s in runs],
                      "final_mean_return_each": [s["final_mean_return"] for s in runs],
                      "time_split_last": split})  # fmt: skip
    machine = common.machine()
    report = {"workload": "exp=cleanrl_cartpole", "steps": args.steps, "repeats": args.repeats,
              "extra_overrides": args.extra, "machine": machine, "results": table}  # fmt: skip
    lines = [
        "# Coupled vs decoupled throughput (CleanRL CartPole workload)",
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}, "
        f"Python {machine['python']}. {args.steps} env steps per run, {args.repeats} runs per variant "
        "(interleaved), SPS = env steps / training wall time.",
        "",
        "| variant | median SPS | vs coupled | SPS per run | final mean return per run |",
        "|---|---:|---:|---|---|",
    ]
    for row in table:
        lines.append(
            f"| {row['variant']} | {row['median_sps']:,.0f} | {row['ratio_vs_coupled']:.2f}x | "
            + ", ".join(f"{x:,.0f}" for x in row["sps_each"]) + " | "
            + ", ".join(f"{x:.1f}" for x in row["final_mean_return_each"]) + " |"
        )  # fmt: skip
    lines += ["", "Time split of the last run of each variant (seconds):", ""]
    for row in table:
        lines.append(f"- {row['variant']}: {json.dumps(row['time_split_last'])}")
    lines += ["", f"Command: `{common.command_line(__file__)}`", ""]
    common.write_report(args.out, "decoupled_vs_coupled", report, "\n".join(lines))


if __name__ == "__main__":
    main()
