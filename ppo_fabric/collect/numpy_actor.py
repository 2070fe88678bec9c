"""The rollout's actions on the CPU, sampled with NumPy from the policy's own parameters.

Why: a CPU rollout step over a few envs is bound by per-call overheads, not arithmetic. On a 2-core AMD EPYC
(CartPole, 4 envs, the CleanRL 64x64 tanh actor) the torch actor takes ~36 us a step alone and gymnasium's
vector step ~52 us alone, but ~146 us when the two alternate, as they do in a rollout: torch's dispatcher and
gymnasium's Python evict each other from the caches. The same actor in NumPy takes ~18 us alone and ~82 us
alternating with gymnasium, whose own code is NumPy (`benchmarks/results/numpy_rollout.md`). So a
feed-forward MLP policy on the CPU acts through this class: the same arithmetic as `ActorCritic.sample`, on
NumPy views of the same parameter tensors (no copies to keep in sync), while the values, GAE and every loss
stay in torch.

The random draws are the head's own (`models.agent.rollout_noise`: torch's generator, one call per rollout, a
few for very large ones), the same the torch rollout samples with, so `algo.numpy_rollout=false`, which
turns this off, changes the speed and not the actions drawn; and the checkpointed torch RNG state is all an
exact resume needs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from ppo_fabric.compat.private import linear_parameters
from ppo_fabric.models.agent import (
    LOG_SQRT_2PI,
    ActorCritic,
    CategoricalHead,
    FlattenEncoder,
    GaussianHead,
)


def _relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0, out=x)


# torch activation -> its NumPy twin; an activation missing here keeps the torch path (elu, gelu)
_ACTIVATIONS: dict[Callable, Callable[[np.ndarray], np.ndarray]] = {
    torch.tanh: np.tanh,
    torch.relu: _relu,
}


def unsupported(policy: nn.Module) -> str | None:
    """Why `policy` cannot act through NumPy (None: it can): only feed-forward policies with a flat-vector
    encoder, MLP bodies of tanh or relu, a categorical or Gaussian head, float32 parameters on the CPU."""
    if not isinstance(policy, ActorCritic):
        return f"{type(policy).__name__} is not an ActorCritic"
    if policy.recurrent:
        return "recurrent policy"
    if not isinstance(policy.encoder, FlattenEncoder):
        return f"encoder {type(policy.encoder).__name__}"
    if policy.actor_body.activation not in _ACTIVATIONS:
        return "activation without a NumPy twin"
    if not isinstance(policy.head, CategoricalHead | GaussianHead):
        return f"head {type(policy.head).__name__}"
    for p in itertools.chain(policy.actor_body.parameters(), policy.head.parameters()):
        if p.device.type != "cpu" or p.dtype != torch.float32:
            return f"parameters are {p.dtype} on {p.device}"
    return None


def _view(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


class NumpyActor:
    """One rollout's actor: NumPy views of the actor's parameters, taken when the rollout starts.

    Views, not copies: an optimizer step updates them in place, and a rollout never outlives the parameters
    it started with (a player loads new ones between rollouts, which may replace the tensors: hence a new
    `NumpyActor` per rollout, a few microseconds).
    """

    def __init__(self, policy: ActorCritic) -> None:
        self.layers = [(_view(w).T, _view(b)) for w, b in map(linear_parameters, policy.actor_body.layers)]
        self.activation = _ACTIVATIONS[policy.actor_body.activation]
        head = policy.head
        self.gaussian = isinstance(head, GaussianHead)
        if self.gaussian:
            w, b = linear_parameters(head.mean)
            self.log_std = _view(head.log_std).copy()  # fixed for the rollout; copied so exp runs once
            self.inv_std = np.exp(-self.log_std)
            self.std = np.exp(self.log_std)
            self.width = int(self.log_std.shape[0])
            self.parts: list[tuple[int, int]] = []
            self.multi = False
        else:
            w, b = linear_parameters(head.linear)
            bounds = np.cumsum([0, *head.nvec])
            self.parts = [(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
            self.multi = head.multi  # MultiDiscrete: actions [R, dims], also for a single dimension
            self.width = int(bounds[-1])
        self.out = (_view(w).T, _view(b))

    def features(self, obs: np.ndarray) -> np.ndarray:
        x = obs if obs.dtype == np.float32 else obs.astype(np.float32)  # pixels given to an MLP: uint8
        if x.ndim > 2:
            x = x.reshape(x.shape[0], -1)
        activation = self.activation
        for w_t, b in self.layers:
            x = activation(x @ w_t + b)
        return x

    def sample(self, obs: np.ndarray, noise: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(actions, log-probs) for a batch of observations [R, ...], with one step's `noise` [R, width]."""
        w_t, b = self.out
        out = self.features(obs) @ w_t + b
        if self.gaussian:
            actions = out + self.std * noise
            z = (actions - out) * self.inv_std
            return actions, (-0.5 * z * z - self.log_std - np.float32(LOG_SQRT_2PI)).sum(-1)
        if not self.multi:
            return _categorical(out, noise)
        picks = [_categorical(out[:, lo:hi], noise[:, lo:hi]) for lo, hi in self.parts]
        return np.stack([a for a, _ in picks], -1), np.sum([lp for _, lp in picks], 0)


def _categorical(logits: np.ndarray, gumbel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gumbel-max: argmax(logits + Gumbel) is a sample of softmax(logits); its log-prob is the chosen
    logit minus the log-sum-exp. Both use the logits shifted by the row's max (torch's actor samples and
    scores log_softmax, likewise shifted): exp cannot overflow, the small log-sum is not rounded to the
    float32 spacing of a large max (~2e-3 at 3e4), and neither is the noise (at 1e38 it vanished and
    two equal logits always gave the first action)."""
    shifted = logits - logits.max(-1, keepdims=True)
    actions = (shifted + gumbel).argmax(-1)
    chosen = np.take_along_axis(shifted, actions[:, None], -1)[:, 0]
    return actions, chosen - np.log(np.exp(shifted).sum(-1))
