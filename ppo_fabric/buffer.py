"""Rollout storage: one preallocated TensorDict of shape [T, E] per collecting rank, reused every rollout."""

from __future__ import annotations

import gymnasium as gym
import torch
from tensordict import TensorDict

from ppo_fabric.agent import action_shape_dtype, obs_storage_dtype

TRAIN_KEYS = ("obs", "actions", "logprobs", "values", "advantages", "returns")


def rollout_storage(
    steps: int, num_envs: int, obs_space: gym.Space, action_space: gym.Space, device: torch.device | str
) -> TensorDict:
    """Allocate the [T, E] rollout once; the rollout loop writes into it in place.

    `final_values` holds V(final observation) at steps whose episode was truncated (0 elsewhere), so GAE
    can bootstrap a time-limit cut without the observation itself being stored.
    """
    action_shape, action_dtype = action_shape_dtype(action_space)
    te = (steps, num_envs)
    floats = {k: torch.zeros(te, device=device) for k in ("logprobs", "values", "rewards", "final_values")}
    floats |= {k: torch.zeros(te, device=device) for k in ("advantages", "returns")}
    return TensorDict(
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


def obs_storage(
    batch: tuple[int, ...], space: gym.Space, device: torch.device | str
) -> torch.Tensor | TensorDict:
    """Zeros for a batch of observations: pixels as uint8, other Boxes as float32, and a Dict space as a
    nested TensorDict with one entry per key (indexing, reshaping and shuffling treat it as one tensor)."""
    if isinstance(space, gym.spaces.Dict):
        parts = {k: obs_storage(batch, sub, device) for k, sub in space.spaces.items()}
        return TensorDict(parts, batch_size=batch, device=device)
    return torch.zeros(batch + tuple(space.shape), dtype=obs_storage_dtype(space), device=device)


def training_batch(storage: TensorDict) -> TensorDict:
    """The flat [T*E] view of what the update needs (no copy for the contiguous storage)."""
    return storage.select(*TRAIN_KEYS).reshape(-1)
