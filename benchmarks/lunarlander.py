"""Does a named env config reach its target return? LunarLander-v3 (discrete) and Pendulum-v1 (continuous).

Runs `python -m ppo_fabric env=<name>` with the env's own config (RL-Zoo's tuned values in conf/env/,
1M steps) once per seed, each in a fresh process, and records the final mean return (last 20 episodes)
against the env's target, the env step at which the mean of the last 20 episodes first reached the target,
SPS and wall time. Writes benchmarks/results/<name>.{json,md}.

    .venv/bin/python benchmarks/lunarlander.py                       # LunarLander-v3, 1M steps (target 200)
    .venv/bin/python benchmarks/lunarlander.py --env pendulum        # Pendulum-v1, its config's 100k steps (target -200)
    .venv/bin/python benchmarks/lunarlander.py --steps 50000 --out /tmp/ll   # smoke test
    .venv/bin/python benchmarks/lunarlander.py --seeds 3 -- env.num_envs=8   # extra overrides after --

LunarLander-v3 needs Box2D (the bench or box2d extra). A smoke run with `--steps` is far too short to reach
the target; write it somewhere other than benchmarks/results/ so it does not replace a full run's figures.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import RESULTS, run_once  # noqa: E402

# env config name -> (gymnasium id, target return). 200 is LunarLander's "solved" score. Pendulum has no
# official threshold; -200 is the usual mark of a policy that swings up and balances from every start
# (the best ones average about -150).
TARGETS: dict[str, tuple[str, float]] = {
    "lunarlander": ("LunarLander-v3", 200.0),
    "pendulum": ("Pendulum-v1", -200.0),
}


def run_seed(env: str, seed: int, steps: int | None, extra: list[str]) -> dict[str, Any]:
    """One training run in a fresh process; the figures the report needs."""
    target = TARGETS[env][1]
    overrides = [f"env={env}", f"seed={seed}", *([f"algo.total_steps={steps}"] if steps else []), *extra]
    s = run_once(overrides, solved_return=target)
    final = s["final_mean_return"]
    return {
        "seed": seed,
        "overrides": overrides,
        "total_env_steps": s["total_env_steps"],
        "final_mean_return": final,
        "reached_target": final is not None and final >= target,
        "first_step_mean20_at_target": s["solved_step"],
        "sps": s["sps"],
        "wall_seconds": s["wall_seconds"],
        "episodes": s.get("episodes"),
    }


def markdown(report: dict[str, Any], command: str) -> str:
    m, env_id, target = report["machine"], report["env_id"], report["target"]
    lines = [
        f"# {env_id} with `env={report['env']}`",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, one torch thread per process. "
        f"The env's own config (`conf/env/{report['env']}.yaml`, RL-Zoo's tuned values)"
        + (f" with {' '.join(report['extra_overrides'])}" if report["extra_overrides"] else "")
        + f". Target: final mean return (last 20 episodes) >= {target:g}.",
        "",
        f"| seed | env steps | final mean return (last 20) | reached {target:g} | first step with mean20 >= {target:g} | SPS | wall s |",
        "|---:|---:|---:|:---:|---:|---:|---:|",
        *(
            f"| {r['seed']} | {r['total_env_steps']:,} | {common.fmt(r['final_mean_return'])} | "
            f"{'yes' if r['reached_target'] else 'no'} | {r['first_step_mean20_at_target'] or 'never'} | "
            f"{r['sps']:,.0f} | {r['wall_seconds']:.0f} |"
            for r in report["runs"]
        ),
        "",
        f"Command: `{command}`",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = common.argument_parser(__doc__)
    parser.add_argument(
        "--env", choices=sorted(TARGETS), default="lunarlander", help="env config (conf/env/)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="env steps per run (default: the config's, 1M)"
    )
    parser.add_argument("--seeds", type=int, default=1, help="seeds 1..N, one run each")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where <env>.json and <env>.md go")
    parser.add_argument("extra", nargs="*", help="overrides for every run, after --")
    args = parser.parse_args()
    env_id, target = TARGETS[args.env]
    runs = []
    for seed in range(1, args.seeds + 1):
        r = run_seed(args.env, seed, args.steps, args.extra)
        runs.append(r)
        print(f"{env_id} seed {seed}: {r['total_env_steps']:,} steps, final {common.fmt(r['final_mean_return'])}, first "
              f"mean20 >= {target:g} at {r['first_step_mean20_at_target']}, {r['sps']:,.0f} SPS, "
              f"{r['wall_seconds']:.0f} s", flush=True)  # fmt: skip
    report = {"env": args.env, "env_id": env_id, "target": target, "steps": args.steps,
              "extra_overrides": args.extra, "machine": common.machine(), "runs": runs}  # fmt: skip
    common.write_report(args.out, args.env, report, markdown(report, common.command_line(__file__)))


if __name__ == "__main__":
    main()
