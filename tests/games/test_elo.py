"""Elo ratings: the expected score and the fitted rating against hand-computed values, and the
budgeted rater on tictactoe with scripted players whose strength order is known."""

from __future__ import annotations

import math
from functools import partial

import pytest

from ppo_fabric.games import elo
from ppo_fabric.games.play import RandomPlayer, aec_env_factory, first_legal_player, play_games


def test_expected_score_by_hand() -> None:
    assert elo.expected_score(1000, 1000) == 0.5
    # 400 points ahead: 1 / (1 + 10**-1) = 10/11
    assert elo.expected_score(1400, 1000) == pytest.approx(10 / 11)
    assert elo.expected_score(1000, 1400) == pytest.approx(1 / 11)


def test_fit_rating_by_hand() -> None:
    # scoring 3/4 against a 1000 player: E = 3/4 <=> R = 1000 + 400 log10(3)
    assert elo.fit_rating([1000] * 4, [1, 1, 1, 0], prior_games=0) == pytest.approx(
        1000 + 400 * math.log10(3), abs=1e-6
    )
    # with one virtual draw: 3.5 of 5 -> R = 1000 + 400 log10(0.7 / 0.3)
    assert elo.fit_rating([1000] * 4, [1, 1, 1, 0]) == pytest.approx(1000 + 400 * math.log10(7 / 3), abs=1e-6)
    # even results against 800 and 1200 sit at 1000 by symmetry
    assert elo.fit_rating([800, 1200], [0.5, 0.5]) == pytest.approx(1000, abs=1e-6)
    # unbeaten: finite, and higher the more games were won
    assert 0 < elo.fit_rating([0] * 4, [1] * 4) < elo.fit_rating([0] * 16, [1] * 16) < 4000


def test_rater_orders_players_and_keeps_to_its_budget() -> None:
    """Snapshots are names of scripted players: 'first' (always the first legal move) and 'random'. The
    rater plays each new one against random and the earlier ones it rated."""
    players = {"random": lambda: RandomPlayer(7), "first": lambda: first_legal_player}
    play = partial(play_games, aec_env_factory("pettingzoo.classic.tictactoe_v3"))
    rater = elo.EloRater(lambda w: players[w](), play, RandomPlayer, games_per_opponent=20, opponents=2)
    pool = [{"id": 0, "weights": "random"}]
    r0 = rater.rate("random", pool, snapshot_id=0)
    pool.append({"id": 1, "weights": "first"})
    r1 = rater.rate("first", pool, snapshot_id=1)
    # a random player rates near the random anchor; 'first' beats random (see test_games)
    assert abs(r0) < 150 and r1 > r0 + 50
    assert rater.games_played == 20 + 40 and set(rater.ratings) == {0, 1}
    # a tiny budget: only min_games against the random player
    before = rater.games_played
    rater.rate("random", pool, snapshot_id=2, train_seconds=1e-9)
    assert rater.games_played - before == rater.min_games
