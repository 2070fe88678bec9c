"""Scripted Connect Four players that think, for measuring a self-play policy against more than chance.

A random player loses to almost anything; these two do not:

- `WinOrBlockPlayer`: takes a winning move when it has one, else blocks the opponent's winning move, else
  plays a random legal move. A policy that ignores threats loses to it quickly.
- `SearchPlayer(depth)`: negamax with alpha-beta pruning `depth` plies deep (wins found at any depth, a
  heuristic of open lines at the horizon), centre columns first, ties broken at random.

Both take PettingZoo `connect_four_v3` observations as `games.play` hands them: [6, 7, 2], plane 0 the
mover's pieces, plane 1 the opponent's, row 5 the bottom. Positions are bitboards (the classic Connect Four
layout: 7 bits per column, bit 0 the bottom cell, the top bit of each column always empty), so a search of
depth 4 takes milliseconds in plain Python.

`scripted_player(name, seed)` builds one by the name `evaluate opponent=` and `selfplay.scripted` take.
"""

from __future__ import annotations

from typing import Any

import numpy as np

ROWS, COLS = 6, 7
HEIGHT = ROWS + 1  # bits per column: the extra top bit keeps lines from wrapping between columns
BOARD = (ROWS, COLS, 2)  # the observation these players read: the mover's pieces, then the opponent's
CENTRE_FIRST = (3, 2, 4, 1, 5, 0, 6)
WIN = 1_000_000


def _bit(col: int, row: int) -> int:
    return 1 << (col * HEIGHT + row)


def _windows() -> tuple[int, ...]:
    """Every line of four cells on the board (69), as bitmasks."""
    found = []
    for col in range(COLS):
        for row in range(ROWS):
            for dc, dr in ((1, 0), (0, 1), (1, 1), (1, -1)):
                cells = [(col + k * dc, row + k * dr) for k in range(4)]
                if all(0 <= c < COLS and 0 <= r < ROWS for c, r in cells):
                    mask = 0
                    for c, r in cells:
                        mask |= _bit(c, r)
                    found.append(mask)
    return tuple(found)


WINDOWS = _windows()
LINE_VALUE = (0, 1, 8, 64)  # a line holding 1, 2 or 3 of one side's pieces and none of the other's


def connected_four(board: int) -> bool:
    """Whether the pieces of `board` hold four in a line (vertical, horizontal, both diagonals)."""
    for shift in (1, HEIGHT, HEIGHT - 1, HEIGHT + 1):
        pairs = board & (board >> shift)
        if pairs & (pairs >> (2 * shift)):
            return True
    return False


def position(observation: Any) -> tuple[int, int, list[int]]:
    """(the mover's bitboard, the opponent's, the number of pieces in each column) of an observation."""
    planes = np.asarray(observation)
    if planes.shape != BOARD:
        raise ValueError(f"a Connect Four observation is {list(BOARD)}, got {list(planes.shape)}")
    mine = theirs = 0
    heights = [0] * COLS
    for col in range(COLS):
        for row in range(ROWS):
            r = ROWS - 1 - row  # observation rows run top to bottom
            if planes[r, col, 0]:
                mine |= _bit(col, row)
            elif planes[r, col, 1]:
                theirs |= _bit(col, row)
            else:
                continue
            heights[col] = row + 1
    return mine, theirs, heights


def winning_columns(board: int, heights: list[int]) -> list[int]:
    """The columns where dropping a piece of `board` completes four."""
    return [c for c in range(COLS) if heights[c] < ROWS and connected_four(board | _bit(c, heights[c]))]


def evaluate(mine: int, theirs: int) -> int:
    """Open lines at the search horizon: each line only one side occupies counts for that side."""
    score = 0
    for window in WINDOWS:
        m, t = mine & window, theirs & window
        if m and not t:
            score += LINE_VALUE[m.bit_count()]
        elif t and not m:
            score -= LINE_VALUE[t.bit_count()]
    return score


def negamax(mine: int, theirs: int, heights: list[int], depth: int, alpha: int, beta: int) -> int:
    """The value of the position for the mover, `depth` plies deep (a win sooner is worth more)."""
    if winning_columns(mine, heights):
        return WIN + depth
    moves = [c for c in CENTRE_FIRST if heights[c] < ROWS]
    if not moves:
        return 0  # a full board: a draw
    if depth == 0:
        return evaluate(mine, theirs)
    best = -WIN * 2
    for col in moves:
        move = _bit(col, heights[col])
        heights[col] += 1
        value = -negamax(theirs, mine | move, heights, depth - 1, -beta, -alpha)
        heights[col] -= 1
        best = max(best, value)
        alpha = max(alpha, value)
        if alpha >= beta:
            break
    return best


def _legal(mask: np.ndarray | None, heights: list[int]) -> list[int]:
    return [c for c in range(COLS) if heights[c] < ROWS and (mask is None or mask[c])]


NAMES = "win_or_block[:centre|:careful] or search[:DEPTH] (DEPTH 1-6, default 2)"
GAMES = ("connect_four",)  # the games these players know (a substring of env.id)


class WinOrBlockPlayer:
    """Win now if it can, else block the opponent's immediate win, else a random legal move.

    Its two variants (`win_or_block:centre`, `win_or_block:careful`) are players a self-play recipe that
    spars with the plain one never meets, to tell whether it learned the game or its partner: `centre`
    picks the legal column nearest the centre instead of a random one (ties at random), `careful` does too
    and never drops a piece under a cell where the opponent would then win (unless every move does).
    """

    def __init__(self, seed: int = 0, centre: bool = False, careful: bool = False) -> None:
        self.rng = np.random.default_rng(seed)  # a self-play run saves and restores its state
        self.centre = centre or careful
        self.careful = careful

    def __call__(self, observation: Any, mask: np.ndarray | None) -> int:
        mine, theirs, heights = position(observation)
        legal = _legal(mask, heights)
        for board in (mine, theirs):  # my win first, then the block
            columns = [c for c in winning_columns(board, heights) if c in legal]
            if columns:
                return int(columns[0])
        if self.careful:
            legal = [c for c in legal if not _gives_away(theirs, heights, c)] or legal
        if self.centre:
            nearest = min(abs(c - COLS // 2) for c in legal)
            legal = [c for c in legal if abs(c - COLS // 2) == nearest]
        return int(self.rng.choice(legal))


def _gives_away(theirs: int, heights: list[int], col: int) -> bool:
    """Whether a piece dropped in `col` lets the opponent win on the cell above it."""
    if heights[col] + 1 >= ROWS:
        return False
    return connected_four(theirs | _bit(col, heights[col] + 1))


class SearchPlayer:
    """The best move of a `depth`-ply negamax search; among equally good moves, one at random."""

    def __init__(self, depth: int = 2, seed: int = 0) -> None:
        if depth < 1:
            raise ValueError(f"a search player needs depth >= 1, got {depth}")
        self.depth = depth
        self.rng = np.random.default_rng(seed)

    def __call__(self, observation: Any, mask: np.ndarray | None) -> int:
        mine, theirs, heights = position(observation)
        legal = _legal(mask, heights)
        wins = [c for c in winning_columns(mine, heights) if c in legal]
        if wins:
            return int(wins[0])
        values = {}
        for col in legal:
            move = _bit(col, heights[col])
            heights[col] += 1
            values[col] = -negamax(theirs, mine | move, heights, self.depth - 1, -WIN * 2, WIN * 2)
            heights[col] -= 1
        top = max(values.values())
        return int(self.rng.choice([c for c, v in values.items() if v == top]))


def scripted_player(name: str, seed: int = 0) -> WinOrBlockPlayer | SearchPlayer:
    """`win_or_block[:centre|:careful]` or `search[:DEPTH]` (default depth 2); ValueError with a one-line
    message otherwise."""
    kind, _, depth = name.partition(":")
    if name == "win_or_block":
        return WinOrBlockPlayer(seed)
    if name in ("win_or_block:centre", "win_or_block:careful"):
        return WinOrBlockPlayer(seed, centre=True, careful=depth == "careful")
    if kind == "search" and (depth == "" or (depth.isdigit() and 1 <= int(depth) <= 6)):
        return SearchPlayer(int(depth or 2), seed)
    if kind == "search":
        raise ValueError(f"{name}: the search depth is a whole number from 1 to 6")
    raise ValueError(f"{name} is not a scripted player; choose {NAMES}")
