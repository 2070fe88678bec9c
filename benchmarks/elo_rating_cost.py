"""What rating one self-play snapshot costs: seconds per game of a policy player against the random player
and against another snapshot, on tictactoe_v3 and connect_four_v3, with the default MLP policy (64x64).

`elo.EloRater` keeps its total time within `budget` (5%) of the training time by playing fewer games when
it must; this measures the per-game cost that budget is spent on, and what one full rating (20 games
against random and against each of 3 earlier snapshots, 80 games) takes. A self-play run that snapshots
every K updates stays within 5% at full rating when one rating costs at most 5% of K updates' time.
Writes benchmarks/results/elo_rating_cost.{json,md}.

    .venv/bin/python benchmarks/elo_rating_cost.py
    .venv/bin/python benchmarks/elo_rating_cost.py --games 40 --out /tmp/elo   # smoke test elsewhere
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

from ppo_fabric.agent import ActorCritic
from ppo_fabric.config import compose
from ppo_fabric.elo import policy_rater
from ppo_fabric.games import PolicyPlayer, RandomPlayer, aec_env_factory, play_games

GAMES = {
    "tictactoe_v3": ((3, 3, 2), 9),
    "connect_four_v3": ((6, 7, 2), 7),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--games", type=int, default=200)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = compose([])[0].model
    rows = {}
    for name, (shape, n) in GAMES.items():
        factory = aec_env_factory(f"pettingzoo.classic.{name}")
        obs_space, action_space = gym.spaces.Box(0, 1, shape, np.int8), gym.spaces.Discrete(n)
        nets = [ActorCritic(obs_space, action_space, model).eval() for _ in range(2)]
        row = {}
        for label, opponent in (
            ("vs_random", RandomPlayer(1)),
            ("vs_snapshot", PolicyPlayer(nets[1], deterministic=False)),
        ):
            start = time.perf_counter()
            results = play_games(factory, PolicyPlayer(nets[0], deterministic=False), opponent, args.games, 0)
            seconds = time.perf_counter() - start
            row[label] = {
                "games": results.games,
                "seconds_per_game": seconds / results.games,
                "moves_per_game": float(np.mean(results.lengths)),
            }
        rater = policy_rater(factory, obs_space, action_space, model, games_per_opponent=20, opponents=3)
        pool = [{"id": i, "weights": nets[i % 2].state_dict()} for i in range(4)]
        for snap in pool[:3]:
            rater.rate(snap["weights"], pool, snapshot_id=snap["id"])
        start = time.perf_counter()
        played = rater.games_played
        rating = rater.rate(pool[3]["weights"], pool, snapshot_id=3)
        row["full_rating"] = {
            "games": rater.games_played - played,
            "seconds": time.perf_counter() - start,
            "rating": rating,
        }
        rows[name] = row
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "games": args.games,
        "threads": 1,
        "cpus": os.cpu_count(),
        "load": os.getloadavg(),
        "results": rows,
    }
    (out / "elo_rating_cost.json").write_text(json.dumps(record, indent=2))
    lines = [
        "# Cost of rating a self-play snapshot (1 thread, default MLP)",
        "",
        f"load average at the end: {record['load'][0]:.1f} on {record['cpus']} cores",
        "",
        "| game | s/game vs random | s/game vs snapshot | moves/game | full rating (games, s) |",
        "|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        lines.append(
            f"| {name} | {row['vs_random']['seconds_per_game'] * 1e3:.1f} ms | "
            f"{row['vs_snapshot']['seconds_per_game'] * 1e3:.1f} ms | {row['vs_snapshot']['moves_per_game']:.1f} | "
            f"{row['full_rating']['games']}, {row['full_rating']['seconds']:.2f} s |"
        )
    (out / "elo_rating_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
