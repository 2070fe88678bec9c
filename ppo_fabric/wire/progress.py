"""Where this process is: the heartbeat the stall watchdog (`runs.watchdog`) reads.

The rollout marks each env step, the update each minibatch step, the run its checkpoints and logs; a
wait on another rank (a message, a collective) is marked as such, so the rank that waits is never taken
for the one that is stuck. A mark is two attribute writes and a clock read (~0.2 us): cheap enough for
every env step. One per process, in the lowest layer, so that every layer can mark without importing the
layer that watches.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path


class Progress:
    """The last time this process made progress, what it was doing, and whether it is waiting on a peer."""

    __slots__ = ("at", "doing", "label", "waiting")

    def __init__(self) -> None:
        self.at = time.monotonic()
        self.doing = "start-up"
        self.waiting = False
        self.label = "rank 0"  # `player rank 1`, `trainer rank 2`: set by the strategy that runs

    def mark(self, doing: str) -> None:
        """Progress: this process is now doing `doing` (`env.step`, `update`, `checkpoint`)."""
        self.at = time.monotonic()
        self.doing = doing
        self.waiting = False

    @contextlib.contextmanager
    def waiting_for(self, what: str, peer: bool = True) -> Iterator[None]:
        """A wait on other ranks (`params from the trainers`): the peer's own watchdog names a stuck peer,
        and a collective that never completes ends with `collectives.timeout`. `peer=False`: a wait on a
        service outside the job (a tracker's server), which nothing else bounds: named as what this
        process does, and a stall once it outlasts `stall_timeout` like any other."""
        self.at, self.doing, self.waiting = time.monotonic(), f"waiting for {what}", peer
        try:
            yield
        finally:
            self.mark(f"after waiting for {what}")


PROGRESS = Progress()

# Processes of this one's own that the watchdog's stall directory should hold the stacks of too (a decoupled
# player's evaluator): each hook writes them into the directory it is given, within a second or two.
STACK_HOOKS: list[Callable[[Path], None]] = []
