"""The NumPy rollout actor (`algo.numpy_rollout`) against the torch one, on CartPole: what a rollout tick costs.

Two parts, in one process, one torch thread, variants alternated `--repeats` times:

1. **Why** (CleanRL's 4 envs, its 64x64 tanh actor): the actor alone, gymnasium's vector step alone, and the
   two alternating as in a rollout, for each actor. The torch actor and the vector step cost more together
   than apart; the NumPy actor much less so.
2. **What it gives**: `RolloutCollector.collect` (the package's own rollout: acting, stepping, storing, values,
   GAE) per vector step on `exp=cleanrl_cartpole` (4 envs x 128 steps) and `exp=fast` (64 envs x 32 steps),
   with `algo.numpy_rollout` true and false.

Writes benchmarks/results/numpy_rollout.{json,md}.

`--learning`: whether it learns alike. `exp=fast` (500k steps) trained once per seed with `algo.numpy_rollout`
true and false, each in a fresh process, alternating: final mean return (last 20 episodes), the first step
with a 20-episode mean >= 475, SPS. The two actors draw their random numbers differently, so each
seed's run differs; what should match is how often and how far they learn. Writes numpy_rollout_learning.*.

    .venv/bin/python benchmarks/numpy_rollout.py [--repeats 5]
    .venv/bin/python benchmarks/numpy_rollout.py --learning [--seeds 10]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # ppo_fabric of this checkout
import common  # noqa: E402
from common import RESULTS  # noqa: E402

from ppo_fabric.collect.numpy_actor import NumpyActor  # noqa: E402
from ppo_fabric.collect.rollout import build_collector  # noqa: E402
from ppo_fabric.config.values import compose  # noqa: E402
from ppo_fabric.envs.multiagent import SINGLE  # noqa: E402
from ppo_fabric.learn.learners import policy_specs  # noqa: E402
from ppo_fabric.models.agent import ActorCritic, rollout_noise  # noqa: E402


def per_call_us(fn: Callable[[], Any], calls: int) -> float:
    for _ in range(min(calls, 200)):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def setup(exp: str, numpy_rollout: bool) -> tuple[Any, ActorCritic]:
    cfg, _ = compose([f"exp={exp}", f"algo.numpy_rollout={str(numpy_rollout).lower()}"])
    specs = policy_specs(cfg)
    torch.manual_seed(0)
    policy = ActorCritic(specs[SINGLE].obs_space, specs[SINGLE].action_space, cfg.model)
    return build_collector(cfg, specs, 0, "cpu", None), policy


def why(calls: int) -> dict[str, float]:
    """us per call: each actor alone, the vector step alone, each actor alternating with the vector step."""
    collector, policy = setup("cleanrl_cartpole", True)
    envs, rows = collector.envs, collector.num_envs
    obs_t = torch.zeros(rows, 4)
    obs_np = obs_t.numpy()
    actions = np.zeros(rows, dtype=np.int64)
    actor = NumpyActor(policy)
    noise = next(rollout_noise(policy.head, 1, rows))

    def torch_act() -> None:
        with torch.inference_mode():
            policy.sample(obs_t, None)

    def numpy_act() -> None:
        actor.sample(obs_np, noise)

    def step() -> None:
        envs.step(actions)

    out = {
        "torch actor": per_call_us(torch_act, calls),
        "numpy actor": per_call_us(numpy_act, calls),
        "vector step": per_call_us(step, calls),
        "torch actor + vector step": per_call_us(lambda: (torch_act(), step()), calls),
        "numpy actor + vector step": per_call_us(lambda: (numpy_act(), step()), calls),
    }
    envs.close()
    return out


def collect_us(exp: str, numpy_rollout: bool, rollouts: int) -> float:
    """us per vector step of `collect`, after two warm-up rollouts."""
    collector, policy = setup(exp, numpy_rollout)
    for _ in range(2):
        collector.collect(policy, 0)
    t0 = time.perf_counter()
    for _ in range(rollouts):
        collector.collect(policy, 0)
    elapsed = time.perf_counter() - t0
    collector.envs.close()
    return elapsed / (rollouts * collector.storage.batch_size[0]) * 1e6


def learning(seeds: int, out: Path) -> None:
    runs = []
    for seed in range(1, seeds + 1):
        for numpy_rollout in (True, False) if seed % 2 else (False, True):
            flag = str(numpy_rollout).lower()
            summary = common.run_once(["exp=fast", f"seed={seed}", f"algo.numpy_rollout={flag}"])
            run = {"seed": seed, "numpy_rollout": numpy_rollout, "sps": float(summary["sps"]),
                   "final_mean_return": float(summary["final_mean_return"]),
                   "solved_step": summary["solved_step"]}  # fmt: skip
            runs.append(run)
            print(json.dumps(run), flush=True)
    m = common.machine()

    def count(flag: bool, threshold: float) -> int:
        return sum(r["final_mean_return"] >= threshold for r in runs if r["numpy_rollout"] is flag)

    lines = [
        "# NumPy rollout actor vs torch actor: learning (`exp=fast`, 500k steps)",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}; commit {common.git_commit()}; each run in "
        "a fresh process, one at a time, alternating.",
        f"Command: `{common.command_line(__file__)}`",
        "",
        "| seed | numpy_rollout | final mean return | first step with mean20 >= 475 | SPS |",
        "|---:|---|---:|---:|---:|",
        *(
            f"| {r['seed']} | {str(r['numpy_rollout']).lower()} | {r['final_mean_return']:.1f} | "
            f"{r['solved_step'] if r['solved_step'] is not None else 'never'} | {r['sps']:,.0f} |"
            for r in runs
        ),
        "",
        f"Final mean return 500 (>= 475): NumPy actor {count(True, 500)} ({count(True, 475)}) of {seeds} seeds, "
        f"torch actor {count(False, 500)} ({count(False, 475)}) of {seeds}.",
        "",
    ]
    common.write_report(out, "numpy_rollout_learning", {"machine": m, "runs": runs}, "\n".join(lines))


def main() -> None:
    p = common.argument_parser(__doc__)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--learning", action="store_true", help="train exp=fast per seed with each actor")
    p.add_argument("--seeds", type=int, default=10, help="--learning: seeds 1..N")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if args.learning:
        learning(args.seeds, args.out)
        return
    torch.set_num_threads(1)
    whys: list[dict[str, float]] = []
    collects: dict[str, list[float]] = {}
    for r in range(args.repeats):
        whys.append(why(5000))
        for exp, rollouts in (("cleanrl_cartpole", 40), ("fast", 60)):
            for numpy_rollout in (True, False) if r % 2 == 0 else (False, True):
                key = f"{exp} numpy_rollout={str(numpy_rollout).lower()}"
                collects.setdefault(key, []).append(collect_us(exp, numpy_rollout, rollouts))
        print(f"repeat {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in collects.items()), flush=True)
    why_med = {k: statistics.median(w[k] for w in whys) for k in whys[0]}
    col_med = {k: statistics.median(v) for k, v in collects.items()}
    speedup = {
        exp: col_med[f"{exp} numpy_rollout=false"] / col_med[f"{exp} numpy_rollout=true"]
        for exp in ("cleanrl_cartpole", "fast")
    }
    m = common.machine()
    lines = [
        "# NumPy rollout actor vs torch actor (CartPole, one process, one torch thread)",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}; commit {common.git_commit()}; medians of "
        f"{args.repeats} repeats, variants alternated.",
        f"Command: `{common.command_line(__file__)}`",
        "",
        "## Why: each part alone and alternating (CleanRL's 4 envs, 64x64 tanh actor), us per call",
        "",
        "| what | us |",
        "|---|---:|",
        *(f"| {k} | {v:.1f} |" for k, v in why_med.items()),
        "",
        f"Alternating costs more than the parts: torch actor + vector step "
        f"{why_med['torch actor + vector step']:.1f} us against "
        f"{why_med['torch actor'] + why_med['vector step']:.1f} apart; NumPy actor + vector step "
        f"{why_med['numpy actor + vector step']:.1f} against "
        f"{why_med['numpy actor'] + why_med['vector step']:.1f} apart.",
        "",
        "## The package's rollout (`RolloutCollector.collect`), us per vector step",
        "",
        "| exp | numpy_rollout=true | numpy_rollout=false | speed-up |",
        "|---|---:|---:|---:|",
        *(
            f"| {exp} | {col_med[f'{exp} numpy_rollout=true']:.1f} | {col_med[f'{exp} numpy_rollout=false']:.1f} "
            f"| {speedup[exp]:.2f}x |"
            for exp in ("cleanrl_cartpole", "fast")
        ),
        "",
    ]
    report = {"machine": m, "why_us": whys, "collect_us": collects, "why_median_us": why_med,
              "collect_median_us": col_med, "speedup": speedup}  # fmt: skip
    common.write_report(args.out, "numpy_rollout", report, "\n".join(lines))


if __name__ == "__main__":
    main()
