"""Two tiny PettingZoo Parallel environments that PPO solves in seconds, with known optimal returns, and a
scripted turn-based (AEC) game, `turn_v0`, whose rewards and values are known move by move.

They play the role the probe environments play for single-agent PPO: small enough to train in a test,
yet each one fails loudly if a piece of the multi-agent plumbing is wrong.

- `MatchingGame` (`matching_v0`, cooperative): one policy shared by every agent must read the agent-id
  part of its observation, since each agent's correct answer to the same cue differs. `leave_early=True`
  removes agents mid-episode, the case where per-agent buffers and done flags most often go wrong.
- `TeamsGame` (`teams_v0`, two teams, zero-sum): the teams observe vectors of different sizes, so they
  need separate policies, and one team's return measures the other team's strength.

Both draw a fresh cue every step from `np.random.default_rng(seed)`; the cue is shown in the next
observation and decides which actions score at that step, so the best policy is reactive (no memory) and
the value of every state is known in closed form.
"""

from __future__ import annotations

import abc
from typing import Any

import gymnasium as gym
import numpy as np
from pettingzoo import AECEnv, ParallelEnv

AgentID = str
StepResult = tuple[
    dict[AgentID, np.ndarray],
    dict[AgentID, float],
    dict[AgentID, bool],
    dict[AgentID, bool],
    dict[AgentID, dict[str, Any]],
]


class _CueGame(ParallelEnv[AgentID, np.ndarray, int], abc.ABC):
    """Shared plumbing: the cue, the step counter, seeding, cached spaces and the end-of-episode flags.

    Subclasses fill `possible_agents`, the two space dicts, `_observe`, `_rewards` and optionally
    `_finish_step` (the step count after which an agent leaves; the episode length by default).
    """

    metadata: dict[str, Any] = {"render_modes": [], "is_parallelizable": True}

    def __init__(
        self, num_symbols: int, episode_length: int, truncate: bool, render_mode: str | None
    ) -> None:
        if num_symbols < 2:
            raise ValueError(
                f"num_symbols must be at least 2 (got {num_symbols}): one symbol leaves nothing to learn"
            )
        if episode_length < 1:
            raise ValueError(f"episode_length must be at least 1 (got {episode_length})")
        if render_mode is not None:
            raise ValueError(f"{type(self).__name__} has no render modes (got render_mode={render_mode!r})")
        self.num_symbols = num_symbols
        self.episode_length = episode_length
        self.truncate = truncate
        self.render_mode = render_mode
        self.agents: list[AgentID] = []
        self.observation_spaces: dict[AgentID, gym.spaces.Box] = {}
        self.action_spaces: dict[AgentID, gym.spaces.Discrete] = {}
        self._rng = np.random.default_rng()
        self._cue = 0
        self._t = 0

    def observation_space(self, agent: AgentID) -> gym.spaces.Box:
        return self.observation_spaces[agent]

    def action_space(self, agent: AgentID) -> gym.spaces.Discrete:
        return self.action_spaces[agent]

    def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[AgentID, np.ndarray], dict[AgentID, dict[str, Any]]]:
        """Start an episode; a seed re-seeds the cue generator, no seed continues its stream (as gymnasium)."""
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self.agents = list(self.possible_agents)
        self._t = 0
        self._cue = int(self._rng.integers(self.num_symbols))
        return {a: self._observe(a) for a in self.agents}, {a: {} for a in self.agents}

    def step(self, actions: dict[AgentID, Any]) -> StepResult:
        """Score the current cue, draw the next one, and finish the agents whose time is up.

        Every live agent needs an action; actions for agents that already left are ignored.
        """
        if not self.agents:
            raise RuntimeError("step() called with no live agents: call reset() first")
        acting = list(self.agents)
        missing = [a for a in acting if a not in actions]
        if missing:
            raise KeyError(f"no action for live agents {missing}")
        chosen = {a: self._action(a, actions[a]) for a in acting}
        rewards = self._rewards(chosen)
        self._t += 1
        self._cue = int(self._rng.integers(self.num_symbols))
        time_up = self._t >= self.episode_length
        leaving = {a: self._t >= self._finish_step(a) for a in acting}
        truncations = {a: time_up and self.truncate for a in acting}
        terminations = {a: leaving[a] and not truncations[a] for a in acting}
        observations = {a: self._observe(a) for a in acting}
        self.agents = [a for a in acting if not leaving[a]]
        return observations, rewards, terminations, truncations, {a: {} for a in acting}

    def _action(self, agent: AgentID, action: Any) -> int:
        value = int(np.asarray(action).item())
        if not 0 <= value < self.action_spaces[agent].n:
            raise ValueError(f"action {value} for {agent} is outside Discrete({self.action_spaces[agent].n})")
        return value

    def _one_hot_cue(self) -> np.ndarray:
        return np.eye(self.num_symbols, dtype=np.float32)[self._cue]

    def _fraction_elapsed(self) -> np.ndarray:
        return np.array([self._t / self.episode_length], dtype=np.float32)

    def _finish_step(self, agent: AgentID) -> int:
        return self.episode_length

    @abc.abstractmethod
    def _observe(self, agent: AgentID) -> np.ndarray:
        """What `agent` sees of the current cue (each game decides)."""

    @abc.abstractmethod
    def _rewards(self, actions: dict[AgentID, int]) -> dict[AgentID, float]:
        """Each present agent's reward for the actions taken on the current cue."""


class MatchingGame(_CueGame):
    """Cooperative: agent i must answer the cue c with action (c + i) % K; all share the team's hit rate.

    - Agents: `agent_0 .. agent_{n_agents-1}`.
    - Observation of agent i: `Box(0, 1, (K + n_agents + 1,), float32)` = one-hot(c), one-hot(i), and the
      fraction of the episode elapsed. The id matters: a policy shared by all agents that ignores it hits
      at most one agent's target per cue.
    - Action: `Discrete(K)`.
    - Reward, the same for every live agent: the fraction of live agents that hit their target this step.
    - Returns per agent (L = `episode_length`): optimal L; uniformly random L / K on average. With
      `leave_early=True` agent i is terminated and removed after L - i steps (agent 0 stays to the end), so
      its optimal return is L - i; the team reward then averages only over the agents still present.
    - The episode ends after L steps with `terminations` True, or `truncations` True if `truncate=True`
      (a time limit, so learners should bootstrap from the final observation instead of zero).
    """

    metadata: dict[str, Any] = {"name": "matching_v0", "render_modes": [], "is_parallelizable": True}

    def __init__(
        self,
        n_agents: int = 3,
        num_symbols: int = 4,
        episode_length: int = 8,
        leave_early: bool = False,
        truncate: bool = False,
        render_mode: str | None = None,
    ) -> None:
        super().__init__(num_symbols, episode_length, truncate, render_mode)
        if n_agents < 1:
            raise ValueError(f"n_agents must be at least 1 (got {n_agents})")
        if leave_early and n_agents > episode_length:
            raise ValueError(
                f"leave_early needs n_agents <= episode_length (got {n_agents} > {episode_length}): "
                f"agent i leaves after episode_length - i steps, which must be at least one"
            )
        self.n_agents = n_agents
        self.leave_early = leave_early
        self.possible_agents = [f"agent_{i}" for i in range(n_agents)]
        self._index = {a: i for i, a in enumerate(self.possible_agents)}
        obs_dim = num_symbols + n_agents + 1
        self.observation_spaces = {
            a: gym.spaces.Box(0.0, 1.0, (obs_dim,), np.float32) for a in self.possible_agents
        }
        self.action_spaces = {a: gym.spaces.Discrete(num_symbols) for a in self.possible_agents}
        self._ids = np.eye(n_agents, dtype=np.float32)

    def target(self, agent: AgentID) -> int:
        """The action that scores for `agent` on the current cue (for scripted play and tests)."""
        return (self._cue + self._index[agent]) % self.num_symbols

    def _finish_step(self, agent: AgentID) -> int:
        return self.episode_length - self._index[agent] if self.leave_early else self.episode_length

    def _observe(self, agent: AgentID) -> np.ndarray:
        return np.concatenate([self._one_hot_cue(), self._ids[self._index[agent]], self._fraction_elapsed()])

    def _rewards(self, actions: dict[AgentID, int]) -> dict[AgentID, float]:
        team = sum(action == self.target(a) for a, action in actions.items()) / len(actions)
        return dict.fromkeys(actions, float(team))


class TeamsGame(_CueGame):
    """Two teams, zero-sum: `agent_*` must answer the cue c with c, `adversary_*` with (c + 1) % K.

    - Agents: `adversary_0 .. adversary_{n-1}`, then `agent_0 .. agent_{n-1}` (n = `n_per_team`).
    - Observations: adversaries `Box(0, 1, (K,), float32)` = one-hot(c); agents `Box(0, 1, (K + 1,),
      float32)` = one-hot(c) and the fraction of the episode elapsed. The sizes differ on purpose, so the
      teams cannot share one network.
    - Action: `Discrete(K)` for everyone.
    - Reward: with hits_A agents and hits_B adversaries on target, each agent gets (hits_A - hits_B) / n and
      each adversary (hits_B - hits_A) / n; the rewards of all 2n agents sum to zero every step.
    - Returns per agent (L = `episode_length`): both teams random or both optimal: 0 on average. Trained
      agents against frozen uniformly random adversaries: L * (1 - 1/K) (agents always hit, adversaries
      hit 1/K of the time), and the same for trained adversaries against random agents.
    - Every agent stays for all L steps; the last step sets `terminations`, or `truncations` if
      `truncate=True`.
    """

    metadata: dict[str, Any] = {"name": "teams_v0", "render_modes": [], "is_parallelizable": True}

    def __init__(
        self,
        n_per_team: int = 2,
        num_symbols: int = 3,
        episode_length: int = 8,
        truncate: bool = False,
        render_mode: str | None = None,
    ) -> None:
        super().__init__(num_symbols, episode_length, truncate, render_mode)
        if n_per_team < 1:
            raise ValueError(f"n_per_team must be at least 1 (got {n_per_team})")
        self.n_per_team = n_per_team
        self.adversaries = [f"adversary_{i}" for i in range(n_per_team)]
        self.good_agents = [f"agent_{i}" for i in range(n_per_team)]
        self.possible_agents = self.adversaries + self.good_agents
        self.observation_spaces = {
            a: gym.spaces.Box(0.0, 1.0, (num_symbols,), np.float32) for a in self.adversaries
        }
        self.observation_spaces |= {
            a: gym.spaces.Box(0.0, 1.0, (num_symbols + 1,), np.float32) for a in self.good_agents
        }
        self.action_spaces = {a: gym.spaces.Discrete(num_symbols) for a in self.possible_agents}

    def target(self, agent: AgentID) -> int:
        """The action that scores for `agent`'s team on the current cue (for scripted play and tests)."""
        return (self._cue + 1) % self.num_symbols if agent.startswith("adversary") else self._cue

    def _observe(self, agent: AgentID) -> np.ndarray:
        if agent.startswith("adversary"):
            return self._one_hot_cue()
        return np.concatenate([self._one_hot_cue(), self._fraction_elapsed()])

    def _rewards(self, actions: dict[AgentID, int]) -> dict[AgentID, float]:
        hits_a = sum(actions[a] == self.target(a) for a in self.good_agents)
        hits_b = sum(actions[a] == self.target(a) for a in self.adversaries)
        margin = (hits_a - hits_b) / self.n_per_team
        return {a: float(-margin if a.startswith("adversary") else margin) for a in actions}


def matching_v0(**kwargs: Any) -> MatchingGame:
    """Build a `MatchingGame`; the `_v0` name follows PettingZoo's convention for env constructors."""
    return MatchingGame(**kwargs)


def teams_v0(**kwargs: Any) -> TeamsGame:
    """Build a `TeamsGame`; the `_v0` name follows PettingZoo's convention for env constructors."""
    return TeamsGame(**kwargs)


class TurnGame(AECEnv):
    """Turn-based (AEC), two players, scripted rewards: a probe for how a turn-based game's rewards reach
    each player and how each player's moves bootstrap from its own next move.

    - Agents `first` and `second` move in turn, `first` opening; a game lasts `length` moves in all.
    - Observation of either agent: `{"observation": Box(0, length, (2,), float32), "action_mask":
      Box(0, 1, (3,), int8)}`; `observation` = (moves made so far k, the observer's seat 0/1), the mask
      (the mover's only; all zeros for the agent that waits) forbids action k % 3. An illegal move raises
      ValueError, so a run that takes one fails.
    - Rewards after each move: the mover `move_reward`, the other agent `wait_reward`; the last move
      instead gives the mover `win_reward` and the other `-win_reward` (the loser learns it only after
      the opponent's move). Both agents are terminated together after the last move.
    """

    metadata: dict[str, Any] = {"name": "turn_v0", "render_modes": [], "is_parallelizable": False}

    def __init__(
        self,
        length: int = 4,
        move_reward: float = 1.0,
        wait_reward: float = 0.5,
        win_reward: float = 10.0,
        render_mode: str | None = None,
    ) -> None:
        super().__init__()
        if length < 1:
            raise ValueError(f"length must be at least 1 (got {length})")
        self.length = length
        self.move_reward, self.wait_reward, self.win_reward = move_reward, wait_reward, win_reward
        self.render_mode = render_mode
        self.possible_agents = ["first", "second"]
        obs = gym.spaces.Dict(
            {
                "observation": gym.spaces.Box(0.0, float(length), (2,), np.float32),
                "action_mask": gym.spaces.Box(0, 1, (3,), np.int8),
            }
        )
        self.observation_spaces = dict.fromkeys(self.possible_agents, obs)
        self.action_spaces = {a: gym.spaces.Discrete(3) for a in self.possible_agents}
        self.moves = 0

    def observation_space(self, agent: AgentID) -> gym.Space:
        return self.observation_spaces[agent]

    def action_space(self, agent: AgentID) -> gym.Space:
        return self.action_spaces[agent]

    def legal(self) -> np.ndarray:
        mask = np.ones(3, dtype=np.int8)
        mask[self.moves % 3] = 0
        return mask

    def observe(self, agent: AgentID) -> dict[str, np.ndarray]:
        seat = self.possible_agents.index(agent)
        mask = self.legal() if agent == self.agent_selection else np.zeros(3, dtype=np.int8)
        return {"observation": np.array([self.moves, seat], dtype=np.float32), "action_mask": mask}

    def reset(self, seed: int | None = None, options: dict | None = None) -> None:
        self.agents = list(self.possible_agents)
        self.moves = 0
        self.agent_selection = self.agents[0]
        self.rewards = dict.fromkeys(self.agents, 0.0)
        self._cumulative_rewards = dict.fromkeys(self.agents, 0.0)
        self.terminations = dict.fromkeys(self.agents, False)
        self.truncations = dict.fromkeys(self.agents, False)
        self.infos = {a: {} for a in self.agents}

    def step(self, action: int | None) -> None:
        mover = self.agent_selection
        if self.terminations[mover] or self.truncations[mover]:  # AEC: a finished agent steps with None
            self._was_dead_step(action)
            return
        other = self.agents[1 - self.agents.index(mover)]
        if not self.legal()[int(action)]:
            raise ValueError(f"illegal move {action} by {mover} at move {self.moves}")
        self.moves += 1
        if self.moves == self.length:
            self.rewards = {mover: self.win_reward, other: -self.win_reward}
            self.terminations = dict.fromkeys(self.agents, True)
        else:
            self.rewards = {mover: self.move_reward, other: self.wait_reward}
        for agent, reward in self.rewards.items():
            self._cumulative_rewards[agent] += reward
        self.agent_selection = other


def turn_v0(**kwargs: Any) -> TurnGame:
    """Build a `TurnGame` (AEC API)."""
    return TurnGame(**kwargs)
