"""PettingZoo Parallel envs in the rollout loop: which agents each policy acts for, and a vector env over
copies of the env that reports per policy what a gymnasium vector env reports per env.

A policy's rows are (env copy, agent) pairs, row = copy * n_agents_of_policy + agent index, so one
policy's batch is all of its agents in all copies (parameter sharing) and one agent's trajectory is one
column of its policy's storage. Agents that leave an episode early (PettingZoo drops them from
`env.agents`) keep their row until the copy resets: `alive` is False there, the rollout stores the step
with `mask` False and `terminated` True, so it adds nothing to any loss or advantage.
"""

from __future__ import annotations

import fnmatch
import importlib
import re
from collections.abc import Callable
from functools import partial
from typing import Any

import gymnasium as gym
import numpy as np
from omegaconf import DictConfig, OmegaConf
from pettingzoo import AECEnv

from ppo_fabric.envs.agent_data import (
    agent_row,
    departed_without_end,
    reset_observations,
    step_result,
    store_row,
)
from ppo_fabric.envs.guard import NonFiniteData, error_line, find_nonfinite
from ppo_fabric.envs.make import EnvError, env_action, env_seeds
from ppo_fabric.envs.traits import PARALLEL_AGENTS
from ppo_fabric.envs.turn_based import TurnBasedVectorEnv, split_observation_space

API = "pettingzoo"
SINGLE = "main"  # the one policy (and rollout group) of a single-agent env


def is_multiagent(env_cfg: DictConfig) -> bool:
    return env_cfg.get("api", "gymnasium") == API


def make_parallel_env(env_cfg: DictConfig) -> Any:
    """`env.id` names a module with `parallel_env(**kwargs)` (PettingZoo's convention, e.g.
    `mpe2.simple_spread_v3`), a module with only `env(**kwargs)` returning a turn-based AEC env (e.g.
    `pettingzoo.classic.connect_four_v3`), or `module:factory` for any callable returning either kind.
    `is_turn_based` tells them apart."""
    env_id = str(env_cfg.id)
    module_name, _, attr = env_id.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = " (pip install 'ppo-fabric[mpe]')" if module_name.startswith("mpe2") else ""
        if re.fullmatch(r"[\w/]+-v\d+", module_name):  # a gymnasium id after env=pettingzoo (a game's recipe)
            hint = (
                "; env=pettingzoo takes a PettingZoo module (pettingzoo.classic.connect_four_v3), "
                "and a gymnasium id needs env=gym"
            )
        raise EnvError(
            f"env.id={env_id!r}: cannot import module {module_name!r}{hint} ({error_line(exc)})"
        ) from exc
    if not attr:  # Parallel first: modules offering both (MPE) keep the simultaneous-move API
        attr = "parallel_env" if callable(getattr(module, "parallel_env", None)) else "env"
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise EnvError(
            f"env.id={env_id!r}: module {module_name!r} has no {attr}() nor parallel_env(); name a "
            "PettingZoo env module or module:factory"
        )
    kwargs = OmegaConf.to_container(env_cfg.kwargs, resolve=True) if env_cfg.get("kwargs") else {}
    try:
        env = factory(**kwargs)
    except TypeError as exc:
        raise EnvError(f"env.id={env_id!r} rejects env.kwargs={kwargs}: {error_line(exc)}") from exc
    if not hasattr(env, "possible_agents") or not hasattr(env, "step"):
        raise EnvError(f"env.id={env_id!r} did not return a PettingZoo Parallel or AEC API env")
    return env


def is_turn_based(env: Any) -> bool:
    """A PettingZoo AEC env (agents move one at a time, `agent_selection` says whose turn it is)."""
    return isinstance(env, AECEnv)


SHARED = "shared"  # the one policy of a multi-agent run that names none


def policy_settings(ma_cfg: DictConfig) -> dict[str, Any]:
    """`multiagent.policies` as a plain dict (name -> overrides); null means one policy, `shared`."""
    if ma_cfg.get("policies") is None:
        return {SHARED: {}}
    if not OmegaConf.is_dict(ma_cfg.policies) or not ma_cfg.policies:
        raise EnvError(
            "multiagent.policies must map policy names to settings, e.g. {red: {}, blue: {lr: 3e-4}}"
        )
    if SINGLE in ma_cfg.policies:  # a multi-agent run whose only policy had it would be read as single-agent
        raise EnvError(
            f"multiagent.policies: {SINGLE!r} names a single-agent run's policy; choose another name"
        )
    return {str(k): (OmegaConf.to_container(v, resolve=True) or {}) for k, v in ma_cfg.policies.items()}


def mapping_rules(ma_cfg: DictConfig) -> dict[str, str]:
    """`multiagent.policy_mapping` as a plain dict; null sends every agent to the only policy."""
    policies = list(policy_settings(ma_cfg))
    if ma_cfg.get("policy_mapping") is None:
        if len(policies) > 1:
            raise EnvError(
                f"multiagent.policies has {len(policies)} policies; say which agents each one acts for with "
                "multiagent.policy_mapping={pattern: policy, ...}"
            )
        return {"*": policies[0]}
    if not OmegaConf.is_dict(ma_cfg.policy_mapping) or not ma_cfg.policy_mapping:
        raise EnvError(
            "multiagent.policy_mapping must map agent names or patterns to policies, e.g. {'agent_*': blue}"
        )
    return {str(k): str(v) for k, v in ma_cfg.policy_mapping.items()}


def policy_mapping(agents: list[str], ma_cfg: DictConfig, strict: bool = False) -> dict[str, list[str]]:
    """policy -> its agents, in the env's agent order.

    `multiagent.policy_mapping` maps agent names or fnmatch patterns to policies; an exact name wins,
    then the first pattern that matches, in the order written. `strict` (a run's config, before it trains):
    an entry that matches none of the agents is refused; a misspelt exact name beside a `*` entry sent its
    agent to the wildcard's policy without a word. Checkpoints are read without it."""
    policies = list(policy_settings(ma_cfg))
    rules = mapping_rules(ma_cfg)
    dead = [k for k in rules if strict and not any(fnmatch.fnmatchcase(a, k) for a in agents)]
    if dead:
        raise EnvError(
            f"multiagent.policy_mapping entry {dead[0]!r} matches none of the env's agents "
            f"({', '.join(agents)}); correct it or drop it"
        )
    groups: dict[str, list[str]] = {p: [] for p in policies}
    for agent in agents:
        policy = rules.get(agent)
        if policy is None:
            policy = next((p for pattern, p in rules.items() if fnmatch.fnmatchcase(agent, pattern)), None)
        if policy is None:
            raise EnvError(
                f"agent {agent!r} matches no entry of multiagent.policy_mapping={rules}; add a pattern such "
                "as '*' for the rest"
            )
        if policy not in groups:
            raise EnvError(
                f"multiagent.policy_mapping sends {agent!r} to {policy!r}, which is not in multiagent.policies "
                f"({', '.join(policies)})"
            )
        groups[policy].append(agent)
    unused = [p for p, members in groups.items() if not members]
    if unused:
        raise EnvError(f"multiagent.policies {unused} get no agents from multiagent.policy_mapping={rules}")
    return groups


def trained_policies(ma_cfg: DictConfig) -> list[str]:
    chosen = ma_cfg.get("policies_to_train")
    names = list(policy_settings(ma_cfg))
    if chosen is None:
        return names
    if not OmegaConf.is_list(chosen) or not chosen:
        raise EnvError(
            f"multiagent.policies_to_train={chosen} must be null (all) or a non-empty list of policies"
        )
    unknown = [p for p in chosen if p not in names]
    if unknown:
        raise EnvError(f"multiagent.policies_to_train names unknown policies {unknown}; known: {names}")
    return [p for p in names if p in chosen]


def group_spaces(
    env: Any, groups: dict[str, list[str]], masked: bool = False
) -> dict[str, tuple[gym.Space, gym.Space, int | None]]:
    """Each policy's observation space, action space and action-mask width (turn-based games with
    `masked`: the `action_mask` key leaves the observation); all agents of one policy must share them."""
    turns = is_turn_based(env)
    spaces = {}
    for policy, agents in groups.items():
        first = (env.observation_space(agents[0]), env.action_space(agents[0]))
        for agent in agents[1:]:
            if (env.observation_space(agent), env.action_space(agent)) != first:
                raise EnvError(
                    f"agents {agents[0]!r} and {agent!r} share policy {policy!r} but have different spaces; "
                    "map them to different policies"
                )
        obs_space, width = split_observation_space(first[0], masked and turns)
        spaces[policy] = (obs_space, first[1], width)
    return spaces


class MultiAgentVectorEnv:
    """`num_envs` copies of a Parallel API env stepped in turn, with autoreset when a copy has no agents
    left. Per policy, `step` returns what gymnasium's SAME_STEP vector envs return per env: next
    observations (the reset ones where a copy restarted), rewards, terminated, truncated, and an info with
    `final_obs` for truncated rows, `episode`/`_episode` for agents whose episode ended, and `alive`."""

    traits = PARALLEL_AGENTS

    def __init__(self, factories: list[Callable[[], Any]], groups: dict[str, list[str]]) -> None:
        self.envs = [factory() for factory in factories]
        self.num_envs = len(self.envs)
        self.groups = groups
        first = self.envs[0]
        self.action_spaces = {p: first.action_space(a[0]) for p, a in groups.items()}
        self.observation_spaces = {p: first.observation_space(a[0]) for p, a in groups.items()}
        # (policy, row) of every agent in every copy
        self._rows = [
            {
                agent: (p, e * len(agents) + j)
                for p, agents in groups.items()
                for j, agent in enumerate(agents)
            }
            for e in range(self.num_envs)
        ]
        self._returns = {p: np.zeros(self.num_envs * len(a)) for p, a in groups.items()}
        self._lengths = {p: np.zeros(self.num_envs * len(a), dtype=np.int64) for p, a in groups.items()}

    def _zeros(self, policy: str) -> np.ndarray:
        space = self.observation_spaces[policy]
        return np.zeros((self.num_envs * len(self.groups[policy]), *space.shape), dtype=space.dtype)

    def reset(self, seed: list[int] | None = None) -> dict[str, np.ndarray]:
        obs = {p: self._zeros(p) for p in self.groups}
        self.alive = {p: np.zeros(len(obs[p]), dtype=bool) for p in self.groups}  # present after reset
        for e, env in enumerate(self.envs):
            self._write_obs(obs, e, reset_observations(env.reset(seed=None if seed is None else seed[e]), e))
            for agent in env.agents:
                p, row = agent_row(self._rows[e], agent, e)
                self.alive[p][row] = True
        for p in self.groups:
            self._returns[p][:] = 0
            self._lengths[p][:] = 0
        return obs

    def _write_obs(self, out: dict[str, np.ndarray], e: int, observations: dict[str, Any]) -> None:
        rows = self._rows[e]
        for agent, value in observations.items():
            if agent in rows:
                policy, row = rows[agent]
                store_row(out[policy], row, value, e, agent)

    def step(self, actions: list[np.ndarray]) -> list[tuple[Any, ...]]:
        by_policy = dict(zip(self.groups, actions, strict=True))
        obs = {p: self._zeros(p) for p in self.groups}
        size = {p: self.num_envs * len(a) for p, a in self.groups.items()}
        rew = {p: np.zeros(n, dtype=np.float32) for p, n in size.items()}
        term = {p: np.ones(n, dtype=bool) for p, n in size.items()}  # absent agents: no transition
        trunc = {p: np.zeros(n, dtype=bool) for p, n in size.items()}
        alive = {p: np.zeros(n, dtype=bool) for p, n in size.items()}
        ended = {p: np.zeros(n, dtype=bool) for p, n in size.items()}
        final_obs = {p: np.empty(n, dtype=object) for p, n in size.items()}
        ep_r = {p: np.zeros(n) for p, n in size.items()}
        ep_l = {p: np.zeros(n, dtype=np.int64) for p, n in size.items()}
        for e, env in enumerate(self.envs):
            rows = self._rows[e]
            acting = {a: agent_row(rows, a, e) for a in env.agents}
            next_obs, rewards, terminations, truncations, _ = env.step(
                {a: env_action(by_policy[p][row]) for a, (p, row) in acting.items()}
            )
            remaining = set(env.agents)
            for agent, (p, row) in acting.items():
                r, term[p][row], trunc[p][row] = step_result(rewards, terminations, truncations, agent, e)
                if agent not in remaining and not (term[p][row] or trunc[p][row]):
                    raise departed_without_end(agent, e)
                rew[p][row] = r
                self._returns[p][row] += r
                self._lengths[p][row] += 1
                if term[p][row] or trunc[p][row]:
                    ended[p][row] = True
                    ep_r[p][row], ep_l[p][row] = self._returns[p][row], self._lengths[p][row]
                    self._returns[p][row], self._lengths[p][row] = 0.0, 0
                    if agent in next_obs:
                        final_obs[p][row] = next_obs[agent]
                    elif trunc[p][row] and not term[p][row]:
                        # its return is bootstrapped from that observation
                        raise ValueError(
                            f"env {e}, agent {agent!r}: truncated without an observation of where it stopped, "
                            "which its return is bootstrapped from (a parallel env's step returns one for "
                            "every agent that acted)"
                        )
            if env.agents:
                unseen = [a for a in env.agents if a not in next_obs]
                if unseen:  # its row would have held zeros, acted on and learned from as an observation
                    raise ValueError(
                        f"env {e}, agent {unseen[0]!r}: step() returned no observation for this agent, which "
                        "is still in env.agents"
                    )
                self._write_obs(obs, e, {a: next_obs[a] for a in env.agents})
            else:  # every agent is done: the copy restarts (gymnasium's SAME_STEP autoreset)
                self._write_obs(obs, e, reset_observations(env.reset(), e))
            for agent in env.agents:
                p, row = agent_row(rows, agent, e)
                alive[p][row] = True
        return [
            (
                obs[p],
                rew[p],
                term[p],
                trunc[p],
                {
                    "final_obs": final_obs[p],
                    "alive": alive[p],
                    "episode": {"r": ep_r[p], "l": ep_l[p]},
                    "_episode": ended[p],
                },
            )
            for p in self.groups
        ]

    def close(self) -> None:
        for env in self.envs:
            env.close()


def make_multiagent_vector_env(
    env_cfg: DictConfig,
    ma_cfg: DictConfig,
    seed: int,
    rank: int,
    masked: bool = False,
    opening_moves: int = 0,
) -> tuple[Any, dict[str, np.ndarray]]:
    """The rank's vector env over `env.num_envs` copies, already reset; returns (envs, first observations).
    A turn-based (AEC) env gets `turn_based.TurnBasedVectorEnv`, with its action masks when `masked` and
    its random openings of up to `opening_moves` moves (self-play training only)."""
    for key in ("normalize_obs", "normalize_reward", "mask_velocity", "observation_noise"):
        if env_cfg.get(key, False):
            raise EnvError(f"env.{key}={env_cfg.get(key)} is not supported for PettingZoo envs yet")
    # partial, not a lambda: checkpoints pickle the vector env
    factories = [partial(make_parallel_env, env_cfg) for _ in range(int(env_cfg.num_envs))]
    probe = factories[0]()
    try:
        groups = policy_mapping(list(probe.possible_agents), ma_cfg)
        turns = is_turn_based(probe)
    finally:
        probe.close()
    if turns:
        envs: Any = TurnBasedVectorEnv(factories, groups, masked, opening_moves)
    else:
        envs = MultiAgentVectorEnv(factories, groups)
    first = envs.reset(seed=env_seeds(seed, rank, int(env_cfg.num_envs)))
    # the first observations too: the steps' are checked by the collector, and a NaN in a first reset's
    # was learned from (its minibatch steps skipped) by a run that then ended with exit 0
    for policy, obs in first.items():
        found = find_nonfinite(obs, np.zeros(1))
        if found is not None:
            row, what = found
            agents = groups[policy]
            raise NonFiniteData(row // len(agents), f"agent {agents[row % len(agents)]!r}: {what}")
    return envs, first
