"""The decoupled pipelined 1+1 layout against Stable-Baselines3 on CleanRL's CartPole workload (the
2-core target: >= 4x SB3's SPS).

Alternates, one run at a time: SB3 through `cartpole_vs_sb3.py --only sb3 --seeds 1` (its own child process,
one torch thread, timed as that script times it) and ppo-fabric's `exp=cleanrl_cartpole strategy=decoupled
fabric.devices=2 algo.pipeline=true torch_threads=1` (its own SPS: env steps / training wall time). Each
round's ratio comes from two runs back to back, so load from other jobs hits both sides of a ratio alike
as far as it can; the report gives every round's ratio and their median.

Each round also reports the two sides' ceilings, from the run's own time split: the SPS the player alone would
reach (env steps / its collect + send seconds, as if the trainers answered at once) and the trainer alone (env
steps / its update seconds, as if batches arrived at once). The pipelined run cannot beat the lower of the two,
so a target above both needs both sides faster, not better overlap.

    .venv/bin/python benchmarks/pipelined_vs_sb3.py [--rounds 3] [--steps 100352]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import RESULTS, run_once  # noqa: E402

PIPELINED = ["exp=cleanrl_cartpole", *common.LAYOUTS["pipelined"], "torch_threads=1"]


def sb3_sps(steps: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(Path(__file__).with_name("cartpole_vs_sb3.py")), "--only", "sb3",
               "--seeds", "1", "--steps", str(steps), "--out", tmp, "--name", "sb3"]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"SB3 run failed:\n{proc.stderr[-2000:]}")
        return float(json.loads((Path(tmp) / "sb3.json").read_text())["runs"][0]["sps"])


def main() -> None:
    p = common.argument_parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=100_352, help="env steps per run (whole 512-step updates)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    rounds = []
    for r in range(args.rounds):
        pair = {}
        for side in ("sb3", "pipelined") if r % 2 == 0 else ("pipelined", "sb3"):
            if side == "sb3":
                pair[side] = sb3_sps(args.steps)
            else:
                summary = run_once([*PIPELINED, f"algo.total_steps={args.steps}"])
                pair[side] = float(summary["sps"])
                split, steps = summary["time_split"], float(summary["total_env_steps"])
                pair["player_bound"] = steps / (split["player"]["collect"] + split["player"]["send"])
                pair["trainer_bound"] = steps / split["trainer"]["train"]
        pair["ratio"] = pair["pipelined"] / pair["sb3"]
        pair["ceiling_ratio"] = min(pair["player_bound"], pair["trainer_bound"]) / pair["sb3"]
        pair["load_after"] = os.getloadavg()[0]
        rounds.append(pair)
        print(json.dumps(pair), flush=True)
    med = statistics.median(x["ratio"] for x in rounds)
    ceiling = statistics.median(x["ceiling_ratio"] for x in rounds)
    m = common.machine()
    md = "\n".join(
        [
            "# Decoupled pipelined 1+1 vs Stable-Baselines3 (CleanRL CartPole workload)",
            "",
            f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}; commit {common.git_commit()}; "
            f"{args.steps:,} env steps per run.",
            f"Command: `{common.command_line(__file__)}`",
            "",
            "| round | SB3 SPS | pipelined 1+1 SPS | ratio | player-bound SPS | trainer-bound SPS | ceiling "
            "ratio | 1-min load after |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
            *(
                f"| {i + 1} | {x['sb3']:,.0f} | {x['pipelined']:,.0f} | {x['ratio']:.2f}x | "
                f"{x['player_bound']:,.0f} | {x['trainer_bound']:,.0f} | "
                f"{x['ceiling_ratio']:.2f}x | {x['load_after']:.1f} |"
                for i, x in enumerate(rounds)
            ),
            "",
            f"**Median ratio: {med:.2f}x** (target >= 4x); median ceiling ratio {ceiling:.2f}x. A load above 2 "
            "means other jobs shared the 2 cores.",
            "",
            "Player-bound: env steps / the player's collect + send seconds; trainer-bound: env steps / the "
            "trainer's update seconds (each measured in the pipelined run itself, both processes busy). Ceiling "
            "ratio: the lower bound of the two over SB3's SPS, what perfect overlap would give.",
            "",
        ]
    )
    common.write_report(
        args.out,
        "pipelined_vs_sb3",
        {"machine": m, "rounds": rounds, "median_ratio": med, "median_ceiling_ratio": ceiling},
        md,
    )


if __name__ == "__main__":
    main()
