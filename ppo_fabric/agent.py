"""Actor-critic networks: a pluggable observation encoder, an actor body with an action head, a critic.

The action heads compute log-probabilities, entropies and samples with plain tensor arithmetic instead
of `torch.distributions`: constructing a distribution object (with argument validation) on every
environment step costs more than the whole 64x64 MLP forward, and the formulas are short and tested.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import Tensor, nn

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "tanh": torch.tanh,
    "relu": torch.relu,
    "elu": F.elu,
    "gelu": F.gelu,
}
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def layer_init(layer: nn.Linear, gain: float = math.sqrt(2), bias: float = 0.0) -> nn.Linear:
    """Orthogonal weights and constant bias, as in the PPO implementations that reach published scores."""
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.constant_(layer.bias, bias)
    return layer


class MLP(nn.Module):
    """Linear layers, each followed by the activation, run in one module call.

    A `Sequential` of Linear and activation modules spends ~3 us per module in `nn.Module.__call__`; on the
    rollout's tiny batches that is more than the arithmetic, so the layers are applied functionally here.
    """

    def __init__(self, in_dim: int, hidden: Sequence[int], activation: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        for width in hidden:
            self.layers.append(layer_init(nn.Linear(in_dim, width)))
            in_dim = width
        self.activation = ACTIVATIONS[activation]
        self.out_dim = in_dim

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = self.activation(F.linear(x, layer.weight, layer.bias))
        return x


# --------------------------------------------------------------------------------------------- encoders
class FlattenEncoder(nn.Module):
    """Flat vector observations: the actor and critic MLPs do the work, so the encoder only flattens."""

    def __init__(self, space: gym.spaces.Box) -> None:
        super().__init__()
        self.out_dim = int(np.prod(space.shape))

    def forward(self, obs: Tensor) -> Tensor:
        return obs.flatten(1) if obs.dim() > 2 else obs


EncoderFactory = Callable[[gym.Space, DictConfig], nn.Module]
ENCODERS: dict[str, EncoderFactory] = {"mlp": lambda space, cfg: FlattenEncoder(space)}


def select_encoder(space: gym.Space, name: str) -> str:
    """Resolve `model.encoder=auto` from the observation space; explain what is not supported."""
    if not isinstance(space, gym.spaces.Box):
        raise ValueError(
            f"observation space {type(space).__name__} is not supported yet; wrap the env to return a Box "
            "(gymnasium.wrappers.FlattenObservation)"
        )
    if name == "auto":
        if len(space.shape) >= 3 and space.dtype == np.uint8:
            raise ValueError(
                f"pixel observations {space.shape} need a CNN encoder, which this version does not ship; "
                "use a vector-observation env"
            )
        return "mlp"
    if name not in ENCODERS:
        raise ValueError(f"model.encoder={name!r} is unknown; choose one of auto, {', '.join(ENCODERS)}")
    return name


# ------------------------------------------------------------------------------------------------ heads
class CategoricalHead(nn.Module):
    """Discrete and MultiDiscrete actions: one categorical per action dimension, log-probs summed."""

    def __init__(self, in_dim: int, nvec: Sequence[int]) -> None:
        super().__init__()
        self.nvec = [int(n) for n in nvec]
        self.multi = len(self.nvec) > 1
        self.linear = layer_init(nn.Linear(in_dim, sum(self.nvec)), gain=0.01)

    def _split(self, logits: Tensor) -> list[Tensor]:
        return list(logits.split(self.nvec, dim=-1)) if self.multi else [logits]

    def sample(self, features: Tensor, deterministic: bool = False) -> tuple[Tensor, Tensor]:
        actions, logps = [], []
        for logits in self._split(F.linear(features, self.linear.weight, self.linear.bias)):
            logp_all = logits.log_softmax(-1)
            if deterministic:
                a = logp_all.argmax(-1)
            else:  # Gumbel-max: one fused sample without building a distribution object
                a = (logp_all - torch.empty_like(logp_all).exponential_().log()).argmax(-1)
            actions.append(a)
            logps.append(logp_all.gather(-1, a.unsqueeze(-1)).squeeze(-1))
        if not self.multi:
            return actions[0], logps[0]
        return torch.stack(actions, -1), torch.stack(logps, -1).sum(-1)

    def log_prob_entropy(self, features: Tensor, actions: Tensor) -> tuple[Tensor, Tensor]:
        logp, ent = 0.0, 0.0
        cols = actions.long().unsqueeze(-1) if not self.multi else actions.long()
        for i, logits in enumerate(self._split(F.linear(features, self.linear.weight, self.linear.bias))):
            logp_all = logits.log_softmax(-1)
            logp = logp + logp_all.gather(-1, cols[..., i : i + 1]).squeeze(-1)
            ent = ent - (logp_all.exp() * logp_all).sum(-1)
        return logp, ent  # type: ignore[return-value]


class GaussianHead(nn.Module):
    """Box actions: diagonal Gaussian with a state-independent log-std; clipping happens at the env only."""

    def __init__(self, in_dim: int, action_dim: int) -> None:
        super().__init__()
        self.mean = layer_init(nn.Linear(in_dim, action_dim), gain=0.01)
        self.log_std = nn.Parameter(torch.zeros(action_dim))

    def sample(self, features: Tensor, deterministic: bool = False) -> tuple[Tensor, Tensor]:
        mean = self.mean(features)
        if deterministic:
            action = mean
        else:
            action = mean + self.log_std.exp() * torch.randn_like(mean)
        return action, self._log_prob(mean, action)

    def _log_prob(self, mean: Tensor, action: Tensor) -> Tensor:
        z = (action - mean) * torch.exp(-self.log_std)
        return (-0.5 * z.pow(2) - self.log_std - _LOG_SQRT_2PI).sum(-1)

    def log_prob_entropy(self, features: Tensor, actions: Tensor) -> tuple[Tensor, Tensor]:
        mean = self.mean(features)
        entropy = (0.5 + _LOG_SQRT_2PI + self.log_std).sum().expand(mean.shape[0])
        return self._log_prob(mean, actions), entropy


def build_head(in_dim: int, space: gym.Space) -> nn.Module:
    if isinstance(space, gym.spaces.Discrete):
        return CategoricalHead(in_dim, [int(space.n)])
    if isinstance(space, gym.spaces.MultiDiscrete):
        if space.nvec.ndim != 1:
            raise ValueError("MultiDiscrete action spaces must be one-dimensional")
        return CategoricalHead(in_dim, space.nvec.tolist())
    if isinstance(space, gym.spaces.Box) and len(space.shape) == 1:
        return GaussianHead(in_dim, int(space.shape[0]))
    raise ValueError(f"action space {space} is not supported: use Discrete, MultiDiscrete or a 1-D Box")


def action_shape_dtype(space: gym.Space) -> tuple[tuple[int, ...], torch.dtype]:
    """How one env's action is stored in the rollout."""
    if isinstance(space, gym.spaces.Discrete):
        return (), torch.int64
    if isinstance(space, gym.spaces.MultiDiscrete):
        return tuple(space.shape), torch.int64
    return tuple(space.shape), torch.float32


# ---------------------------------------------------------------------------------------- actor-critic
class ActorCritic(nn.Module):
    """`act` serves the rollout (no autograd); `forward` serves the update, so DDP sees one forward pass
    that touches every parameter (actor and critic) per minibatch."""

    def __init__(self, obs_space: gym.Space, action_space: gym.Space, cfg: DictConfig) -> None:
        super().__init__()
        self.encoder = ENCODERS[select_encoder(obs_space, cfg.encoder)](obs_space, cfg)
        feat = self.encoder.out_dim
        self.actor_body = MLP(feat, cfg.actor_hidden, cfg.activation)
        self.critic_body = MLP(feat, cfg.critic_hidden, cfg.activation)
        self.head = build_head(self.actor_body.out_dim, action_space)
        self.value_out = layer_init(nn.Linear(self.critic_body.out_dim, 1), gain=1.0)

    def _value(self, features: Tensor) -> Tensor:
        out = self.value_out
        return F.linear(self.critic_body(features), out.weight, out.bias).squeeze(-1)

    def get_value(self, obs: Tensor) -> Tensor:
        return self._value(self.encoder(obs))

    def act(self, obs: Tensor, deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """Sample an action; returns (action, log-prob, value)."""
        features = self.encoder(obs)
        action, logprob = self.head.sample(self.actor_body(features), deterministic)
        return action, logprob, self._value(features)

    def forward(self, obs: Tensor, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Re-evaluate stored actions; returns (log-prob, entropy, value)."""
        features = self.encoder(obs)
        logprob, entropy = self.head.log_prob_entropy(self.actor_body(features), actions)
        return logprob, entropy, self._value(features)
