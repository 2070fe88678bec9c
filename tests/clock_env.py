"""An env whose one-step episodes return the number of steps its instance has taken: a logged row's mean
episode return says which env steps its episodes came from, so a row that counts episodes of a rollout
collected after its own env step shows it."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np


class Clock(gym.Env):
    observation_space = gym.spaces.Box(-1, 1, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self) -> None:
        self.steps = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        self.steps += 1
        return np.zeros(1, np.float32), float(self.steps), True, False, {}


def make(**_kwargs: Any) -> Clock:
    return Clock()
