"""PPO losses (seed 002), written as tensors in, scalar loss out, so they can be checked by hand."""

from __future__ import annotations

import torch
from torch import Tensor


def policy_loss(new_logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, clip_coef: float) -> Tensor:
    """Clipped surrogate objective, negated so that it is minimised."""
    ratio = (new_logprobs - old_logprobs).exp()
    surrogate = advantages * ratio
    clipped = advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)
    return -torch.min(surrogate, clipped).mean()


def value_loss(
    new_values: Tensor, old_values: Tensor, returns: Tensor, clip_coef: float, clip_vloss: bool
) -> Tensor:
    """MSE to the returns; with `clip_vloss`, the prediction may move at most `clip_coef` from the rollout's."""
    if clip_vloss:
        new_values = old_values + torch.clamp(new_values - old_values, -clip_coef, clip_coef)
    return (new_values - returns).pow(2).mean()


def entropy_loss(entropy: Tensor) -> Tensor:
    """Minimising this maximises entropy."""
    return -entropy.mean()


def normalize(advantages: Tensor, eps: float = 1e-8) -> Tensor:
    return (advantages - advantages.mean()) / (advantages.std() + eps)
