"""Actor-critic networks: a pluggable observation encoder, an actor body with an action head, a critic.

The action heads compute log-probabilities, entropies and samples with plain tensor arithmetic instead
of `torch.distributions`: constructing a distribution object (with argument validation) on every
environment step costs more than the whole 64x64 MLP forward, and the formulas are short and tested.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import Tensor, nn

from ppo_fabric.compat.private import linear_parameters

if TYPE_CHECKING:  # tensordict imports torch._dynamo (~1.5 s): the checks before a run need only the model
    from tensordict import TensorDict

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "tanh": torch.tanh,
    "relu": torch.relu,
    "elu": F.elu,
    "gelu": F.gelu,
}
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@contextlib.contextmanager
def float32_default() -> Iterator[None]:
    """torch's default dtype float32 inside (a decorator too), whatever the caller set it to: the envs'
    observations, the rollout and the checkpoints are float32, and under a research notebook's
    `torch.set_default_dtype(torch.float64)` the model was built in float64 and its first forward failed
    ("mat1 and mat2 must have the same dtype"), in training and in `Policy.predict`."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def float32_calls(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` under `float32_default`, entered only when the default is another dtype: the context
    manager's ~7 us a call was ~10% of a CartPole `Policy.predict`."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.get_default_dtype() is torch.float32:
            return method(*args, **kwargs)
        with float32_default():
            return method(*args, **kwargs)

    return call


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
        activation = self.activation
        for layer in self.layers:
            x = activation(F.linear(x, *linear_parameters(layer)))
        return x


# --------------------------------------------------------------------------------------------- encoders
if TYPE_CHECKING:
    Obs = Tensor | TensorDict  # a Box observation batch, or a TensorDict of them for Dict observation spaces


def is_image_space(space: gym.Space) -> bool:
    """uint8 Boxes of 2 (H, W) or 3 dimensions ([C, H, W] or [H, W, C]) are pixels; float arrays of the
    same rank may be anything (grids, stacked vectors), so they keep the flattening encoder unless asked."""
    return isinstance(space, gym.spaces.Box) and space.dtype == np.uint8 and len(space.shape) in (2, 3)


def obs_storage_dtype(space: gym.Space) -> torch.dtype:
    """How one observation is stored in the rollout: pixels stay uint8 (a quarter of float32's memory and
    of the bytes the decoupled strategy sends); the encoder converts them. Everything else is float32."""
    return torch.uint8 if is_image_space(space) else torch.float32


def single_obs_batch(obs: Any) -> Obs:
    """One env's observation (array, or dict of arrays) as a batch of one, for evaluation outside the
    rollout. Pixels may arrive as float32: the CNN scales by its space's dtype, not the batch's."""
    if isinstance(obs, dict):
        from tensordict import TensorDict

        parts = {k: single_obs_batch(v) for k, v in obs.items()}
        return TensorDict(parts, batch_size=[1])
    return torch.as_tensor(np.asarray(obs), dtype=torch.float32).unsqueeze(0)


class FlattenEncoder(nn.Module):
    """Flat vector observations: the actor and critic MLPs do the work, so the encoder only flattens."""

    def __init__(self, space: gym.spaces.Box) -> None:
        super().__init__()
        self.out_dim = int(np.prod(space.shape))

    def forward(self, obs: Tensor) -> Tensor:
        if obs.dtype != torch.float32:  # pixels flattened on request (model.encoder=mlp) arrive as uint8
            obs = obs.float()
        return obs.flatten(1) if obs.dim() > 2 else obs


def _conv_init(layer: nn.Conv2d, gain: float = math.sqrt(2)) -> nn.Conv2d:
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.constant_(layer.bias, 0.0)
    return layer


class NatureCNN(nn.Module):
    """The DQN Nature network (Mnih et al. 2015) that CleanRL's and SB3's Atari PPO use: conv 32x8x8/4,
    64x4x4/2, 64x3x3/1, flatten, linear 512, ReLU; orthogonal init with gain sqrt(2).

    Images are channels first ([C, H, W], as a frame stack gives [4, 84, 84]); an [H, W, C] space (a last
    dimension smaller than the first, as raw RGB frames have) is transposed here, and a 2-D [H, W] space
    gets one channel. A uint8 space is scaled by 1/255 here whatever dtype the batch arrives in (uint8 from
    the rollout storage, float32 from evaluate/export), so the rollout can store raw pixels.
    """

    def __init__(self, space: gym.spaces.Box, features: int = 512) -> None:
        super().__init__()
        if not isinstance(space, gym.spaces.Box) or len(space.shape) not in (2, 3):
            raise ValueError(
                f"model.encoder=cnn needs an image observation space ([C, H, W], [H, W, C] or [H, W]), "
                f"got {space}; use model.encoder=auto"
            )
        shape = tuple(int(d) for d in space.shape)
        self.add_channel = len(shape) == 2
        # channels are the small end: [64, 64, 2] or two stacked RGB frames [48, 64, 6] were read as 64 or 48
        # channels of 64x2 or 64x6 pixels and refused as too small
        self.channels_last = len(shape) == 3 and (
            (shape[-1] in (1, 3, 4) and shape[0] not in (1, 3, 4)) or shape[-1] < shape[0]
        )
        if self.add_channel:
            shape = (1, *shape)
        elif self.channels_last:
            shape = (shape[2], shape[0], shape[1])
        self.scale = 1.0 / 255.0 if space.dtype == np.uint8 else 1.0
        self.convs = nn.ModuleList(
            [
                _conv_init(nn.Conv2d(shape[0], 32, 8, stride=4)),
                _conv_init(nn.Conv2d(32, 64, 4, stride=2)),
                _conv_init(nn.Conv2d(64, 64, 3, stride=1)),
            ]
        )
        with torch.no_grad():
            try:
                flat = self._conv(torch.zeros(1, *shape)).shape[1]
            except RuntimeError as exc:  # the kernels do not fit: say what does
                raise ValueError(
                    f"observation {tuple(space.shape)} is too small for the Nature CNN (needs at least "
                    "36x36 pixels); resize the frames or use model.encoder=mlp"
                ) from exc
        self.linear = layer_init(nn.Linear(flat, features))
        self.out_dim = features

    def _conv(self, x: Tensor) -> Tensor:
        for conv in self.convs:
            x = torch.relu(conv(x))
        return x.flatten(1)

    def forward(self, obs: Tensor) -> Tensor:
        x = obs.float() * self.scale if self.scale != 1.0 else obs.float()
        if self.add_channel:
            x = x.unsqueeze(1)
        elif self.channels_last:
            x = x.permute(0, 3, 1, 2)
        return torch.relu(self.linear(self._conv(x)))


class GridCNN(nn.Module):
    """The MinAtar network (Young and Tian 2019): one conv layer of 16 3x3 filters, stride 1, then a
    linear layer of 128 units, ReLU after each. Sized for small grids of object channels (MinAtar's 10x10
    frames), where the Nature CNN's 8x8 stride-4 kernel would not fit and would lose the one-cell detail
    the games turn on.

    Observations are [H, W, C] (gymnasium's and MinAtar's layout; bool or float channels), or [H, W] for
    one channel; they are cast to float32 here, so bool frames need no wrapper.

    `filters` and `kernel` (`model.grid`) size the conv layer for other grids: a game won by four in a
    line sees every line of four whole in a 4x4 kernel, where a 3x3 one leaves the linear layer to piece
    each line together at every place on the board.
    """

    def __init__(
        self, space: gym.spaces.Box, filters: int = 16, features: int = 128, kernel: int = 3
    ) -> None:
        super().__init__()
        if not isinstance(space, gym.spaces.Box) or len(space.shape) not in (2, 3):
            raise ValueError(
                f"model.encoder=grid needs a grid observation space ([H, W, C] or [H, W]), got {space}; "
                "use model.encoder=auto"
            )
        if space.dtype == np.uint8 and float(np.max(space.high)) > 1:
            # its cells go in as they are: 0-255 pixels collapsed the policy at its first update, silently
            raise ValueError(
                f"model.encoder=grid reads cells as they are (0/1 channels, as MinAtar's and board games'), and "
                f"this observation holds uint8 pixels up to {int(np.max(space.high))}: use model.encoder=cnn "
                "(the Nature CNN scales them by 1/255), or scale them in a wrapper"
            )
        shape = tuple(int(d) for d in space.shape)
        self.add_channel = len(shape) == 2
        channels, height, width = (1, *shape) if self.add_channel else (shape[2], shape[0], shape[1])
        if height < kernel or width < kernel:
            raise ValueError(
                f"observation {shape} is smaller than the {kernel}x{kernel} kernel of model.encoder=grid"
            )
        self.width = width
        self.conv = _conv_init(nn.Conv2d(channels, filters, kernel, stride=1))
        self.linear = layer_init(nn.Linear(filters * (height - kernel + 1) * (width - kernel + 1), features))
        self.out_dim = features

    def forward(self, obs: Tensor) -> Tensor:
        x = obs.float()
        x = x.unsqueeze(1) if self.add_channel else x.permute(0, 3, 1, 2)
        return torch.relu(self.linear(torch.relu(self.conv(x)).flatten(1)))


class MirroredGridCNN(GridCNN):
    """`GridCNN` over each board and its left-right mirror image (`model.grid.mirror`): [B, ...] boards
    in, [2B, F] features out, the boards' first. The bodies and the head after it (`PairedMLP`,
    `AveragedMLP`, `MirroredHead`) fold the pairs back, so a mirrored board gets exactly the mirrored policy
    and the same value: what is learnt on one side of the board holds on the other, and half the positions
    a game can reach need no learning of their own. Same layers as `GridCNN`, same parameter names."""

    def forward(self, obs: Tensor) -> Tensor:
        return super().forward(torch.cat([obs, obs.flip(2)]))  # [B, H, W, C] and [B, H, W]: W is axis 2


class PairedMLP(MLP):
    """The actor body of a mirrored policy: [2B, F] features (boards, then mirror images) in, [B, 2, H]
    out, each board beside its mirror image for `MirroredHead`."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x).unflatten(0, (2, -1)).transpose(0, 1)


class AveragedMLP(MLP):
    """The critic body of a mirrored policy: [2B, F] in, [B, H] out, the mean of each board's and its mirror
    image's; the value layer after it is affine, so the value is the mean of the two boards' values."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x).unflatten(0, (2, -1)).mean(0)


class MultiEncoder(nn.Module):
    """Dict observations: a Nature CNN per image key, the other (Box) keys flattened; features concatenated
    in the space's key order. Vector keys get no layers of their own: the actor and critic MLPs (or, with
    model=cnn, the heads) mix them with the image features."""

    def __init__(self, space: gym.spaces.Dict) -> None:
        super().__init__()
        self.keys = list(space.spaces)
        self.encoders = nn.ModuleDict()
        for key, sub in space.spaces.items():
            if is_image_space(sub):
                self.encoders[key] = NatureCNN(sub)
            elif isinstance(sub, gym.spaces.Box) and sub.shape == ():
                raise ValueError(
                    f"observation key {key!r} is a Box of shape () (one number, unbatched), which is not "
                    "supported; give it shape (1,)"
                )
            elif isinstance(sub, gym.spaces.Box):
                self.encoders[key] = FlattenEncoder(sub)
            else:
                raise ValueError(
                    f"observation key {key!r} has space {sub}; Dict observations support image (uint8) and "
                    "Box keys only"
                )
        self.out_dim = sum(enc.out_dim for enc in self.encoders.values())

    def forward(self, obs: TensorDict) -> Tensor:
        return torch.cat([self.encoders[k](obs[k]) for k in self.keys], dim=-1)


def grid_options(cfg: DictConfig) -> dict[str, int]:
    """`model.grid`'s conv sizes. Only model=grid's config has the group: a grid encoder that
    `encoder=auto` picked (MinAtar's frames under model=mlp), or one in a checkpoint written before the
    group existed, is the MinAtar network, GridCNN's own defaults."""
    grid = cfg.get("grid") or {}
    unknown = set(grid) - {"filters", "kernel", "mirror"}
    if unknown:
        raise ValueError(
            f"model.grid.{sorted(unknown)[0]} is unknown; model.grid has filters, kernel and mirror"
        )
    sizes = {key: value for key, value in grid.items() if key != "mirror"}
    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"model.grid.{key}={value} must be a positive integer")
    return {key: int(value) for key, value in sizes.items()}


def mirrored(cfg: DictConfig, encoder: nn.Module, action_space: gym.Space) -> bool:
    """Whether `model.grid.mirror` asks for a left-right mirrored policy, checked against the model it
    would change. Only a board whose actions are its columns (Connect Four's drop-a-piece) mirrors by
    reversing the action order, so anything else is refused rather than given a wrong symmetry."""
    mirror = (cfg.get("grid") or {}).get("mirror", False)
    if not isinstance(mirror, bool):
        raise ValueError(f"model.grid.mirror={mirror} must be true or false")
    if not mirror:
        return False
    if not isinstance(encoder, MirroredGridCNN):
        raise ValueError("model.grid.mirror=true needs the grid encoder (model=grid)")
    if cfg.get("lstm") is not None and int(cfg.lstm.hidden_size) > 0:
        raise ValueError("model.grid.mirror=true is for feed-forward policies; set model.lstm.hidden_size=0")
    if not isinstance(action_space, gym.spaces.Discrete) or int(action_space.n) != encoder.width:
        raise ValueError(
            f"model.grid.mirror=true needs one action per board column (Discrete({encoder.width})), "
            f"got {action_space}"
        )
    return True


def grid_encoder(space: gym.Space, cfg: DictConfig) -> GridCNN:
    """`model.encoder=grid`: the grid network, reading each board beside its mirror image when
    `model.grid.mirror` is set."""
    mirror = (cfg.get("grid") or {}).get("mirror", False) is True
    return (MirroredGridCNN if mirror else GridCNN)(space, **grid_options(cfg))


EncoderFactory = Callable[[gym.Space, DictConfig], nn.Module]
ENCODERS: dict[str, EncoderFactory] = {
    "mlp": lambda space, cfg: FlattenEncoder(space),
    "cnn": lambda space, cfg: NatureCNN(space),
    "grid": grid_encoder,
    "multi": lambda space, cfg: MultiEncoder(space),
}


def select_encoder(space: gym.Space, name: str) -> str:
    """Resolve `model.encoder=auto` from the observation space; explain what is not supported.

    auto: `cnn` for image Boxes (uint8, 2-D or 3-D), `grid` for bool [H, W, C] Boxes (MinAtar's object
    channels), `mlp` for other Boxes, `multi` for Dict spaces.
    """
    if name != "auto" and name not in ENCODERS:
        raise ValueError(f"model.encoder={name!r} is unknown; choose one of auto, {', '.join(ENCODERS)}")
    if isinstance(space, gym.spaces.Dict):
        if name not in ("auto", "multi"):
            raise ValueError(f"model.encoder={name} cannot read Dict observations; use auto or multi")
        return "multi"
    if isinstance(space, (gym.spaces.Graph, gym.spaces.Sequence)):
        # flatten_space returns Graph and Sequence spaces as they are: FlattenObservation cannot help
        raise ValueError(
            f"observation space {type(space).__name__} (of varying size) is not supported; wrap the env to "
            "return a fixed-size Box or a Dict of Boxes (pad or summarise it)"
        )
    if not isinstance(space, gym.spaces.Box):
        raise ValueError(
            f"observation space {type(space).__name__} is not supported yet; wrap the env to return a Box "
            "(gymnasium.wrappers.FlattenObservation) or a Dict of Boxes"
        )
    if space.shape == ():
        raise ValueError(
            "observation space Box of shape () (one number, unbatched) is not supported; give it shape (1,) "
            "(gymnasium.wrappers.ReshapeObservation(env, (1,)))"
        )
    if name == "auto":
        if is_image_space(space):
            return "cnn"
        return "grid" if space.dtype == np.bool_ and len(space.shape) == 3 else "mlp"
    if name == "multi":
        raise ValueError("model.encoder=multi is for Dict observations; use auto")
    return name


# ------------------------------------------------------------------------------------------------ heads
class CategoricalHead(nn.Module):
    """Discrete and MultiDiscrete actions: one categorical per action dimension, log-probs summed.

    An action `mask` (bool, [B, sum(nvec)], True where legal) sets the logits of illegal actions to the
    dtype's lowest finite value before log_softmax: they get probability 0 when sampling and picking the
    best action, and log-probs and entropies are those of the distribution over the legal actions. Without
    a mask nothing of this runs.
    """

    def __init__(self, in_dim: int, nvec: Sequence[int], multi: bool | None = None) -> None:
        super().__init__()
        self.nvec = [int(n) for n in nvec]
        # MultiDiscrete actions are [B, dims] even with one dimension (MultiDiscrete([n])): its env takes
        # and its storage holds arrays of that shape, so `multi` follows the space, not len(nvec)
        self.multi = len(self.nvec) > 1 if multi is None else multi
        self.linear = layer_init(nn.Linear(in_dim, sum(self.nvec)), gain=0.01)

    def _logits(self, features: Tensor) -> Tensor:
        return F.linear(features, *linear_parameters(self.linear))

    def _split(self, logits: Tensor) -> list[Tensor]:
        return list(logits.split(self.nvec, dim=-1)) if self.multi else [logits]

    @property
    def noise_width(self) -> int:
        """Random draws per row of a sample: one Gumbel variate per logit."""
        return sum(self.nvec)

    @staticmethod
    def draw_noise(shape: tuple[int, ...]) -> Tensor:
        """Gumbel noise -log(Exp(1)) from torch's generator: argmax(log-probs + noise) samples the policy."""
        return torch.empty(shape).exponential_().log_().neg_()

    def sample(
        self,
        features: Tensor,
        deterministic: bool = False,
        mask: Tensor | None = None,
        noise: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(actions, log-probs); `noise` [B, noise_width]: the Gumbel draws to sample with (the rollout
        draws them ahead, as the NumPy actor does, so both sample the same actions), else drawn here."""
        logits = self._logits(features)
        if mask is not None:
            logits = _masked(logits, mask)
        if not self.multi:
            return self._sample(logits, deterministic, noise)
        parts = self._split(noise) if noise is not None else [None] * len(self.nvec)
        actions, logps = zip(
            *(
                self._sample(part, deterministic, g)
                for part, g in zip(self._split(logits), parts, strict=True)
            ),
            strict=True,
        )
        return torch.stack(actions, -1), torch.stack(logps, -1).sum(-1)

    @staticmethod
    def _sample(logits: Tensor, deterministic: bool, gumbel: Tensor | None = None) -> tuple[Tensor, Tensor]:
        logp_all = logits.log_softmax(-1)
        if deterministic:
            a = logp_all.argmax(-1)
        elif gumbel is not None:
            a = (logp_all + gumbel).argmax(-1)
        else:  # Gumbel-max: one fused sample without building a distribution object
            a = (logp_all - torch.empty_like(logp_all).exponential_().log()).argmax(-1)
        return a, logp_all.gather(-1, a.unsqueeze(-1)).squeeze(-1)

    def log_prob_entropy(
        self, features: Tensor, actions: Tensor, mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        logits = self._logits(features)
        if mask is not None:
            return self._masked_log_prob_entropy(logits, actions, mask)
        if not self.multi:
            return self._log_prob_entropy(logits, actions.long())
        cols = actions.long()
        parts = [self._log_prob_entropy(part, cols[..., i]) for i, part in enumerate(self._split(logits))]
        logps, entropies = zip(*parts, strict=True)
        return torch.stack(logps, -1).sum(-1), torch.stack(entropies, -1).sum(-1)

    @staticmethod
    def _log_prob_entropy(logits: Tensor, actions: Tensor) -> tuple[Tensor, Tensor]:
        logp_all = logits.log_softmax(-1)
        logp = logp_all.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        return logp, -(logp_all.exp() * logp_all).sum(-1)

    def _masked_log_prob_entropy(
        self, logits: Tensor, actions: Tensor, mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        logits = _masked(logits, mask)
        if self.multi:  # one distribution per action dimension
            logp_all = torch.cat([part.log_softmax(-1) for part in self._split(logits)], -1)
        else:
            logp_all = logits.log_softmax(-1)
        # Illegal actions contribute 0 to the entropy (0 * log 0), not 0 * (a huge negative number).
        p_logp = torch.where(mask, logp_all.exp() * logp_all, 0.0)
        cols = actions.long()
        if not self.multi:
            return logp_all.gather(-1, cols.unsqueeze(-1)).squeeze(-1), -p_logp.sum(-1)
        logp = torch.stack(
            [
                part.gather(-1, cols[..., i : i + 1]).squeeze(-1)
                for i, part in enumerate(self._split(logp_all))
            ],
            -1,
        ).sum(-1)
        return logp, -p_logp.sum(-1)  # summed over every dimension's legal actions: the entropies' sum


class MirroredHead(CategoricalHead):
    """One categorical over a board's columns for a mirrored policy (`MirroredGridCNN`): its features are
    [B, 2, F], each board's beside its mirror image's (`PairedMLP`), and its logits the mean of the board's
    and the mirror image's reversed, so the mirrored board gets exactly the mirrored policy."""

    def _logits(self, features: Tensor) -> Tensor:
        logits = F.linear(features, *linear_parameters(self.linear))
        return (logits[..., 0, :] + logits[..., 1, :].flip(-1)) * 0.5


def _masked(logits: Tensor, mask: Tensor) -> Tensor:
    """Logits with illegal actions (mask False) at the dtype's lowest finite value: exp() of their
    log-softmax is exactly 0, and every result stays finite."""
    return logits.masked_fill(~mask, torch.finfo(logits.dtype).min)


ONE_BOUND_SHARE = 0.95  # of the initial policy's actions clipped to one bound, past which a run is warned


def clipped_actions_warning(space: gym.Space) -> str | None:
    """One line when a Box action space's bounds leave the initial Gaussian (mean ~0: the mean layer's gain
    is 0.01; std 1) acting at one bound nearly every time. Actions are clipped at the env, not rescaled:
    with bounds [100, 200] every action the env received was 100, the reward never varied, the advantages
    were 0, and the run ended with exit 0 having learned nothing. None for other spaces and sound bounds."""
    if not isinstance(space, gym.spaces.Box) or not np.issubdtype(space.dtype, np.floating):
        return None
    low = np.broadcast_to(space.low, space.shape).astype(np.float64).ravel()
    high = np.broadcast_to(space.high, space.shape).astype(np.float64).ravel()
    for dim, (lo, hi) in enumerate(zip(low, high, strict=True)):
        below, above = 0.5 * math.erfc(-lo / math.sqrt(2)), 0.5 * math.erfc(hi / math.sqrt(2))
        share = max(below, above)
        if share >= ONE_BOUND_SHARE:
            return (
                f"warning: action dimension {dim} has bounds [{lo:g}, {hi:g}]: the initial policy (mean 0, "
                f"std 1) is clipped to {'the lower' if below > above else 'the upper'} bound in {share:.1%} "
                "of its actions, which then all look alike to the env and leave nothing to learn from "
                "(actions are clipped, not rescaled); rescale them to [-1, 1] with "
                "gymnasium.wrappers.RescaleAction in an env factory (env.id=module:factory)"
            )
    return None


class GaussianHead(nn.Module):
    """Box actions: diagonal Gaussian with a state-independent log-std; clipping happens at the env only."""

    def __init__(self, in_dim: int, action_dim: int) -> None:
        super().__init__()
        self.mean = layer_init(nn.Linear(in_dim, action_dim), gain=0.01)
        self.log_std = nn.Parameter(torch.zeros(action_dim))

    @property
    def noise_width(self) -> int:
        """Random draws per row of a sample: one standard normal per action dimension."""
        return int(self.log_std.shape[0])

    @staticmethod
    def draw_noise(shape: tuple[int, ...]) -> Tensor:
        return torch.randn(shape)

    def sample(
        self, features: Tensor, deterministic: bool = False, noise: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """(actions, log-probs); `noise` [B, action_dim]: the standard normals to sample with, else drawn
        here."""
        mean = F.linear(features, *linear_parameters(self.mean))
        if deterministic:
            action = mean
        else:
            action = mean + self.log_std.exp() * (torch.randn_like(mean) if noise is None else noise)
        return action, self._log_prob(mean, action)

    def _log_prob(self, mean: Tensor, action: Tensor) -> Tensor:
        z = (action - mean) * torch.exp(-self.log_std)
        return (-0.5 * z.pow(2) - self.log_std - LOG_SQRT_2PI).sum(-1)

    def log_prob_entropy(self, features: Tensor, actions: Tensor) -> tuple[Tensor, Tensor]:
        mean = F.linear(features, *linear_parameters(self.mean))
        entropy = (0.5 + LOG_SQRT_2PI + self.log_std).sum().expand(mean.shape[0])
        return self._log_prob(mean, actions), entropy


def build_head(in_dim: int, space: gym.Space) -> nn.Module:
    if isinstance(space, gym.spaces.Discrete | gym.spaces.MultiDiscrete) and np.any(space.start != 0):
        # the heads sample 0..n-1 and the rollout hands them to the env as they are: a shifted space
        # would get actions outside it (or silently the wrong ones), so it is refused here
        raise ValueError(
            f"action space {space} starts at {space.start.tolist()}: only spaces starting at 0 are "
            "supported; wrap the env to shift its actions (gymnasium.wrappers.TransformAction)"
        )
    if isinstance(space, gym.spaces.Discrete):
        return CategoricalHead(in_dim, [int(space.n)])
    if isinstance(space, gym.spaces.MultiDiscrete):
        if space.nvec.ndim != 1:
            raise ValueError(
                f"action space MultiDiscrete with nvec of shape {space.nvec.shape}: MultiDiscrete action spaces "
                "must be one-dimensional; flatten it in a wrapper (nvec.ravel(), actions reshaped back)"
            )
        return CategoricalHead(in_dim, space.nvec.tolist(), multi=True)
    if isinstance(space, gym.spaces.Box) and not np.issubdtype(space.dtype, np.floating):
        # a Gaussian's actions are floats: the env got 0.277 where it takes whole numbers, silently
        raise ValueError(
            f"action space {space} holds {space.dtype} actions, which a Gaussian policy does not give: use a "
            "float Box, or a Discrete/MultiDiscrete space for whole-number actions"
        )
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


# ------------------------------------------------------------------------------------------- recurrence
class RecurrentCore(nn.Module):
    """An LSTM between the encoder and the heads. Its state is one tensor [B, 2, layers, hidden] (h and c
    stacked), so the rollout stores it as a single extra per step and checkpoints hold it as one tensor.

    Sequences arrive batch-first with `starts` [B, S], True where a step begins a new episode: the state is
    zeroed there. The LSTM runs once per stretch between such steps instead of once per step.
    """

    def __init__(self, in_dim: int, hidden_size: int, num_layers: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(in_dim, hidden_size, num_layers, batch_first=True)
        for name, param in self.lstm.named_parameters():
            if "weight" in name:
                nn.init.orthogonal_(param, 1.0)
            else:
                nn.init.constant_(param, 0.0)
        self.state_shape = (2, num_layers, hidden_size)
        self.out_dim = hidden_size

    def _run(self, x: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
        hc = state.permute(1, 2, 0, 3)  # [2, layers, B, H]
        out, (h, c) = self.lstm(x, (hc[0].contiguous(), hc[1].contiguous()))
        return out, torch.stack((h, c)).permute(2, 0, 1, 3)

    def step(self, features: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
        """One step for a batch: features [B, F], state [B, 2, layers, H] -> (output [B, H], next state)."""
        out, state = self._run(features.unsqueeze(1), state)
        return out.squeeze(1), state

    def sequence(self, features: Tensor, state: Tensor, starts: Tensor) -> Tensor:
        """Outputs [B, S, H] for features [B, S, F] from the initial `state`, reset where `starts`."""
        # where any sequence starts an episode, read in one transfer (one host sync per minibatch, not per step)
        inner = (starts[:, 1:].any(0).nonzero().flatten() + 1).tolist()
        cuts = [0, *inner, starts.shape[1]]
        outputs = []
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            if a > 0:
                state = state * (~starts[:, a]).to(state.dtype).view(-1, 1, 1, 1)
            out, state = self._run(features[:, a:b], state)
            outputs.append(out)
        return torch.cat(outputs, 1) if len(outputs) > 1 else outputs[0]


class RecurrentCores(nn.Module):
    """The recurrence of an actor-critic: one LSTM shared by actor and critic (`model.lstm.shared=true`),
    or one each (the default, as in SB3's RecurrentPPO: the value loss then cannot disturb the memory the
    policy relies on, which made learning markedly steadier on CartPole without velocities). Their states
    are stacked into one tensor [B, 2 * cores, layers, hidden]."""

    def __init__(self, in_dim: int, hidden_size: int, num_layers: int, shared: bool) -> None:
        super().__init__()
        self.cores = nn.ModuleList(
            RecurrentCore(in_dim, hidden_size, num_layers) for _ in range(1 if shared else 2)
        )
        self.state_shape = (2 * len(self.cores), num_layers, hidden_size)
        self.out_dim = hidden_size

    def initial_state(self, batch: int, device: torch.device | str) -> Tensor:
        return torch.zeros((batch, *self.state_shape), device=device)

    def step(self, features: Tensor, state: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(actor features, critic features, next state) for one step of a batch."""
        if len(self.cores) == 1:
            out, state = self.cores[0].step(features, state)
            return out, out, state
        actor, actor_state = self.cores[0].step(features, state[:, :2])
        critic, critic_state = self.cores[1].step(features, state[:, 2:])
        return actor, critic, torch.cat((actor_state, critic_state), 1)

    def sequence(self, features: Tensor, state: Tensor, starts: Tensor) -> tuple[Tensor, Tensor]:
        """(actor, critic) features [B, S, H] of sequences from their initial `state`, reset at `starts`."""
        if len(self.cores) == 1:
            out = self.cores[0].sequence(features, state, starts)
            return out, out
        return (
            self.cores[0].sequence(features, state[:, :2], starts),
            self.cores[1].sequence(features, state[:, 2:], starts),
        )


# ---------------------------------------------------------------------------------------- actor-critic
class ActorCritic(nn.Module):
    """`act` serves the rollout (no autograd); `forward` serves the update, so DDP sees one forward pass
    that touches every parameter (actor and critic) per minibatch.

    With `model.lstm.hidden_size > 0` LSTM cores sit between the encoder and the heads (`recurrent`):
    the rollout then carries a state per env (`act_with_state`), and `forward` takes whole sequences with
    the state each one started from.

    The encoder and the MLP bodies are called through their `forward` methods: `nn.Module.__call__` (hook
    dispatch, none of which the package registers on them) costs ~1 us a call, ~12% of a CartPole policy
    step on a few envs (~36 -> ~31 us). DDP and torch.compile work on the whole model, so neither needs them.
    """

    @float32_default()
    def __init__(self, obs_space: gym.Space, action_space: gym.Space, cfg: DictConfig) -> None:
        super().__init__()
        self.encoder = ENCODERS[select_encoder(obs_space, cfg.encoder)](obs_space, cfg)
        feat = self.encoder.out_dim
        lstm = cfg.get("lstm")
        self.core = None
        if lstm is not None and int(lstm.hidden_size) > 0:
            shared = bool(lstm.get("shared", False))
            self.core = RecurrentCores(feat, int(lstm.hidden_size), int(lstm.num_layers), shared)
            feat = self.core.out_dim
        # a mirrored policy has the same layers, each reading a board beside its mirror image
        mirror = mirrored(cfg, self.encoder, action_space)
        actor_body, critic_body = (PairedMLP, AveragedMLP) if mirror else (MLP, MLP)
        self.actor_body = actor_body(feat, cfg.actor_hidden, cfg.activation)
        self.critic_body = critic_body(feat, cfg.critic_hidden, cfg.activation)
        if mirror:
            self.head: nn.Module = MirroredHead(self.actor_body.out_dim, [int(action_space.n)])
        else:
            self.head = build_head(self.actor_body.out_dim, action_space)
        self.value_out = layer_init(nn.Linear(self.critic_body.out_dim, 1), gain=1.0)

    @property
    def recurrent(self) -> bool:
        return self.core is not None

    @property
    def state_shape(self) -> tuple[int, ...] | None:
        """One row's recurrent state, as the rollout stores it per step (None for feed-forward)."""
        return None if self.core is None else self.core.state_shape

    def initial_state(self, batch: int, device: torch.device | str = "cpu") -> Tensor | None:
        """The state a fresh episode starts from (None for feed-forward policies)."""
        return None if self.core is None else self.core.initial_state(batch, device)

    def _features(self, obs: Obs, state: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
        """(actor features, critic features, next state)."""
        features = self.encoder.forward(obs)
        if self.core is None:
            return features, features, None
        if state is None:
            state = self.core.initial_state(features.shape[0], features.device)
        return self.core.step(features, state)

    def _value(self, features: Tensor) -> Tensor:
        return F.linear(self.critic_body.forward(features), *linear_parameters(self.value_out)).squeeze(-1)

    def get_value(self, obs: Obs, state: Tensor | None = None) -> Tensor:
        return self._value(self._features(obs, state)[1])

    def act(
        self, obs: Obs, deterministic: bool = False, action_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Sample an action; returns (action, log-prob, value). A recurrent policy starts from zero state:
        use `act_with_state` to carry it across steps. `action_mask` [B, sum(nvec)]: True where legal."""
        return self.act_with_state(obs, None, deterministic, action_mask)[:3]

    def act_with_state(
        self, obs: Obs, state: Tensor | None, deterministic: bool = False, action_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """Sample an action from `state`; returns (action, log-prob, value, state after this step)."""
        actor, critic, state = self._features(obs, state)
        if action_mask is None:
            action, logprob = self.head.sample(self.actor_body.forward(actor), deterministic)
        else:
            action, logprob = self.head.sample(
                self.actor_body.forward(actor), deterministic, mask=action_mask
            )
        return action, logprob, self._value(critic), state

    def sample(
        self,
        obs: Obs,
        state: Tensor | None,
        deterministic: bool = False,
        action_mask: Tensor | None = None,
        noise: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """What the rollout needs at every step: (action, log-prob, state after this step). The critic's
        MLP is left out: the rollout evaluates it once over all its steps afterwards (`get_value` on the
        stored observations and states), one batched forward instead of one per step. `noise`: the
        head's random draws for this step (`rollout_noise`), else drawn by the head."""
        actor, _, state = self._features(obs, state)
        if action_mask is None:
            action, logprob = self.head.sample(self.actor_body.forward(actor), deterministic, noise=noise)
        else:
            action, logprob = self.head.sample(
                self.actor_body.forward(actor), deterministic, mask=action_mask, noise=noise
            )
        return action, logprob, state

    def forward(
        self,
        obs: Obs,
        actions: Tensor,
        state: Tensor | None = None,
        starts: Tensor | None = None,
        action_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Re-evaluate stored actions; returns (log-prob, entropy, value).

        Feed-forward: a batch of steps. Recurrent: sequences [B, S] starting from `state` [B, 2, layers, H],
        reset where `starts`; outputs are [B, S]. `action_mask`: the masks the actions were sampled under.
        """
        features = self.encoder.forward(obs if self.core is None else obs.flatten(0, 1))
        actor = critic = features
        if self.core is not None:
            batch, steps = actions.shape[:2]
            actor, critic = self.core.sequence(features.unflatten(0, (batch, steps)), state, starts)
            actor, critic = actor.flatten(0, 1), critic.flatten(0, 1)
            actions = actions.flatten(0, 1)
            if action_mask is not None:
                action_mask = action_mask.flatten(0, 1)
        if action_mask is None:
            logprob, entropy = self.head.log_prob_entropy(self.actor_body.forward(actor), actions)
        else:
            logprob, entropy = self.head.log_prob_entropy(
                self.actor_body.forward(actor), actions, action_mask
            )
        values = self._value(critic)
        if self.core is not None:
            return (
                logprob.unflatten(0, (batch, steps)),
                entropy.unflatten(0, (batch, steps)),
                values.unflatten(0, (batch, steps)),
            )
        return logprob, entropy, values


# Draws per torch call: a rollout's noise is drawn in blocks of steps of at most this many floats (4 MiB),
# not all at once (2048 steps x 64 envs x Discrete(4096) would be 2 GiB). One block covers a whole
# CartPole or MuJoCo rollout, so those take one call per rollout.
NOISE_FLOATS = 1 << 20


def rollout_noise(head: nn.Module, steps: int, rows: int) -> Iterator[np.ndarray]:
    """A rollout's random draws for `head`, one step [rows, noise_width] at a time, from torch's generator
    in blocks of at most `NOISE_FLOATS`. The torch rollout (`torch.from_numpy`, no copy) and the NumPy actor
    both sample with these, so `algo.numpy_rollout` changes how fast actions are computed, not which are
    drawn. NumPy views of each block: a step's slice costs a fraction of a tensor view's."""
    width = head.noise_width
    block = max(1, NOISE_FLOATS // max(1, rows * width))
    for start in range(0, steps, block):
        yield from head.draw_noise((min(block, steps - start), rows, width)).numpy()
