"""LunarLander-v3 with faults on a schedule, for `chaos.py`: `env.id=benchmarks.chaos_env:ChaosLunarLander-v3`.

Each fault of `FAULTS` fires once per chaos run, in order, `gap` env steps (counted over every env of the
player process) after the previous one or after the process started, whichever is later. A fault is
claimed by creating its marker file in `state_dir` (O_EXCL: one process, one env), so a relaunched job
goes on to the next fault instead of repeating one:

- `kill`: the player process SIGKILLs itself (a rank lost to `kill -9` or the OOM killer);
- `nan_burst`: the next `burst` observations of the process hold NaN (in whichever envs step next,
  rebuilt ones included: the burst lives in the process, not in an env);
- `raise`: one env's `step` raises;
- `hang`: one env's `step` never returns (a stuck simulator).

A SIGTERM and requeue is not an env fault: `chaos.py` sends it from outside.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.envs.box2d.lunar_lander import LunarLander

FAULTS = ("kill", "nan_burst", "raise", "hang")


class _Process:
    """What the envs of one process share: steps since the last fault (or the start), the burst left."""

    since = 0
    burst_left = 0


class ChaosLunarLander(LunarLander):
    def __init__(self, state_dir: str = "", gap: int = 120_000, burst: int = 20, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.state_dir = Path(state_dir) if state_dir else None
        self.gap, self.burst = int(gap), int(burst)
        self.resetting = False

    def reset(self, **kwargs: Any) -> Any:
        """LunarLander's reset takes a step of its own: that one is no env step of the run's, no fault."""
        self.resetting = True
        try:
            return super().reset(**kwargs)
        finally:
            self.resetting = False

    def _claim(self) -> str | None:
        """The next fault not yet fired, claimed by this env; None when all have fired or another env of
        this or another process claimed it first."""
        assert self.state_dir is not None
        for fault in FAULTS:
            marker = self.state_dir / f"{fault}.fired"
            if marker.exists():
                continue
            try:
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return None
            with os.fdopen(fd, "w") as fh:
                fh.write(f"{time.time()} pid {os.getpid()}\n")
            return fault
        return None

    def step(self, action: Any) -> Any:
        obs, reward, terminated, truncated, info = super().step(action)
        if self.state_dir is None or self.resetting:
            return obs, reward, terminated, truncated, info
        _Process.since += 1
        if _Process.burst_left > 0:
            _Process.burst_left -= 1
            obs = np.full_like(obs, np.nan)
        elif _Process.since >= self.gap:
            _Process.since = 0
            fault = self._claim()
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault == "nan_burst":
                _Process.burst_left = self.burst - 1
                obs = np.full_like(obs, np.nan)
            elif fault == "raise":
                raise RuntimeError("simulator crashed (chaos benchmark)")
            elif fault == "hang":
                while True:
                    time.sleep(1)
        return obs, reward, terminated, truncated, info


gym.register("ChaosLunarLander-v3", entry_point=ChaosLunarLander, max_episode_steps=1000)
