"""Envs that are not registered anywhere, named as `env.id=tests.envs.factory_envs:<callable>`."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from ppo_fabric.envs.toy_multiagent import matching_v0


def short_cartpole(**kwargs: Any) -> gym.Env:
    """CartPole built by a plain function; `env.kwargs` arrive as its keyword arguments."""
    return gym.make("CartPole-v1", max_episode_steps=kwargs.pop("limit", 100), **kwargs)


def pettingzoo_matching(**kwargs: Any) -> Any:
    """A PettingZoo Parallel env: right with env=pettingzoo, refused in one line without."""
    return matching_v0(**kwargs)


def not_an_env() -> object:
    return object()


def sized_cartpole(size: int = 4) -> gym.Env:
    """Refuses a bad value of its keyword argument with a ValueError, as envs check their settings."""
    if size < 1:
        raise ValueError(f"size must be at least 1, got {size}")
    return gym.make("CartPole-v1")


NOT_CALLABLE = 3  # named as env.id=...:NOT_CALLABLE: refused as no callable


def three_player_turns(**kwargs: Any) -> Any:
    """A turn-based game of three players: what evaluation during training (two-player games) cannot play."""
    from ppo_fabric.envs.toy_multiagent import TurnGame

    game = TurnGame(**kwargs)
    game.possible_agents = ["first", "second", "third"]
    game.observation_spaces["third"] = game.observation_spaces["first"]
    game.action_spaces["third"] = game.action_spaces["first"]
    return game


def misshapen_teams(**kwargs: Any) -> Any:
    """teams_v0 whose first agent's observation after a step has one entry too many."""
    from ppo_fabric.envs.toy_multiagent import TeamsGame

    class Misshapen(TeamsGame):
        def step(self, actions: Any) -> Any:
            obs, *rest = super().step(actions)
            first = self.possible_agents[0]
            if first in obs:
                obs[first] = np.zeros(len(obs[first]) + 1, np.float32)
            return (obs, *rest)

    return Misshapen(**kwargs)


def unobserved_truncation(**kwargs: Any) -> Any:
    """matching_v0 cut by its time limit (`truncate=True`) whose last step returns no observations."""
    from ppo_fabric.envs.toy_multiagent import MatchingGame

    class Unobserved(MatchingGame):
        def step(self, actions: Any) -> Any:
            obs, rewards, terminations, truncations, infos = super().step(actions)
            if any(truncations.values()):
                obs = {}
            return obs, rewards, terminations, truncations, infos

    return Unobserved(truncate=True, episode_length=4, **kwargs)


def faulty_matching(fault: str, **kwargs: Any) -> Any:
    """matching_v0 breaking PettingZoo's Parallel API one way (`fault`) from its second step on."""
    from ppo_fabric.envs.toy_multiagent import MatchingGame

    class Faulty(MatchingGame):
        def reset(self, seed: int | None = None, options: dict | None = None) -> Any:
            obs, infos = super().reset(seed=seed, options=options)
            self.steps = 0
            return obs if fault == "old_reset" else (obs, infos)

        def step(self, actions: Any) -> Any:
            obs, rewards, terminations, truncations, infos = super().step(actions)
            self.steps += 1
            if self.steps >= 2 and "agent_0" in self.agents:
                if fault == "vanish":  # gone without an episode end
                    self.agents.remove("agent_0")
                elif fault == "ghost":
                    self.agents.append("ghost")
                    obs["ghost"] = obs["agent_0"]
                elif fault == "none_reward":
                    rewards["agent_0"] = None
                elif fault == "text_reward":
                    rewards["agent_0"] = "high"
                elif fault == "text_truncation":
                    truncations["agent_0"] = "False"
                elif fault == "unobserved":
                    del obs["agent_0"]
                elif fault in ("rewards", "terminations", "truncations"):
                    del {"rewards": rewards, "terminations": terminations, "truncations": truncations}[fault][
                        "agent_0"
                    ]
            return obs, rewards, terminations, truncations, infos

    return Faulty(**kwargs)


def misshapen_turns(part: str, **kwargs: Any) -> Any:
    """A two-player turn game whose observation (`part`="observation") or action mask ("action_mask") has
    one entry too many."""
    from ppo_fabric.envs.toy_multiagent import TurnGame

    class Misshapen(TurnGame):
        def observe(self, agent: Any) -> Any:
            value = super().observe(agent)
            value[part] = np.zeros(len(value[part]) + 1, value[part].dtype)
            return value

    return Misshapen(**kwargs)


class SpacedEnv(gym.Env):
    """A 10-step env with the spaces it is given, that raises for an action its action space does not
    contain (as envs that check their actions do) and observes `obs_fn()` (its observation space's zeros)."""

    def __init__(self, observation_space: gym.Space, action_space: gym.Space, obs_fn: Any = None) -> None:
        self.observation_space, self.action_space = observation_space, action_space
        self.obs_fn = obs_fn or (lambda: np.zeros(observation_space.shape, observation_space.dtype))
        self.t = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        super().reset(seed=seed)
        self.t = 0
        return self.obs_fn(), {}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        if not self.action_space.contains(action):
            raise ValueError(f"{action!r} ({np.asarray(action).dtype}) is not in {self.action_space}")
        self.t += 1
        return self.obs_fn(), 0.0, False, self.t >= 10, {}


def strict_actions(kind: str) -> gym.Env:
    """Actions in a dtype other than the package samples (int64, float32), checked by the env."""
    obs = gym.spaces.Box(-1, 1, (3,), np.float32)
    action = {
        "discrete_int32": gym.spaces.Discrete(3, dtype=np.int32),
        "multidiscrete_int8": gym.spaces.MultiDiscrete([3, 3], dtype=np.int8),
        "box_float16": gym.spaces.Box(-1, 1, (2,), np.float16),
        "box_float64": gym.spaces.Box(-1, 1, (2,), np.float64),
        "box_far": gym.spaces.Box(np.array([-1.0, 100.0]), np.array([1.0, 200.0]), dtype=np.float32),
    }[kind]
    return SpacedEnv(obs, action)


def odd_observations(kind: str) -> gym.Env:
    """Observation spaces the model cannot read: one number of shape (), a Graph; and an observation of
    shape (1, 3) from a space of (3,)."""
    action = gym.spaces.Discrete(2)
    if kind == "scalar":
        return SpacedEnv(gym.spaces.Box(-1, 1, (), np.float32), action)
    if kind == "graph":
        return SpacedEnv(gym.spaces.Graph(gym.spaces.Box(-1, 1, (2,)), None), action, obs_fn=lambda: None)
    return SpacedEnv(
        gym.spaces.Box(-1, 1, (3,), np.float32), action, obs_fn=lambda: np.zeros((1, 3), np.float32)
    )
