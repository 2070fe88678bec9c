"""Does the default config solve CartPole-v1 in every layout? (the decoupled issue's learning check)

Runs `python -m ppo_fabric` with the default config (CartPole-v1, RL-Zoo's tuned values, 200k steps)
coupled on 1 process and decoupled as 1 player + 1 trainer and 1 player + 2 trainers, pipeline on and off,
and records the final mean return (last 20 episodes), the env step at which the mean of the last 20
episodes first reached 475, and SPS. Writes benchmarks/results/cartpole_solve.{json,md}.

    .venv/bin/python benchmarks/cartpole_solve.py [--seeds 1]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import RESULTS, run_once  # noqa: E402

LAYOUTS = {
    "coupled, 1 process": common.LAYOUTS["coupled"],
    "decoupled 1+1, pipeline on": common.LAYOUTS["pipelined"],
    "decoupled 1+1, pipeline off": common.LAYOUTS["synchronous"],
    "decoupled 1+2, pipeline on": ["strategy=decoupled", "fabric.devices=3", "algo.pipeline=true"],
    "decoupled 1+2, pipeline off": ["strategy=decoupled", "fabric.devices=3", "algo.pipeline=false"],
}


def main() -> None:
    parser = common.argument_parser(__doc__)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = []
    for name, overrides in LAYOUTS.items():
        for seed in range(1, args.seeds + 1):
            s = run_once([*overrides, f"seed={seed}"])
            rows.append({"layout": name, "seed": seed, "total_env_steps": s["total_env_steps"],
                         "final_mean_return": s["final_mean_return"], "solved_step": s["solved_step"],
                         "sps": s["sps"], "wall_seconds": s["wall_seconds"]})  # fmt: skip
            print(f"{name:30s} seed {seed}: final {s['final_mean_return']:.1f}, first >=475 at "
                  f"{s['solved_step']}, {s['sps']:,.0f} SPS", flush=True)  # fmt: skip
    m = common.machine()
    lines = [
        "# CartPole-v1 with the default config, every layout",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}. Default config (`conf/env/cartpole.yaml`: "
        "8 envs x 32 steps, minibatch 256 over all trainers, 20 epochs, lr 1e-3, gamma 0.98, lambda 0.8), "
        "200k steps. Three processes on two cores run slower; this table is about learning, not speed.",
        "",
        "| layout | seed | final mean return (last 20) | first step with mean20 >= 475 | SPS |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {r['layout']} | {r['seed']} | {r['final_mean_return']:.1f} | {r['solved_step']} | {r['sps']:,.0f} |"
            for r in rows
        ),  # fmt: skip
        "",
        f"Command: `{common.command_line(__file__)}`",
        "",
    ]
    common.write_report(args.out, "cartpole_solve", {"machine": m, "runs": rows}, "\n".join(lines))


if __name__ == "__main__":
    main()
