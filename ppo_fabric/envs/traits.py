"""What the rollout loop must know about a vector env: the env classes that differ from gymnasium's declare
it once, as a class attribute `traits`, instead of the loop probing for attributes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VectorEnvTraits:
    """`multiagent`: one group of rows per policy (`groups`, `action_spaces`, `alive`, `action_masks` by
    policy); `turn_based`: an AEC game, one agent moves per step, so a move's outcome reaches its row at a
    later step; `asynchronous`: an async pool, only `batch_size` ready envs act per step and their results
    arrive at a later one."""

    multiagent: bool = False
    turn_based: bool = False
    asynchronous: bool = False

    @property
    def delayed(self) -> bool:
        """Whether a decision's outcome may reach its row at a later step (`rollout.credit_waiting`)."""
        return self.turn_based or self.asynchronous


GYMNASIUM = VectorEnvTraits()  # every step acts for every env copy and returns its results at once
PARALLEL_AGENTS = VectorEnvTraits(multiagent=True)
TURN_BASED = VectorEnvTraits(multiagent=True, turn_based=True)
ASYNC_POOL = VectorEnvTraits(asynchronous=True)


def traits_of(envs: Any) -> VectorEnvTraits:
    """The env's declared traits; gymnasium's vector envs (and their wrappers) declare none."""
    return getattr(envs, "traits", GYMNASIUM)
