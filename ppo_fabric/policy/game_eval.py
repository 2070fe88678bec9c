"""Evaluation of a two-player turn-based game's policy against an opponent: `python -m ppo_fabric.evaluate
checkpoint=PATH opponent=random|snapshot:PATH|pool games=N`, win / draw / loss rates over N games with seats
alternated, played by `games.play_games`. Kept apart from `evaluate` (episodes and returns) since nothing
here is about returns: players, opponents and results."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


class GameEvalError(ValueError):
    """Input a game evaluation cannot run with; `str()` is one line for the user."""


OPPONENTS = "random, win_or_block[:centre|:careful], search[:DEPTH], snapshot:<checkpoint> or pool"


def is_aec_game(env_id: str) -> bool:
    """Whether `env_id` names a PettingZoo AEC env (module with env(), or module:factory of one)."""
    from ppo_fabric.games.play import aec_env_factory

    try:
        env = aec_env_factory(env_id)()
    except Exception:  # not importable, or needs arguments: not something to suggest games for
        return False
    try:
        return hasattr(env, "agent_iter")
    finally:
        env.close()


def _playing_policy(state: dict[str, Any], policies: dict[str, Any], policy: str | None) -> str:
    if policy is not None:
        if policy not in policies:
            raise GameEvalError(f"policy={policy} is not in this checkpoint (it has {', '.join(policies)})")
        return policy
    trained = ((state["config"].get("multiagent") or {}).get("policies_to_train")) or list(policies)
    return next(p for p in policies if p in trained)


def policy_player(agent: Any, deterministic: bool) -> Any:
    """A policy as a game player: one that observed the whole `{"observation", "action_mask"}` dict (masks
    off in training) gets it whole; one that observed `observation` alone gets the mask as its mask."""
    from ppo_fabric.games.play import ACTION_MASK, PolicyPlayer

    keys = getattr(agent.encoder, "keys", None)  # a Dict observation's keys (MultiEncoder)
    sees_mask = isinstance(keys, list) and ACTION_MASK in keys
    return PolicyPlayer(agent, deterministic, masked=not sees_mask)


def opponent_players(
    opponent: str, state: dict[str, Any], name: str, deterministic: bool, seed: int
) -> list[tuple[str, Any]]:
    """(label, player) of each opponent `opponent=` names; raises GameEvalError for anything else."""
    from ppo_fabric.games.play import RandomPlayer
    from ppo_fabric.runs import checkpoint as ckpt

    if opponent == "random":
        return [("random", RandomPlayer(seed + 1))]
    if opponent.partition(":")[0] in ("win_or_block", "search"):
        return [(opponent, scripted_player(opponent, str(state["config"]["env"]["id"]), seed + 1))]
    if opponent.startswith("snapshot:"):
        path = opponent.partition(":")[2]
        try:
            other_state, others = ckpt.load_policies(path, key="opponent=snapshot:")
        except ValueError as exc:
            raise GameEvalError(str(exc)) from exc
        other_name = name if name in others else next(iter(others)) if len(others) == 1 else None
        if other_name is None:
            raise GameEvalError(f"opponent={opponent} has no policy {name!r} (it has {', '.join(others)})")
        mine, theirs = _spaces(state, name), _spaces(other_state, other_name)
        if mine != theirs:  # another game's (or a gymnasium run's) policy: it cannot play this board
            raise GameEvalError(
                f"opponent={opponent}: its policy {other_name!r} plays observations {theirs[0]} and actions "
                f"{theirs[1]}, not this game's {mine[0]} and {mine[1]}"
            )
        return [(f"snapshot:{path}", policy_player(others[other_name], deterministic))]
    if opponent == "pool":
        pool = ckpt.pool_snapshots(state)
        if not pool:
            raise GameEvalError(
                "opponent=pool: this checkpoint holds no self-play pool (selfplay.enabled=true)"
            )
        obs_spaces, action_spaces = ckpt.saved_spaces(state)
        if state.get("multiagent"):
            obs_spaces, action_spaces = obs_spaces[name], action_spaces[name]
        players = []
        for snap in pool:
            try:
                agent = ckpt.policy_from_weights(snap["weights"], obs_spaces, action_spaces, state, name)
            except ValueError as exc:  # weights of another model, said in one line
                raise GameEvalError(f"opponent=pool: snapshot {snap['id']}: {exc}") from exc
            players.append((f"pool:{snap['id']}", policy_player(agent, deterministic)))
        return players
    raise GameEvalError(f"opponent={opponent} is unknown; choose {OPPONENTS}")


def _spaces(state: dict[str, Any], name: str) -> tuple[Any, Any]:
    """(board space, action space) of a checkpoint's policy `name`: the `observation` part of a game's
    Dict observation, which a policy trained without masks records whole (`policy_player` plays both)."""
    import gymnasium as gym

    from ppo_fabric.runs import checkpoint as ckpt

    obs, action = ckpt.saved_spaces(state)
    obs, action = (obs[name], action[name]) if state.get("multiagent") else (obs, action)
    if isinstance(obs, gym.spaces.Dict) and "observation" in obs.spaces:
        obs = obs["observation"]
    return obs, action


def scripted_player(opponent: str, env_id: str, seed: int) -> Any:
    """`win_or_block` or `search[:DEPTH]` (default depth 2) on Connect Four; GameEvalError otherwise."""
    from ppo_fabric.games import scripted

    try:
        player = scripted.scripted_player(opponent, seed)
    except ValueError as exc:
        raise GameEvalError(f"opponent={exc}") from exc
    if not any(game in env_id for game in scripted.GAMES):
        raise GameEvalError(f"opponent={opponent} plays connect_four_v3 only, not env.id={env_id}")
    return player


def evaluate_games(
    state: dict[str, Any],
    policies: dict[str, Any],
    checkpoint: str | Path,
    opponent: str | None,
    games: int,
    deterministic: bool,
    seed: int,
    policy: str | None,
) -> dict[str, Any]:
    """Win / draw / loss rates of the checkpoint's policy against `opponent` over `games` games on the
    checkpoint's two-player AEC game; with `pool`, the games are shared out evenly among the snapshots.
    Greedy players (deterministic=true) on both sides replay the same two games: sample with
    deterministic=false against a snapshot for a spread of games."""
    from ppo_fabric.games.play import GameResults, aec_env_factory, play_games
    from ppo_fabric.runs import checkpoint as ckpt

    if opponent is None:
        raise GameEvalError(f"policy= chooses who plays a game: set opponent= too ({OPPONENTS})")
    if games <= 0:
        raise GameEvalError(f"games={games} must be > 0")
    env_cfg = state["config"]["env"]
    if env_cfg.get("api") != "pettingzoo":
        raise GameEvalError(
            f"opponent= plays two-player PettingZoo AEC games; env.id={env_cfg['id']} is not one"
        )
    name = _playing_policy(state, policies, policy)
    player = policy_player(policies[name], deterministic)
    opponents = opponent_players(opponent, state, name, deterministic, seed)
    try:
        factory = aec_env_factory(str(env_cfg["id"]), dict(env_cfg.get("kwargs") or {}))
        probe = factory()
        probe.close()
    except Exception as exc:
        raise GameEvalError(f"opponent= needs a two-player AEC game: {exc}") from exc
    if not hasattr(probe, "agent_iter"):
        raise GameEvalError(f"opponent= plays AEC games; env.id={env_cfg['id']} is a Parallel env")
    if games < 2 * len(opponents):
        raise GameEvalError(
            f"games={games} is fewer than 2 per opponent (one from each seat) for {len(opponents)} opponents; "
            f"use games={2 * len(opponents)} or more"
        )
    share = games // len(opponents) // 2 * 2  # an even share each: as many games from each seat
    start = time.perf_counter()
    total = GameResults()
    rows = {}
    for i, (label, other) in enumerate(opponents):
        try:
            results = play_games(factory, player, other, share, seed + i * share)
        except ValueError as exc:
            raise GameEvalError(str(exc)) from exc
        rows[label] = results.summary()
        total.extend(results)
    return {
        "checkpoint": str(ckpt.resolve(checkpoint).resolve()),
        "env_id": str(env_cfg["id"]),
        "env_step": state.get("env_step"),
        "policy": name,
        "opponent": opponent,
        "deterministic": deterministic,
        "seed": seed,
        **total.summary(),
        "opponents": rows,
        "wall_seconds": time.perf_counter() - start,
        "video": None,
    }
