"""The public Python API: `ppo_fabric.load_policy(path)` and `Policy.predict`, checked against the
policies' own outputs for feed-forward, normalised, Box, masked, recurrent and multi-agent checkpoints."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import pytest
import torch

import ppo_fabric
import tests.probe_envs  # noqa: F401  (registers the probe envs)
from ppo_fabric.config.values import compose
from ppo_fabric.envs.make import make_env
from ppo_fabric.envs.normalize import RunningMoments
from ppo_fabric.models.agent import ActorCritic
from tests.policy.test_export_policies import LSTM, MASKED_ENV, _write

BOX = (gym.spaces.Box(-1.0, 1.0, (3,), np.float32), gym.spaces.Box(-2.0, 2.0, (2,), np.float32))


def _act(policy: ppo_fabric.Policy, obs: np.ndarray, **kw: object) -> np.ndarray:
    with torch.no_grad():
        return policy.model.act(torch.as_tensor(obs, dtype=torch.float32), True, **kw)[0].numpy()


def test_feed_forward_one_observation_or_a_batch(tiny_run: Path) -> None:
    policy = ppo_fabric.load_policy(tiny_run)
    assert policy.name == "main" and not policy.recurrent and policy.initial_state() is None
    obs = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
    actions, state = policy.predict(obs)
    assert state is None and actions.shape == (6,) and actions.dtype == np.int64
    np.testing.assert_array_equal(actions, _act(policy, obs))
    one, _ = policy.predict(obs[2])
    assert one.shape == () and int(one) == actions[2]
    from_a_graph = torch.as_tensor(obs).requires_grad_()  # a user's tensor with a grad: taken as its values
    np.testing.assert_array_equal(policy.predict(from_a_graph)[0], actions)
    assert (
        ppo_fabric.load_policy(tiny_run / "checkpoints" / "last.ckpt").predict(obs)[0].tolist()
        == actions.tolist()
    )


def test_observations_are_normalised_with_the_runs_statistics(tmp_path: Path) -> None:
    moments = RunningMoments((3,))
    moments.mean, moments.var, moments.count = np.array([5.0, -5.0, 0.0]), np.array([4.0, 1.0, 9.0]), 10.0
    path = _write(
        tmp_path / "n.ckpt",
        ["env.id=Pendulum-v1"],
        {"main": BOX},
        ranks=[{"normalizers": {"NormalizeObservation": moments.state_dict()}}],
    )
    policy = ppo_fabric.load_policy(path)
    raw = np.array([[6.0, -4.0, 3.0], [5.0, -5.0, 0.0]], np.float32)
    got, _ = policy.predict(raw)
    np.testing.assert_allclose(got, np.clip(_act(policy, moments.normalize(raw)), -2.0, 2.0), rtol=1e-6)
    assert not np.allclose(got, np.clip(_act(policy, raw), -2.0, 2.0))  # the statistics made a difference


def test_box_actions_are_clipped_as_the_env_receives_them(tmp_path: Path) -> None:
    policy = ppo_fabric.load_policy(_write(tmp_path / "b.ckpt", ["env.id=Pendulum-v1"], {"main": BOX}))
    with torch.no_grad():
        policy.model.head.mean.weight.mul_(50.0)
    obs = np.random.default_rng(1).uniform(-1, 1, size=(64, 3)).astype(np.float32)
    raw = _act(policy, obs)
    assert np.abs(raw).max() > 2.0  # the test's large head weights push some means out of bounds
    got, _ = policy.predict(obs)
    np.testing.assert_array_equal(got, np.clip(raw, -2.0, 2.0))
    sampled, _ = policy.predict(obs, deterministic=False)
    assert sampled.shape == (64, 2) and np.all(np.abs(sampled) <= 2.0)


def test_action_masks_are_honoured(tmp_path: Path) -> None:
    env = make_env(compose([f"env.id={MASKED_ENV}"])[0].env, action_mask=4)
    path = _write(
        tmp_path / "m.ckpt",
        [f"env.id={MASKED_ENV}"],
        {"main": (env.observation_space, env.action_space)},
        action_mask=4,
    )
    policy = ppo_fabric.load_policy(path)
    assert policy.mask_width == 4
    differ = 0
    for episode in range(3):
        obs, info = env.reset(seed=episode)
        done = False
        while not done:
            mask = np.asarray(info["action_mask"], dtype=bool)
            action, _ = policy.predict(obs, action_mask=mask)
            assert mask[int(action)]
            assert int(action) == int(_act(policy, obs[None], action_mask=torch.as_tensor(mask)[None])[0])
            differ += int(policy.predict(obs)[0]) != int(action)
            obs, _, terminated, truncated, info = env.step(int(action))
            done = terminated or truncated
    assert differ > 0, "the mask never changed the greedy action: a dropped mask would go unseen"
    obs, info = env.reset(seed=0)
    for bad, fragment in (
        (np.ones(3, bool), r"action_mask of shape \(3,\) does not fit 1 observation\(s\) of this policy's 4 "
                           r"actions: give \[4\]"),
        (np.ones((2, 4), bool), r"shape \(2, 4\) does not fit 1 observation"),  # not row 0 used silently
        (np.zeros(4, bool), "action_mask row 0 allows no action"),  # an illegal action otherwise
    ):  # fmt: skip
        with pytest.raises(ValueError, match=fragment):
            policy.predict(obs, action_mask=bad)
    env.close()


def test_a_policy_trained_without_masks(tmp_path: Path) -> None:
    """A policy trained with `algo.action_mask=off` on an env that offers masks: `evaluate` plays it as it
    trained (the env's mask left out, as the evaluation during training does); `predict` given a mask
    checks it against the action count in one line, and refuses one for actions that cannot be masked."""
    from ppo_fabric.policy.evaluate import play

    env = make_env(compose([f"env.id={MASKED_ENV}"])[0].env)
    path = _write(
        tmp_path / "u.ckpt", [f"env.id={MASKED_ENV}"], {"main": (env.observation_space, env.action_space)}
    )
    policy = ppo_fabric.load_policy(path)
    assert policy.mask_width is None
    seen: list[object] = []
    predict = policy.predict
    policy.predict = lambda *a, **k: (seen.append(a[4]), predict(*a, **k))[1]  # type: ignore[method-assign]
    play(policy, env, 2, True, seed=0)
    assert seen and all(mask is None for mask in seen)
    obs, info = env.reset(seed=0)
    mask = np.asarray(info["action_mask"], dtype=bool)
    assert predict(obs, action_mask=mask)[0].shape == ()  # a mask over its 4 actions: honoured
    with pytest.raises(ValueError, match=r"action_mask of shape \(5,\) does not fit .* 4 actions"):
        predict(obs, action_mask=np.ones(5, bool))
    box = ppo_fabric.load_policy(_write(tmp_path / "b.ckpt", ["env.id=Pendulum-v1"], {"main": BOX}))
    with pytest.raises(ValueError, match="Box actions cannot be masked"):
        box.predict(np.zeros(3, np.float32), action_mask=np.ones(2, bool))
    env.close()


@pytest.mark.parametrize("recurrent", [False, True])
def test_a_float64_default_dtype_is_the_callers_own(tmp_path: Path, recurrent: bool) -> None:
    """A notebook's `torch.set_default_dtype(torch.float64)`: the policy loads and acts in float32 as the
    run trained it (its model was built in float64 and every predict failed, "mat1 and mat2 must have the
    same dtype"), and the caller's default stays float64."""
    env = gym.make("CartPole-v1")
    lstm = LSTM if recurrent else []
    path = _write(
        tmp_path / "p.ckpt",
        ["env.id=CartPole-v1", *lstm],
        {"main": (env.observation_space, env.action_space)},
    )
    obs = np.random.default_rng(3).normal(size=(4, 4))
    want, want_state = ppo_fabric.load_policy(path).predict(obs.astype(np.float32))
    torch.set_default_dtype(torch.float64)
    try:
        policy = ppo_fabric.load_policy(path)
        assert next(policy.model.parameters()).dtype == torch.float32
        actions, state = policy.predict(obs, policy.initial_state(4))  # float64 observations too
        assert torch.get_default_dtype() == torch.float64
    finally:
        torch.set_default_dtype(torch.float32)
    np.testing.assert_array_equal(actions, want)
    assert (state is None) == (not recurrent) and (state is None or state.dtype == want_state.dtype)
    env.close()


def test_recurrent_state_is_carried_by_the_caller(tmp_path: Path) -> None:
    env = gym.make("CartPole-v1")
    path = _write(
        tmp_path / "r.ckpt",
        ["env.id=CartPole-v1", *LSTM],
        {"main": (env.observation_space, env.action_space)},
    )
    policy = ppo_fabric.load_policy(path)
    assert policy.recurrent and policy.initial_state(2).shape == (2, *policy.model.state_shape)
    obs = np.random.default_rng(2).normal(size=(5, 2, 4)).astype(np.float32)  # 5 steps of a batch of 2
    state, ref = None, None
    for t in range(5):
        action, state = policy.predict(obs[t], state)
        with torch.no_grad():
            want, _, _, ref = policy.model.act_with_state(torch.as_tensor(obs[t]), ref, True)
        np.testing.assert_array_equal(action, want.numpy())
        np.testing.assert_allclose(state, ref.numpy(), rtol=1e-6)
    # episode_start: row 0 begins again from the initial state, row 1 keeps its own
    restarted, after = policy.predict(obs[0], state, episode_start=np.array([True, False]))
    fresh, fresh_state = policy.predict(obs[0][:1])
    assert int(restarted[0]) == int(fresh[0])
    np.testing.assert_allclose(after[:1], fresh_state, rtol=1e-6)
    assert not np.allclose(after[1:], fresh_state)
    one, one_state = policy.predict(obs[0][0])  # one observation: one action, state of a batch of one
    assert one.shape == () and one_state.shape == (1, *policy.model.state_shape)
    with pytest.raises(ValueError, match=r"state of shape \(2, .*\) does not fit 3 observation\(s\)"):
        policy.predict(np.zeros((3, 4), np.float32), state)
    with pytest.raises(ValueError, match="episode_start has 2 entries for 3 observation"):
        policy.predict(np.zeros((3, 4), np.float32), None, episode_start=np.array([True, False]))
    env.close()


def test_make_env_builds_the_env_as_the_run_did(tmp_path: Path) -> None:
    """`Policy.make_env`: the run's wrappers (here zeroed velocities), so `predict` gets the observations
    the policy trained on; an env of a module outside the known packages only with trust_env=True."""
    overrides = ["env.id=CartPole-v1", "env.mask_velocity=zero"]
    cfg_env = compose(overrides)[0].env
    trained = make_env(cfg_env)
    path = _write(tmp_path / "v.ckpt", overrides, {"main": (trained.observation_space, trained.action_space)})
    policy = ppo_fabric.load_policy(path)
    env = policy.make_env()
    obs, _ = env.reset(seed=0)
    for _ in range(5):
        obs, *_ = env.step(int(policy.predict(obs)[0]))
    assert obs[1] == 0.0 and obs[3] == 0.0, "the velocities are hidden as in training"
    env.close()
    trained.close()
    foreign = _write(tmp_path / "f.ckpt", ["env.id=tests.endless_env:make"],
                     {"main": (gym.spaces.Box(-1, 1, (2,), np.float32), gym.spaces.Discrete(2))})  # fmt: skip
    with pytest.raises(ValueError, match="would import and run module 'tests.endless_env'.*trust_env=True"):
        ppo_fabric.load_policy(foreign).make_env()
    ppo_fabric.load_policy(foreign).make_env(trust_env=True).close()


def test_multiagent_checkpoint_needs_a_policy_name(tmp_path: Path) -> None:
    spaces = {"red": BOX, "blue": (gym.spaces.Box(-1.0, 1.0, (5,), np.float32), gym.spaces.Discrete(3))}
    path = _write(
        tmp_path / "ma.ckpt",
        [
            "env=pettingzoo",
            "env.id=ppo_fabric.envs.toy_multiagent:teams_v0",
            "multiagent.policies={red:{},blue:{}}",
        ],
        spaces,
    )
    with pytest.raises(ValueError, match=r"multi-agent run \(red, blue\); choose one with"):
        ppo_fabric.load_policy(path)
    with pytest.raises(ValueError, match="policy='green' is not in"):
        ppo_fabric.load_policy(path, policy="green")
    blue = ppo_fabric.load_policy(path, policy="blue")
    assert blue.name == "blue" and blue.action_space == gym.spaces.Discrete(3)
    obs = np.zeros((2, 5), np.float32)
    np.testing.assert_array_equal(blue.predict(obs)[0], _act(blue, obs))
    with pytest.raises(
        ValueError, match=r"single-agent run's policy; a multi-agent policy acts in a PettingZoo"
    ):
        blue.make_env()


def test_a_file_that_is_no_checkpoint_is_refused_in_one_line(tmp_path: Path) -> None:
    """Each in one line that says what the file is (random bytes read as "objects that load only by running
    code" before, an exported policy as torch's two-line warning and a RuntimeError)."""
    scripted = tmp_path / "policy.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript's deprecation: the file is what export still writes
        torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(scripted))
    (tmp_path / "bad.ckpt").write_bytes(b"not a checkpoint")
    (tmp_path / "empty.ckpt").write_bytes(b"")
    for path, fragment in (
        (tmp_path / "bad.ckpt", "not a torch file: truncated, damaged or of another kind"),
        (tmp_path / "empty.ckpt", "the file is empty"),
        (scripted, "an exported TorchScript policy: load it with torch.jit.load"),
    ):
        with warnings.catch_warnings(), pytest.raises(ValueError) as info:
            warnings.simplefilter("error")  # no warning beside the one line
            ppo_fabric.load_policy(path)
        assert "\n" not in str(info.value) and fragment in str(info.value), str(info.value)


def test_a_wrong_sized_observation_names_both_shapes(tmp_path: Path) -> None:
    """Not torch's `mat1 and mat2 shapes cannot be multiplied`: the expected and the given shape."""
    policy = ppo_fabric.load_policy(_write(tmp_path / "s.ckpt", ["env.id=Pendulum-v1"], {"main": BOX}))
    for bad, given in [
        (np.zeros(4, np.float32), r"\(4,\)"),  # another env's observation
        (np.zeros((5, 4), np.float32), r"\(5, 4\)"),
        (np.zeros((2, 5, 3), np.float32), r"\(2, 5, 3\)"),  # a batch of batches
        (np.float32(0.0), r"\(\)"),
    ]:
        with pytest.raises(ValueError, match=rf"observation of shape {given} does not fit .* shape \(3,\)"):
            policy.predict(bad)
    assert policy.predict(np.zeros(3, np.float32))[0].shape == (2,)
    assert policy.predict([[0.0, 0.0, 0.0]] * 2)[0].shape == (2, 2)  # a list batch still works


def test_a_games_observation_dict_is_pointed_at_its_parts(tmp_path: Path) -> None:
    """It read the dict as an observation of shape () (`does not fit ... (3,)`)."""
    policy = ppo_fabric.load_policy(_write(tmp_path / "s.ckpt", ["env.id=Pendulum-v1"], {"main": BOX}))
    with pytest.raises(ValueError, match=r"give the game's observation\['observation'\], with action_mask="):
        policy.predict({"observation": np.zeros(3, np.float32), "action_mask": np.ones(2, np.int8)})


def test_a_nan_or_inf_observation_is_refused(tmp_path: Path) -> None:
    """As training refuses it: the network turned a NaN into an action without a word."""
    policy = ppo_fabric.load_policy(_write(tmp_path / "s.ckpt", ["env.id=Pendulum-v1"], {"main": BOX}))
    with pytest.raises(ValueError, match=r"^Policy.predict: the observation holds NaN$"):
        policy.predict(np.array([np.nan, 0.0, 0.0], np.float32))
    batch = np.zeros((3, 3))
    batch[2, 1] = -np.inf
    with pytest.raises(
        ValueError, match=r"^Policy.predict: the observation holds -inf in row 2 of the batch$"
    ):
        policy.predict(batch)


def test_a_dict_observation_is_checked_key_by_key() -> None:
    space = gym.spaces.Dict(
        {
            "pos": gym.spaces.Box(-1.0, 1.0, (2,), np.float32),
            "goal": gym.spaces.Box(-1.0, 1.0, (3,), np.float32),
        }
    )
    cfg = compose(["env.id=CartPole-v1"])[0]
    policy = ppo_fabric.Policy(
        ActorCritic(space, gym.spaces.Discrete(2), cfg.model), space, gym.spaces.Discrete(2)
    )
    one = {"pos": np.zeros(2, np.float32), "goal": np.zeros(3, np.float32)}
    assert policy.predict(one)[0].shape == ()
    batch = {"pos": np.zeros((4, 2), np.float32), "goal": np.zeros((4, 3), np.float32)}
    assert policy.predict(batch)[0].shape == (4,)
    with pytest.raises(ValueError, match=r"Dict of \['goal', 'pos'\], given \['pos'\]"):
        policy.predict({"pos": one["pos"]})
    with pytest.raises(ValueError, match=r"observation\['goal'\] of shape \(4,\) does not fit .*\(3,\)"):
        policy.predict({**one, "goal": np.zeros(4, np.float32)})
    with pytest.raises(
        ValueError, match=r"observation\['goal'\] of shape \(3,\)"
    ):  # one key single, one batched
        policy.predict({**batch, "goal": one["goal"]})
    with pytest.raises(ValueError, match=r'the observation\["pos"\] holds NaN$'):
        policy.predict({**one, "pos": np.array([0.0, np.nan], np.float32)})
    with pytest.raises(ValueError, match="differ in size"):
        policy.predict({**batch, "goal": np.zeros((5, 3), np.float32)})


def test_a_multidiscrete_mask_needs_a_legal_choice_in_every_dimension() -> None:
    """A mask that allows actions in one dimension but none in another would have the policy draw an
    illegal sub-action (its log-probability -log n, its entropy 0): refused per dimension, as training's
    check does, not only per row."""
    from ppo_fabric.policy.trained import Policy

    stub = SimpleNamespace(action_space=gym.spaces.MultiDiscrete([3, 3]), mask_width=6)
    ok = np.array([True, False, False, False, True, False])
    assert Policy._mask(stub, ok, 1, True).shape == (1, 6)  # noqa: SLF001
    with pytest.raises(ValueError, match="action_mask row 1 allows no action in action dimension 1"):
        Policy._mask(stub, np.stack([ok, [True, True, True, False, False, False]]), 2, False)  # noqa: SLF001
