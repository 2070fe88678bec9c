"""Action heads against torch.distributions, sampling statistics, and the ActorCritic's init and shapes."""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import pytest
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributions import Categorical, Normal

from ppo_fabric.config.values import config_dir
from ppo_fabric.models.agent import ActorCritic, CategoricalHead, GaussianHead, action_shape_dtype

IN_DIM = 6


def model_cfg(**overrides: object) -> DictConfig:
    cfg = {"encoder": "auto", "actor_hidden": [64, 64], "critic_hidden": [64, 64], "activation": "tanh"}
    return OmegaConf.create(cfg | overrides)


def sharpen(linear: nn.Linear, seed: int) -> None:
    """Replace the 0.01-gain init with large weights so distributions are far from uniform (a stronger test)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(linear.weight.shape, generator=g))
        linear.bias.copy_(torch.randn(linear.bias.shape, generator=g))


def categorical_head(nvec: list[int], seed: int = 0) -> CategoricalHead:
    torch.manual_seed(seed)
    head = CategoricalHead(IN_DIM, nvec)
    sharpen(head.linear, seed)
    return head


def gaussian_head(action_dim: int, seed: int = 0) -> GaussianHead:
    torch.manual_seed(seed)
    head = GaussianHead(IN_DIM, action_dim)
    sharpen(head.mean, seed)
    with torch.no_grad():
        head.log_std.copy_(torch.linspace(-1.0, 0.7, action_dim))
    return head


def reference_categorical(head: CategoricalHead, features: torch.Tensor) -> list[Categorical]:
    logits = head.linear(features)
    return [Categorical(logits=chunk) for chunk in logits.split(head.nvec, dim=-1)]


# ------------------------------------------------------------------------------------- categorical
@pytest.mark.parametrize("nvec", [[5], [3, 4, 2]])
def test_categorical_log_prob_entropy_matches_torch(nvec: list[int]) -> None:
    """Summed per-dimension log-prob and entropy equal torch.distributions.Categorical's."""
    head = categorical_head(nvec)
    features = torch.randn(32, IN_DIM)
    dists = reference_categorical(head, features)
    sampled = torch.stack([d.sample() for d in dists], -1)
    actions = sampled.squeeze(-1) if len(nvec) == 1 else sampled
    logp, ent = head.log_prob_entropy(features, actions)
    exp_logp = sum(d.log_prob(sampled[:, i]) for i, d in enumerate(dists))
    exp_ent = sum(d.entropy() for d in dists)
    assert logp.shape == ent.shape == (32,)
    torch.testing.assert_close(logp, exp_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, exp_ent, rtol=1e-5, atol=1e-5)
    # the sharpened logits are far from uniform, so a uniform-distribution bug would show
    assert ent.mean() < sum(math.log(n) for n in nvec) - 0.2


@pytest.mark.parametrize("nvec", [[5], [3, 4, 2]])
def test_categorical_sample_log_prob_consistent(nvec: list[int]) -> None:
    """The log-prob returned with a sample is the log-prob of that sample as the update re-evaluates it."""
    head = categorical_head(nvec, seed=1)
    features = torch.randn(64, IN_DIM)
    actions, logp = head.sample(features)
    assert actions.dtype == torch.int64
    assert actions.shape == ((64,) if len(nvec) == 1 else (64, len(nvec)))
    re_logp, _ = head.log_prob_entropy(features, actions)
    torch.testing.assert_close(logp, re_logp, rtol=0, atol=1e-6)
    cols = actions.reshape(64, -1)
    for i, n in enumerate(nvec):
        assert ((cols[:, i] >= 0) & (cols[:, i] < n)).all()


@pytest.mark.parametrize("nvec", [[5], [3, 4, 2]])
def test_categorical_deterministic_is_argmax(nvec: list[int]) -> None:
    """Deterministic actions are the modes of each dimension's logits."""
    head = categorical_head(nvec, seed=2)
    features = torch.randn(50, IN_DIM)
    actions, logp = head.sample(features, deterministic=True)
    dists = reference_categorical(head, features)
    modes = torch.stack([d.logits.argmax(-1) for d in dists], -1)
    assert torch.equal(actions.reshape(50, -1), modes)
    exp_logp = sum(d.log_prob(modes[:, i]) for i, d in enumerate(dists))
    torch.testing.assert_close(logp, exp_logp, rtol=1e-5, atol=1e-5)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# chi-square critical values at p = 1e-4 for df = 1..4 (tables): seeded, so this is a fixed draw anyway
_CHI2_CRIT = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51}


@pytest.mark.parametrize("nvec", [[5], [3, 4, 2]])
def test_gumbel_max_frequencies_match_softmax(nvec: list[int]) -> None:
    """Gumbel-max sampling draws each category with its softmax probability (per action dimension)."""
    head = categorical_head(nvec, seed=3)
    n = 200_000
    features = torch.randn(1, IN_DIM).expand(n, IN_DIM)
    torch.manual_seed(1234)
    with torch.no_grad():
        actions, _ = head.sample(features)
        probs = [d.probs[0] for d in reference_categorical(head, features[:1])]
    cols = actions.reshape(n, -1)
    for i, (k, p) in enumerate(zip(nvec, probs, strict=True)):
        counts = torch.bincount(cols[:, i], minlength=k).double()
        assert chi_square(counts, p.double()) < _CHI2_CRIT[k - 1], (counts / n, p)
        torch.testing.assert_close(counts / n, p.double(), rtol=0, atol=0.005)


def test_gumbel_frequencies_test_can_fail() -> None:
    """Guard on the chi-square check: uniform counts are rejected against the sharpened softmax."""
    head = categorical_head([5], seed=3)
    with torch.no_grad():
        probs = reference_categorical(head, torch.randn(1, IN_DIM))[0].probs[0].double()
    uniform = torch.full((5,), 200_000 / 5, dtype=torch.float64)
    assert chi_square(uniform, probs) > _CHI2_CRIT[4]


# ---------------------------------------------------------------------------------------- gaussian
def test_gaussian_log_prob_entropy_matches_torch() -> None:
    """Diagonal Gaussian log-prob and entropy equal Normal's, summed over action dimensions."""
    head = gaussian_head(3)
    features = torch.randn(40, IN_DIM)
    actions = torch.randn(40, 3) * 2
    logp, ent = head.log_prob_entropy(features, actions)
    dist = Normal(head.mean(features), head.log_std.exp())
    assert logp.shape == ent.shape == (40,)
    torch.testing.assert_close(logp, dist.log_prob(actions).sum(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, dist.entropy().sum(-1), rtol=1e-5, atol=1e-5)


def test_gaussian_sample_log_prob_consistent_and_deterministic_mean() -> None:
    """Sampled log-probs match re-evaluation; deterministic actions are the mean."""
    head = gaussian_head(2, seed=4)
    features = torch.randn(64, IN_DIM)
    actions, logp = head.sample(features)
    assert actions.shape == (64, 2) and actions.dtype == torch.float32
    torch.testing.assert_close(logp, head.log_prob_entropy(features, actions)[0], rtol=0, atol=1e-5)
    mean_actions, mean_logp = head.sample(features, deterministic=True)
    torch.testing.assert_close(mean_actions, head.mean(features), rtol=0, atol=0)
    exp = Normal(head.mean(features), head.log_std.exp()).log_prob(mean_actions).sum(-1)
    torch.testing.assert_close(mean_logp, exp, rtol=1e-5, atol=1e-5)


def test_gaussian_sample_moments() -> None:
    """Samples have the head's mean and std = exp(log_std) per dimension."""
    head = gaussian_head(3, seed=5)
    n = 100_000
    features = torch.randn(1, IN_DIM).expand(n, IN_DIM)
    torch.manual_seed(99)
    with torch.no_grad():
        actions, _ = head.sample(features)
        mean, std = head.mean(features[:1])[0], head.log_std.exp()
    # standard error of the mean is std/sqrt(n) ~ 0.006 std; 5 standard errors
    torch.testing.assert_close(actions.mean(0), mean, rtol=0, atol=float(5 * std.max() / math.sqrt(n)))
    torch.testing.assert_close(actions.std(0), std, rtol=0.02, atol=0)


# ------------------------------------------------------------------------------------ actor-critic
OBS = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)


def test_orthogonal_init_gains() -> None:
    """Hidden layers gain sqrt(2), the policy output gain 0.01, the value output gain 1; biases zero."""
    torch.manual_seed(0)
    model = ActorCritic(OBS, gym.spaces.Discrete(3), model_cfg())
    hidden = [m for body in (model.actor_body, model.critic_body) for m in body.layers]
    assert len(hidden) == 4
    for layer in hidden:
        w = layer.weight.detach().double()
        gram = w.T @ w if w.shape[0] >= w.shape[1] else w @ w.T  # the smaller Gram is gain^2 * I
        torch.testing.assert_close(
            gram, 2.0 * torch.eye(gram.shape[0], dtype=torch.float64), atol=1e-5, rtol=0
        )
    policy_w = model.head.linear.weight.detach().double()  # [3, 64]
    torch.testing.assert_close(
        policy_w @ policy_w.T, 1e-4 * torch.eye(3, dtype=torch.float64), atol=1e-9, rtol=0
    )
    value_w = model.value_out.weight.detach().double()  # [1, 64]
    assert value_w.norm().item() == pytest.approx(1.0, abs=1e-5)
    for layer in [*hidden, model.head.linear, model.value_out]:
        assert torch.equal(layer.bias, torch.zeros_like(layer.bias))
    # so the initial policy is near uniform: logits are O(0.01)
    assert model.head.linear(torch.randn(128, 64)).abs().max() < 0.1


def test_gaussian_policy_init() -> None:
    """Box actions: the mean layer has gain 0.01 and log_std starts at 0 (std 1)."""
    torch.manual_seed(0)
    model = ActorCritic(OBS, gym.spaces.Box(-1.0, 1.0, (2,), np.float32), model_cfg())
    w = model.head.mean.weight.detach().double()
    torch.testing.assert_close(w @ w.T, 1e-4 * torch.eye(2, dtype=torch.float64), atol=1e-9, rtol=0)
    assert torch.equal(model.head.log_std.detach(), torch.zeros(2))


@pytest.mark.parametrize(
    "space,action_shape",
    [
        (gym.spaces.Discrete(3), ()),
        (gym.spaces.MultiDiscrete([3, 2, 4]), (3,)),
        (gym.spaces.MultiDiscrete([3]), (1,)),
        (gym.spaces.Box(-2.0, 2.0, (2,), np.float32), (2,)),
    ],
)
def test_act_and_forward_shapes(space: gym.Space, action_shape: tuple[int, ...]) -> None:
    """`act` and `forward` give one action, log-prob, value/entropy per observation, stored as declared."""
    torch.manual_seed(0)
    model = ActorCritic(OBS, space, model_cfg(actor_hidden=[32], critic_hidden=[16, 16], activation="relu"))
    obs = torch.randn(7, 4)
    with torch.no_grad():
        action, logp, value = model.act(obs)
        det_action, _, det_value = model.act(obs, deterministic=True)
        new_logp, entropy, new_value = model(obs, action)
    stored_shape, stored_dtype = action_shape_dtype(space)
    assert stored_shape == action_shape
    assert action.shape == det_action.shape == (7, *action_shape)
    assert action.dtype == stored_dtype
    for x in (logp, value, det_value, new_logp, entropy, new_value):
        assert x.shape == (7,) and x.dtype == torch.float32 and torch.isfinite(x).all()
    assert model.get_value(obs).shape == (7,)
    torch.testing.assert_close(new_logp, logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(new_value, value, rtol=0, atol=1e-6)
    if not isinstance(space, gym.spaces.Box):
        assert space.contains(action[0].numpy().astype(np.int64) if action_shape else int(action[0]))


def test_forward_backpropagates_into_every_parameter() -> None:
    """One `forward` touches actor and critic (what DDP requires of the update's single pass)."""
    torch.manual_seed(0)
    model = ActorCritic(OBS, gym.spaces.Box(-1.0, 1.0, (2,), np.float32), model_cfg())
    obs, actions = torch.randn(5, 4), torch.randn(5, 2)
    logp, entropy, value = model(obs, actions)
    (logp.sum() + entropy.sum() + value.sum()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_multi_dim_box_observation_is_flattened() -> None:
    """A [2, 3] Box observation is flattened to 6 features."""
    model = ActorCritic(gym.spaces.Box(-1.0, 1.0, (2, 3), np.float32), gym.spaces.Discrete(2), model_cfg())
    action, logp, value = model.act(torch.randn(5, 2, 3))
    assert action.shape == logp.shape == value.shape == (5,)


@pytest.mark.parametrize(
    "obs_space,action_space,cfg",
    [
        (gym.spaces.Dict({"x": gym.spaces.Discrete(3)}), gym.spaces.Discrete(2), model_cfg()),
        (gym.spaces.Discrete(5), gym.spaces.Discrete(2), model_cfg()),
        (gym.spaces.Box(0, 255, (16, 16, 3), np.uint8), gym.spaces.Discrete(2), model_cfg()),
        (OBS, gym.spaces.Discrete(2), model_cfg(encoder="transformer")),
        (OBS, gym.spaces.Box(-1.0, 1.0, (2, 2), np.float32), model_cfg()),
        (OBS, gym.spaces.MultiDiscrete([[2, 3], [4, 5]]), model_cfg()),
        (OBS, gym.spaces.MultiBinary(3), model_cfg()),
        (OBS, gym.spaces.Tuple((gym.spaces.Discrete(2), gym.spaces.Discrete(3))), model_cfg()),
        (OBS, gym.spaces.Box(0, 5, (2,), np.int64), model_cfg()),  # the env got 0.277 where it takes ints
    ],
    ids=[
        "dict-obs-discrete-key",
        "discrete-obs",
        "pixel-obs-too-small-for-cnn",
        "unknown-encoder",
        "2d-box-action",
        "2d-multidiscrete",
        "multibinary",
        "tuple-action",
        "integer-box-action",
    ],
)
def test_unsupported_spaces_raise_value_error(
    obs_space: gym.Space, action_space: gym.Space, cfg: DictConfig
) -> None:
    """Spaces the networks cannot handle fail at construction with a ValueError, not later with a shape error."""
    with pytest.raises(ValueError) as info:
        ActorCritic(obs_space, action_space, cfg)
    assert "\n" not in str(info.value)
    if isinstance(action_space, gym.spaces.Box) and action_space.dtype == np.int64:
        assert "holds int64 actions, which a Gaussian policy does not give" in str(info.value)


def test_model_grid_sizes_the_conv_and_a_4x4_kernel_sees_a_line_of_four_whole() -> None:
    """model=grid with model.grid.kernel=4, filters=8 on Connect Four's [6, 7, 2] board: 8 filters of
    2x4x4 over 3x4 places; a filter that is 1 on a row of four cells responds at full strength (4) exactly
    where four in a row lie inside its window. Without the group (encoder=auto's pick, or an earlier
    checkpoint) it is the MinAtar network; unknown or non-positive sizes are refused in one line."""
    board = gym.spaces.Box(0, 1, (6, 7, 2), np.int8)
    cfg = OmegaConf.load(config_dir() / "model" / "grid.yaml")
    cfg.grid.kernel, cfg.grid.filters = 4, 8
    agent = ActorCritic(board, gym.spaces.Discrete(7), cfg)
    conv = agent.encoder.conv
    assert (conv.in_channels, conv.out_channels, conv.kernel_size) == (2, 8, (4, 4))
    assert agent.encoder.linear.in_features == 8 * 3 * 4
    with torch.no_grad():
        conv.weight.zero_(), conv.bias.zero_()
        conv.weight[0, 0, 3, :] = 1.0  # the window's bottom row, the mover's plane
    obs = torch.zeros(1, 6, 7, 2)
    obs[0, 5, 1:5, 0] = 1  # four in a row on the bottom row, columns 1-4
    response = conv(obs.permute(0, 3, 1, 2))[0, 0]
    assert response[2, 1] == 4 and (response.flatten().topk(2).values == torch.tensor([4.0, 3.0])).all()
    plain = OmegaConf.load(config_dir() / "model" / "mlp.yaml")
    plain.encoder = "grid"
    assert ActorCritic(board, gym.spaces.Discrete(7), plain).encoder.conv.kernel_size == (3, 3)
    for bad, message in ((OmegaConf.create({"kernel": 0}), "kernel=0 must be a positive"),
                         (OmegaConf.create({"stride": 2}), "model.grid.stride is unknown")):  # fmt: skip
        cfg.grid = bad
        with pytest.raises(ValueError, match=message):
            ActorCritic(board, gym.spaces.Discrete(7), cfg)
    # uint8 pixels of 0-255 went in as they are and the policy collapsed at its first update, silently
    with pytest.raises(ValueError, match=r"holds uint8 pixels up to 255: use model.encoder=cnn"):
        ActorCritic(gym.spaces.Box(0, 255, (10, 12, 3), np.uint8), gym.spaces.Discrete(7), plain)
    assert ActorCritic(
        gym.spaces.Box(0, 1, (10, 10, 4), np.uint8), gym.spaces.Discrete(3), plain
    )  # 0/1 cells
    cfg.grid = OmegaConf.create({"kernel": 7})
    with pytest.raises(ValueError, match="smaller than the 7x7 kernel"):
        ActorCritic(board, gym.spaces.Discrete(7), cfg)


def test_model_grid_mirror_gives_the_mirrored_board_exactly_the_mirrored_policy() -> None:
    """model.grid.mirror on Connect Four's board: for random boards and masks, the board mirrored
    left-right gets the action mirrored (column c -> 6 - c) greedily, the same log-prob and entropy for
    the mirrored action and the same value, at initialisation and after a gradient step; the plain
    network does not (so the check can fail). Boards whose actions are not their columns are refused."""
    board = gym.spaces.Box(0, 1, (6, 7, 2), np.int8)
    cfg = OmegaConf.load(config_dir() / "model" / "grid.yaml")
    cfg.actor_hidden, cfg.critic_hidden = [32], [32]
    torch.manual_seed(0)
    obs = torch.randint(0, 2, (64, 6, 7, 2)).float()
    mask = torch.rand(64, 7) < 0.7
    mask[:, 3] = True
    actions = torch.where(mask, torch.rand(64, 7), -1.0).argmax(-1)
    mirrored = (obs.flip(2), mask.flip(1), 6 - actions)

    def gaps(agent: ActorCritic) -> list[float]:
        with torch.no_grad():
            here = agent(obs, actions, action_mask=mask)
            there = agent(mirrored[0], mirrored[2], action_mask=mirrored[1])
            greedy = agent.act(obs, True, mask)[0], agent.act(mirrored[0], True, mirrored[1])[0]
        return [(a - b).abs().max().item() for a, b in zip(here, there, strict=True)] + [
            (greedy[0] - (6 - greedy[1])).abs().max().item()
        ]

    assert max(gaps(ActorCritic(board, gym.spaces.Discrete(7), cfg))) > 1e-3
    cfg.grid.mirror = True
    agent = ActorCritic(board, gym.spaces.Discrete(7), cfg)
    assert max(gaps(agent)) < 1e-5
    logprob, entropy, value = agent(obs, actions, action_mask=mask)
    (value.square().mean() - logprob.mean() - entropy.mean()).backward()
    with torch.no_grad():
        for p in agent.parameters():
            p.sub_(0.5 * p.grad)
    assert max(gaps(agent)) < 1e-4
    for space, message in ((gym.spaces.Discrete(6), r"one action per board column \(Discrete\(7\)\)"),
                           (gym.spaces.MultiDiscrete([7, 2]), "one action per board column")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            ActorCritic(board, space, cfg)
    cfg.grid.mirror = "yes"
    with pytest.raises(ValueError, match="model.grid.mirror=yes must be true or false"):
        ActorCritic(board, gym.spaces.Discrete(7), cfg)


def test_a_mask_given_to_a_box_policy_is_refused_not_used_as_noise() -> None:
    """The mask goes to the head by name: a Gaussian head has no mask, and its third positional parameter
    is the sampling noise, which a mask of 100s turned into actions of about 100."""
    model = ActorCritic(OBS, gym.spaces.Box(-1.0, 1.0, (2,), np.float32), model_cfg())
    mask = torch.ones(4, 2, dtype=torch.bool)
    with pytest.raises(TypeError, match="mask"):
        model.act_with_state(torch.zeros(4, *OBS.shape), None, False, mask)
    with pytest.raises(TypeError, match="mask"):
        model.sample(torch.zeros(4, *OBS.shape), None, False, mask)


def test_the_clipped_actions_warning_names_a_bound_the_initial_policy_sits_at() -> None:
    """Warned where >= 95% of N(0, 1) draws fall beyond one bound: [100, 200] (all), [2, 5] (97.7%),
    [-5, -3] (99.9%, the upper); not for [-2, 2], [0, 1] (half at 0, half spread), [0.5, 1] (69%), the
    narrow [-0.01, 0.01] (clipped to either bound: the sign still varies), infinite bounds or non-Boxes."""
    from ppo_fabric.models.agent import clipped_actions_warning

    def box(low: float, high: float) -> gym.spaces.Box:
        return gym.spaces.Box(np.array([-1.0, low]), np.array([1.0, high]), dtype=np.float32)

    assert "dimension 1 has bounds [100, 200]" in clipped_actions_warning(box(100, 200))
    assert "lower bound in 97.7%" in clipped_actions_warning(box(2, 5))
    assert "upper bound in 99.9%" in clipped_actions_warning(box(-5, -3))
    for low, high in ((-2, 2), (0, 1), (0.5, 1), (-0.01, 0.01), (-np.inf, np.inf)):
        assert clipped_actions_warning(box(low, high)) is None, (low, high)
    assert clipped_actions_warning(gym.spaces.Discrete(3)) is None


def test_a_box_of_shape_nothing_is_refused_alone_or_as_a_dict_key() -> None:
    """One number of shape (): the first forward failed in torch.cat or a matmul, in their own words."""
    from ppo_fabric.config.values import compose
    from ppo_fabric.models.agent import ActorCritic

    cfg, _ = compose([])
    scalar = gym.spaces.Box(-1, 1, (), np.float32)
    with pytest.raises(ValueError, match=r"^observation space Box of shape \(\) \(one number, unbatched\)"):
        ActorCritic(scalar, gym.spaces.Discrete(2), cfg.model)
    keyed = gym.spaces.Dict({"a": scalar, "b": gym.spaces.Box(-1, 1, (3,), np.float32)})
    with pytest.raises(ValueError, match=r"^observation key 'a' is a Box of shape \(\)"):
        ActorCritic(keyed, gym.spaces.Discrete(2), cfg.model)
