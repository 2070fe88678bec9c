"""A CartPole that sends its own process one SIGTERM after some env steps (counted over every copy in the
process), as a cluster's preemption would, to stop an in-process run at its next update boundary.

It signals only while a run's stop handler (`session.STOP`) is installed, so a test process is never killed
by it, and once per process (`SignalledCartPole.sent`; a second signal would end the process at once)."""

from __future__ import annotations

import os
import signal
from typing import Any

import gymnasium as gym
from gymnasium.envs.classic_control import CartPoleEnv

from ppo_fabric.runs.session import STOP


class SignalledCartPole(CartPoleEnv):
    after = 600  # env steps of every copy together before the signal
    steps = 0
    sent = False
    signum = signal.SIGTERM  # or SIGINT, as Ctrl+C (a notebook's interrupt) sends

    def step(self, action: Any) -> Any:
        cls = type(self)
        cls.steps += 1
        handler = signal.getsignal(signal.SIGTERM)
        if not cls.sent and cls.steps > cls.after and getattr(handler, "__self__", None) is STOP:
            cls.sent = True
            os.kill(os.getpid(), cls.signum)
        return super().step(action)


gym.register("SignalledCartPole-v0", entry_point=SignalledCartPole, max_episode_steps=500)
