"""Small environments for the pixel tests: a Dict observation with an image and a vector key, and a fake
ALE game that the Atari wrappers accept without the emulator (so they can be tested step by step).

Importing this module registers `DictPixels-v0`, so `env.id=tests.pixel_envs:DictPixels-v0` works.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np


class DictPixels(gym.Env):
    """{"image": uint8 [1, 36, 36], "vec": float32 [3]}; reward 1 when the action is the sign of vec[0].

    The image is the smallest the Nature CNN accepts; a time limit of 10 steps (at registration) makes
    episodes end by truncation, so the rollout's final-observation bootstrap sees Dict observations too.
    """

    def __init__(self, end_prob: float = 0.0) -> None:
        self.end_prob = end_prob  # a chance per step that the episode ends (terminated)
        self.observation_space = gym.spaces.Dict(
            {
                "image": gym.spaces.Box(0, 255, (1, 36, 36), np.uint8),
                "vec": gym.spaces.Box(-1.0, 1.0, (3,), np.float32),
            }
        )
        self.action_space = gym.spaces.Discrete(2)
        self._vec = np.zeros(3, np.float32)

    def _obs(self) -> dict[str, np.ndarray]:
        self._vec = self.np_random.uniform(-1, 1, 3).astype(np.float32)
        image = np.full((1, 36, 36), int((self._vec[0] + 1) * 127), np.uint8)
        return {"image": image, "vec": self._vec}

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        super().reset(seed=seed)
        return self._obs(), {}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        reward = float(int(action) == int(self._vec[0] > 0))
        return self._obs(), reward, bool(self.np_random.random() < self.end_prob), False, {}


gym.register("DictPixels-v0", entry_point=DictPixels, max_episode_steps=10)
# Episodes that end at random too: the copies reach the time limit at different steps, so a step can cut
# some copies' episodes (their final observations bootstrapped) and not the others'.
gym.register(
    "DictPixelsStaggered-v0", entry_point=DictPixels, max_episode_steps=10, kwargs={"end_prob": 0.15}
)


class FakeALE:
    """The parts of `ale_py.ALEInterface` that AtariPreprocessing and the life/fire wrappers call."""

    def __init__(self) -> None:
        self.lives_left = 3
        self.frame = 0

    def lives(self) -> int:
        return self.lives_left

    def getScreenGrayscale(self, out: np.ndarray) -> None:  # the ALE's name
        out.fill(self.frame % 256)

    def getScreenRGB(self, out: np.ndarray) -> None:
        out.fill(self.frame % 256)


class FakeAtari(gym.Env):
    """A 'game' that pays `reward` every frame and loses a life every `frames_per_life` frames (0: never);
    it records every action and counts real resets, so the wrappers' effects can be asserted."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(
        self, reward: float = 5.0, lives: int = 3, frames_per_life: int = 0, fire: bool = True
    ) -> None:
        self.observation_space = gym.spaces.Box(0, 255, (210, 160, 3), np.uint8)
        self.action_space = gym.spaces.Discrete(4)
        self.ale = FakeALE()
        self._frameskip = 1  # AtariPreprocessing refuses an env that skips frames itself
        self.reward, self.start_lives, self.frames_per_life, self.fire = reward, lives, frames_per_life, fire
        self.actions: list[int] = []
        self.resets = 0
        self._since_life = 0

    def get_action_meanings(self) -> list[str]:
        return ["NOOP", "FIRE", "RIGHT", "LEFT"] if self.fire else ["NOOP", "UP", "RIGHT", "LEFT"]

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        super().reset(seed=seed)
        self.resets += 1
        self.ale.lives_left = self.start_lives
        self._since_life = 0
        return np.zeros(self.observation_space.shape, np.uint8), {}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        self.actions.append(int(action))
        self.ale.frame += 1
        self._since_life += 1
        if self.frames_per_life and self._since_life >= self.frames_per_life:
            self.ale.lives_left -= 1
            self._since_life = 0
        terminated = self.ale.lives_left <= 0
        return np.zeros(self.observation_space.shape, np.uint8), self.reward, terminated, False, {}
