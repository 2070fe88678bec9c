"""Multi-agent PPO on PettingZoo Parallel envs: MPE's cooperative navigation and the shipped two-team game.

1. `exp=mpe_spread`: `mpe2.simple_spread_v3` (3 agents, 3 landmarks, 25-step episodes, discrete actions,
   local_ratio 0.5), one policy shared by the three agents. Its return is read against two references
   measured here by stepping the env directly: uniformly random actions, and a scripted policy that sends
   each agent to its landmark in the assignment with the least total distance (it reads the env's internal
   state to choose the assignment, which no learned policy can, so it is a rough ceiling, not the optimum).
2. `ppo_fabric.envs.toy_multiagent:teams_v0` (2 adversaries vs 2 agents, zero-sum) with two policies,
   `adversary` and `agent`: once with both trained, and once with the adversaries frozen at their random
   initial policy (`multiagent.policies_to_train=[agent]`), where the agents' optimal return is known
   (L * (1 - 1/K) = 8 * 2/3 = 5.33). With both trained the two returns are each other's negatives and sit
   near 0 whatever the teams learned, so the report also gives each policy's final entropy (log 3 = 1.10
   for uniform play; near 0 once a team hits its target every step).

Every training run is `python -m ppo_fabric` in a fresh process, one at a time. Records per run the env
steps, the final mean return of every policy (last 20 agent-episodes), SPS, the training wall time and the
process wall time, and draws the learning curves from each run's metrics.csv. Writes
benchmarks/results/multiagent.{json,md,png}.

    .venv/bin/python benchmarks/multiagent.py                          # 1 seed, the recipe's steps
    .venv/bin/python benchmarks/multiagent.py --seeds 3
    .venv/bin/python benchmarks/multiagent.py --steps 20000 --teams-steps 10000 --out /tmp/ma   # smoke test
    .venv/bin/python benchmarks/multiagent.py --only spread -- env.num_envs=8   # extra overrides (spread runs)

A smoke run is too short to learn much; write it somewhere other than benchmarks/results/.
"""

from __future__ import annotations

import csv
import fnmatch
import importlib
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import RESULTS  # noqa: E402

SPREAD_ID = "mpe2.simple_spread_v3"
SPREAD_KWARGS = {"N": 3, "max_cycles": 25, "continuous_actions": False}  # local_ratio: the env's 0.5
TEAMS_ID = "ppo_fabric.envs.toy_multiagent:teams_v0"
TEAMS_OPTIMAL_VS_RANDOM = 8 * (1 - 1 / 3)  # episode_length * (1 - 1/num_symbols), the defaults
TEAMS_POLICIES = ["multiagent.policies={adversary:{},agent:{}}",
                  "multiagent.policy_mapping={adversary_*:adversary,agent_*:agent}"]  # fmt: skip
TEAMS_ALGO = ["algo.rollout_steps=32", "algo.minibatch_size=64", "algo.lr=1e-3", "algo.gamma=0.9"]
# run name -> overrides (the spread recipe gets --steps and the extra overrides as well)
TEAMS_RUNS: dict[str, list[str]] = {
    "teams: both trained": [],
    "teams: adversary frozen": ["multiagent.policies_to_train=[agent]"],
}
REFERENCE_EPISODES = 200


# ------------------------------------------------------------------------------------ references
def make_env(env_id: str, kwargs: dict[str, Any]) -> Any:
    module, _, attr = env_id.partition(":")
    return getattr(importlib.import_module(module), attr or "parallel_env")(**kwargs)


def policy_of(agent: str, mapping: dict[str, str]) -> str:
    """The policy an agent belongs to, by the first fnmatch pattern that matches (as the package maps)."""
    return mapping.get(agent) or next(p for pat, p in mapping.items() if fnmatch.fnmatchcase(agent, pat))


def play(env: Any, choose: Any, episodes: int, mapping: dict[str, str], seed: int = 0) -> dict[str, float]:
    """Mean return of one agent-episode per policy over `episodes` episodes; `choose(env, obs, rng)` gives
    the joint action."""
    rng = np.random.default_rng(seed)
    totals: dict[str, list[float]] = {}
    for ep in range(episodes):
        obs, _ = env.reset(seed=seed + ep)
        returns = dict.fromkeys(env.possible_agents, 0.0)
        while env.agents:
            obs, rewards, _, _, _ = env.step(choose(env, obs, rng))
            for agent, r in rewards.items():
                returns[agent] += float(r)
        for agent, r in returns.items():
            totals.setdefault(policy_of(agent, mapping), []).append(r)
    return {p: float(np.mean(v)) for p, v in totals.items()}


def random_actions(env: Any, obs: dict[str, Any], rng: np.random.Generator) -> dict[str, int]:
    return {a: int(rng.integers(env.action_space(a).n)) for a in env.agents}


def spread_scripted(env: Any, obs: dict[str, Any], rng: np.random.Generator) -> dict[str, int]:
    """Each agent steers for its landmark in the least-total-distance assignment (recomputed every step
    from the env's state), along the larger axis of (relative position - 0.5 * velocity), and idles once
    within 0.05. Observation of agent i: [vel(2), pos(2), landmark_rel(2N), other_rel(2(N-1)), comm]."""
    world = env.unwrapped.world
    agents, marks = world.agents, world.landmarks
    n = len(agents)
    best = min(itertools.permutations(range(n)), key=lambda p: sum(
        np.linalg.norm(agents[i].state.p_pos - marks[p[i]].state.p_pos) for i in range(n)))  # fmt: skip
    actions = {}
    for i, name in enumerate(env.possible_agents):
        if name not in env.agents:
            continue
        o = obs[name]
        d = o[4 + 2 * best[i] : 6 + 2 * best[i]] - 0.5 * o[0:2]
        if np.abs(d).max() < 0.05:
            actions[name] = 0  # no-op
        elif abs(d[0]) > abs(d[1]):
            actions[name] = 2 if d[0] > 0 else 1  # right / left
        else:
            actions[name] = 4 if d[1] > 0 else 3  # up / down
    return actions


def references() -> dict[str, dict[str, dict[str, float]]]:
    """Per env and policy: the mean agent-episode return of random play (and the scripted spread policy)."""
    spread = make_env(SPREAD_ID, SPREAD_KWARGS)
    teams = make_env(TEAMS_ID, {})
    shared = {"*": "shared"}
    teams_map = {"adversary_*": "adversary", "agent_*": "agent"}
    out = {
        "spread": {
            "random": play(spread, random_actions, REFERENCE_EPISODES, shared),
            "scripted": play(spread, spread_scripted, REFERENCE_EPISODES, shared),
        },
        "teams": {"random": play(teams, random_actions, REFERENCE_EPISODES, teams_map)},
    }
    spread.close()
    teams.close()
    return out


# ------------------------------------------------------------------------------------ training runs
def read_curves(metrics_csv: Path) -> dict[str, list[tuple[int, float]]]:
    """Every `.../rollout/episode_return` column and `rollout/return_mean20`: (env step, value) per update."""
    with metrics_csv.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    keys = [
        k
        for k in (rows[0] if rows else {})
        if k.endswith("rollout/episode_return") or k == "rollout/return_mean20"
    ]
    curves: dict[str, list[tuple[int, float]]] = {k: [] for k in keys}
    for row in rows:
        for k in keys:
            raw = row.get(k)
            if raw not in (None, "") and math.isfinite(float(raw)):
                curves[k].append((int(row["step"]), float(raw)))
    return curves


def last_updates(metrics_csv: Path, suffix: str, last: int = 10) -> dict[str, float]:
    """Mean of every `<policy>/<suffix>` column over the last `last` updates, per policy."""
    with metrics_csv.open(newline="") as fh:
        rows = list(csv.DictReader(fh))[-last:]
    keys = [
        k
        for k in (rows[0] if rows else {})
        if k.endswith("/" + suffix) and k.count("/") == suffix.count("/") + 1
    ]
    out = {}
    for k in keys:
        values = [float(r[k]) for r in rows if r.get(k) not in (None, "")]
        if values:
            out[k.split("/")[0]] = float(np.mean(values))
    return out


def train(name: str, overrides: list[str]) -> dict[str, Any]:
    """One training run in a fresh process (as a user launches it); its figures and curves."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "ppo_fabric", "logger.tensorboard=false", f"hydra.run.dir={run_dir}",
               *overrides]  # fmt: skip
        load_before = os.getloadavg()[0]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        process_wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"benchmark run failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
        s = json.loads((run_dir / "summary.json").read_text())
        metrics = run_dir / "metrics.csv"
        curves = read_curves(metrics)
        entropy = last_updates(metrics, "loss/entropy")
        recent = last_updates(metrics, "rollout/episode_return")
    return {
        "name": name,
        "overrides": overrides,
        "total_env_steps": s["total_env_steps"],
        "final_mean_return": s["final_mean_return"],
        "policies": {
            p: v | {"final_entropy": entropy.get(p), "last10_updates_return": recent.get(p)}
            for p, v in s.get("policies", {}).items()
        },
        "sps": s["sps"],
        "wall_seconds": s["wall_seconds"],
        "process_wall_seconds": process_wall,
        "time_split": s.get("time_split"),
        "episodes": s.get("episodes"),
        "loadavg_1min_before": load_before,
        "loadavg_1min_after": os.getloadavg()[0],
        "curves": curves,
    }


def smooth(ys: list[float], k: int = 5) -> np.ndarray:
    """Centred moving average over k updates (shorter at the ends)."""
    y = np.asarray(ys, dtype=float)
    if len(y) < k:
        return y
    kernel = np.ones(k)
    return np.convolve(y, kernel, "same") / np.convolve(np.ones_like(y), kernel, "same")


def plot(report: dict[str, Any], out: Path) -> None:
    """Left: simple_spread per-update mean agent-episode return (smoothed) with the references; right: the
    teams game, one line per policy and run. Agg canvas through the object API, as ppo_fabric/runs/plots.py."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    spread = [r for r in report["runs"] if r["name"].startswith("spread")]
    teams = [r for r in report["runs"] if r["name"].startswith("teams")]
    panels = [p for p in (spread, teams) if p]
    fig = Figure(figsize=(6.5 * len(panels), 4.2), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, len(panels), i + 1) for i in range(len(panels))]
    refs = report["references"]
    if spread:
        ax = axes[0]
        for r in spread:
            curve = r["curves"].get("shared/rollout/episode_return", [])
            if curve:
                xs, ys = zip(*curve, strict=True)
                (line,) = ax.plot(xs, smooth(list(ys)), lw=1.6, label=f"PPO, shared policy ({r['name']})")
                ax.plot(xs, ys, color=line.get_color(), lw=0.6, alpha=0.3)
        ax.axhline(refs["spread"]["random"]["shared"], color="grey", ls="--", lw=1, label="random actions")
        ax.axhline(refs["spread"]["scripted"]["shared"], color="tab:green", ls=":", lw=1.2,
                   label="scripted (env state)")  # fmt: skip
        ax.set_title("mpe2 simple_spread_v3, N=3 (exp=mpe_spread)")
        ax.set_xlabel("env steps")
        ax.set_ylabel("return per agent-episode (25 steps)")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize="small")
    if teams:
        ax = axes[-1]
        styles = {"teams: both trained": "-", "teams: adversary frozen": "--"}
        colors = {"adversary": "tab:red", "agent": "tab:blue"}
        for r in teams:
            for policy in r["policies"]:
                curve = r["curves"].get(f"{policy}/rollout/episode_return", [])
                if curve:
                    xs, ys = zip(*curve, strict=True)
                    ax.plot(xs, smooth(list(ys)), ls=styles.get(r["name"], "-"), color=colors.get(policy),
                            lw=1.4, label=f"{policy} ({r['name'].split(': ')[1]})")  # fmt: skip
        ax.axhline(TEAMS_OPTIMAL_VS_RANDOM, color="grey", ls=":", lw=1, label="optimal vs random (5.33)")
        ax.axhline(0, color="grey", lw=0.6)
        ax.set_title("teams_v0: 2 adversaries vs 2 agents, two policies")
        ax.set_xlabel("env steps")
        ax.set_ylabel("return per agent-episode (8 steps)")
        ax.grid(alpha=0.3)
        ax.legend(loc="center right", fontsize="small")
    fig.savefig(out)


# ------------------------------------------------------------------------------------ report
def markdown(report: dict[str, Any], command: str) -> str:
    m, refs = report["machine"], report["references"]
    extra = (
        f" Extra overrides on the spread runs: `{' '.join(report['extra_overrides'])}`."
        if report["extra_overrides"]
        else ""
    )
    rows = []
    for r in report["runs"]:
        env = "simple_spread_v3" if r["name"].startswith("spread") else "teams_v0"
        ref = refs["spread" if env.startswith("simple") else "teams"]["random"]
        for policy, p in r["policies"].items():
            trained = "trained" if p["trained"] else "frozen"
            rows.append(
                f"| {env} | {r['name']} | {r['total_env_steps']:,} | {policy} ({p['agents_per_env']} agents, {trained}) | "
                f"{common.fmt(ref.get(policy), '.2f')} | {common.fmt(p['final_mean_return'], '.2f')} | {common.fmt(p['last10_updates_return'], '.2f')} | "
                f"{common.fmt(p['final_entropy'], '.2f')} | "
                f"{r['sps']:,.0f} | {r['wall_seconds']:.0f} | {r['process_wall_seconds']:.0f} | "
                f"{r['loadavg_1min_before']:.1f} / {r['loadavg_1min_after']:.1f} |"
            )
    spread_runs = [r for r in report["runs"] if r["name"].startswith("spread")]
    tail = ""
    if spread_runs:
        s = spread_runs[0]["overrides"]
        tail = f"Spread run overrides: `{' '.join(s)}`. "
        over = [r["policies"]["shared"] for r in spread_runs if "shared" in r["policies"]]
        if len(over) > 1:  # the figure the recipe's comment states
            tail += (f"Over the {len(over)} spread seeds: final mean return "
                     f"{common.mean_std([v['final_mean_return'] for v in over])}, last 10 updates "
                     f"{common.mean_std([v['last10_updates_return'] for v in over])}. ")  # fmt: skip
    lines = [
        "# Multi-agent PPO on PettingZoo envs (`exp=mpe_spread`, `teams_v0`)",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, one torch thread per process; commit "
        f"{report['commit']}. Other jobs shared the machine: the 1-minute load average before and after each run "
        f"is in the last column (above 1, the run did not have a core to itself, and SPS is low).{extra}",
        "",
        "Returns are per agent-episode (one agent's summed reward over one episode), the unit the package logs. "
        "*random* is uniformly random actions for every agent, stepped directly in the env over "
        f"{REFERENCE_EPISODES} episodes; *final* is the summary's `final_mean_return` of the policy (last 20 "
        "agent-episodes, a few env episodes, so noisy); *last 10 updates* is the mean of the policy's per-update "
        "`rollout/episode_return` over the last 10 updates (every agent-episode that ended in them); *entropy* is the policy's mean `loss/entropy` over the last 10 updates (n/a for a "
        "frozen policy; log 5 = 1.61 and log 3 = 1.10 are uniform play). *train s* is the training loop, "
        "*process s* the whole `python -m ppo_fabric` process.",
        "",
        "| env | run | env steps | policy | random return | final mean return | last 10 updates | entropy | SPS | train s | process s | load before / after |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        f"References for simple_spread (per agent-episode, {REFERENCE_EPISODES} episodes): random actions "
        f"{refs['spread']['random']['shared']:.2f}; scripted {refs['spread']['scripted']['shared']:.2f} (each "
        "agent steers for its landmark in the least-distance assignment, read from the env's state). In teams_v0 "
        f"the agents' optimal return against a frozen random adversary team is {TEAMS_OPTIMAL_VS_RANDOM:.2f}.",
        "",
        tail
        + f"Teams runs: `env=pettingzoo env.id={TEAMS_ID} {' '.join(TEAMS_POLICIES)} {' '.join(TEAMS_ALGO)}`.",
        "",
        f"![learning curves]({report['png']})" if report["png"] else "",
        "",
        f"Command: `{command}`",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = common.argument_parser(__doc__)
    parser.add_argument(
        "--steps", type=int, default=None, help="env steps per spread run (default: the recipe's)"
    )
    parser.add_argument("--teams-steps", type=int, default=100_000, help="env steps per teams_v0 run")
    parser.add_argument("--seeds", type=int, default=1, help="seeds 1..N for the spread recipe")
    parser.add_argument(
        "--only", choices=["both", "spread", "teams"], default="both", help="run one part only"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="where multiagent.{json,md,png} go")
    parser.add_argument("extra", nargs="*", help="overrides for the spread runs, after --")
    args = parser.parse_args()

    refs = references()
    print(f"references: {json.dumps(refs)}", flush=True)
    runs = []
    if args.only in ("both", "spread"):
        for seed in range(1, args.seeds + 1):
            overrides = [
                "exp=mpe_spread",
                f"seed={seed}",
                *([f"algo.total_steps={args.steps}"] if args.steps else []),
            ]
            runs.append(train(f"spread seed {seed}", [*overrides, *args.extra]))
    if args.only in ("both", "teams"):
        base = ["env=pettingzoo", f"env.id={TEAMS_ID}", *TEAMS_POLICIES, *TEAMS_ALGO,
                f"algo.total_steps={args.teams_steps}", "seed=1"]  # fmt: skip
        for name, extra in TEAMS_RUNS.items():
            runs.append(train(name, [*base, *extra]))
    for r in runs:
        per_policy = ", ".join(
            f"{p} {common.fmt(v['final_mean_return'], '.2f')}" for p, v in r["policies"].items()
        )
        print(f"{r['name']}: {r['total_env_steps']:,} steps, final {per_policy}, {r['sps']:,.0f} SPS, "
              f"{r['wall_seconds']:.0f} s", flush=True)  # fmt: skip

    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / "multiagent.png"
    report = {"steps": args.steps, "teams_steps": args.teams_steps, "extra_overrides": args.extra,
              "machine": common.machine(), "commit": common.git_commit(), "png": png.name,
              "references": refs, "runs": runs}  # fmt: skip
    plot(report, png)
    common.write_report(args.out, "multiagent", report, markdown(report, common.command_line(__file__)))


if __name__ == "__main__":
    main()
