"""Generalised Advantage Estimation with terminated and truncated kept apart."""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import Tensor


def gae(
    rewards: Tensor,
    values: Tensor,
    terminated: Tensor,
    truncated: Tensor,
    final_values: Tensor,
    next_value: Tensor,
    gamma: float,
    gae_lambda: float,
) -> tuple[Tensor, Tensor]:
    """Advantages and returns over a [T, E] rollout.

    The value each step bootstraps from: 0 after a termination, V(final observation) after a truncation
    (`final_values`), otherwise the value of the next stored step, and V(next_obs) (`next_value`, [E]) for
    the unfinished tail. Advantages never flow backwards across an episode end of either kind.
    """
    done = terminated | truncated
    next_values = torch.cat((values[1:], next_value.unsqueeze(0)), 0)
    next_values = torch.where(truncated, final_values, next_values)
    next_values = torch.where(terminated, torch.zeros_like(next_values), next_values)
    deltas = rewards + gamma * next_values - values
    carry = (~done).to(values.dtype) * (gamma * gae_lambda)
    advantages = torch.empty_like(values)
    last = torch.zeros_like(next_value)
    for t in range(values.shape[0] - 1, -1, -1):
        last = torch.addcmul(deltas[t], carry[t], last)
        advantages[t] = last
    return advantages, advantages + values


def compute_advantages(storage: TensorDict, next_value: Tensor, gamma: float, gae_lambda: float) -> None:
    """Fill `advantages` and `returns` of a rollout storage in place."""
    adv, ret = gae(
        storage["rewards"],
        storage["values"],
        storage["terminated"],
        storage["truncated"],
        storage["final_values"],
        next_value,
        gamma,
        gae_lambda,
    )
    storage["advantages"].copy_(adv)
    storage["returns"].copy_(ret)
