"""A CartPole whose process SIGKILLs itself on one chosen rank after some steps, once per marker file: the
first attempt of a job dies like a rank hit by `kill -9` (or the OOM killer), a relaunch trains through."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import gymnasium as gym
from gymnasium.envs.classic_control import CartPoleEnv


class KilledOnceCartPole(CartPoleEnv):
    def __init__(self, kill_rank: int = 1, kill_after: int = 100, marker: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.armed = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))) == kill_rank
        self.kill_after = kill_after
        self.marker = Path(marker) if marker else None
        self.steps = 0

    def step(self, action: Any) -> Any:
        self.steps += 1
        # The marker is looked at when killing, not when built: a restored env snapshot is armed too.
        if self.armed and self.steps > self.kill_after and self.marker and not self.marker.exists():
            self.marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return super().step(action)


gym.register("KilledOnceCartPole-v0", entry_point=KilledOnceCartPole, max_episode_steps=500)
