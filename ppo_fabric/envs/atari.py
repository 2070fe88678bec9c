"""Atari (ALE) preprocessing of the DQN/PPO papers, built from gymnasium's wrappers plus the two it lacks.

`make_env` applies `wrap_atari` when `env.preprocess=atari`. The chain, innermost first:

1. `gymnasium.make(id, frameskip=1)`: the wrapper below does the frame skipping, so the ALE must not;
2. `AtariPreprocessing`: up to 30 no-op actions at reset, the action repeated 4 frames with the last two
   max-pooled (Atari sprites flicker between frames), 84x84 grayscale uint8; then `env.max_episode_steps`
   as a `TimeLimit` in agent steps (EnvPool's unit), when it is set;
3. `RecordEpisodeStatistics`: the real game's return and length (in agent steps), recorded *before* the
   life-loss episodes and the reward clipping below change what an "episode" and a "reward" are;
4. `EpisodicLife`: a lost life ends the episode for the learner (no bootstrap across it), but the game
   goes on: only game over resets the emulator;
5. `FireReset`: press FIRE after every reset, for games that wait for it before they start;
6. `TransformReward(np.sign)`: rewards clipped to {-1, 0, 1}, so one set of hyper-parameters fits games
   whose scores differ by orders of magnitude;
7. `FrameStackObservation(4)`: the last 4 frames, [4, 84, 84] uint8, channels first as the CNN expects.

Episode statistics: the vector env's own `RecordEpisodeStatistics` would count life-loss episodes and
clipped rewards, so for Atari `make_vector_env` replaces it with `GameEpisodeStatistics`, which moves the
per-env game statistics of step 3 to where the rollout reads them (`info["episode"]`, `info["_episode"]`).
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import VectorEnv, VectorWrapper

PREPROCESSORS = ("none", "atari")
FRAME_STACK = 4
SCREEN_SIZE = 84


class EpisodicLife(gym.Wrapper):
    """Losing a life ends the episode (terminated), yet only a real game over resets the game.

    The value of the state after a lost life is then not bootstrapped into the one before it, which
    teaches the agent that losing a life is bad (Mnih et al. 2015). `reset` after a lost life takes one
    no-op step instead of restarting the game.
    """

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.lives = 0
        self.game_over = True

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.game_over = bool(terminated or truncated)
        lives = self.env.unwrapped.ale.lives()
        if 0 < lives < self.lives:
            terminated = True
        self.lives = lives
        return obs, reward, terminated, truncated, info

    def end_game(self) -> None:
        """The next reset starts a new game (and takes its seed): after the normalisation warm-up, whose
        games must leave nothing behind in the run's first episode (`make_vector_env`)."""
        self.game_over = True

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        if self.game_over:
            obs, info = self.env.reset(**kwargs)
        else:
            obs, _, terminated, truncated, info = self.env.step(0)
            if terminated or truncated:  # the no-op itself ended the game
                obs, info = self.env.reset(**kwargs)
        self.game_over = False
        self.lives = self.env.unwrapped.ale.lives()
        return obs, info


class FireReset(gym.Wrapper):
    """Press FIRE (then action 2) after reset: games such as Breakout stand still until FIRE is pressed,
    and an agent that has not yet learnt to press it would see nothing happen for a whole episode."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        meanings = env.unwrapped.get_action_meanings()
        if len(meanings) < 3 or meanings[1] != "FIRE":
            raise ValueError(f"FireReset needs action 1 to be FIRE, the game has {meanings}")

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        self.env.reset(**kwargs)
        for action in (1, 2):
            obs, _, terminated, truncated, info = self.env.step(action)
            if terminated or truncated:
                obs, info = self.env.reset(**kwargs)
        return obs, info


def has_fire(env: gym.Env) -> bool:
    """Whether the game waits for FIRE (action 1), as the Atari wrappers of the baselines decide it."""
    meanings = env.unwrapped.get_action_meanings()
    return len(meanings) >= 3 and meanings[1] == "FIRE"


def gym_make_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`gymnasium.make` arguments for a preprocessed ALE env: frame skipping belongs to the wrapper."""
    return {"frameskip": 1} | kwargs


def wrap_atari(env: gym.Env, max_episode_steps: int | None = None) -> gym.Env:
    """The standard Atari chain (module docstring) around an ALE env made with `frameskip=1`, with
    `max_episode_steps` (`env.max_episode_steps`) counted in agent steps of 4 frames, as EnvPool counts
    them: a time limit inside the frame skipping would count frames."""
    if not hasattr(env.unwrapped, "ale"):
        raise ValueError("env.preprocess=atari needs an ALE environment (env.id=ALE/<Game>-v5)")
    env = gym.wrappers.AtariPreprocessing(
        env, noop_max=30, frame_skip=4, screen_size=SCREEN_SIZE, grayscale_obs=True, scale_obs=False
    )
    if max_episode_steps is not None:
        env = gym.wrappers.TimeLimit(env, max_episode_steps)
    env = gym.wrappers.RecordEpisodeStatistics(env)
    env = EpisodicLife(env)
    if has_fire(env):
        env = FireReset(env)
    env = gym.wrappers.TransformReward(env, np.sign)  # a ufunc, not a lambda: envs are pickled
    return gym.wrappers.FrameStackObservation(env, FRAME_STACK)


def records_games(env: gym.Env) -> bool:
    """Whether `env` is wrapped by the Atari chain: its episodes end at every lost life, and the info of
    the step that ends the game carries the game's raw `episode` statistics."""
    while isinstance(env, gym.Wrapper):
        if isinstance(env, EpisodicLife):
            return True
        env = env.env
    return bool(getattr(env, "whole_games", False))  # EnvPool's Atari (`envpool_backend.PoolEnv`)


class GameEpisodeStatistics(VectorWrapper):
    """Reports the sub-envs' own episode statistics (whole games, raw score) as `info["episode"]`.

    With same-step autoreset, the info of a step that ended an episode arrives under `info["final_info"]`
    (the top level holds the reset's info); the rollout reads `info["episode"]`/`info["_episode"]`, which
    the vector `RecordEpisodeStatistics` would otherwise fill with life-loss episodes and clipped rewards.
    """

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        obs, rewards, terminated, truncated, info = self.env.step(actions)
        final = info.get("final_info")
        if final is not None and "_episode" in final:
            done = final["_episode"] & info["_final_info"]
            if done.any():
                info["episode"] = final["episode"]
                info["_episode"] = done
        return obs, rewards, terminated, truncated, info


def wrap_vector(envs: VectorEnv, preprocess: str) -> VectorEnv:
    """Episode statistics for the vector env: the games' own for Atari, the vector env's otherwise."""
    if preprocess == "atari":
        return GameEpisodeStatistics(envs)
    return gym.wrappers.vector.RecordEpisodeStatistics(envs, buffer_length=1)
