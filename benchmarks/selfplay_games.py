"""Self-play on PettingZoo's classic board games, from scratch, judged against a uniformly random player.

For each game (`exp=tictactoe`, `exp=connect_four`): one training run of `python -m ppo_fabric` in a fresh
process with numbered checkpoints along the way, then every checkpoint plays `--curve-games` games (the
final one `--games`, 400 by default) against a player that picks uniformly among the legal moves, seats
alternated (the trained policy samples from its distribution). Records env steps (one agent's move is one
env step), the training wall time, the win / draw / loss rates, and the win-rate curve over env steps.
Writes benchmarks/results/selfplay_games.{json,md,png}.

Targets (2 CPU cores): connect_four_v3 wins >= 95% of 400 games within 30 minutes of training, and its
greedy policy >= 60% of 400 games against the scripted win_or_block player within 60 minutes; tictactoe_v3
loses at most 1% of 400 games.

    .venv/bin/python benchmarks/selfplay_games.py                        # both games, the recipes' steps
    .venv/bin/python benchmarks/selfplay_games.py --only tictactoe
    .venv/bin/python benchmarks/selfplay_games.py --only tictactoe --steps 20000 --out /tmp/sp   # smoke
    .venv/bin/python benchmarks/selfplay_games.py --only connect_four -- algo.lr=1e-3   # extra overrides
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from ppo_fabric.config.values import compose  # noqa: E402
from ppo_fabric.games.play import PolicyPlayer, RandomPlayer, aec_env_factory, play_games  # noqa: E402
from ppo_fabric.games.scripted import SearchPlayer, WinOrBlockPlayer  # noqa: E402
from ppo_fabric.learn.learners import policy_specs  # noqa: E402
from ppo_fabric.models.agent import ActorCritic  # noqa: E402
from ppo_fabric.runs import checkpoint as ckpt  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
GAMES = {"tictactoe": "tictactoe", "connect_four": "connect_four"}  # name -> recipe (conf/exp)
TARGETS = {
    "tictactoe": "loses <= 1% of 400 games",
    "connect_four": "wins >= 95% of 400 games in 30 min; greedy >= 60% vs win_or_block in 60 min",
}


def train(game: str, run_dir: Path, steps: int | None, checkpoints: int, extra: list[str]) -> dict[str, Any]:
    """One training run in a fresh process; returns its summary, the wall time and the checkpoints."""
    cfg, _ = compose([f"exp={GAMES[game]}", *extra, *([f"algo.total_steps={steps}"] if steps else [])])
    per_update = int(cfg.algo.rollout_steps) * int(cfg.env.num_envs)
    updates = int(cfg.algo.total_steps) // per_update
    every = max(1, updates // checkpoints)
    cmd = [
        sys.executable, "-m", "ppo_fabric", f"exp={GAMES[game]}", *extra,
        *([f"algo.total_steps={steps}"] if steps else []), "logger.tensorboard=false",
        f"checkpoint.every={every}", "checkpoint.keep=0", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    summary = json.loads((run_dir / "summary.json").read_text())
    found = sorted(
        (int(m.group(1)), p)
        for p in (run_dir / "checkpoints").glob("step_*.ckpt")
        if (m := re.match(r"step_(\d+)_", p.name))
    )
    return {"summary": summary, "process_wall_s": wall, "checkpoints": found, "cfg": cfg}


def win_rates(
    cfg: Any, path: Path, games: int, seed: int, greedy: bool = False, opponent: Any = None
) -> dict[str, float]:
    """Win / draw / loss rates of the checkpoint's policy (sampling, or its most likely move with `greedy`)
    against `opponent` (default: a uniformly random legal player)."""
    spec = policy_specs(cfg)["shared"]
    policy = ActorCritic(spec.obs_space, spec.action_space, spec.model)
    policy.load_state_dict(ckpt.load(path)["agent"]["shared"])
    player = PolicyPlayer(policy.eval(), deterministic=greedy, masked=True)
    opponent = RandomPlayer(seed) if opponent is None else opponent
    results = play_games(aec_env_factory(str(cfg.env.id)), player, opponent, games, seed)
    return {"win": results.rate(1), "draw": results.rate(0), "loss": results.rate(-1), "games": games}


def wall_times(metrics: Path) -> list[tuple[int, float]]:
    """(env step, `time/wall_s`) of every update in the run's metrics.csv, read once."""
    with metrics.open() as f:
        rows = csv.DictReader(f)
        return [(int(float(r["step"])), float(r["time/wall_s"])) for r in rows if r.get("time/wall_s")]


def wall_at(walls: list[tuple[int, float]], step: int) -> float | None:
    """The wall time of the last update at or before env step `step` (the training time a checkpoint took)."""
    before = [wall for at, wall in walls if at <= step]
    return round(before[-1], 1) if before else None


def run_game(game: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        run = train(game, Path(tmp) / "run", args.steps, args.checkpoints, args.overrides)
        cfg = run["cfg"]
        walls = wall_times(Path(tmp) / "run" / "metrics.csv")
        curve = []
        for step, path in run["checkpoints"][:-1]:
            point = {"step": step, "wall_s": wall_at(walls, step)}
            point.update(win_rates(cfg, path, args.curve_games, seed=step))
            if game == "connect_four":  # the thinking opponent's curve: greedy, as the target is judged
                wb = win_rates(
                    cfg, path, args.curve_games, seed=step, greedy=True, opponent=WinOrBlockPlayer(step)
                )
                point["greedy_vs_win_or_block"] = wb["win"]
            curve.append(point)
        last_step, last = run["checkpoints"][-1]
        final = win_rates(cfg, last, args.games, seed=12345)
        greedy = win_rates(cfg, last, args.games, seed=12345, greedy=True)
        scripted = {}  # Connect Four: greedy games against the players that think (games/scripted.py)
        if game == "connect_four":
            for name, opponent in (
                ("win_or_block", WinOrBlockPlayer(12345)),
                ("search:2", SearchPlayer(2, 12345)),
            ):
                scripted[name] = win_rates(cfg, last, args.games, seed=12345, greedy=True, opponent=opponent)
        point = {"step": last_step, "wall_s": wall_at(walls, last_step), **final}
        if scripted:
            point["greedy_vs_win_or_block"] = scripted["win_or_block"]["win"]
        curve.append(point)
    summary = run["summary"]
    train_s = float(summary.get("wall_seconds") or run["process_wall_s"])
    return {
        "game": game,
        "env_id": str(cfg.env.id),
        "recipe": f"exp={GAMES[game]}",
        "overrides": args.overrides,
        "env_steps": int(summary["total_env_steps"]),
        "train_wall_s": round(train_s, 1),
        "process_wall_s": round(run["process_wall_s"], 1),
        "sps": summary.get("sps"),
        "final_vs_random": final,
        "final_vs_random_greedy": greedy,
        "final_vs_scripted_greedy": scripted,
        "curve": curve,
        "target": TARGETS[game],
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
    }


def write(results: list[dict[str, Any]], out: Path, stem: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [
        "# Self-play on classic board games vs a uniformly random player",
        "",
        "`python benchmarks/selfplay_games.py` (one agent's move = one env step; seats alternated; the final",
        "checkpoint plays 400 games, intermediate ones fewer).",
        "",
        "| game | env steps | training wall (s) | win | draw | loss | greedy: win / draw / loss "
        "| greedy vs win_or_block / search:2 (win) | target |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        f, g = r["final_vs_random"], r["final_vs_random_greedy"]
        scripted = r.get("final_vs_scripted_greedy") or {}
        versus = " / ".join(
            f"{scripted[k]['win']:.1%}" for k in ("win_or_block", "search:2") if k in scripted
        )
        lines.append(
            f"| {r['env_id']} | {r['env_steps']:,} | {r['train_wall_s']} | {f['win']:.1%} | {f['draw']:.1%} "
            f"| {f['loss']:.1%} | {g['win']:.1%} / {g['draw']:.1%} / {g['loss']:.1%} | {versus or 'n/a'} "
            f"| {r['target']} |"
        )
    for r in results:  # the curve against win_or_block, where measured: when the 60% target is first met
        wb = [c for c in r["curve"] if "greedy_vs_win_or_block" in c]
        if wb:
            points = ", ".join(
                f"{c['step'] / 1e6:.2f}M: {c['greedy_vs_win_or_block']:.0%}"
                + (f" ({c['wall_s']:.0f} s)" if c.get("wall_s") is not None else "")
                for c in wb
            )
            lines += ["", f"{r['env_id']}, greedy games won against win_or_block along training "
                      f"(env steps: win rate (training wall)): {points}."]  # fmt: skip
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.5), squeeze=False)
    for ax, r in zip(axes[0], results, strict=True):
        steps = [c["step"] for c in r["curve"]]
        ax.plot(steps, [c["win"] for c in r["curve"]], marker="o", label="win")
        ax.plot(steps, [c["loss"] for c in r["curve"]], marker="x", label="loss")
        wb = [(c["step"], c["greedy_vs_win_or_block"]) for c in r["curve"] if "greedy_vs_win_or_block" in c]
        if wb:
            ax.plot(*zip(*wb, strict=True), marker="s", label="greedy win vs win_or_block")
            ax.axhline(0.6, color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"{r['env_id']} vs random" + (" and win_or_block" if wb else ""))
        ax.set_xlabel("env steps (moves)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", choices=sorted(GAMES), action="append")
    parser.add_argument("--steps", type=int, default=None, help="algo.total_steps (default: the recipe's)")
    parser.add_argument("--games", type=int, default=400)
    parser.add_argument("--curve-games", type=int, default=100)
    parser.add_argument("--checkpoints", type=int, default=10, help="points on the win-rate curve")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--stem", default="selfplay_games", help="output file names (json, md, png)")
    parser.add_argument("overrides", nargs="*", help="extra config overrides for the training runs")
    args = parser.parse_args()
    results = []
    for game in args.only or list(GAMES):
        results.append(run_game(game, args))
        r = results[-1]
        print(f"{game}: {r['env_steps']:,} steps, {r['train_wall_s']} s, vs random {r['final_vs_random']}")
    write(results, args.out, args.stem)


if __name__ == "__main__":
    main()
