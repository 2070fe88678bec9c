"""Memory tasks for recurrent policies: the `ProbeMemory-v0` probe and `env.mask_velocity`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env
from omegaconf import DictConfig

import ppo_fabric
from ppo_fabric.envs.make import (
    VELOCITY_FREE_INDICES,
    EnvError,
    MaskVelocity,
    env_name,
    make_env,
    make_vector_env,
)
from ppo_fabric.runs.checkpoint import saved_spaces
from tests import probe_envs
from tests.conftest import env_section

MEMORY = "tests.probe_envs:ProbeMemory-v0"


def env_cfg(env_id: str, **overrides: Any) -> DictConfig:
    """A hand-built `env` section, as make_env receives it after config composition."""
    base = {"id": env_id, "num_envs": 2, "vector": "sync", "action_repeat": 1, "max_episode_steps": None,
            "kwargs": {}, "mask_velocity": True}  # fmt: skip
    return env_section(**{**base, **overrides})


def test_memory_probe_follows_the_gymnasium_api() -> None:
    env = gym.make(MEMORY)
    check_env(env.unwrapped, skip_render_check=True)
    assert env.observation_space == gym.spaces.Box(-1.0, 1.0, (1,), "float32")
    assert env.action_space == gym.spaces.Discrete(2)
    assert "ProbeMemory-v0" in probe_envs.MEMORY_PROBES and "ProbeMemory-v0" not in probe_envs.PROBES


@pytest.mark.parametrize("match", [True, False])
def test_memory_probe_shows_the_cue_once_and_pays_at_the_last_step(match: bool) -> None:
    env = gym.make(MEMORY)
    cues = set()
    for seed in range(20):
        first, _ = env.reset(seed=seed)
        cue = float(first[0])
        assert cue in (-1.0, 1.0) and first.dtype == np.float32
        cues.add(cue)
        right = 1 if cue > 0 else 0
        for t in range(1, probe_envs.ProbeMemory.LENGTH + 1):
            last = t == probe_envs.ProbeMemory.LENGTH
            # Before the last step the action does not matter: take the wrong one.
            action = right if (last and match) else 1 - right
            obs, reward, terminated, truncated, _ = env.step(action)
            assert float(obs[0]) == 0.0  # the cue is gone after the first observation
            assert not truncated and terminated == last
            assert reward == ((1.0 if match else -1.0) if last else 0.0)
    assert cues == {-1.0, 1.0}  # both cue signs appear over the seeds


def test_memoryless_policy_earns_nothing_on_the_memory_probe() -> None:
    """Any fixed last action is right for one cue and wrong for the other: expected return 0."""
    env = gym.make(MEMORY)
    for last_action in (0, 1):
        total = 0.0
        for seed in range(200):
            env.reset(seed=seed)
            for _ in range(probe_envs.ProbeMemory.LENGTH):
                _, reward, terminated, _, _ = env.step(last_action)
                total += float(reward)
        assert abs(total / 200) < 0.2


def test_env_name_drops_module_and_version() -> None:
    assert env_name("CartPole-v1") == "CartPole"
    assert env_name("my.module:LunarLander-v3") == "LunarLander"
    assert env_name("Pendulum") == "Pendulum"


def test_mask_velocity_keeps_cartpole_position_and_angle() -> None:
    masked = make_env(env_cfg("CartPole-v1"))
    full = make_env(env_cfg("CartPole-v1", mask_velocity=False))
    assert isinstance(masked, MaskVelocity)
    assert masked.observation_space.shape == (2,)
    assert masked.observation_space.dtype == full.observation_space.dtype
    np.testing.assert_array_equal(masked.observation_space.low, full.observation_space.low[[0, 2]])
    np.testing.assert_array_equal(masked.observation_space.high, full.observation_space.high[[0, 2]])
    obs, _ = masked.reset(seed=3)
    ref, _ = full.reset(seed=3)
    np.testing.assert_array_equal(obs, ref[[0, 2]])
    for t in range(30):
        obs, _, terminated, truncated, _ = masked.step(t % 2)
        ref, _, ref_terminated, ref_truncated, _ = full.step(t % 2)
        assert obs.shape == (2,) and obs.dtype == np.float32
        np.testing.assert_array_equal(obs, ref[[0, 2]])
        assert (terminated, truncated) == (ref_terminated, ref_truncated)
        if terminated or truncated:
            break
    masked.close()
    full.close()


@pytest.mark.parametrize(("env_id", "kept"), [("Pendulum-v1", 2), ("MountainCar-v0", 1)])
def test_mask_velocity_other_envs(env_id: str, kept: int) -> None:
    env = make_env(env_cfg(env_id))
    obs, _ = env.reset(seed=0)
    assert env.observation_space.shape == (kept,) and obs.shape == (kept,)
    assert env.observation_space.contains(obs)
    env.close()


def test_mask_velocity_lunarlander() -> None:
    pytest.importorskip("Box2D")
    env = make_env(env_cfg("LunarLander-v3"))
    full = make_env(env_cfg("LunarLander-v3", mask_velocity=False))
    obs, _ = env.reset(seed=0)
    ref, _ = full.reset(seed=0)
    assert env.observation_space.shape == (5,)
    np.testing.assert_array_equal(obs, ref[list(VELOCITY_FREE_INDICES["LunarLander"])])
    env.close()
    full.close()


def test_zeroed_velocities_keep_the_shape_and_read_zero() -> None:
    zeroed = make_env(env_cfg("CartPole-v1", mask_velocity="zero"))
    full = make_env(env_cfg("CartPole-v1", mask_velocity=False))
    assert zeroed.observation_space.shape == (4,)
    np.testing.assert_array_equal(zeroed.observation_space.low[[1, 3]], [0.0, 0.0])
    np.testing.assert_array_equal(zeroed.observation_space.high[[0, 2]], full.observation_space.high[[0, 2]])
    obs, _ = zeroed.reset(seed=5)
    ref, _ = full.reset(seed=5)
    for t in range(20):
        assert zeroed.observation_space.contains(obs)
        np.testing.assert_array_equal(obs, [ref[0], 0.0, ref[2], 0.0])
        assert ref[1] != 0.0 or ref[3] != 0.0  # the full observation does move
        obs, *_ = zeroed.step(t % 2)
        ref, *_ = full.step(t % 2)
    # "drop" is what true has always meant
    assert make_env(env_cfg("CartPole-v1", mask_velocity="drop")).observation_space.shape == (2,)
    with pytest.raises(EnvError, match="choose false, true"):
        make_env(env_cfg("CartPole-v1", mask_velocity="hide"))


def test_observation_noise_is_seeded_gaussian_noise_on_every_entry() -> None:
    cfg = env_cfg("CartPole-v1", mask_velocity=False, observation_noise=0.5)
    noisy, again = make_env(cfg), make_env(cfg)
    errors = []
    obs, _ = noisy.reset(seed=11)
    twin, _ = again.reset(seed=11)
    for t in range(400):
        errors.append(obs - np.asarray(noisy.unwrapped.state, dtype=np.float32))  # the true state
        np.testing.assert_array_equal(obs, twin)  # one seed, one noise
        assert obs.dtype == np.float32 and noisy.observation_space.contains(obs)
        obs, _, done, cut, _ = noisy.step(t % 2)
        twin, *_ = again.step(t % 2)
        if done or cut:
            obs, _ = noisy.reset()
            twin, _ = again.reset()
    errors = np.asarray(errors)
    assert np.all(np.abs(errors.mean(axis=0)) < 0.1) and np.all(np.abs(errors.std(axis=0) - 0.5) < 0.06)
    # with dropped velocities the noise lands on the entries that are left
    both = make_env(env_cfg("CartPole-v1", observation_noise=0.1))
    assert both.observation_space.shape == (2,)
    with pytest.raises(EnvError, match="standard deviation > 0"):
        make_env(env_cfg("CartPole-v1", observation_noise=-1.0))


def test_mask_velocity_in_a_vector_env() -> None:
    envs, obs = make_vector_env(env_cfg("CartPole-v1"), seed=0, rank=0)
    assert envs.single_observation_space.shape == (2,)
    assert np.asarray(obs).shape == (2, 2)
    envs.close()


def test_mask_velocity_on_an_unsupported_env_is_an_env_error() -> None:
    with pytest.raises(EnvError) as exc:
        make_env(env_cfg("Acrobot-v1"))
    message = str(exc.value)
    assert "\n" not in message and "Acrobot-v1" in message
    assert all(name in message for name in ("CartPole", "Pendulum", "LunarLander"))


def test_mask_velocity_defaults_to_off() -> None:
    cfg = env_section(id="CartPole-v1", num_envs=2)
    assert cfg.mask_velocity is False  # conf/env/gym.yaml's, which completes a config without the key
    env = make_env(cfg)
    assert env.observation_space.shape == (4,)
    env.close()


def test_short_run_with_masked_velocity(tmp_path: Path) -> None:
    """`env.mask_velocity=true` composes from the config and the model is built for the masked space."""
    summary = ppo_fabric.run(
        [
            "env=cartpole",
            "env.mask_velocity=true",
            "algo.total_steps=512",
            "logger=none",
            f"hydra.run.dir={tmp_path}",
        ]
    )
    assert summary["total_env_steps"] == 512
    state = torch.load(summary["checkpoint"], map_location="cpu", weights_only=True)
    assert saved_spaces(state)[0].shape == (2,)
