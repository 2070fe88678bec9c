"""The PPO ratio starts at 1: re-evaluating a CartPole rollout reproduces its log-probs and values, and one
`update_policy()` update on it under a real single-process Fabric reports the metrics that follow from that.

Bit-exactness does not hold in general: on CPU the re-evaluation of a minibatch whose size differs from the
rollout batch (num_envs rows per `act` call) goes through different BLAS kernels, and odd minibatch sizes
(1, 3, 7) were measured to differ by ~1 ulp (|ratio - 1| ~ 6e-8, |dV| ~ 2e-7). The NumPy rollout actor (the
default for these MLPs, `numpy_actor.py`) samples through NumPy's BLAS, which rounds like that too. So the
tests bound the error; the torch actor's per-step re-evaluation is checked bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from lightning_fabric import Fabric
from omegaconf import DictConfig, OmegaConf
from tensordict import TensorDict

from ppo_fabric.collect.rollout import RolloutCollector
from ppo_fabric.envs.make import make_vector_env
from ppo_fabric.learn.buffer import rollout_storage, training_batch
from ppo_fabric.models.agent import ActorCritic
from tests.conftest import algo_section, cartpole_env_cfg, single_learner
from tests.conftest import update_with_config as train

STEPS, ENVS = 32, 4
N = STEPS * ENVS


def env_cfg() -> DictConfig:
    return cartpole_env_cfg(ENVS, max_episode_steps=20)


def model_cfg() -> DictConfig:
    return OmegaConf.create(
        {"encoder": "auto", "actor_hidden": [64, 64], "critic_hidden": [64, 64], "activation": "tanh"}
    )


def algo_cfg(**overrides: object) -> DictConfig:
    """conf/algo/ppo.yaml's update keys, sized for a 128-sample batch."""
    algo = {
        "minibatch_size": N,
        "update_epochs": 1,
        "lr": 2.5e-4,
        "adam_eps": 1e-5,  # read by build_learners
        "gamma": 0.99,
        "gae_lambda": 0.95,
        "norm_adv": True,
        "clip_coef": 0.2,
        "clip_vloss": False,
        "vf_coef": 0.5,
        "ent_coef": 0.01,
        "max_grad_norm": 0.5,
        "target_kl": None,
        "anneal_lr": False,
    }
    return algo_section(**(algo | overrides))


def collect(model: ActorCritic, seed: int = 0, numpy_rollout: bool = True) -> TensorDict:
    """One [STEPS, ENVS] CartPole rollout with GAE filled in, acted by the NumPy actor or the torch one."""
    envs, first_obs = make_vector_env(env_cfg(), seed, 0)
    try:
        storage = rollout_storage(STEPS, ENVS, envs.single_observation_space, envs.single_action_space, "cpu")
        collector = RolloutCollector(envs, first_obs, storage, 0.99, 0.95, numpy_rollout=numpy_rollout)
        assert collector.collect(model, 0) == N
    finally:
        envs.close()
    return storage


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Run as the CLI does (torch_threads=1): on a busy 2-core box, OpenMP hand-offs on these tiny tensors
    cost ~10 ms per op and made this file 10x slower. Restored afterwards for the other test modules."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def seeded_rollout(numpy_rollout: bool) -> tuple[ActorCritic, TensorDict]:
    torch.manual_seed(0)
    envs, _ = make_vector_env(env_cfg(), 0, 0)
    model = ActorCritic(envs.single_observation_space, envs.single_action_space, model_cfg())
    envs.close()
    return model, collect(model, numpy_rollout=numpy_rollout)


@pytest.fixture(scope="module")
def rollout(one_thread: None) -> tuple[ActorCritic, TensorDict]:
    return seeded_rollout(numpy_rollout=True)


@pytest.fixture(scope="module")
def torch_rollout(one_thread: None) -> tuple[ActorCritic, TensorDict]:
    return seeded_rollout(numpy_rollout=False)


def test_rollout_has_both_episode_ends(rollout: tuple[ActorCritic, TensorDict]) -> None:
    """Guard: the data exercises terminations and time-limit truncations (20-step limit, 32 steps)."""
    _, storage = rollout
    assert storage["truncated"].any() and storage["terminated"].any()
    # V(final obs) was stored exactly where a time limit cut an episode
    cut = storage["truncated"] & ~storage["terminated"]
    assert ((storage["final_values"] != 0) == cut).all()


@pytest.mark.parametrize("minibatch", [1, 3, 4, 7, 16, 32, 64, N])
def test_first_minibatch_ratio_is_one(rollout: tuple[ActorCritic, TensorDict], minibatch: int) -> None:
    """Before any step, `forward` on shuffled minibatches of the stored obs/actions gives the stored
    log-probs and values: the first minibatch's ratio is 1 up to BLAS rounding (see module docstring)."""
    model, storage = rollout
    batch = training_batch(storage)
    shuffled = batch[torch.randperm(N, generator=torch.Generator().manual_seed(minibatch))]
    worst_ratio, worst_value = 0.0, 0.0
    with torch.no_grad():
        for start in range(0, N, minibatch):
            mb = shuffled[start : start + minibatch]
            new_logp, entropy, new_values = model(mb["obs"], mb["actions"])
            ratio = (new_logp - mb["logprobs"]).exp()
            worst_ratio = max(worst_ratio, (ratio - 1).abs().max().item())
            worst_value = max(worst_value, (new_values - mb["values"]).abs().max().item())
            assert (entropy > 0).all() and (entropy <= math.log(2) + 1e-6).all()
    assert worst_ratio < 1e-6
    assert worst_value < 1e-5


def test_numpy_rollout_per_step_reevaluation_is_within_rounding(
    rollout: tuple[ActorCritic, TensorDict],
) -> None:
    """The NumPy actor's log-probs are torch's to float32 rounding; the values are torch's own, bit-exact."""
    model, storage = rollout
    with torch.no_grad():
        for t in range(STEPS):
            new_logp, _, new_values = model(storage["obs"][t], storage["actions"][t])
            assert (new_logp - storage["logprobs"][t]).abs().max() < 1e-6
            assert torch.equal(new_values, storage["values"][t])


def test_per_step_reevaluation_is_bit_exact(torch_rollout: tuple[ActorCritic, TensorDict]) -> None:
    """Torch actor: unshuffled, per-step [ENVS] evaluation is the same computation as the rollout's
    `sample`, so the log-probs are bit-exact; the values, which the rollout computes once over all its
    steps, come out bit-exact on this BLAS too (each row's dot products do not depend on the batch here)."""
    model, storage = torch_rollout
    with torch.no_grad():
        for t in range(STEPS):
            new_logp, _, new_values = model(storage["obs"][t], storage["actions"][t])
            assert torch.equal(new_logp, storage["logprobs"][t])
            assert torch.equal(new_values, storage["values"][t])


# ------------------------------------------------------------------------------------------ train()
KEYS = {
    "loss/policy",
    "loss/value",
    "loss/entropy",
    "train/approx_kl",
    "train/clip_fraction",
    "train/explained_variance",
    "train/epochs",
    "train/skipped_steps",
}


def fabric_learner(seed: int, lr: float = 2.5e-4) -> tuple[Fabric, Any, Any, ActorCritic]:
    """A real single-process CPU Fabric with the model and optimizer set up as `main()` does it."""
    torch.manual_seed(seed)
    fabric = Fabric(accelerator="cpu", devices=1)
    envs, _ = make_vector_env(env_cfg(), seed, 0)
    spaces = envs.single_observation_space, envs.single_action_space
    envs.close()
    cfg = OmegaConf.create({"model": model_cfg(), "algo": algo_cfg(lr=lr)})
    learner = single_learner(fabric, cfg, *spaces)
    return fabric, learner.model, learner.optimizer, learner.policy


def params(agent: ActorCritic) -> list[torch.Tensor]:
    return [p.detach().clone() for p in agent.parameters()]


@pytest.mark.parametrize("norm_adv", [True, False])
@pytest.mark.parametrize("clip_vloss", [False, True])
def test_train_one_minibatch_metrics(norm_adv: bool, clip_vloss: bool) -> None:
    """One epoch, one minibatch = the whole batch: the stats are taken at ratio 1, so clip fraction and KL
    are 0 (KL to float32 rounding of ratios within ~1e-7 of 1), the policy loss is -mean(adv) (0 when normalised), the value loss mean(adv^2), and the entropy
    the mean entropy of the initial policy; the parameters move."""
    fabric, model, optimizer, agent = fabric_learner(seed=1)
    storage = collect(agent, seed=1)
    batch = training_batch(storage)
    before = params(agent)
    with torch.no_grad():
        _, entropy, _ = agent(batch["obs"], batch["actions"])
    adv, values, returns = batch["advantages"].double(), batch["values"].double(), batch["returns"].double()
    expected_explained = 1 - ((returns - values).var() / returns.var()).item()

    stats = train(fabric, model, optimizer, batch, algo_cfg(norm_adv=norm_adv, clip_vloss=clip_vloss))

    assert set(stats) == KEYS
    assert all(math.isfinite(v) for v in stats.values())
    assert stats["train/epochs"] == 1
    assert stats["train/clip_fraction"] == 0.0
    assert abs(stats["train/approx_kl"]) < 1e-7
    assert stats["loss/policy"] == pytest.approx(0.0 if norm_adv else -adv.mean().item(), abs=1e-5)
    assert stats["loss/value"] == pytest.approx(adv.pow(2).mean().item(), rel=1e-5, abs=1e-6)
    assert stats["loss/entropy"] == pytest.approx(entropy.mean().item(), rel=1e-6)
    assert stats["train/explained_variance"] == pytest.approx(expected_explained, rel=1e-4, abs=1e-6)
    after = params(agent)
    assert all(p.isfinite().all() for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_train_clip_fraction_counts_later_minibatches_only() -> None:
    """With four minibatches and a large learning rate, later minibatches see ratios beyond the clip range;
    the first contributes 0, so the mean clip fraction lies in (0, 3/4]."""
    fabric, model, optimizer, agent = fabric_learner(seed=2, lr=0.05)
    storage = collect(agent, seed=2)
    stats = train(fabric, model, optimizer, training_batch(storage), algo_cfg(minibatch_size=N // 4))
    assert 0.0 < stats["train/clip_fraction"] <= 0.75
    assert stats["train/approx_kl"] > 0
    assert all(math.isfinite(v) for v in stats.values())


@pytest.mark.parametrize("target_kl,expected_epochs", [(None, 3), (-1.0, 1)])
def test_train_epochs_and_target_kl(target_kl: float | None, expected_epochs: int) -> None:
    """Without target_kl every epoch runs; a target every KL estimate exceeds stops after the first epoch."""
    fabric, model, optimizer, agent = fabric_learner(seed=3)
    storage = collect(agent, seed=3)
    before = params(agent)
    algo = algo_cfg(minibatch_size=N // 2, update_epochs=3, target_kl=target_kl)
    stats = train(fabric, model, optimizer, training_batch(storage), algo)
    assert stats["train/epochs"] == expected_epochs
    assert set(stats) == KEYS and all(math.isfinite(v) for v in stats.values())
    assert any(not torch.equal(a, b) for a, b in zip(before, params(agent), strict=True))


def test_values_are_the_critic_of_each_stored_step_in_any_chunking(
    rollout: tuple[ActorCritic, TensorDict], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rollout evaluates the critic after the loop, over the stored observations, in chunks of
    `VALUE_CHUNK` rows: chunks that split the [T, E] grid mid-row must give the same values in the same
    places, and those are V(obs) of each stored step."""
    model, _ = rollout
    torch.manual_seed(1)
    storage = collect(model)
    monkeypatch.setattr(RolloutCollector, "VALUE_CHUNK", 7)  # 128 rows: 18 full chunks and a ragged one
    torch.manual_seed(1)  # the same actions, so the same observations
    chunked = collect(model)
    assert torch.equal(chunked["obs"], storage["obs"])
    torch.testing.assert_close(chunked["values"], storage["values"], rtol=0, atol=1e-6)
    with torch.no_grad():
        expected = model.get_value(storage["obs"].reshape(N, -1)).view(STEPS, ENVS)
    torch.testing.assert_close(storage["values"], expected, rtol=0, atol=1e-6)
    assert storage["values"].std() > 0  # not a constant that any layout would reproduce
