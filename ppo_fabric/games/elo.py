"""Elo ratings of self-play snapshots: a learning curve for zero-sum games, whose return says nothing.

The pure functions follow the Elo model, in which a player rated R_a scores against one rated R_b
on average E = 1 / (1 + 10 ** ((R_b - R_a) / 400)) (win 1, draw 1/2, loss 0):

- `expected_score`: the mean score the model expects of one player against another.
- `fit_rating`: the maximum-likelihood rating of a new player from its games against players whose
  ratings are held fixed (the snapshots rated before it, and the random player, the anchor). Holding the
  old ratings fixed keeps the curve's earlier points where they were logged.

`EloRater` is what a self-play loop calls with each new snapshot and the pool: the snapshot plays a few
games against the random player and the newest earlier snapshots it has rated, within a time budget (a
fraction of the training time, 5% by default), and the fitted rating is returned for logging.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

RANDOM_RATING = 0.0  # the uniformly random player anchors the scale
SCALE = 400.0


def expected_score(rating: float, opponent: float) -> float:
    """The mean score of a player rated `rating` against one rated `opponent`."""
    return 1.0 / (1.0 + 10.0 ** ((opponent - rating) / SCALE))


def fit_rating(
    opponents: Sequence[float], scores: Sequence[float], prior_games: float = 1.0, span: float = 4000.0
) -> float:
    """The rating R that makes the expected total score equal the actual one, sum_i E(R, r_i) = sum_i s_i,
    over games i against opponents rated `r_i` with scores `s_i` (the Elo maximum-likelihood estimate).

    `prior_games` adds that many virtual draws against the opponents' mean rating, so an unbeaten (or
    winless) record gives a finite rating that grows with the number of games rather than infinity.
    Solved by bisection on [min(r) - span, max(r) + span] (the expected total rises with R).
    """
    if len(opponents) != len(scores) or not opponents:
        raise ValueError("fit_rating needs one score per opponent game, and at least one game")
    ratings = list(opponents)
    mean = sum(ratings) / len(ratings)
    target = sum(scores) + 0.5 * prior_games

    def excess(r: float) -> float:
        return sum(expected_score(r, o) for o in ratings) + prior_games * expected_score(r, mean) - target

    lo, hi = min(ratings) - span, max(ratings) + span
    if excess(lo) >= 0:
        return lo
    if excess(hi) <= 0:
        return hi
    for _ in range(100):  # 8000 / 2**100: far below float precision
        mid = 0.5 * (lo + hi)
        if excess(mid) < 0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


# ---------------------------------------------------------------------------------------- budgeted rater
GamesFn = Callable[[Any, Any, int, int], Any]  # (player, opponent, n_games, seed) -> games.GameResults


class EloRater:
    """Rates each new snapshot against the random player and the newest rated earlier snapshots.

    `make_player(weights)` turns a snapshot's state dict into a `games` player; `play(first, second,
    n_games, seed)` returns `games.GameResults` (usually `functools.partial(play_games, env_factory)`).
    Per call of `rate`, the new snapshot plays `games_per_opponent` games (seats alternated) against the
    random player and each of the `opponents` newest snapshots of the pool that already have a rating.

    The budget: when `rate` is told the training time so far, it plays only as many games as keep the
    rater's own total time at most `budget` times that (measured seconds per game), and always at least
    `min_games` against the random player, so each snapshot still gets a (coarser) rating.
    """

    def __init__(
        self,
        make_player: Callable[[Any], Any],
        play: GamesFn,
        random_player: Callable[[int], Any],
        games_per_opponent: int = 20,
        opponents: int = 3,
        budget: float = 0.05,
        min_games: int = 2,
        seed: int = 0,
    ) -> None:
        self.make_player = make_player
        self.play = play
        self.random_player = random_player
        self.games_per_opponent = games_per_opponent
        self.opponents = opponents
        self.budget = budget
        self.min_games = min_games
        self.seed = seed
        self.ratings: dict[int, float] = {}  # snapshot id -> rating
        self.seconds = 0.0  # spent rating, in total
        self.games_played = 0
        self.calls = 0

    def _allowed_games(self, train_seconds: float | None, wanted: int) -> int:
        if train_seconds is None or self.games_played == 0:
            return wanted
        per_game = self.seconds / self.games_played
        spare = self.budget * train_seconds - self.seconds
        return max(self.min_games, min(wanted, int(spare / per_game) if per_game > 0 else wanted))

    def rate(
        self,
        weights: Any,
        pool: Sequence[dict[str, Any]] = (),
        snapshot_id: int | None = None,
        train_seconds: float | None = None,
    ) -> float:
        """The new snapshot's rating (random player = 0); remembered under `snapshot_id` (when given) so
        later snapshots can play against it. `pool`: entries {"id": int, "weights" (or "policy"): state dict},
        as `checkpoint.pool_snapshots` returns them."""
        start = time.perf_counter()
        self.calls += 1
        seed = self.seed + 100_003 * self.calls
        player = self.make_player(weights)
        rated = [s for s in pool if int(s["id"]) in self.ratings and int(s["id"]) != snapshot_id]
        earlier = rated[-self.opponents :] if self.opponents > 0 else []
        wanted = self.games_per_opponent * (1 + len(earlier))
        allowed = self._allowed_games(train_seconds, wanted)
        # the random player first (the anchor), then the newest earlier snapshots, while games remain
        schedule: list[tuple[Any, float]] = [(self.random_player(seed), RANDOM_RATING)]
        for snap in reversed(earlier):
            weights = snap["weights"] if "weights" in snap else snap["policy"]
            schedule.append((self.make_player(weights), self.ratings[int(snap["id"])]))
        opponents: list[float] = []
        scores: list[float] = []
        for i, (opponent, rating) in enumerate(schedule):
            n = min(self.games_per_opponent, allowed - len(scores))
            n -= n % 2 if n > 1 else 0  # even counts: both seats equally often
            if n <= 0:
                break
            results = self.play(player, opponent, n, seed + 1000 * i)
            scores += [(o + 1) / 2 for o in results.outcomes]  # win 1, draw 1/2, loss 0
            opponents += [rating] * results.games
        rating = fit_rating(opponents, scores)
        if snapshot_id is not None:
            self.ratings[int(snapshot_id)] = rating
        self.seconds += time.perf_counter() - start
        self.games_played += len(scores)
        return rating


def policy_rater(
    env_factory: Callable[[], Any],
    obs_space: Any,
    action_space: Any,
    model_cfg: Any,
    masked: bool = True,
    deterministic: bool = False,
    **kwargs: Any,
) -> EloRater:
    """An `EloRater` for snapshots of one `ActorCritic` (state dicts) on the AEC game `env_factory` makes.
    Players sample their moves by default: two greedy snapshots would replay the same two games."""
    from functools import partial

    from ppo_fabric.games.play import PolicyPlayer, RandomPlayer, play_games
    from ppo_fabric.models.agent import ActorCritic

    def make_player(weights: Any) -> PolicyPlayer:
        net = ActorCritic(obs_space, action_space, model_cfg)
        net.load_state_dict(weights)
        return PolicyPlayer(net.eval(), deterministic=deterministic, masked=masked)

    return EloRater(make_player, partial(play_games, env_factory), RandomPlayer, **kwargs)
