"""`collect.actors`: which actor a group gets for a rollout, and what each writes into the storage.

The actors' agreement with each other (the same draws, the same actions) is tested on whole rollouts in
tests/learn/test_ratio.py (`test_the_switch_changes_the_speed_not_the_actions`)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from ppo_fabric.collect.actors import NumpyRolloutActor, ReadyRowsActor, TorchActor, acting_for
from ppo_fabric.learn.buffer import rollout_storage
from ppo_fabric.models.agent import ActorCritic

STEPS, ROWS = 3, 4
OBS = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
ACT = gym.spaces.Discrete(3)


def _policy() -> ActorCritic:
    torch.manual_seed(0)
    model = OmegaConf.create(
        {"encoder": "auto", "actor_hidden": [8], "critic_hidden": [8], "activation": "tanh"}
    )
    return ActorCritic(OBS, ACT, model)


def _storage():  # type: ignore[no-untyped-def]
    return rollout_storage(STEPS, ROWS, OBS, ACT, "cpu")


@pytest.mark.parametrize(
    ("plain", "numpy_rollout", "ready", "kind", "noise"),
    [
        (True, True, False, NumpyRolloutActor, True),
        (True, False, False, TorchActor, True),
        (False, True, False, TorchActor, False),
        (False, False, True, ReadyRowsActor, False),
        (True, True, True, ReadyRowsActor, False),  # an async pool acts by ready rows whatever else holds
    ],
)
def test_each_case_gets_its_actor(
    plain: bool, numpy_rollout: bool, ready: bool, kind: type, noise: bool
) -> None:
    storage = _storage()
    rows = (lambda: np.ones(ROWS, dtype=bool)) if ready else None
    actor = acting_for(_policy(), storage, storage["obs"].numpy(), plain, numpy_rollout, rows)
    assert type(actor) is kind
    assert (getattr(actor, "noise", None) is not None) is noise


@torch.inference_mode()  # as the rollout loop acts
def test_torch_actor_stores_what_it_sampled() -> None:
    storage, policy = _storage(), _policy()
    actor = acting_for(policy, storage, storage["obs"].numpy(), False, False, None)
    taken = []
    for t in range(STEPS):
        action, state = actor.act(t, torch.rand(ROWS, 2), None, None)
        assert state is None and action.shape == (ROWS,)
        taken.append(action)
    actor.store(storage)
    assert np.array_equal(storage["actions"].numpy(), np.stack(taken))
    assert (storage["logprobs"] < 0).all()


def test_numpy_actor_writes_the_storage_as_it_acts() -> None:
    storage, policy = _storage(), _policy()
    storage["obs"].copy_(torch.rand(STEPS, ROWS, 2))
    actor = acting_for(policy, storage, storage["obs"].numpy(), True, True, None)
    assert actor.reads_host
    action, _ = actor.act(0, None, None, None)
    assert np.array_equal(storage["actions"][0].numpy(), action)
    with torch.no_grad():
        logp, _, _ = policy(storage["obs"][0], storage["actions"][0])
    torch.testing.assert_close(storage["logprobs"][0], logp, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_ready_rows_actor_acts_for_the_ready_rows_only() -> None:
    storage, policy = _storage(), _policy()
    ready = np.array([True, False, True, False])
    actor = acting_for(policy, storage, storage["obs"].numpy(), True, True, lambda: ready)
    obs = torch.rand(ROWS, 2)
    action, _ = actor.act(0, obs, None, None)
    actor.act(1, obs, None, None)
    actor.act(2, obs, None, None)
    actor.store(storage)
    assert (storage["logprobs"][:, ~torch.from_numpy(ready)] == 0).all()
    assert (storage["logprobs"][:, torch.from_numpy(ready)] < 0).all()
    assert (action[~ready] == 0).all()
