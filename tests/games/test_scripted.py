"""The scripted Connect Four players (`games/scripted.py`): the board read from PettingZoo's observation, the
line test, the win and the block by hand, and their strength in real games against each other."""

from __future__ import annotations

import numpy as np
import pytest

from ppo_fabric.games.play import WIN, RandomPlayer, aec_env_factory, play_games
from ppo_fabric.games.scripted import (
    SearchPlayer,
    WinOrBlockPlayer,
    connected_four,
    position,
    winning_columns,
)
from ppo_fabric.policy.game_eval import GameEvalError, scripted_player

GAME = "pettingzoo.classic.connect_four_v3"


def board(mine: list[tuple[int, int]], theirs: list[tuple[int, int]]) -> np.ndarray:
    """An observation with pieces at (column, row from the bottom)."""
    obs = np.zeros((6, 7, 2), dtype=np.int8)
    for plane, cells in ((0, mine), (1, theirs)):
        for col, row in cells:
            obs[5 - row, col, plane] = 1
    return obs


def test_position_reads_planes_columns_and_heights() -> None:
    mine, theirs, heights = position(board([(3, 0), (3, 2)], [(3, 1), (0, 0)]))
    assert heights == [1, 0, 0, 3, 0, 0, 0]
    assert mine == (1 << (3 * 7)) | (1 << (3 * 7 + 2))  # 7 bits per column, bit 0 at the bottom
    assert theirs == (1 << (3 * 7 + 1)) | 1


@pytest.mark.parametrize(
    "cells",
    [
        [(0, 0), (0, 1), (0, 2), (0, 3)],  # vertical
        [(2, 0), (3, 0), (4, 0), (5, 0)],  # horizontal
        [(0, 0), (1, 1), (2, 2), (3, 3)],  # rising
        [(3, 0), (2, 1), (1, 2), (0, 3)],  # falling
    ],
)
def test_four_in_a_line_and_no_wrap(cells: list[tuple[int, int]]) -> None:
    mine, _, _ = position(board(cells, []))
    assert connected_four(mine)
    assert not connected_four(position(board(cells[:3], []))[0])
    # the top of one column and the bottom of the next are not a line
    wrapped, _, _ = position(board([(0, 4), (0, 5), (1, 0), (1, 1)], []))
    assert not connected_four(wrapped)


def test_win_or_block_wins_first_then_blocks() -> None:
    player = WinOrBlockPlayer(seed=0)
    both = board([(0, 0), (0, 1), (0, 2)], [(6, 0), (6, 1), (6, 2)])  # each side threatens a column
    assert winning_columns(position(both)[0], position(both)[2]) == [0]
    assert player(both, np.ones(7, dtype=bool)) == 0  # its own win beats the block
    threat = board([(0, 0)], [(2, 0), (3, 0), (4, 0)])  # the opponent wins at 1 or 5: it blocks one
    assert player(threat, np.ones(7, dtype=bool)) in (1, 5)
    mask = np.ones(7, dtype=bool)
    mask[1] = False  # a block the mask forbids is not played
    assert player(threat, mask) == 5


def test_search_sees_a_double_threat_the_blocker_does_not() -> None:
    """Mover to play: column 2 (or 5) makes an open three on the bottom row with both ends free, which a
    depth-3 search sees win whatever the reply; the blocker has no threat to answer and plays at random."""
    obs = board([(3, 0), (4, 0)], [(3, 1), (4, 1)])
    move = SearchPlayer(depth=3, seed=0)(obs, np.ones(7, dtype=bool))
    assert move in (2, 5)


@pytest.mark.parametrize(
    ("first", "second", "at_least"),
    [
        (lambda: WinOrBlockPlayer(1), lambda: RandomPlayer(2), 0.8),
        (lambda: SearchPlayer(2, 1), lambda: WinOrBlockPlayer(2), 0.7),
    ],
    ids=["win_or_block-vs-random", "search2-vs-win_or_block"],
)
def test_stronger_players_win_real_games(first, second, at_least: float) -> None:  # type: ignore[no-untyped-def]
    results = play_games(aec_env_factory(GAME), first(), second(), 40, seed=0)
    assert results.illegal_moves == 0
    assert results.rate(WIN) >= at_least, results.summary()


def test_evaluate_names_them_and_refuses_other_games() -> None:
    assert isinstance(scripted_player("win_or_block", "connect_four_v3", 0), WinOrBlockPlayer)
    assert scripted_player("search:3", "pettingzoo.classic.connect_four_v3", 0).depth == 3
    assert scripted_player("search", "connect_four_v3", 0).depth == 2
    with pytest.raises(GameEvalError, match="connect_four_v3 only"):
        scripted_player("win_or_block", "pettingzoo.classic.tictactoe_v3", 0)
    with pytest.raises(GameEvalError, match="depth"):
        scripted_player("search:x", "connect_four_v3", 0)


def test_the_held_out_variants_prefer_the_centre_and_give_nothing_away() -> None:
    """`win_or_block:centre` takes the free column nearest the centre; `win_or_block:careful` does too, but
    not under a cell where the opponent would then win (its three on row 1 waits for (3, 1))."""
    empty = board([], [])
    centre = scripted_player("win_or_block:centre", "connect_four_v3", 0)
    assert {centre(empty, np.ones(7, dtype=bool)) for _ in range(5)} == {3}
    mask = np.ones(7, dtype=bool)
    mask[3] = False
    assert centre(empty, mask) in (2, 4)
    trap = board([(0, 0), (1, 0), (5, 0), (6, 0)], [(0, 1), (1, 1), (2, 1)])  # theirs wins at (3, 1)
    assert centre(trap, np.ones(7, dtype=bool)) == 3, "the plain centre player walks into it"
    careful = scripted_player("win_or_block:careful", "connect_four_v3", 0)
    assert {careful(trap, np.ones(7, dtype=bool)) for _ in range(5)} <= {2, 4}
