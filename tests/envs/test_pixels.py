"""Pixel observations: the Nature CNN, the Atari preprocessing, uint8 rollout storage, Dict observations.

The Atari wrappers are tested step by step on a fake game (tests/pixel_envs.py), which needs OpenCV (the
resize of gymnasium's AtariPreprocessing) but not the emulator; the end-to-end tests play real ALE Pong
and are skipped where the `atari` extra (ale-py, opencv-python-headless) is not installed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from omegaconf import OmegaConf

import ppo_fabric
from ppo_fabric.app.preflight import check as validate
from ppo_fabric.collect.rollout import RolloutCollector
from ppo_fabric.config.values import ConfigError, compose
from ppo_fabric.envs.atari import EpisodicLife, FireReset, GameEpisodeStatistics, wrap_atari
from ppo_fabric.envs.make import make_vector_env
from ppo_fabric.learn.buffer import rollout_storage, training_batch
from ppo_fabric.models.agent import ActorCritic, MultiEncoder, NatureCNN, select_encoder
from ppo_fabric.policy.evaluate import play
from ppo_fabric.wire.protocol import BatchCodec, Header, Kind
from tests.pixel_envs import DictPixels, FakeAtari

HAS_CV2 = importlib.util.find_spec("cv2") is not None
HAS_ALE = HAS_CV2 and importlib.util.find_spec("ale_py") is not None
needs_cv2 = pytest.mark.skipif(
    not HAS_CV2, reason="OpenCV missing: pip install -c constraints.txt '.[atari]'"
)
needs_ale = pytest.mark.skipif(
    not HAS_ALE, reason="ale-py/OpenCV missing: pip install -c constraints.txt '.[atari]'"
)

FRAMES = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
CNN_MODEL = OmegaConf.create(
    {"encoder": "auto", "actor_hidden": [], "critic_hidden": [], "activation": "relu"}
)


# ------------------------------------------------------------------------------------------------- CNN
def test_nature_cnn_shapes_and_uint8_scaling() -> None:
    torch.manual_seed(0)
    cnn = NatureCNN(FRAMES)
    assert cnn.linear.in_features == 64 * 7 * 7 and cnn.out_dim == 512
    pixels = torch.randint(0, 256, (5, 4, 84, 84), dtype=torch.uint8)
    out = cnn(pixels)
    assert out.shape == (5, 512) and out.dtype == torch.float32 and (out >= 0).all()
    # A uint8 space is scaled by 1/255 whatever dtype arrives (evaluate and export send float32 pixels).
    torch.testing.assert_close(cnn(pixels.float()), out)
    floats = NatureCNN(gym.spaces.Box(0.0, 1.0, (4, 84, 84), np.float32))
    floats.load_state_dict(cnn.state_dict())
    torch.testing.assert_close(floats(pixels.float() / 255), out)


def test_nature_cnn_reads_channels_last_and_2d_frames() -> None:
    chw = NatureCNN(gym.spaces.Box(0, 255, (3, 64, 64), np.uint8))
    hwc = NatureCNN(gym.spaces.Box(0, 255, (64, 64, 3), np.uint8))
    hwc.load_state_dict(chw.state_dict())
    image = torch.randint(0, 256, (2, 64, 64, 3), dtype=torch.uint8)
    torch.testing.assert_close(hwc(image), chw(image.permute(0, 3, 1, 2)))
    gray = NatureCNN(gym.spaces.Box(0, 255, (84, 84), np.uint8))
    assert gray.convs[0].in_channels == 1 and gray(torch.zeros(3, 84, 84, dtype=torch.uint8)).shape == (
        3,
        512,
    )
    with pytest.raises(ValueError, match="too small"):
        NatureCNN(gym.spaces.Box(0, 255, (3, 20, 20), np.uint8))
    # two channels, two stacked RGB frames: refused as 64 or 48 channels of 64x2 or 64x6 pixels
    for shape in ((64, 64, 2), (48, 64, 6)):
        cnn = NatureCNN(gym.spaces.Box(0, 255, shape, np.uint8))
        assert cnn.channels_last and cnn.convs[0].in_channels == shape[-1]
        assert cnn(torch.zeros(2, *shape, dtype=torch.uint8)).shape == (2, 512)


def test_auto_encoder_follows_the_observation_space() -> None:
    assert select_encoder(FRAMES, "auto") == "cnn"
    assert select_encoder(gym.spaces.Box(0, 255, (210, 160, 3), np.uint8), "auto") == "cnn"
    assert select_encoder(gym.spaces.Box(-1, 1, (4, 8, 8), np.float32), "auto") == "mlp"
    assert select_encoder(DictPixels().observation_space, "auto") == "multi"
    with pytest.raises(ValueError, match="Dict"):
        select_encoder(DictPixels().observation_space, "cnn")
    with pytest.raises(ValueError, match="not supported"):
        select_encoder(gym.spaces.Discrete(3), "auto")


def test_actor_critic_heads_sit_on_cnn_features() -> None:
    agent = ActorCritic(FRAMES, gym.spaces.Discrete(6), CNN_MODEL)
    assert isinstance(agent.encoder, NatureCNN) and agent.head.linear.in_features == 512
    obs = torch.randint(0, 256, (3, 4, 84, 84), dtype=torch.uint8)
    action, logprob, value = agent.act(obs)
    assert action.shape == logprob.shape == value.shape == (3,)
    new_logp, entropy, new_value = agent(obs, action)
    torch.testing.assert_close(new_logp, logprob)
    torch.testing.assert_close(new_value, value)


# -------------------------------------------------------------------------------------- Atari wrappers
@needs_cv2
def test_atari_chain_frames_fire_and_clipped_rewards() -> None:
    game = FakeAtari(reward=5.0)
    env = wrap_atari(game)
    assert env.observation_space == FRAMES
    obs, _ = env.reset(seed=0)
    assert obs.shape == (4, 84, 84) and obs.dtype == np.uint8
    noops = len(game.actions) - 8
    assert 1 <= noops <= 30 and set(game.actions[:noops]) == {0}  # no-op reset
    assert game.actions[noops:] == [1] * 4 + [2] * 4  # FIRE, then 2, each repeated over 4 skipped frames
    obs, reward, terminated, truncated, _ = env.step(3)
    assert game.actions[-4:] == [3] * 4
    assert reward == 1.0  # 4 frames x 5 = 20, clipped to its sign
    assert not np.array_equal(obs[-1], obs[0])  # the newest frame differs from the oldest in the stack


def test_episodic_life_ends_episodes_per_life_but_resets_only_at_game_over() -> None:
    game = FakeAtari(lives=2)
    env = EpisodicLife(game)
    env.reset(seed=0)
    assert game.resets == 1
    assert env.step(0)[2] is False
    game.ale.lives_left = 1  # a life is lost on the next step
    assert env.step(0)[2] is True
    env.reset()
    assert game.resets == 1 and game.actions[-1] == 0  # the game goes on after a no-op
    game.ale.lives_left = 0
    assert env.step(0)[2] is True  # game over
    env.reset()
    assert game.resets == 2


@needs_ale
def test_the_normalisation_warm_up_leaves_no_game_behind() -> None:
    """Atari with `env.normalize_reward=true`: after the warm-up's random games the seeded reset starts new
    games, so the run starts where a run without warm-up starts (a game mid-way took a lost life's no-op
    instead, kept its seed-less state and counted the warm-up's steps in the run's first game)."""
    from tests.conftest import env_section

    def first(warmup: int) -> np.ndarray:
        cfg = env_section(id="ALE/Pong-v5", num_envs=2, vector="sync", preprocess="atari",
                          normalize_reward=True, normalize_warmup=warmup)  # fmt: skip
        envs, obs = make_vector_env(cfg, seed=3, rank=0)
        envs.close()
        return np.asarray(obs)

    np.testing.assert_array_equal(first(200), first(0))


def test_fire_reset_presses_fire_and_refuses_games_without_it() -> None:
    game = FakeAtari()
    FireReset(game).reset(seed=0)
    assert game.actions == [1, 2]
    with pytest.raises(ValueError, match="FIRE"):
        FireReset(FakeAtari(fire=False))


@needs_cv2
def test_episode_statistics_report_whole_games_with_raw_scores() -> None:
    """Life losses end the learner's episodes (terminated) without an episode record; the game's end
    records the raw, unclipped return over all its lives."""

    def make() -> gym.Env:
        return wrap_atari(FakeAtari(reward=5.0, lives=2, frames_per_life=100))

    envs = GameEpisodeStatistics(SyncVectorEnv([make, make], autoreset_mode=AutoresetMode.SAME_STEP))
    envs.reset(seed=[1, 2])
    life_ends, games = 0, []
    for _ in range(80):
        _, rewards, terminated, _, info = envs.step(np.zeros(2, dtype=np.int64))
        assert set(rewards.tolist()) <= {1.0}
        if "_episode" in info:
            games += [
                (info["episode"]["r"][i], info["episode"]["l"][i]) for i in np.flatnonzero(info["_episode"])
            ]
            life_ends += int(terminated.sum()) - int(info["_episode"].sum())
        else:
            life_ends += int(terminated.sum())
    assert life_ends >= 2 and games
    for ret, length in games:
        assert ret > length  # raw score: 5 per frame, 4 frames per step, not the clipped 1 per step
        assert ret % 5 == 0 and ret <= 20 * length


@needs_cv2
def test_evaluate_plays_whole_games_with_raw_scores() -> None:
    """evaluate's episodes are games: the lost life (terminated for the learner) does not end one."""

    class Noop:
        mask_width = None  # a Policy's: trained without action masks

        def predict(self, obs: np.ndarray, state: None, *_: object) -> tuple[np.ndarray, None]:
            assert obs.shape == (4, 84, 84)
            return np.zeros((), dtype=np.int64), None

    env = wrap_atari(FakeAtari(reward=5.0, lives=2, frames_per_life=100))
    returns, lengths, _ = play(Noop(), env, episodes=2, deterministic=True, seed=0)
    for ret, length in zip(returns, lengths, strict=True):
        assert length > 100 // 4 and ret > 20 * (length - 2)  # both lives, unclipped


# ------------------------------------------------------------------------------------------ config
def test_atari_recipe_is_cleanrls_atari_workload() -> None:
    """ppo_atari.py: 8 envs x 128 steps, 4 minibatches of 256, 4 epochs, lr 2.5e-4 annealed, clip 0.1, ..."""
    cfg, _ = compose(["exp=atari"])
    assert (cfg.env.id, cfg.env.preprocess, cfg.model.encoder) == ("ALE/Pong-v5", "atari", "cnn")
    a = cfg.algo
    batch = a.rollout_steps * cfg.env.num_envs
    assert (cfg.env.num_envs, a.rollout_steps, batch // a.minibatch_size, a.minibatch_size) == (
        8,
        128,
        4,
        256,
    )
    assert (a.update_epochs, a.lr, a.anneal_lr, a.gamma, a.gae_lambda) == (4, 2.5e-4, True, 0.99, 0.95)
    assert (a.clip_coef, a.ent_coef, a.vf_coef, a.max_grad_norm, a.total_steps) == (
        0.1,
        0.01,
        0.5,
        0.5,
        10**7,
    )
    assert list(cfg.model.actor_hidden) == list(cfg.model.critic_hidden) == []


def test_unknown_preprocess_is_a_config_error() -> None:
    cfg, _ = compose(["env.preprocess=atary"])
    with pytest.raises(ConfigError, match="env.preprocess='atary' is not one of none, atari"):
        validate(cfg)


# ------------------------------------------------------------------------------------------ real ALE
@needs_ale
def test_pong_rollout_stores_uint8_frames(tmp_path: Path) -> None:
    cfg, _ = compose(["env=atari", "model=cnn", "env.num_envs=2", "algo.rollout_steps=32"])
    envs, first_obs = make_vector_env(cfg.env, 0, 0)
    try:
        obs_space, action_space = envs.single_observation_space, envs.single_action_space
        assert obs_space == FRAMES and action_space.n == 6
        policy = ActorCritic(obs_space, action_space, cfg.model)
        storage = rollout_storage(32, 2, obs_space, action_space, "cpu")
        collector = RolloutCollector(envs, first_obs, storage, 0.99, 0.95)
        assert collector.collect(policy, 0) == 64
    finally:
        envs.close()
    obs = storage["obs"]
    assert obs.dtype == torch.uint8 and obs.shape == (32, 2, 4, 84, 84)
    assert obs[-1].float().std() > 0  # real frames, not the zeros it was allocated with
    assert set(storage["rewards"].unique().tolist()) <= {-1.0, 0.0, 1.0}


@pytest.mark.slow
@needs_ale
def test_pong_trains_end_to_end(tmp_path: Path) -> None:
    summary = ppo_fabric.run(
        [
            "exp=atari",
            "env.num_envs=2",
            "algo.total_steps=512",
            "algo.rollout_steps=64",
            "algo.minibatch_size=64",
            "logger=none",
            "eval.every=0",  # 10 whole Pong games an evaluation: minutes, and not what this test checks
            f"hydra.run.dir={tmp_path}",
        ]
    )
    assert summary["total_env_steps"] == 512 and summary["env_id"] == "ALE/Pong-v5"
    assert summary["ranks_in_sync"] and (tmp_path / "checkpoints" / "last.ckpt").exists()


# ------------------------------------------------------------------------------------ Dict observations
def test_multi_encoder_concatenates_cnn_and_vector_features() -> None:
    space = DictPixels().observation_space
    encoder = MultiEncoder(space)
    assert encoder.out_dim == 512 + 3
    from tensordict import TensorDict

    obs = TensorDict(
        {"image": torch.zeros(4, 1, 36, 36, dtype=torch.uint8), "vec": torch.ones(4, 3)}, batch_size=[4]
    )
    features = encoder(obs)
    assert features.shape == (4, 515)
    torch.testing.assert_close(features[:, 512:], torch.ones(4, 3))


def test_dict_observations_store_nested_and_pack_for_trainers() -> None:
    space = DictPixels().observation_space
    storage = rollout_storage(4, 2, space, gym.spaces.Discrete(2), "cpu")
    assert storage["obs", "image"].dtype == torch.uint8 and storage["obs", "vec"].dtype == torch.float32
    storage["obs", "image"].random_(0, 255)
    storage["obs", "vec"].normal_()
    storage["actions"].random_(0, 2)
    batch = training_batch(storage)
    codec = BatchCodec(batch, num_trainers=2)
    shards = [codec.unpack(buf, torch.device("cpu"))[1] for buf in codec.pack(batch, Header(Kind.DATA, 1))]
    restored = torch.cat(shards)
    for key in (("obs", "image"), ("obs", "vec"), "actions", "logprobs"):
        torch.testing.assert_close(restored[key], batch[key])


@pytest.mark.parametrize("env_id", ["DictPixels-v0", "DictPixelsStaggered-v0"])
def test_dict_observations_train_end_to_end(tmp_path: Path, env_id: str) -> None:
    """Staggered: copies cut by the time limit at a step where others go on (the bootstrap of a few rows'
    final Dict observations failed on the batch size of all the copies)."""
    summary = ppo_fabric.run(
        [
            "env=gym",
            f"env.id=tests.pixel_envs:{env_id}",
            "env.num_envs=2",
            "algo.total_steps=128",
            "algo.rollout_steps=32",
            "algo.minibatch_size=32",
            "logger=none",
            f"hydra.run.dir={tmp_path}",
        ]
    )
    assert summary["total_env_steps"] == 128 and summary["episodes"] >= 10  # 10-step episodes (truncated)
