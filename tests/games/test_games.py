"""`games.play_games` on PettingZoo's tictactoe_v3 (AEC), stepped directly: rates, seat alternation,
legal moves only, and a scripted player whose results against random are known."""

from __future__ import annotations

import numpy as np
import pytest

from ppo_fabric.games.play import (
    LOSS,
    WIN,
    GameResults,
    RandomPlayer,
    aec_env_factory,
    first_legal_player,
    play_games,
)

TICTACTOE = aec_env_factory("pettingzoo.classic.tictactoe_v3")


class Recorder:
    """Wraps a player and records every mask it saw and move it made."""

    def __init__(self, player) -> None:
        self.player, self.moves = player, []

    def new_game(self, seed: int) -> None:
        self.moves.append([])

    def __call__(self, observation, mask):
        action = self.player(observation, mask)
        self.moves[-1].append((observation.copy(), mask.copy(), action))
        return action


def test_random_against_random() -> None:
    first, second = Recorder(RandomPlayer(1)), Recorder(RandomPlayer(2))
    results = play_games(TICTACTOE, first, second, 40, seed=3)
    summary = results.summary()
    assert results.games == 40 and summary["games"] == 40
    assert summary["win_rate"] + summary["draw_rate"] + summary["loss_rate"] == pytest.approx(1.0)
    assert results.first_seats == [0, 1] * 20  # seats alternated
    # seat 0 moves first: `first` opens in even games, `second` in odd ones
    for game in range(40):
        opener = first if game % 2 == 0 else second
        other = second if game % 2 == 0 else first
        assert not opener.moves[game][0][0].any()  # an empty board
        assert len(opener.moves[game]) in (len(other.moves[game]), len(other.moves[game]) + 1)
        assert results.lengths[game] == len(opener.moves[game]) + len(other.moves[game])
    for recorder in (first, second):
        assert all(mask[action] for game in recorder.moves for _, mask, action in game)
    # random play: the opener wins tictactoe more often than not; both outcomes occur
    assert {WIN, LOSS} <= set(results.outcomes) and results.illegal_moves == 0
    again = play_games(TICTACTOE, RandomPlayer(1), RandomPlayer(2), 40, seed=3)
    assert again.outcomes == results.outcomes  # seeded


def test_first_legal_move_against_itself_by_hand() -> None:
    """Cells are numbered 0..8; the opener takes 0, 2, 4, 6 and the other 1, 3, 5 (3-4-5 is blocked at 4):
    2-4-6 is a line, so the opener wins on the 7th move, whichever seat `first` holds."""
    results = play_games(TICTACTOE, first_legal_player, first_legal_player, 4, seed=0)
    assert results.outcomes == [WIN, LOSS, WIN, LOSS] and results.lengths == [7] * 4
    summary = results.summary()  # every game it opens, none it answers: the seats tell what 50% hides
    assert summary["win_rate"] == 0.5
    assert (summary["win_rate_moving_first"], summary["win_rate_moving_second"]) == (1.0, 0.0)
    pooled = GameResults()
    pooled.extend(results)
    pooled.extend(play_games(TICTACTOE, first_legal_player, first_legal_player, 1, seed=0))
    assert pooled.games == 5 and pooled.seat_win_rate(0) == 1.0 and pooled.seat_win_rate(1) == 0.0
    assert GameResults().seat_win_rate(0) is None  # no game from that seat: no rate


def test_first_legal_move_against_random() -> None:
    """Random rarely blocks the opener's 2-4-6 line, so the scripted player wins more than it loses, more
    often when it moves first; every game has exactly one result."""
    results = play_games(TICTACTOE, first_legal_player, RandomPlayer(0), 100, seed=0)
    s = results.summary()
    assert s["win_rate"] + s["draw_rate"] + s["loss_rate"] == pytest.approx(1.0)
    opening = [o for o, seat in zip(results.outcomes, results.first_seats, strict=True) if seat == 0]
    replying = [o for o, seat in zip(results.outcomes, results.first_seats, strict=True) if seat == 1]
    # moving first, cells 0,1,2 complete a line unless random blocks: it wins more often than moving second
    assert np.mean([o == WIN for o in opening]) > np.mean([o == WIN for o in replying])
    assert s["win_rate"] > s["loss_rate"] and results.illegal_moves == 0


def test_illegal_move_loses_the_game() -> None:
    results = play_games(TICTACTOE, lambda obs, mask: 4, RandomPlayer(0), 4, seed=0)
    assert results.illegal_moves > 0 and LOSS in results.outcomes


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="n_games"):
        play_games(TICTACTOE, first_legal_player, first_legal_player, 0)
    with pytest.raises(ValueError, match="cannot import"):
        aec_env_factory("no_such_module_xyz.game")
