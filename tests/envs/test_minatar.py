"""MinAtar wiring: the grid CNN, `model.encoder=auto` on bool frames, the env ids, the recipe, a short run."""

from __future__ import annotations

import builtins
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import ppo_fabric
from ppo_fabric.config.values import compose
from ppo_fabric.envs.make import EnvError, make_env
from ppo_fabric.models.agent import ActorCritic, GridCNN, select_encoder

pytest.importorskip("minatar", reason="MinAtar missing: pip install -c constraints.txt '.[minatar]'")

FRAMES = gym.spaces.Box(0, 1, (10, 10, 4), np.bool_)


def test_grid_cnn_convolves_channels_last_bool_frames() -> None:
    torch.manual_seed(0)
    cnn = GridCNN(FRAMES)
    assert (cnn.conv.in_channels, cnn.conv.out_channels) == (4, 16)
    assert cnn.linear.in_features == 16 * 8 * 8 and cnn.out_dim == 128
    frames = torch.rand(3, 10, 10, 4) > 0.7
    by_hand = torch.relu(cnn.conv(frames.float().permute(0, 3, 1, 2))).flatten(1)  # [H, W, C] -> [C, H, W]
    torch.testing.assert_close(cnn(frames), torch.relu(cnn.linear(by_hand)))


def test_grid_cnn_reads_one_channel_grids_and_refuses_tiny_ones() -> None:
    flat = GridCNN(gym.spaces.Box(0, 1, (6, 7), np.float32))
    assert flat.conv.in_channels == 1 and flat(torch.zeros(2, 6, 7)).shape == (2, 128)
    with pytest.raises(ValueError, match="smaller than the 3x3 kernel"):
        GridCNN(gym.spaces.Box(0, 1, (2, 8, 3), np.bool_))
    with pytest.raises(ValueError, match="grid observation space"):
        GridCNN(gym.spaces.Box(0, 1, (5,), np.float32))


def test_auto_encoder_picks_the_grid_cnn_for_bool_frames_only() -> None:
    assert select_encoder(FRAMES, "auto") == "grid"
    assert select_encoder(gym.spaces.Box(0, 1, (10,), np.bool_), "auto") == "mlp"
    assert select_encoder(gym.spaces.Box(0, 1, (10, 10, 4), np.float32), "auto") == "mlp"
    model = OmegaConf.create(
        {"encoder": "auto", "actor_hidden": [], "critic_hidden": [], "activation": "relu"}
    )
    agent = ActorCritic(FRAMES, gym.spaces.Discrete(3), model)
    assert isinstance(agent.encoder, GridCNN) and agent.head.linear.in_features == 128
    action, logprob, value = agent.act(torch.rand(5, 10, 10, 4) > 0.5)
    assert action.shape == logprob.shape == value.shape == (5,)


def test_minatar_recipe_builds_breakout_with_minimal_actions() -> None:
    cfg, _ = compose(["exp=minatar"])
    assert cfg.env.id == "MinAtar/Breakout-v1" and cfg.model.encoder == "grid"
    assert cfg.algo.total_steps == 5_000_000 and cfg.env.num_envs * cfg.algo.rollout_steps == 2048
    env = make_env(cfg.env)
    obs, _ = env.reset(seed=3)
    assert obs.shape == (10, 10, 4) and obs.dtype == np.bool_
    assert env.action_space == gym.spaces.Discrete(3) and env.spec.max_episode_steps == 10_000
    invaders, _ = compose(["exp=minatar", "env.id=MinAtar/SpaceInvaders-v1"])
    assert make_env(invaders.env).observation_space.shape == (10, 10, 6)


def test_missing_minatar_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_minatar(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("minatar"):
            raise ImportError("No module named 'minatar'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_minatar)
    cfg, _ = compose(["exp=minatar", "env.id=MinAtar/Freeway-v1"])
    if cfg.env.id in gym.registry:  # registered by an earlier test in this process: drop it for this one
        monkeypatch.delitem(gym.registry, cfg.env.id)
    with pytest.raises(EnvError, match=r"pip install 'ppo-fabric\[minatar\]'"):
        make_env(cfg.env)


def test_minatar_trains_end_to_end(tmp_path: Path) -> None:
    summary = ppo_fabric.run(
        [
            "exp=minatar",
            "env.num_envs=2",
            "algo.total_steps=512",
            "algo.rollout_steps=64",
            "algo.minibatch_size=64",
            "logger=none",
            f"hydra.run.dir={tmp_path}",
        ]
    )
    assert summary["total_env_steps"] == 512 and summary["env_id"] == "MinAtar/Breakout-v1"
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()
