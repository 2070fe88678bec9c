"""The NumPy rollout actor against the torch policy it mirrors, and the rollout that uses it."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from ppo_fabric.app.preflight import check
from ppo_fabric.collect.numpy_actor import NumpyActor, unsupported
from ppo_fabric.collect.rollout import build_collector
from ppo_fabric.config.values import ConfigError, compose
from ppo_fabric.envs.multiagent import SINGLE
from ppo_fabric.learn.learners import policy_specs
from ppo_fabric.models import agent as agent_module
from ppo_fabric.models.agent import ActorCritic, rollout_noise


def model_cfg(**overrides: Any) -> Any:
    cfg = {"encoder": "auto", "actor_hidden": [16, 16], "critic_hidden": [16, 16], "activation": "tanh"}
    return OmegaConf.create(cfg | overrides)


def sharp_policy(obs_space: gym.Space, action_space: gym.Space, seed: int, **model: Any) -> ActorCritic:
    """A policy whose weights are all large: distributions far from uniform make the comparison strict."""
    torch.manual_seed(seed)
    policy = ActorCritic(obs_space, action_space, model_cfg(**model))
    with torch.no_grad():
        for p in policy.parameters():
            p.copy_(torch.randn_like(p) * 0.7)
    return policy


BOX4 = gym.spaces.Box(-5, 5, (4,), np.float32)
CASES = {
    "discrete-tanh": (BOX4, gym.spaces.Discrete(3), {}),
    "multidiscrete-relu-2d-obs": (
        gym.spaces.Box(-5, 5, (2, 3), np.float32),
        gym.spaces.MultiDiscrete([3, 4, 2]),
        {"activation": "relu"},
    ),
    "gaussian": (gym.spaces.Box(-5, 5, (5,), np.float32), gym.spaces.Box(-1, 1, (2,), np.float32), {}),
    "uint8-obs-mlp": (gym.spaces.Box(0, 255, (3, 4), np.uint8), gym.spaces.Discrete(4), {"encoder": "mlp"}),
    # one action dimension: still [R, 1] actions, as the space and the storage have them
    "multidiscrete-one-dim": (BOX4, gym.spaces.MultiDiscrete([4]), {"activation": "relu"}),
    "no-hidden-layer": (BOX4, gym.spaces.Discrete(3), {"actor_hidden": [], "activation": "relu"}),
}


def random_obs(space: gym.spaces.Box, rows: int) -> np.ndarray:
    space.seed(0)
    return np.stack([space.sample() for _ in range(rows)])


def _noise(policy: ActorCritic, steps: int, rows: int) -> np.ndarray:
    """A rollout's draws for the policy's head, [steps, rows, width], as the rollout hands them out."""
    return np.stack(list(rollout_noise(policy.head, steps, rows)))


@pytest.mark.parametrize("case", CASES)
def test_log_probs_equal_the_torch_policys(case: str) -> None:
    """Every sampled action's log-prob is the one the update will compute for it (`ActorCritic.forward`)."""
    obs_space, action_space, model = CASES[case]
    policy = sharp_policy(obs_space, action_space, seed=1, **model)
    assert unsupported(policy) is None
    actor = NumpyActor(policy)
    obs = random_obs(obs_space, 64)
    obs_before, params_before = obs.copy(), [p.detach().clone() for p in policy.parameters()]
    actions, logp = actor.sample(obs, _noise(policy, 1, 64)[0])
    # relu runs in place: on the layer's own output, never on the observations or a parameter view
    assert np.array_equal(obs, obs_before)
    assert all(torch.equal(a, b) for a, b in zip(policy.parameters(), params_before, strict=True))
    assert logp.dtype == np.float32 and logp.shape == (64,)
    assert actions.shape == (64, *action_space.shape)
    with torch.no_grad():
        expected, _, _ = policy(torch.from_numpy(obs), torch.from_numpy(actions))
    np.testing.assert_allclose(logp, expected.numpy(), rtol=1e-5, atol=1e-5)
    if isinstance(action_space, gym.spaces.Discrete | gym.spaces.MultiDiscrete):
        assert actions.dtype == np.int64 and all(action_space.contains(a) for a in actions)
        assert len(np.unique(actions, axis=0)) > 1  # sampled, not a constant


def test_gumbel_max_samples_follow_the_softmax() -> None:
    """One observation acted on 40,000 times: the action frequencies are the policy's probabilities
    (each within 4 standard errors)."""
    policy = sharp_policy(BOX4, gym.spaces.Discrete(3), seed=2)
    probs = np.array([0.15, 0.25, 0.6])
    with torch.no_grad():  # logits = log(probs) + a per-observation shift that softmax removes
        policy.head.linear.weight.zero_()
        policy.head.linear.bias.copy_(torch.tensor(np.log(probs) + 3.0))
    actor = NumpyActor(policy)
    obs = random_obs(BOX4, 1)
    n = 40_000
    noise = _noise(policy, n, 1)
    counts = np.bincount([int(actor.sample(obs, noise[t])[0][0]) for t in range(n)], minlength=3)
    se = np.sqrt(probs * (1 - probs) / n)
    assert np.all(np.abs(counts / n - probs) < 4 * se), (counts / n, probs)


@pytest.mark.parametrize(
    "bias", [[3e4, 3e4 + 1.25, 3e4 - 2], [-3e4, -3e4 + 1.25, -3e4 - 2], [1e38, 1e38, -1e38]]
)
def test_log_probs_of_huge_logits_are_torchs(bias: list[float]) -> None:
    """Logits far from 0 (a diverging policy): the log-probs stay finite and within float32 rounding of
    the shifted values torch's log_softmax gives (not rounded to the spacing of the logits themselves)."""
    policy = sharp_policy(BOX4, gym.spaces.Discrete(3), seed=4)
    with torch.no_grad():
        policy.head.linear.weight.zero_()
        policy.head.linear.bias.copy_(torch.tensor(bias))
    actor = NumpyActor(policy)
    obs = random_obs(BOX4, 256)
    actions, logp = actor.sample(obs, _noise(policy, 1, 256)[0])
    with torch.no_grad():
        expected, _, _ = policy(torch.from_numpy(obs), torch.from_numpy(actions))
    assert np.isfinite(logp).all() and {0, 1} <= set(actions.tolist())
    np.testing.assert_allclose(logp, expected.numpy(), rtol=0, atol=1e-6)


def test_gaussian_actions_are_mean_plus_std_times_the_draw() -> None:
    obs_space, action_space, model = CASES["gaussian"]
    policy = sharp_policy(obs_space, action_space, seed=3, **model)
    actor = NumpyActor(policy)
    obs = random_obs(obs_space, 8)
    noise = _noise(policy, 1, 8)[0]
    actions, _ = actor.sample(obs, noise)
    with torch.no_grad():
        mean = policy.head.mean(policy.actor_body(torch.from_numpy(obs))).numpy()
        std = policy.head.log_std.exp().numpy()
    np.testing.assert_allclose(actions, mean + std * noise, rtol=1e-5, atol=1e-6)


def test_noise_comes_from_torchs_generator() -> None:
    """Seeding torch seeds the NumPy rollout too (checkpoints hold torch's RNG state, not NumPy's)."""
    policy = sharp_policy(BOX4, gym.spaces.Discrete(3), seed=0)
    torch.manual_seed(7)
    first = _noise(policy, 5, 4)
    torch.manual_seed(7)
    np.testing.assert_array_equal(first, _noise(policy, 5, 4))
    assert first.shape == (5, 4, 3) and not np.array_equal(first, _noise(policy, 5, 4))


def test_noise_is_drawn_in_bounded_blocks(monkeypatch: Any) -> None:
    """A rollout's noise comes in blocks of at most NOISE_FLOATS draws (its memory does not grow with
    T x rows x actions), one step at a time, the same draws whatever the block size while one block holds
    the whole rollout, and reproducible from torch's seed when it does not."""
    head = sharp_policy(BOX4, gym.spaces.Discrete(3), seed=0).head
    sizes = []
    draw = head.draw_noise
    monkeypatch.setattr(head, "draw_noise", lambda shape: sizes.append(shape) or draw(shape))
    torch.manual_seed(7)
    whole = list(rollout_noise(head, 10, 4))
    assert sizes == [(10, 4, 3)]
    torch.manual_seed(7)
    np.testing.assert_array_equal(np.stack(whole), draw((10, 4, 3)).numpy())
    monkeypatch.setattr(agent_module, "NOISE_FLOATS", 30)  # 2 steps of 4 rows x 3 actions per block
    sizes.clear()
    torch.manual_seed(7)
    blocks = list(rollout_noise(head, 5, 4))
    assert sizes == [(2, 4, 3), (2, 4, 3), (1, 4, 3)] and [b.shape for b in blocks] == [(4, 3)] * 5
    torch.manual_seed(7)
    np.testing.assert_array_equal(np.stack(blocks), np.stack(list(rollout_noise(head, 5, 4))))


def test_policies_numpy_cannot_mirror_are_named() -> None:
    lstm = {"lstm": {"hidden_size": 8, "num_layers": 1}}
    image = gym.spaces.Box(0, 255, (4, 36, 36), np.uint8)
    assert "recurrent" in unsupported(sharp_policy(BOX4, gym.spaces.Discrete(2), 0, **lstm))
    assert "activation" in unsupported(sharp_policy(BOX4, gym.spaces.Discrete(2), 0, activation="elu"))
    assert "encoder" in unsupported(sharp_policy(image, gym.spaces.Discrete(2), 0, encoder="cnn"))
    assert "float64" in unsupported(sharp_policy(BOX4, gym.spaces.Discrete(2), 0).double())


# --------------------------------------------------------------------------------------------- rollout
def collector_and_policy(*overrides: str) -> tuple[Any, ActorCritic]:
    cfg, _ = compose(
        ["exp=cleanrl_cartpole", "env.num_envs=3", "env.max_episode_steps=20", "algo.rollout_steps=40",
         *overrides]
    )  # fmt: skip
    specs = policy_specs(cfg)
    torch.manual_seed(0)
    policy = ActorCritic(specs[SINGLE].obs_space, specs[SINGLE].action_space, cfg.model)
    return build_collector(cfg, specs, 0, "cpu", None), policy


def stored_log_probs_match(collector: Any, policy: ActorCritic) -> None:
    s = collector.storage
    with torch.no_grad():
        logp, _, _ = policy(s["obs"].flatten(0, 1), s["actions"].flatten(0, 1))
    torch.testing.assert_close(s["logprobs"].flatten(), logp, rtol=1e-5, atol=1e-5)


def test_rollout_acts_through_numpy_and_stores_what_the_update_recomputes(monkeypatch: Any) -> None:
    """The torch actor is never called; the stored log-probs are the policy's for the stored actions, also
    after the parameters are replaced between rollouts (a player loading new ones); a truncated episode
    still bootstraps from its final observation."""
    collector, policy = collector_and_policy()
    monkeypatch.setattr(policy, "sample", lambda *a, **k: pytest.fail("torch actor called"))
    assert collector.collect(policy, 0) == 120
    stored_log_probs_match(collector, policy)
    s = collector.storage
    assert set(s["actions"].unique().tolist()) == {0, 1}
    assert (s["final_values"] != 0).any()  # 20-step time limit: cut episodes bootstrap
    torch.manual_seed(5)
    fresh = parameters_to_vector(policy.parameters()) + torch.randn(
        sum(p.numel() for p in policy.parameters())
    )
    vector_to_parameters(fresh, policy.parameters())  # new tensors, as a player's parameter load
    collector.collect(policy, 120)
    stored_log_probs_match(collector, policy)
    collector.envs.close()


def test_rollout_is_reproducible_and_the_switch_turns_it_off(monkeypatch: Any) -> None:
    """Reproducible from torch's seed, also when the noise comes in several blocks (a 40-step rollout of 3
    envs in blocks of 3 steps), whose actions still carry their own log-probs."""
    runs = []
    for floats in (agent_module.NOISE_FLOATS, agent_module.NOISE_FLOATS, 18, 18):
        monkeypatch.setattr(agent_module, "NOISE_FLOATS", floats)
        collector, policy = collector_and_policy()
        torch.manual_seed(11)
        collector.collect(policy, 0)
        stored_log_probs_match(collector, policy)
        runs.append(collector.storage.clone())
        collector.envs.close()
    assert (runs[0] == runs[1]).all() and (runs[2] == runs[3]).all()
    monkeypatch.undo()
    assert_acts_in_torch("algo.numpy_rollout=false")


@pytest.mark.parametrize("env", ["exp=cleanrl_cartpole", "env=pendulum"])
def test_the_switch_changes_the_speed_not_the_actions(env: str) -> None:
    """The torch and the NumPy actor sample with the same draws: from one seed, `algo.numpy_rollout` on
    and off collect the same rollout (actions equal, or within float32 rounding for Box actions)."""
    runs = []
    for switch in ("true", "false"):
        cfg, _ = compose([env, "env.num_envs=3", "algo.rollout_steps=40", f"algo.numpy_rollout={switch}"])
        specs = policy_specs(cfg)
        torch.manual_seed(0)
        policy = ActorCritic(specs[SINGLE].obs_space, specs[SINGLE].action_space, cfg.model)
        collector = build_collector(cfg, specs, 0, "cpu", None)
        torch.manual_seed(11)
        collector.collect(policy, 0)
        runs.append(collector.storage.clone())
        collector.envs.close()
    numpy_run, torch_run = runs
    if env == "env=pendulum":
        torch.testing.assert_close(numpy_run["actions"], torch_run["actions"], rtol=1e-4, atol=1e-4)
    else:
        assert torch.equal(numpy_run["actions"], torch_run["actions"])
    torch.testing.assert_close(numpy_run["logprobs"], torch_run["logprobs"], rtol=1e-4, atol=1e-4)


def test_policies_without_a_numpy_twin_act_in_torch() -> None:
    assert_acts_in_torch("model.activation=elu")


def assert_acts_in_torch(override: str) -> None:
    """Every one of the 40 rollout steps calls the torch actor, and the stored log-probs are its own."""
    collector, policy = collector_and_policy(override)
    calls = []
    sample = policy.sample
    policy.sample = lambda *a, **k: calls.append(1) or sample(*a, **k)  # type: ignore[method-assign]
    collector.collect(policy, 0)
    assert len(calls) == 40
    stored_log_probs_match(collector, policy)
    collector.envs.close()


class _OneDimMultiDiscrete(gym.Env):
    """MultiDiscrete([3]) actions, which the env checks against its space (a shape-[] action fails)."""

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
        self.action_space = gym.spaces.MultiDiscrete([3])
        self.steps = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.steps = 0
        return self.observation_space.sample(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        assert self.action_space.contains(np.asarray(action)), action
        self.steps += 1
        return self.observation_space.sample(), float(action[0] == 2), self.steps >= 5, False, {}


class _ShiftedDiscrete(_OneDimMultiDiscrete):
    def __init__(self) -> None:
        super().__init__()
        self.action_space = gym.spaces.Discrete(3, start=1)


for _id, _env in {
    "OneDimMultiDiscrete-v0": _OneDimMultiDiscrete,
    "ShiftedDiscrete-v0": _ShiftedDiscrete,
}.items():
    if _id not in gym.registry:
        gym.register(id=_id, entry_point=_env)


@pytest.mark.parametrize("numpy_rollout", ["true", "false"])
def test_one_dimensional_multidiscrete_rollout(numpy_rollout: str) -> None:
    """MultiDiscrete([3]): both actors hand the env [1]-shaped actions and store them as [T, E, 1]."""
    cfg, _ = compose(
        ["env=gym", "env.id=OneDimMultiDiscrete-v0", "env.num_envs=2", "algo.rollout_steps=8",
         f"algo.numpy_rollout={numpy_rollout}"]
    )  # fmt: skip
    specs = policy_specs(cfg)
    policy = ActorCritic(specs[SINGLE].obs_space, specs[SINGLE].action_space, cfg.model)
    collector = build_collector(cfg, specs, 0, "cpu", None)
    assert collector.collect(policy, 0) == 16
    assert collector.storage["actions"].shape == (8, 2, 1)
    stored_log_probs_match(collector, policy)
    collector.envs.close()


@pytest.mark.parametrize(
    "space", [gym.spaces.Discrete(3, start=1), gym.spaces.MultiDiscrete([2, 3], start=[0, -1])]
)
def test_shifted_discrete_spaces_are_refused(space: gym.Space) -> None:
    """Both actors sample 0..n-1 and the env gets them as they are: a space starting elsewhere would get
    actions outside it, so the model refuses it (preflight turns this into a ConfigError)."""
    with pytest.raises(ValueError, match="starts at"):
        ActorCritic(BOX4, space, model_cfg())


def test_shifted_discrete_env_is_a_config_error() -> None:
    cfg, _ = compose(["env=gym", "env.id=ShiftedDiscrete-v0"])
    with pytest.raises(ConfigError, match=r"Discrete\(3, start=1\) starts at 1: .*TransformAction"):
        check(cfg)


# ------------------------------------------------------------------------------------------ multi-agent
# matching_v0 with agents leaving early (agent_i after 8 - i steps): agent_1 and agent_2 leave, so the
# second policy's storage holds rows of departed agents
TWO_POLICIES = [
    "env=pettingzoo",
    "+env.kwargs.leave_early=true",
    "multiagent.policies={first:{},rest:{model:{actor_hidden:[32],activation:relu}}}",
    "multiagent.policy_mapping={agent_0:first,agent_*:rest}",
    "env.num_envs=2",
    "algo.rollout_steps=24",
]


def test_multiagent_groups_act_through_numpy_with_their_own_policies() -> None:
    """Two policies of different widths and activations: each group acts through its own NumPy actor (the
    torch actors are never called), every row's stored log-prob is its policy's for the stored action,
    rows of agents that left included (their transitions are masked, not missing), and the draws come
    from torch's generator: a reseeded second collector stores the same rollout."""
    stores = []
    for _ in range(2):
        cfg, _ = compose(TWO_POLICIES)
        specs = policy_specs(cfg)
        torch.manual_seed(0)
        policies = {n: sharp_policy(s.obs_space, s.action_space, 0, **s.model) for n, s in specs.items()}
        for policy in policies.values():
            policy.sample = lambda *a, **k: pytest.fail("torch actor called")  # type: ignore[method-assign]
        collector = build_collector(cfg, specs, 0, "cpu", None)
        torch.manual_seed(3)
        collector.collect(policies, 0)
        for name, policy in policies.items():
            s = collector.storages[name]
            with torch.no_grad():
                logp, _, _ = policy(s["obs"].flatten(0, 1), s["actions"].flatten(0, 1))
            torch.testing.assert_close(s["logprobs"].flatten(), logp, rtol=1e-5, atol=1e-5)
            assert len(s["actions"].unique()) > 1
        assert (~collector.storages["rest"]["mask"]).any(), "agents must leave"
        stores.append({n: s.clone() for n, s in collector.storages.items()})
        collector.envs.close()
    for name in stores[0]:
        assert (stores[0][name] == stores[1][name]).all()


def test_a_coupled_run_acts_through_numpy(tmp_path: Any, monkeypatch: Any) -> None:
    """Through `ppo_fabric.run` (the model Fabric wraps, the optimizer stepping it in place) every rollout
    step acts through NumPy: the policy the loop hands the collector is the bare ActorCritic."""
    import ppo_fabric

    calls = []
    sample = NumpyActor.sample
    monkeypatch.setattr(NumpyActor, "sample", lambda self, *a: calls.append(1) or sample(self, *a))
    summary = ppo_fabric.run(
        [
            "env.num_envs=2",
            "algo.rollout_steps=16",
            "algo.minibatch_size=16",
            "algo.total_steps=128",
            "logger=none",
            "eval.every=0",
            f"hydra.run.dir={tmp_path}",
        ]
    )  # evaluation acts through NumPy too: off, so that the calls count the rollout's steps
    assert summary["total_env_steps"] == 128 and len(calls) == 64
