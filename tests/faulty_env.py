"""A CartPole that goes wrong on purpose, for the fault tests (`env.id=tests.faulty_env:FaultyCartPole-v0`).

`fault`: `nan_obs` (one observation entry NaN), `inf_reward`, `array_reward` (a reward of shape (1,)), `text_terminated` (terminated as the text `'False'`), `huge_reward` (1e200: finite, but its square
is not), `raise` (step raises), `hang` (step sleeps for
ever, a stuck simulator), `gil_hang` (step never returns from C code that holds the interpreter lock), `slow` (each step sleeps `pause` seconds, 1 by default), `signal_slow` (SIGINT to its own process at the first
strike, then `slow`), `signal_parent_slow` (the same to its parent process), `slow_close` (the process's first close takes 7 s; steps are fine), `raise_init` (the constructor
raises), `raise_init_worker` (the constructor raises in a worker process, not in the main one), `hang_init` (the constructor never returns), `raise_close` (`close` raises once the env has stepped),
`hang_close` (`close` never returns once the env has stepped), `exit` (step calls `sys.exit(0)`), `keyboard_interrupt` (step raises KeyboardInterrupt), `os_exit`
(the process ends at once, status 3, as a crash in C code would end it), `raise_then_noinit` (step raises,
and every later construction in the process raises too: a rebuild that fails) or `none`; it strikes at the `after`-th step of each env instance (a recreated env
starts counting again), on rank `rank` (-1: every rank), for `times` steps in a row (0: from then on);
`others` is the fault of the other ranks then (default `none`).
With `seeds`, only in an instance last reset with one of them (the evaluation envs' seeds: a fault in
evaluation alone).
"""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import sys
import time
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.envs.classic_control import CartPoleEnv

FAULT_ENV = "FAULTY_CARTPOLE_FAULT"  # overrides `fault` in `step` while set
_SLOW_CLOSES = [1]  # `slow_close` sleeps once a process: one 7-s close outlasts Lightning's 5-s poll


class FaultyCartPole(CartPoleEnv):
    struck = False  # `raise_then_noinit` struck in this process: constructions raise from then on

    def __init__(
        self,
        fault: str = "none",
        after: int = 50,
        rank: int = -1,
        times: int = 0,
        seeds: list[int] | None = None,
        others: str = "none",
        pause: float = 1.0,
        **kwargs: Any,
    ) -> None:
        if fault == "raise_init" or (fault == "raise_then_noinit" and FaultyCartPole.struck):
            raise RuntimeError("no licence for the simulator (injected by the test env)")
        if fault == "raise_init_worker" and multiprocessing.parent_process() is not None:
            raise RuntimeError("no display in a worker process (injected by the test env)")
        while fault == "hang_init":
            time.sleep(1)
        super().__init__(**kwargs)
        here = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
        self.fault = fault if rank < 0 or here == rank else others
        self.after, self.times, self.steps, self.pause = after, times, 0, pause
        self.seeds, self.seeded = (None if seeds is None else set(seeds)), None
        self.signalled = False

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> Any:
        if seed is not None:
            self.seeded = seed
        obs, info = super().reset(seed=seed, options=options)
        if self.fault == "wrong_shape_reset" and self.steps == 0:  # the vector env's first reset
            obs = np.zeros(5, dtype=np.float32)
        return obs, info

    def close(self) -> None:
        if self.fault == "raise_close" and self.steps > 0:  # the run's envs, not the checks' probe env
            raise OSError("device busy (injected by the test env)")
        while self.fault == "hang_close" and self.steps > 0:
            time.sleep(1)
        if self.fault == "slow_close" and _SLOW_CLOSES:
            _SLOW_CLOSES.pop()
            time.sleep(7.0)
        super().close()

    def step(self, action: Any) -> Any:
        obs, reward, terminated, truncated, info = super().step(action)
        self.steps += 1
        striking = self.steps >= self.after and (self.times == 0 or self.steps < self.after + self.times)
        if self.seeds is not None and self.seeded not in self.seeds:
            striking = False
        fault = os.environ.get(FAULT_ENV, self.fault)  # a fault a test sets for a resumed session only
        if not striking or fault in ("none", "slow_close", "raise_close", "hang_close"):
            return obs, reward, terminated, truncated, info
        if fault == "nan_obs":
            obs = np.array(obs, dtype=np.float32)
            obs[2] = np.nan
        elif fault == "inf_reward":
            reward = float("inf")
        elif fault == "huge_reward":
            reward = 1e200
        elif fault == "none_reward":
            reward = None
        elif fault == "array_reward":
            reward = np.array([reward])
        elif fault == "text_terminated":
            terminated = str(terminated)
        elif fault == "wrong_shape":
            obs = np.zeros(5, dtype=np.float32)
        elif fault in ("raise", "raise_then_noinit"):
            FaultyCartPole.struck = fault == "raise_then_noinit"
            raise RuntimeError("simulator crashed (injected by the test env)")
        elif fault == "slow":
            time.sleep(self.pause)
        elif fault == "signal_slow":  # a stop signal to this process at its first strike, then slow steps
            if not self.signalled:
                self.signalled = True
                os.kill(os.getpid(), signal.SIGINT)
            time.sleep(self.pause)
        elif (
            fault == "signal_parent_slow"
        ):  # the same, to the parent (a decoupled player, from its evaluator)
            if not self.signalled:
                self.signalled = True
                os.kill(os.getppid(), signal.SIGINT)
            time.sleep(self.pause)
        elif fault == "hang":
            while True:
                time.sleep(1)
        elif fault == "gil_hang":  # C code that never returns and never lets another thread run
            re.match(r"(a+)+$", "a" * 64 + "b")
        elif fault == "exit":
            sys.exit(0)
        elif fault == "keyboard_interrupt":
            raise KeyboardInterrupt
        elif fault == "os_exit":
            os._exit(3)
        return obs, reward, terminated, truncated, info


gym.register("FaultyCartPole-v0", entry_point=FaultyCartPole, max_episode_steps=500)


def nan_matching_v0(after: int = 10, agent: str = "agent_1", **kwargs: Any) -> Any:
    """PettingZoo's side: matching_v0 (3 agents) whose `agent` observes NaN from its `after`-th step on."""
    from ppo_fabric.envs.toy_multiagent import MatchingGame

    class NanMatching(MatchingGame):
        steps = 0

        def _observe(self, who: str) -> np.ndarray:
            obs = super()._observe(who)
            if who == agent and self.steps >= after:
                obs = obs.copy()
                obs[0] = np.nan
            return obs

        def step(self, actions: dict[str, Any]) -> Any:
            self.steps += 1
            return super().step(actions)

    return NanMatching(**kwargs)


def nan_final_matching_v0(**kwargs: Any) -> Any:
    """matching_v0 whose agents observe NaN only at the step the time limit cuts their episode: the vector
    env returns the next episode's first observation there, the NaN one only as `final_obs`."""
    from ppo_fabric.envs.toy_multiagent import MatchingGame

    class NanAtTheCut(MatchingGame):
        def _observe(self, who: str) -> np.ndarray:
            obs = super()._observe(who)
            if self._t >= self.episode_length:
                obs = obs.copy()
                obs[0] = np.nan
            return obs

    return NanAtTheCut(**{"truncate": True, "episode_length": 4, **kwargs})
