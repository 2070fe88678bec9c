"""A CartPole that raises on one chosen rank after some steps, to test that a failing rank ends the job."""

from __future__ import annotations

import os
from typing import Any

import gymnasium as gym
from gymnasium.envs.classic_control import CartPoleEnv


class FailingCartPole(CartPoleEnv):
    def __init__(self, fail_rank: int = 1, fail_after: int = 300, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.armed = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))) == fail_rank
        self.fail_after = fail_after
        self.steps = 0

    def step(self, action: Any) -> Any:
        self.steps += 1
        if self.armed and self.steps > self.fail_after:
            raise RuntimeError("probe failure injected by the test env")
        return super().step(action)


gym.register("FailingCartPole-v0", entry_point=FailingCartPole, max_episode_steps=500)
