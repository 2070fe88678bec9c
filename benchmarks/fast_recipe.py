"""The high-throughput recipe: `exp=fast` (CartPole-v1, 64 sync envs x 32 steps) next to CleanRL's workload.

Runs `python -m ppo_fabric exp=fast` and `exp=cleanrl_cartpole` once per seed, alternating, each in a fresh
process, one at a time, each with its experiment's own step budget; records SPS, the final mean return (last
20 episodes) and the first env step at which that mean reached 475. The ratio of the SPS medians is what the
recipe buys on this machine. Writes benchmarks/results/fast_recipe.{json,md}.

    .venv/bin/python benchmarks/fast_recipe.py [--seeds 3] [--out DIR]
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

RECIPES = ("fast", "cleanrl_cartpole")


def main() -> None:
    parser = common.argument_parser(__doc__)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for seed in range(1, args.seeds + 1):
        for exp in RECIPES:
            s = run_once([f"exp={exp}", f"seed={seed}"])
            row = {"exp": exp, "seed": seed, "sps": s["sps"], "env_steps": s["total_env_steps"],
                   "final_mean_return": s["final_mean_return"], "solved_step": s["solved_step"]}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    medians = {exp: statistics.median(r["sps"] for r in rows if r["exp"] == exp) for exp in RECIPES}
    result = {"machine": common.machine(), "git": common.git_commit(), "rows": rows, "median_sps": medians,
              "ratio": medians["fast"] / medians["cleanrl_cartpole"]}  # fmt: skip
    m = result["machine"]
    lines = [
        "# `exp=fast` vs `exp=cleanrl_cartpole` (CartPole-v1, coupled, 1 process)",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}; git {result['git']}. Each run in a fresh "
        "process, one at a time, alternating; each experiment's own step budget (env steps column).",
        "",
        "| exp | seed | env steps | SPS | final mean return | first step with mean20 >= 475 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        solved = "never" if r["solved_step"] is None else f"{r['solved_step']:,}"
        lines.append(f"| {r['exp']} | {r['seed']} | {r['env_steps']:,} | {r['sps']:,.0f} | "
                     f"{r['final_mean_return']:.1f} | {solved} |")  # fmt: skip
    lines += [
        "",
        f"**Median SPS: exp=fast {medians['fast']:,.0f}, exp=cleanrl_cartpole {medians['cleanrl_cartpole']:,.0f}: "
        f"{result['ratio']:.2f}x.**",
        "",
        f"Command: `{common.command_line(__file__)}`",
        "",
    ]
    common.write_report(args.out, "fast_recipe", result, "\n".join(lines))


if __name__ == "__main__":
    main()
