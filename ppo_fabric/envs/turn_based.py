"""Turn-based PettingZoo games (the AEC API: connect_four_v3, tictactoe_v3, ...) as a vector env with the
same rows and per-policy results as `multiagent.MultiAgentVectorEnv`, so the one rollout loop serves both.

One env step is one agent's move: in each of the `num_envs` copies the agent whose turn it is
(`agent_selection`) acts, every other row of that copy waits. `alive` marks the rows that act at the next
step, so the rollout stores only movers' steps as transitions (`mask`); waiting rows' actions are ignored.

Rewards reach the agent that earned them: `step` reports, per row, the reward PettingZoo assigned to that
agent during this move, whoever moved. A waiting agent's reward (a loss decided by the opponent's move)
is reported in a row that did not act; `info["acted"]` tells the rollout loop so, and it adds that reward
(and the end of the episode) to the agent's own last decision (`rollout.credit_waiting`).

A game ends for every player at once: as soon as any agent is terminated or truncated, every agent of the
copy gets its episode end, its return and its length (its own moves), and the copy restarts.

With `opening_moves` = N every game (after each reset) starts with 0..N uniformly random legal moves that
belong to nobody: no transition, no reward, no length. Self-play's second seat otherwise meets only the
lines its sparring partners open with and learns those, not the game (docs/how-to/multi-agent.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

from ppo_fabric.envs.agent_data import agent_row, reward_value, store_row
from ppo_fabric.envs.make import ACTION_MASK, EnvError, env_action
from ppo_fabric.envs.traits import TURN_BASED

OPENING_TRIES = 1000  # random openings discarded in a row (they ended the game) before the length is refused

TURN = "acted"  # the info key: rows whose agent moved at this step
OBSERVATION = "observation"  # the key of a PettingZoo game's observation beside its action_mask


def split_observation_space(space: gym.Space, masked: bool) -> tuple[gym.Space, int | None]:
    """A turn-based agent's (policy observation space, action-mask width): PettingZoo games observe
    `{"observation", "action_mask"}`; with masks on the policy sees `observation` only and the mask
    restricts its actions. Other spaces (and masks off) are observed whole."""
    if masked and isinstance(space, gym.spaces.Dict) and ACTION_MASK in space.spaces:
        rest = {k: sub for k, sub in space.spaces.items() if k != ACTION_MASK}
        width = int(np.prod(space.spaces[ACTION_MASK].shape))
        if list(rest) == [OBSERVATION]:
            return rest[OBSERVATION], width
        return gym.spaces.Dict(rest), width
    return space, None


class TurnBasedVectorEnv:
    """`num_envs` copies of an AEC env; per policy, `step` returns (obs, rewards, terminated, truncated,
    info) with the `MultiAgentVectorEnv` info keys plus `acted` and, with masks, `action_mask` (the legal
    moves of each row's next observation; all True for rows that wait, whose action is never used)."""

    traits = TURN_BASED

    def __init__(
        self,
        factories: list[Callable[[], Any]],
        groups: dict[str, list[str]],
        masked: bool,
        opening_moves: int = 0,
    ) -> None:
        self.factories = factories
        self.envs = [factory() for factory in factories]
        self.num_envs = len(self.envs)
        self.opening_moves = int(opening_moves)
        self._rng = (
            np.random.default_rng()
        )  # the openings' draws; `reset(seed)` seeds it, checkpoints keep it
        # each copy's reset seed and moves since: PettingZoo's games pickle as a fresh env (EzPickle), so a
        # checkpoint keeps the moves and `__setstate__` replays them
        self._seeds: list[int | None] = [None] * self.num_envs
        self._moves: list[list[Any]] = [[] for _ in range(self.num_envs)]
        self.groups = groups
        first = self.envs[0]
        self.action_spaces = {p: first.action_space(a[0]) for p, a in groups.items()}
        if self.opening_moves and not all(
            isinstance(a, gym.spaces.Discrete) for a in self.action_spaces.values()
        ):
            raise EnvError("selfplay.opening_moves needs a game whose moves are Discrete actions")
        split = {p: split_observation_space(first.observation_space(a[0]), masked) for p, a in groups.items()}
        self.observation_spaces = {p: space for p, (space, _) in split.items()}
        self.mask_widths = {p: width for p, (_, width) in split.items()}
        self._rows = [
            {
                agent: (p, e * len(agents) + j)
                for p, agents in groups.items()
                for j, agent in enumerate(agents)
            }
            for e in range(self.num_envs)
        ]
        self._size = {p: self.num_envs * len(a) for p, a in groups.items()}
        self._returns = {p: np.zeros(n) for p, n in self._size.items()}
        self._lengths = {p: np.zeros(n, dtype=np.int64) for p, n in self._size.items()}
        self.alive: dict[str, np.ndarray] = {}
        self.action_masks: dict[str, np.ndarray] = {}

    def _zeros(self, policy: str) -> Any:
        space, n = self.observation_spaces[policy], self._size[policy]
        if isinstance(space, gym.spaces.Dict):
            return {k: np.zeros((n, *s.shape), dtype=s.dtype) for k, s in space.spaces.items()}
        return np.zeros((n, *space.shape), dtype=space.dtype)

    def _observe(self, e: int, obs: dict[str, Any]) -> None:
        """Write every agent's observation of copy `e`, its mask, and who moves next."""
        env = self.envs[e]
        for agent in env.agents:
            p, row = agent_row(self._rows[e], agent, e)
            value = env.observe(agent)
            to_move = agent == env.agent_selection
            self.alive[p][row] = to_move
            if self.mask_widths[p] is not None:
                if to_move:
                    mask = np.asarray(value[ACTION_MASK], dtype=bool)
                    store_row(self.action_masks[p], row, mask, e, agent, "an action mask", "action_space")
                else:
                    self.action_masks[p][row] = True
                value = value[OBSERVATION] if not isinstance(obs[p], dict) else value
            if isinstance(obs[p], dict):
                for k in obs[p]:
                    store_row(
                        obs[p][k], row, value[k], e, agent, f'observation["{k}"]', f'observation_space["{k}"]'
                    )
            else:
                store_row(obs[p], row, value, e, agent)

    def _fresh(self) -> dict[str, Any]:
        self.alive = {p: np.zeros(n, dtype=bool) for p, n in self._size.items()}
        self.action_masks = {
            p: np.ones((n, self.mask_widths[p] or 0), dtype=bool) for p, n in self._size.items()
        }
        return {p: self._zeros(p) for p in self.groups}

    def reset(self, seed: list[int] | None = None) -> dict[str, Any]:
        obs = self._fresh()
        if seed is not None:
            self._rng = np.random.default_rng([int(s) for s in seed])
        for e, env in enumerate(self.envs):
            self._seeds[e] = None if seed is None else int(seed[e])
            self._moves[e] = []
            env.reset(seed=self._seeds[e])
            self._open(e)
            self._observe(e, obs)
        for p in self.groups:
            self._returns[p][:] = 0
            self._lengths[p][:] = 0
        return obs

    def step(self, actions: list[np.ndarray]) -> list[tuple[Any, ...]]:
        by_policy = dict(zip(self.groups, actions, strict=True))
        size = self._size
        rew = {p: np.zeros(n, dtype=np.float32) for p, n in size.items()}
        term = {p: np.zeros(n, dtype=bool) for p, n in size.items()}
        trunc = {p: np.zeros(n, dtype=bool) for p, n in size.items()}
        acted = {p: np.zeros(n, dtype=bool) for p, n in size.items()}
        ended = {p: np.zeros(n, dtype=bool) for p, n in size.items()}
        final_obs = {p: np.empty(n, dtype=object) for p, n in size.items()}
        ep_r = {p: np.zeros(n) for p, n in size.items()}
        ep_l = {p: np.zeros(n, dtype=np.int64) for p, n in size.items()}
        obs = self._fresh()
        for e, env in enumerate(self.envs):
            rows = self._rows[e]
            mover = env.agent_selection
            p, row = agent_row(rows, mover, e)
            acted[p][row] = True
            self._lengths[p][row] += 1
            move = env_action(by_policy[p][row])
            self._moves[e].append(move)
            env.step(move)
            over = any(env.terminations.values()) or any(env.truncations.values())
            for agent, (q, r) in rows.items():
                reward = reward_value(env.rewards.get(agent, 0.0), e, agent)  # a removed agent has none
                rew[q][r] = reward
                self._returns[q][r] += reward
                if over:
                    term[q][r] = bool(env.terminations.get(agent, False))
                    trunc[q][r] = not term[q][r]  # the game ended for everyone; this agent's part was cut
                    if trunc[q][r]:
                        final_obs[q][r] = self._final_obs(env, agent, q)
                    ended[q][r] = True
                    ep_r[q][r], ep_l[q][r] = self._returns[q][r], self._lengths[q][r]
                    self._returns[q][r], self._lengths[q][r] = 0.0, 0
            if over:
                env.reset()
                self._seeds[e], self._moves[e] = None, []
                self._open(e)
            self._observe(e, obs)
        return [
            (
                obs[p],
                rew[p],
                term[p],
                trunc[p],
                {
                    "final_obs": final_obs[p],
                    "alive": self.alive[p].copy(),
                    TURN: acted[p],
                    "episode": {"r": ep_r[p], "l": ep_l[p]},
                    "_episode": ended[p],
                    **({ACTION_MASK: self.action_masks[p].copy()} if self.mask_widths[p] is not None else {}),
                },
            )
            for p in self.groups
        ]

    def _open(self, e: int) -> None:
        """Play copy `e`'s random opening (0..`opening_moves` legal moves, drawn uniformly), recorded in its
        moves so that a checkpoint replays it. An opening that ends the game is discarded and drawn again
        (a draw of no moves always ends the loop). `OPENING_TRIES` discarded in a row is an opening too long
        for the game (it would redraw for ever): one line, not a hang."""
        env = self.envs[e]
        done, tries = False, 0
        while not done:
            done, tries = True, tries + 1
            if tries > OPENING_TRIES:
                raise EnvError(
                    f"selfplay.opening_moves={self.opening_moves}: {OPENING_TRIES} random openings in a row "
                    "ended the game before it began; use fewer opening moves"
                )
            for _ in range(int(self._rng.integers(0, self.opening_moves + 1))):
                value = env.observe(env.agent_selection)
                legal = (
                    np.flatnonzero(value[ACTION_MASK])
                    if isinstance(value, dict) and ACTION_MASK in value
                    else np.arange(int(env.action_space(env.agent_selection).n))
                )
                move = int(self._rng.choice(legal))
                self._moves[e].append(move)
                env.step(move)
                if any(env.terminations.values()) or any(env.truncations.values()):
                    env.reset()
                    self._seeds[e], self._moves[e], done = None, [], False
                    break

    def _final_obs(self, env: Any, agent: str, policy: str) -> Any:
        value = env.observe(agent)
        if self.mask_widths[policy] is not None and not isinstance(
            self.observation_spaces[policy], gym.spaces.Dict
        ):
            return value[OBSERVATION]
        if isinstance(value, dict) and self.mask_widths[policy] is not None:
            return {k: v for k, v in value.items() if k != ACTION_MASK}
        return value

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "envs"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild every copy and replay its game so far: exact for deterministic games (board games)."""
        self.__dict__.update(state)
        self.envs = [factory() for factory in self.factories]
        for e, env in enumerate(self.envs):
            env.reset(seed=self._seeds[e])
            for move in self._moves[e]:
                env.step(move)

    def close(self) -> None:
        for env in self.envs:
            env.close()
