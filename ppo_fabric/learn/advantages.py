"""Generalised Advantage Estimation with terminated and truncated kept apart."""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import Tensor


def bootstrap_values(
    values: Tensor, terminated: Tensor, truncated: Tensor, final_values: Tensor, next_value: Tensor
) -> Tensor:
    """[T, E]: the value each step of a rollout bootstraps from (see `gae`), 0 after a termination."""
    next_values = torch.cat((values[1:], next_value.unsqueeze(0)), 0)
    next_values = torch.where(truncated, final_values, next_values)
    return torch.where(terminated, torch.zeros_like(next_values), next_values)


def reverse_scan(deltas: Tensor, carry: Tensor) -> Tensor:
    """A[t] = deltas[t] + carry[t] * A[t+1] over the first dimension, A[T] = 0, in log2(T) rounds.

    Each round doubles how far every row has summed: a row holding A[t] = D + C * A[t+w] takes the row w
    ahead into it (Hillis-Steele scan of the affine maps). ~6 ops a round instead of one op per step: a
    128 x 4 rollout in 84 us instead of 304 (the step loop), 1024 x 16 in 0.17 ms instead of 2.5, and
    2048 x 1 in 0.14 ms instead of 7.4 (2 cores, one thread); the sums associate differently, so the
    results differ from the loop's in the last float32 bits (~1e-6).
    """
    adv, coef = deltas, carry
    width, steps = 1, deltas.shape[0]
    while width < steps:
        # rows within `width` of the end already hold their whole sum (nothing lies beyond the rollout)
        adv = torch.cat((torch.addcmul(adv[:-width], coef[:-width], adv[width:]), adv[-width:]))
        if 2 * width < steps:
            coef = torch.cat((coef[:-width] * coef[width:], coef[-width:]))
        width *= 2
    return adv


def gae(
    rewards: Tensor,
    values: Tensor,
    terminated: Tensor,
    truncated: Tensor,
    final_values: Tensor,
    next_value: Tensor,
    gamma: float,
    gae_lambda: float,
    mask: Tensor | None = None,
    traces: Tensor | None = None,
    bootstrap_out: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Advantages and returns over a [T, E] rollout.

    The value each step bootstraps from: 0 after a termination, V(final observation) after a truncation
    (`final_values`), otherwise the value of the next stored step, and V(next_obs) (`next_value`, [E]) for
    the unfinished tail. Advantages never flow backwards across an episode end of either kind.

    With a `mask` ([T, E], multi-agent rows) a column's chain runs over its masked steps only: a step
    bootstraps from the column's next masked step (or `next_value`), and unmasked steps are skipped,
    with advantage 0. In a turn-based game that is each agent's own decisions, so an agent's next value
    is its own next decision's, never the opponent's; for agents that left a simultaneous-move episode
    it changes nothing, since their last step is terminated.

    `traces` ([T, E], unmasked rollouts): step t takes `traces[t]` times the usual share of the advantage
    of step t+1. Truncated importance ratios there (V-trace's c = min(1, pi / mu) of the next step's action)
    cut the lambda-return of a rollout collected by an older policy where the policy now acts otherwise;
    ones give plain GAE. `bootstrap_out` ([T, E], unmasked rollouts) receives the value each step
    bootstrapped from (`bootstrap_values`).
    """
    done = terminated | truncated
    if mask is None:
        next_values = bootstrap_values(values, terminated, truncated, final_values, next_value)
        if bootstrap_out is not None:
            bootstrap_out.copy_(next_values)
        deltas = rewards + gamma * next_values - values
        carry = (~done).to(values.dtype) * (gamma * gae_lambda)
        if traces is not None:
            carry = carry * traces
        advantages = reverse_scan(deltas, carry)
        return advantages, advantages + values
    advantages = torch.zeros_like(values)
    last = torch.zeros_like(next_value)
    following = next_value  # per column: the value of its next masked step
    for t in range(values.shape[0] - 1, -1, -1):
        nv = torch.where(truncated[t], final_values[t], following)
        nv = torch.where(terminated[t], torch.zeros_like(nv), nv)
        delta = rewards[t] + gamma * nv - values[t]
        adv = delta + (~done[t]).to(values.dtype) * (gamma * gae_lambda) * last
        m = mask[t]
        advantages[t] = torch.where(m, adv, advantages[t])
        last = torch.where(m, adv, last)
        following = torch.where(m, values[t], following)
    return advantages, advantages + values


def compute_advantages(storage: TensorDict, next_value: Tensor, gamma: float, gae_lambda: float) -> None:
    """Fill `advantages` and `returns` of a rollout storage in place (per agent chain when it has a `mask`),
    and `next_values` where the storage has them (each step's bootstrap value, which a learner whose critic
    is newer than this one needs where it cannot evaluate the next observation itself)."""
    adv, ret = gae(
        storage["rewards"],
        storage["values"],
        storage["terminated"],
        storage["truncated"],
        storage["final_values"],
        next_value,
        gamma,
        gae_lambda,
        storage.get("mask", None),
        bootstrap_out=storage.get("next_values", None),
    )
    storage["advantages"].copy_(adv)
    storage["returns"].copy_(ret)
