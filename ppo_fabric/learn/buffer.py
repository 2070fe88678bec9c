"""Rollout storage: one preallocated TensorDict of shape [T, E] per collecting rank, reused every rollout."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import torch
from tensordict import TensorDict

from ppo_fabric.models.agent import action_shape_dtype, obs_storage_dtype

TRAIN_KEYS = ("obs", "actions", "logprobs", "values", "advantages", "returns")
# What GAE was computed from: a feed-forward batch carries it when its learner's policy and critic will be
# newer than the collector's (the decoupled pipeline), to recompute the advantages (`update.lagged_batch`).
GAE_KEYS = ("rewards", "terminated", "truncated", "next_values")
STATE_KEY = ("extras", "state")  # the recurrent state each step started from: [T, E, 2, layers, hidden]


def rollout_storage(
    steps: int,
    num_envs: int,
    obs_space: gym.Space,
    action_space: gym.Space,
    device: torch.device | str,
    state_shape: tuple[int, ...] | None = None,
    masked: bool = False,
    action_mask: int | None = None,
) -> TensorDict:
    """Allocate the [T, E] rollout once; the rollout loop writes into it in place.

    `final_values` holds V(final observation) at steps whose episode was truncated (0 elsewhere), so GAE
    can bootstrap a time-limit cut without the observation itself being stored. A recurrent policy adds
    `extras/state` (`state_shape` per step); multi-agent rollouts, where a row is one agent of one env copy,
    add `mask`: False where the agent had left its episode and the step holds no transition. Envs with
    action masks (`action_mask`: their width) add `action_mask` [T, E, width], True where an action was legal
    at the step, so the update evaluates the policy under the masks the rollout sampled with.
    """
    action_shape, action_dtype = action_shape_dtype(action_space)
    te = (steps, num_envs)
    floats = {k: torch.zeros(te, device=device) for k in ("logprobs", "values", "rewards", "final_values")}
    floats["next_values"] = torch.zeros(te, device=device)  # what each step bootstraps from (GAE_KEYS)
    floats |= {k: torch.zeros(te, device=device) for k in ("advantages", "returns")}
    storage = TensorDict(
        {
            "obs": obs_storage(te, obs_space, device),
            "actions": torch.zeros(te + action_shape, dtype=action_dtype, device=device),
            "terminated": torch.zeros(te, dtype=torch.bool, device=device),
            "truncated": torch.zeros(te, dtype=torch.bool, device=device),
            **floats,
        },
        batch_size=te,
        device=device,
    )
    if state_shape is not None:
        storage[STATE_KEY] = torch.zeros(te + tuple(state_shape), device=device)
    if masked:
        storage["mask"] = torch.ones(te, dtype=torch.bool, device=device)
    if action_mask is not None:
        storage["action_mask"] = torch.ones(te + (int(action_mask),), dtype=torch.bool, device=device)
    return storage


def obs_storage(
    batch: tuple[int, ...], space: gym.Space, device: torch.device | str
) -> torch.Tensor | TensorDict:
    """Zeros for a batch of observations: pixels as uint8, other Boxes as float32, and a Dict space as a
    nested TensorDict with one entry per key (indexing, reshaping and shuffling treat it as one tensor)."""
    if isinstance(space, gym.spaces.Dict):
        parts = {k: obs_storage(batch, sub, device) for k, sub in space.spaces.items()}
        return TensorDict(parts, batch_size=batch, device=device)
    return torch.zeros(batch + tuple(space.shape), dtype=obs_storage_dtype(space), device=device)


def training_batch(storage: TensorDict, seq_len: int = 1, gae_inputs: bool = False) -> TensorDict:
    """What the update needs, with one entry per unit it shuffles.

    Feed-forward: the flat [T*E] view of the steps (no copy for the contiguous storage). Recurrent: [N]
    sequences of `seq_len` consecutive steps of one env (N = T/seq_len * E), each with the state stored at
    its first step (`initial_state`) and `starts` marking steps that begin an episode inside it, so the
    update rebuilds exactly the states the rollout acted with. `gae_inputs` adds `GAE_KEYS` to a
    feed-forward batch.
    """
    present = storage.keys()
    keys = [*TRAIN_KEYS, *(k for k in ("mask", "action_mask") if k in present)]
    if STATE_KEY not in storage.keys(include_nested=True):
        return storage.select(*keys, *(GAE_KEYS if gae_inputs else ())).reshape(-1)
    steps, num_envs = storage.batch_size
    if steps % seq_len:
        raise ValueError(f"rollout_steps={steps} is not a multiple of model.lstm.seq_len={seq_len}")
    chunks = steps // seq_len
    done = storage["terminated"] | storage["truncated"]
    starts = torch.zeros_like(done)
    starts[1:] = done[:-1]  # step 0's stored state already accounts for an episode that ended before it

    def sequences(x: torch.Tensor | TensorDict) -> torch.Tensor | TensorDict:
        x = x.reshape(chunks, seq_len, num_envs, *x.shape[2:])
        return x.transpose(1, 2).reshape(chunks * num_envs, seq_len, *x.shape[3:])

    parts = {k: sequences(storage[k]) for k in keys}
    parts["starts"] = sequences(starts)
    state = storage[STATE_KEY][::seq_len]
    parts["initial_state"] = state.reshape(chunks * num_envs, *state.shape[2:])
    return TensorDict(parts, batch_size=[chunks * num_envs], device=storage.device)


class MultiAgentRolloutBuffer:
    """A per-agent view of the rollout loop's per-policy storages: agent `a` of env copy `e` is `(a, e)`,
    and its row is a column of its policy's storage, so its policy batch and its own trajectory are the
    same memory. An "episode" here is a rollout of every agent, closed by `end_episode()`, which records
    each agent's length and reward (steps its `mask` marks present only). `extras` hold controller state
    per agent: `prev_hidden_states` and `prev_cell_states` of an LSTM.
    """

    FIELDS = ("states", "state_values", "actions", "log_probs", "rewards", "next_states",
              "next_state_values", "dones")  # fmt: skip

    def __init__(
        self, storages: dict[str, TensorDict], groups: dict[str, list[str]], num_envs: int, gamma: float
    ) -> None:
        self.gamma = gamma  # the tail's bootstrap value is read back from its advantage
        self.episodes: list[dict[str, Any]] = []
        self._rows: dict[Any, tuple[TensorDict, int]] = {}  # agent -> (its policy's storage, column)
        for policy, agents in groups.items():
            for e in range(num_envs):
                for j, agent in enumerate(agents):
                    self._rows[(agent, e)] = (storages[policy], e * len(agents) + j)
        self._length = 0

    @property
    def agents(self) -> list[Any]:
        return list(self._rows)

    def mark_collected(self, steps: int) -> None:
        """The rollout loop filled `steps` steps of every agent's row."""
        self._length = steps

    def trajectory(self, agent: Any) -> TensorDict:
        """One agent's steps of the current episode, in order: [steps] (absent steps left out)."""
        storage, column = self._rows[agent]
        rows = storage[: self._length, column]
        return rows[rows["mask"]] if "mask" in rows.keys() else rows  # noqa: SIM118

    @property
    def current_episode(self) -> dict[str, Any]:
        """Per field a list over agents of [steps] tensors, and `extras` (per-agent trajectories, as code
        written for per-agent buffers reads them)."""
        out: dict[str, Any] = {name: [] for name in self.FIELDS}
        extras: dict[str, list] = {}
        for agent in self.agents:
            steps = self.trajectory(agent)
            done = steps["terminated"] | steps["truncated"]
            out["states"].append(steps["obs"])
            out["state_values"].append(steps["values"])
            out["actions"].append(steps["actions"])
            out["log_probs"].append(steps["logprobs"])
            out["rewards"].append(steps["rewards"])
            out["dones"].append(done)
            out["next_states"].append(None)
            out["next_state_values"].append(self._next_values(steps))
            for key, value in _extras(steps).items():
                extras.setdefault(key, []).append(value)
        out["extras"] = extras
        return out

    def _next_values(self, steps: TensorDict) -> torch.Tensor:
        """The value each step's advantage bootstrapped from: the agent's next step's, 0 at a termination,
        the final observation's at a truncation, and at the rollout's end the bootstrap GAE used (from
        A = r + gamma * V_next - V, its one-step advantage there)."""
        values = steps["values"]
        out = torch.empty_like(values)
        if values.shape[0]:
            out[:-1] = values[1:]
            # with gamma 0 no value is bootstrapped from (any would do): 0
            out[-1] = (
                (steps["advantages"][-1] - steps["rewards"][-1] + values[-1]) / self.gamma
                if self.gamma
                else 0.0
            )
        out = torch.where(steps["truncated"].bool(), steps["final_values"], out)
        return torch.where(steps["terminated"].bool(), torch.zeros_like(out), out)

    def end_episode(self) -> dict[str, Any]:
        """Close the current episode: each agent's and the average length and reward; kept in `episodes`."""
        lengths, rewards = [], []
        for agent in self.agents:
            steps = self.trajectory(agent)
            lengths.append(int(steps.batch_size[0]))
            rewards.append(float(steps["rewards"].sum()) if lengths[-1] else 0.0)
        summary = {
            "agents": self.agents,
            "episode_length": lengths,
            "episode_reward": rewards,
            "average_episode_length": sum(lengths) / max(len(lengths), 1),
            "average_episode_reward": sum(rewards) / max(len(rewards), 1),
        }
        self.episodes.append(summary)
        return summary


def _extras(steps: TensorDict) -> dict[str, torch.Tensor]:
    """Controller state per step (LSTM: previous hidden and cell states)."""
    if STATE_KEY in steps.keys(include_nested=True):
        state = steps[STATE_KEY]  # [steps, 2 * cores, layers, hidden]: (h, c) of each LSTM in turn
        return {"prev_hidden_states": state[:, 0::2], "prev_cell_states": state[:, 1::2]}
    return {}
