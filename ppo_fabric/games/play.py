"""Two-player turn-based games (PettingZoo AEC: `tictactoe_v3`, `connect_four_v3`, ...) played out to a
result: win / draw / loss rates of one player against another over N games with seats alternated.

`play_games` steps the AEC env directly (`agent_iter` / `last` / `step`), so it needs nothing of the
training loop: `python -m ppo_fabric.evaluate ... opponent=...` calls it, and so can self-play to rate
snapshots (`elo.EloRater`). A player is any callable `(observation, action_mask) -> action` taking the
acting agent's observation (the `observation` entry of PettingZoo's `{"observation", "action_mask"}`
dict, or the whole observation when it has no mask) and the legal-move mask (bool array, or None); a
player with a `new_game(seed)` method hears of each new game (a recurrent policy clears its state there).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ppo_fabric.config import faults
from ppo_fabric.wire.progress import PROGRESS

ACTION_MASK = "action_mask"
OBSERVATION = "observation"
WIN, DRAW, LOSS = 1, 0, -1


class Player(Protocol):
    def __call__(self, observation: Any, mask: np.ndarray | None) -> int: ...


@dataclass
class GameResults:
    """Outcomes from `first`'s side: `outcomes[i]` is WIN/DRAW/LOSS of game i, `first_seats[i]` the seat
    (0 = the agent that moves first) `first` held in it."""

    outcomes: list[int] = field(default_factory=list)
    first_seats: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    illegal_moves: int = 0  # games lost by a move outside the mask

    @property
    def games(self) -> int:
        return len(self.outcomes)

    def rate(self, outcome: int) -> float:
        return sum(o == outcome for o in self.outcomes) / max(1, self.games)

    def seat_win_rate(self, seat: int) -> float | None:
        """The share of the games `first` won from `seat` (0: moving first); None when it never held it.
        A game's first move is worth a lot (Connect Four is a first-player win): a policy that wins every
        game it opens and none it answers scores 50% overall, which only the two seats' rates tell apart."""
        won = [o == WIN for o, s in zip(self.outcomes, self.first_seats, strict=True) if s == seat]
        return float(np.mean(won)) if won else None

    def extend(self, other: GameResults) -> None:
        """Add another series' games (several opponents pooled into one record)."""
        self.outcomes += other.outcomes
        self.first_seats += other.first_seats
        self.lengths += other.lengths
        self.illegal_moves += other.illegal_moves

    @property
    def score(self) -> float:
        """Mean score of `first` (win 1, draw 1/2, loss 0): what Elo ratings are fitted to."""
        return (self.rate(WIN) + 0.5 * self.rate(DRAW)) if self.games else 0.5

    def summary(self) -> dict[str, Any]:
        return {
            "games": self.games,
            "win_rate": self.rate(WIN),
            "draw_rate": self.rate(DRAW),
            "loss_rate": self.rate(LOSS),
            "score": self.score,
            "mean_length": float(np.mean(self.lengths)) if self.lengths else 0.0,
            "illegal_moves": self.illegal_moves,
            "win_rate_moving_first": self.seat_win_rate(0),
            "win_rate_moving_second": self.seat_win_rate(1),
        }


def aec_env_factory(env_id: str, kwargs: dict[str, Any] | None = None) -> Callable[[], Any]:
    """A factory of the AEC env `env_id` names: a module with `env(**kwargs)` (PettingZoo's convention,
    e.g. `pettingzoo.classic.tictactoe_v3`) or `module:factory`. Raises ValueError (one line)."""
    module_name, _, attr = env_id.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"env.id={env_id!r}: cannot import module {module_name!r} ({exc})") from exc
    factory = getattr(module, attr or "env", None)
    if not callable(factory):
        raise ValueError(f"env.id={env_id!r}: module {module_name!r} has no {attr or 'env'}() (an AEC game)")
    return lambda: factory(**(kwargs or {}))


def aec_mask_width(env_id: str, kwargs: dict[str, Any] | None = None) -> int | None:
    """The action-mask width of a two-player AEC game whose observations carry an `action_mask` (all its
    agents share it), or None when `env_id` is no such game. Raises ImportError when its module (or one
    it needs) is not installed: the width is unknown, not absent."""
    try:
        factory = aec_env_factory(env_id, kwargs)
    except ValueError as exc:  # no env(): not a game; a module that does not import: unknown
        if isinstance(exc.__cause__, ImportError):
            raise ImportError(str(exc)) from exc
        return None
    try:
        env = factory()
    except ImportError:
        raise
    except Exception:  # it does not build as a game: not one
        return None
    try:
        if not hasattr(env, "agent_iter"):
            return None
        space = env.observation_space(env.possible_agents[0])
        spaces = getattr(space, "spaces", None)
        if not isinstance(spaces, dict) or ACTION_MASK not in spaces:
            return None
        return int(np.prod(spaces[ACTION_MASK].shape))
    finally:
        env.close()


def split_observation(obs: Any) -> tuple[Any, np.ndarray | None]:
    """(what a policy observes, legal-move mask) from one AEC observation."""
    if isinstance(obs, dict) and ACTION_MASK in obs:
        mask = np.asarray(obs[ACTION_MASK], dtype=bool)
        rest = {k: v for k, v in obs.items() if k != ACTION_MASK}
        return (rest[OBSERVATION] if list(rest) == [OBSERVATION] else rest), mask
    return obs, None


def play_games(
    env_factory: Callable[[], Any], first: Player, second: Player, n_games: int, seed: int = 0
) -> GameResults:
    """Play `n_games` games of `first` against `second` and return the results from `first`'s side.

    Seats alternate: in even games `first` takes seat 0 (the agent that moves first), in odd games seat 1,
    so neither player profits from the first move more often. Game i resets the env with `seed + i`.
    A game is won by the player whose return (its rewards summed over the game) is higher. An illegal
    move (outside the mask: a policy trained without masks) loses the game on the spot, as PettingZoo's
    classic games rule, and is counted in `illegal_moves` so it never passes unnoticed.
    A game with no end of its own stops after `faults.EVAL_MAX_EPISODE_STEPS` moves, scored as it stands.
    """
    if n_games <= 0:
        raise ValueError(f"n_games={n_games} must be > 0")
    env = env_factory()
    results = GameResults()
    try:
        for game in range(n_games):
            env.reset(seed=seed + game)
            seats = list(env.possible_agents)
            if len(seats) != 2:
                raise ValueError(f"play_games needs a two-player game; this one has agents {seats}")
            first_seat = game % 2
            players = {seats[first_seat]: first, seats[1 - first_seat]: second}
            for player in players.values():
                if hasattr(player, "new_game"):
                    player.new_game(seed + game)
            returns = dict.fromkeys(seats, 0.0)
            moves, forfeit = 0, None
            for agent in env.agent_iter():
                if (
                    moves >= faults.EVAL_MAX_EPISODE_STEPS
                ):  # a game with no end of its own: scored as it stands
                    break
                PROGRESS.mark("game move")  # the stall watchdog's heartbeat (evaluation during training)
                obs, reward, terminated, truncated, _ = env.last()
                returns[agent] += float(reward)
                if terminated or truncated:
                    env.step(None)
                    continue
                observation, mask = split_observation(obs)
                action = int(players[agent](observation, mask))
                if mask is not None and not (0 <= action < len(mask) and mask[action]):
                    forfeit = agent
                    break
                env.step(action)
                moves += 1
            mine, theirs = returns[seats[first_seat]], returns[seats[1 - first_seat]]
            if forfeit is not None:
                results.illegal_moves += 1
                mine, theirs = (-1.0, 1.0) if forfeit == seats[first_seat] else (1.0, -1.0)
            results.outcomes.append(WIN if mine > theirs else LOSS if mine < theirs else DRAW)
            results.first_seats.append(first_seat)
            results.lengths.append(moves)
    finally:
        env.close()
    return results


# --------------------------------------------------------------------------------------------- players
class RandomPlayer:
    """Uniform over the legal moves (over all moves of a Discrete space when there is no mask)."""

    def __init__(self, seed: int = 0, n_actions: int | None = None) -> None:
        self.rng = np.random.default_rng(seed)
        self.n_actions = n_actions

    def __call__(self, observation: Any, mask: np.ndarray | None) -> int:
        if mask is None:
            if self.n_actions is None:
                raise ValueError("a random player needs the action mask or n_actions")
            return int(self.rng.integers(self.n_actions))
        return int(self.rng.choice(np.flatnonzero(mask)))


def first_legal_player(observation: Any, mask: np.ndarray | None) -> int:
    """Always the lowest-numbered legal move: a fixed, weak but not random strategy (tests, baselines)."""
    return 0 if mask is None else int(np.flatnonzero(mask)[0])


class PolicyPlayer:
    """An `ActorCritic` as a player: its observation as a batch of one, the recurrent state carried through
    the game and cleared per game. `masked`: the policy was trained with masks, so it gets the mask as its
    action mask; otherwise it observed the whole `{"observation", "action_mask"}` dict and gets that.
    Inputs go to the device the policy is on (a self-play loop may rate a snapshot on its GPU); sampled
    moves (deterministic=False) draw from torch's global generator."""

    def __init__(self, agent: Any, deterministic: bool = True, masked: bool = True) -> None:
        self.agent = agent
        self.device = next(agent.parameters()).device
        self.deterministic = deterministic
        self.masked = masked
        self.state = None

    def new_game(self, seed: int) -> None:
        self.state = None  # act_with_state starts from zeros

    def __call__(self, observation: Any, mask: np.ndarray | None) -> int:
        import torch

        from ppo_fabric.models.agent import single_obs_batch

        masks: tuple[Any, ...] = ()
        if mask is not None and self.masked:
            # PettingZoo's own masks are int8: a player someone drives from `env.last()` takes them as they are
            masks = (torch.as_tensor(mask, dtype=torch.bool, device=self.device).unsqueeze(0),)
        elif mask is not None:
            observation = {OBSERVATION: observation, ACTION_MASK: mask.astype(np.int8)}
        with torch.inference_mode():
            action, _, _, self.state = self.agent.act_with_state(
                single_obs_batch(observation).to(self.device), self.state, self.deterministic, *masks
            )
        return int(action[0])
