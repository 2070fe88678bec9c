"""An env with no time limit that ends only on action 1: a greedy policy that never takes it would play
one evaluation episode for ever, as a balance task a good policy never fails does."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np


class Endless(gym.Env):
    observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        return np.zeros(2, np.float32), 1.0, bool(action == 1), False, {}


def make(**_kwargs: Any) -> Endless:
    return Endless()
