"""PPO losses: clipped surrogate, (optionally clipped) value loss, entropy bonus. Tensors in, scalar
loss out, so each can be checked by hand.

Each takes an optional boolean `mask` of the steps that hold a transition (multi-agent rollouts keep a
row for an agent after it has left its episode); means run over those steps only.
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked_mean(x: Tensor, mask: Tensor | None) -> Tensor:
    """Mean over the masked steps; an empty mask gives 0 (still connected to the graph, so DDP's
    backward runs on every rank)."""
    if mask is None:
        return x.mean()
    count = mask.sum().to(x.dtype).clamp(min=1.0)
    return torch.where(mask, x, torch.zeros_like(x)).sum() / count  # where, not *: absent steps may hold inf


def policy_loss(
    new_logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    clip_coef: float,
    mask: Tensor | None = None,
    weights: Tensor | None = None,
) -> Tensor:
    """Clipped surrogate objective, negated so that it is minimised.

    `old_logprobs` are those of the policy the clip range is centred on. Plain PPO centres it on the
    behaviour policy that collected the batch. The decoupled objective (Hilton, Cobbe and Schulman 2021)
    centres it on a proximal policy (the learner's parameters when the update started) and multiplies each
    step's term by `weights`, the (truncated) importance ratio proximal / behaviour, so a batch collected by
    an older policy still moves the learner by a trust region around where it is now.
    """
    if weights is not None:  # w * min(r A, clip(r) A) = min(r wA, clip(r) wA) for w >= 0: no autograd op
        advantages = advantages * weights
    ratio = (new_logprobs - old_logprobs).exp()
    surrogate = advantages * ratio
    clipped = advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)
    return -masked_mean(torch.min(surrogate, clipped), mask)


def importance_weights(ratio: Tensor, max_weight: float) -> tuple[Tensor, Tensor]:
    """The decoupled objective's per-step weights from `ratio` = pi_proximal / pi_behaviour: truncated at
    `max_weight` (V-trace's rho-bar: a step the learner now favours far more than its collector did cannot
    dominate a minibatch), and which steps the truncation cut."""
    return ratio.clamp(max=max_weight), ratio > max_weight


def value_loss(
    new_values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    clip_coef: float,
    clip_vloss: bool,
    mask: Tensor | None = None,
) -> Tensor:
    """MSE to the returns. With `clip_vloss` (PPO2's and CleanRL's clipped value loss), each step's error is
    the larger of the unclipped one and that of the prediction clamped to within `clip_coef` of the rollout's
    value: a pessimistic bound, so a prediction that moved too far is still pulled back by its gradient
    (clamping alone would cut that gradient to zero)."""
    error = (new_values - returns).pow(2)
    if clip_vloss:
        clamped = old_values + torch.clamp(new_values - old_values, -clip_coef, clip_coef)
        error = torch.max(error, (clamped - returns).pow(2))
    return masked_mean(error, mask)


def entropy_loss(entropy: Tensor, mask: Tensor | None = None) -> Tensor:
    """Minimising this maximises entropy."""
    return -masked_mean(entropy, mask)


def normalize(advantages: Tensor, eps: float = 1e-8, mask: Tensor | None = None) -> Tensor:
    if mask is None:
        return (advantages - advantages.mean()) / (advantages.std() + eps)
    mean = masked_mean(advantages, mask)
    count = mask.sum().clamp(min=2)
    std = (
        torch.where(mask, advantages - mean, torch.zeros_like(advantages)).pow(2).sum() / (count - 1)
    ).sqrt()
    return (advantages - mean) / (std + eps)
