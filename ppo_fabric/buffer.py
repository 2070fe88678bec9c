"""Rollout storage: one preallocated TensorDict of shape [T, E] per collecting rank, reused every rollout."""

from __future__ import annotations

import gymnasium as gym
import torch
from tensordict import TensorDict

from ppo_fabric.agent import action_shape_dtype, obs_storage_dtype

TRAIN_KEYS = ("obs", "actions", "logprobs", "values", "advantages", "returns")
STATE_KEY = ("extras", "state")  # the recurrent state each step started from: [T, E, 2, layers, hidden]


def rollout_storage(
    steps: int,
    num_envs: int,
    obs_space: gym.Space,
    action_space: gym.Space,
    device: torch.device | str,
    state_shape: tuple[int, ...] | None = None,
    masked: bool = False,
) -> TensorDict:
    """Allocate the [T, E] rollout once; the rollout loop writes into it in place.

    `final_values` holds V(final observation) at steps whose episode was truncated (0 elsewhere), so GAE
    can bootstrap a time-limit cut without the observation itself being stored. A recurrent policy adds
    `extras/state` (`state_shape` per step); multi-agent rollouts, where a row is one agent of one env copy,
    add `mask`: False where the agent had left its episode and the step holds no transition.
    """
    action_shape, action_dtype = action_shape_dtype(action_space)
    te = (steps, num_envs)
    floats = {k: torch.zeros(te, device=device) for k in ("logprobs", "values", "rewards", "final_values")}
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


def training_batch(storage: TensorDict, seq_len: int = 1) -> TensorDict:
    """What the update needs, with one entry per unit it shuffles.

    Feed-forward: the flat [T*E] view of the steps (no copy for the contiguous storage). Recurrent: [N]
    sequences of `seq_len` consecutive steps of one env (N = T/seq_len * E), each with the state stored at
    its first step (`initial_state`) and `starts` marking steps that begin an episode inside it, so the
    update rebuilds exactly the states the rollout acted with.
    """
    keys = [*TRAIN_KEYS, "mask"] if "mask" in storage.keys() else list(TRAIN_KEYS)  # noqa: SIM118 (TensorDict refuses `in`)
    if STATE_KEY not in storage.keys(include_nested=True):
        return storage.select(*keys).reshape(-1)
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
