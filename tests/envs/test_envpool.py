"""`env.backend=envpool` side by side with the gymnasium backend: spaces, same-step autoreset with the final
observation, episode accounting, truncation bootstrapping, seeding, Atari preprocessing, learning, errors."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import ppo_fabric
from ppo_fabric.app.preflight import load
from ppo_fabric.collect.rollout import build_collector
from ppo_fabric.config.values import ConfigError, compose
from ppo_fabric.envs import envpool_backend
from ppo_fabric.envs.make import EnvError, make_env, make_vector_env, probe_env
from ppo_fabric.envs.multiagent import SINGLE
from ppo_fabric.learn.learners import policy_specs
from ppo_fabric.models.agent import ActorCritic
from tests.conftest import cartpole_env_cfg, job_env

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("envpool") is None, reason="EnvPool missing: pip install 'ppo-fabric[envpool]'"
)
needs_ale = pytest.mark.skipif(
    importlib.util.find_spec("ale_py") is None or importlib.util.find_spec("cv2") is None,
    reason="the gymnasium side of the Atari comparison needs the atari extra",
)
BACKENDS = ("gymnasium", "envpool")


def _cfg(backend: str, num_envs: int = 4, max_episode_steps: int | None = None, **extra: Any) -> Any:
    return cartpole_env_cfg(num_envs, max_episode_steps, backend=backend, **extra)  # type: ignore[arg-type]


def _atari_cfg(backend: str, env_id: str = "ALE/Pong-v5", num_envs: int = 2) -> Any:
    cfg, _ = compose(["env=atari", f"env.id={env_id}", f"env.num_envs={num_envs}", f"env.backend={backend}"])
    return cfg.env


def _episodes_by_hand(rewards: np.ndarray, done: np.ndarray) -> list[tuple[int, float, int]]:
    """(env, return, length) of every episode that ended, from the raw per-step arrays [T, E]."""
    out, ret, length = [], np.zeros(rewards.shape[1]), np.zeros(rewards.shape[1], dtype=int)
    for t in range(rewards.shape[0]):
        ret += rewards[t]
        length += 1
        for e in np.flatnonzero(done[t]):
            out.append((int(e), float(ret[e]), int(length[e])))
            ret[e], length[e] = 0.0, 0
    return out


def _needs(module: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        importlib.util.find_spec(module) is None, reason=f"gymnasium's side needs {module}"
    )


@pytest.mark.parametrize(
    "env_id",
    [
        "CartPole-v1",
        "Pendulum-v1",
        pytest.param("LunarLander-v3", marks=_needs("Box2D")),  # EnvPool's own bounds are wrong
        pytest.param("HalfCheetah-v5", marks=_needs("mujoco")),  # EnvPool's actions are float64
    ],
)
def test_spaces_equal_the_gymnasium_backends(env_id: str) -> None:
    spaces = [probe_env(OmegaConf.merge(_cfg(b), {"id": env_id})) for b in BACKENDS]
    assert spaces[0] == spaces[1]
    envs, obs = make_vector_env(OmegaConf.merge(_cfg("envpool", 3), {"id": env_id}), seed=0, rank=0)
    assert envs.single_observation_space == spaces[0][0] and envs.num_envs == 3
    assert obs.shape == (3, *spaces[0][0].shape) and obs.dtype == spaces[0][0].dtype
    envs.close()


def test_spaces_without_gymnasium_are_the_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where gymnasium cannot build the env, the pool's spaces serve, Box actions as float32."""
    monkeypatch.setattr(envpool_backend, "_gymnasium_spaces", lambda env_cfg: None)
    obs_space, act_space, _ = probe_env(OmegaConf.merge(_cfg("envpool"), {"id": "HalfCheetah-v5"}))
    assert obs_space.shape == (17,) and act_space.shape == (6,) and act_space.dtype == np.float32


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_step_autoreset_and_episode_accounting(backend: str) -> None:
    """Always pushing right: every episode ends by termination within ~10 steps. The step that ends one
    returns the next episode's first observation, the last one in `final_obs`, and the statistics match
    the per-step rewards counted by hand, on both backends alike."""
    envs, _ = make_vector_env(_cfg(backend, 3), seed=3, rank=0)
    rewards, done, reported = [], [], []
    for _ in range(60):
        obs, reward, terminated, truncated, info = envs.step(np.ones(3, dtype=np.int64))
        rewards.append(reward)
        done.append(terminated | truncated)
        assert not truncated.any()
        if terminated.any():
            np.testing.assert_array_equal(info["_final_obs"], terminated)
            for e in np.flatnonzero(terminated):
                final = info["final_obs"][e]
                assert abs(final[0]) > 2.4 or abs(final[2]) > 0.2094  # the state that ended it
                assert np.abs(obs[e]).max() <= 0.05  # a fresh reset state
            for e in np.flatnonzero(info["_episode"]):
                reported.append((int(e), float(info["episode"]["r"][e]), int(info["episode"]["l"][e])))
        else:
            assert "_episode" not in info
    by_hand = _episodes_by_hand(np.array(rewards), np.array(done))
    assert reported == by_hand and len(by_hand) >= 3 * 5
    assert all(6 <= length <= 14 for _, _, length in by_hand)
    envs.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_truncation_bootstraps_from_the_final_observation(backend: str) -> None:
    """CartPole cut at 5 steps: the collector stores V(final obs) exactly at the truncations (steps 4, 9),
    the next stored observation is a fresh episode's, and every cut episode is counted with length 5."""
    cfg, _ = compose(
        [f"env.backend={backend}", "env.num_envs=3", "env.max_episode_steps=5", "algo.rollout_steps=12"]
    )
    torch.manual_seed(0)
    specs = policy_specs(cfg)
    collector = build_collector(cfg, specs, 0, "cpu", None)
    policy = ActorCritic(specs[SINGLE].obs_space, specs[SINGLE].action_space, cfg.model)
    assert collector.collect(policy, 0) == 36
    s = collector.storage
    cut = s["truncated"].bool() & ~s["terminated"].bool()
    assert cut[[4, 9]].all() and cut.sum() == 6
    assert (s["final_values"][cut] != 0).all() and (s["final_values"][~cut] == 0).all()
    assert s["obs"][[5, 10]].abs().max() <= 0.05  # first observations of the next episodes
    # Not the value of the stored next observation: the final one is the cut episode's own last state.
    assert not torch.allclose(s["final_values"][4], policy.get_value(s["obs"][5]))
    assert collector.episodes.lengths == [5] * 6 and collector.episodes.returns == [5.0] * 6
    collector.envs.close()


def test_seeding_follows_the_gymnasium_backends_rules() -> None:
    """Same seed and rank: the same observations, steps included; another rank or another env copy:
    different ones. A seeded reset after stepping starts over exactly (the warm-up relies on it)."""
    cfg = _cfg("envpool", 3)
    runs = []
    for rank in (0, 0, 1):
        envs, first = make_vector_env(cfg, seed=1, rank=rank)
        stepped = [envs.step(np.array([0, 1, 0]))[0] for _ in range(5)]
        runs.append(np.stack([first, *stepped]))
        if rank == 1:
            again, _ = envs.reset(seed=envs.unwrapped.seeds)
            np.testing.assert_array_equal(again, first)
        envs.close()
    np.testing.assert_array_equal(runs[0], runs[1])
    assert not np.array_equal(runs[0][0], runs[2][0])
    assert len({tuple(row) for row in runs[0][0]}) == 3


def test_normalisation_and_warm_up_wrap_the_pool() -> None:
    """normalize_obs wraps the pool as it wraps gymnasium envs: the first observations are normalised
    with the warm-up's statistics, and the warm-up does not move where the run's episodes start."""
    plain, raw = make_vector_env(_cfg("envpool", 4), seed=2, rank=0)
    envs, first = make_vector_env(_cfg("envpool", 4, normalize_obs=True, normalize_warmup=16), seed=2, rank=0)
    moments = envs.moments
    assert moments.count == 16 * 4 + 4  # the warm-up's observations, then the run's reset
    np.testing.assert_allclose(first, moments.normalize(raw), rtol=1e-6)
    plain.close()
    envs.close()


@needs_ale
def test_atari_spaces_and_preprocessing_equal_the_gymnasium_chain() -> None:
    spaces = [probe_env(_atari_cfg(b)) for b in BACKENDS]
    assert spaces[0] == spaces[1]
    assert spaces[1][0].shape == (4, 84, 84) and spaces[1][0].dtype == np.uint8
    options = envpool_backend.atari_options({})
    assert (
        options["repeat_action_probability"] == 0.25 and options["episodic_life"] and options["reward_clip"]
    )
    assert (
        envpool_backend.atari_options({"repeat_action_probability": 0.0})["repeat_action_probability"] == 0.0
    )


def test_atari_lives_end_learner_episodes_but_statistics_report_whole_games() -> None:
    """Breakout, random actions: every lost life terminates the learner's episode while the game goes on;
    the statistics report one whole game with its raw (unclipped) score and all its agent steps."""
    envs, obs = make_vector_env(_atari_cfg("envpool", "ALE/Breakout-v5", 1), seed=0, rank=0)
    assert obs.shape == (1, 4, 84, 84) and obs.dtype == np.uint8
    rng = np.random.default_rng(0)
    lives_lost, clipped, steps = 0, [], 0
    for _ in range(3000):
        obs, reward, terminated, truncated, info = envs.step(rng.integers(0, 4, 1))
        steps += 1
        clipped.append(float(reward[0]))
        assert set(np.unique(reward)) <= {-1.0, 0.0, 1.0}
        if "_episode" in info:
            break
        lives_lost += int(terminated[0])
    else:
        pytest.fail("no game ended in 3000 steps")
    assert lives_lost == 4 and terminated[0]  # Breakout's 5 lives: 4 learner episodes before game over
    assert info["episode"]["l"][0] == steps
    assert info["episode"]["r"][0] >= sum(clipped)  # raw bricks score 1, 4 or 7; clipped ones 1
    envs.close()


@needs_ale
def test_atari_time_limits_count_agent_steps_on_both_backends() -> None:
    """`env.max_episode_steps=100` ends a Pong episode at its 100th agent step on either backend (the
    gymnasium chain's limit sat inside the frame skipping and cut it at 25): on the gymnasium chain the
    two FIRE steps of its reset count among them (the documented difference in game lengths)."""
    for backend, expected in zip(BACKENDS, (98, 100), strict=True):
        cfg = _atari_cfg(backend, num_envs=1)
        cfg.max_episode_steps = 100
        env = make_env(cfg)
        env.reset(seed=0)
        steps, truncated = 0, False
        while not truncated:
            _, _, terminated, truncated, _ = env.step(0)
            steps += 1
            assert not terminated and steps <= 100, (backend, steps)
        assert steps == expected, backend
        env.close()


def test_evaluation_plays_the_pool_it_trained_on() -> None:
    """A run on EnvPool is evaluated on a one-env pool of its own options: `+env.kwargs.noop_max=1` (an
    EnvPool option gymnasium's ALE refuses, which ended the run at its first evaluation) builds, and a
    Breakout evaluation episode is a whole game (5 lives) with its raw score, as on the gymnasium chain."""
    from ppo_fabric.envs.atari import records_games
    from ppo_fabric.policy.evaluate import play

    cfg = _atari_cfg("envpool", "ALE/Breakout-v5", num_envs=1)
    cfg.kwargs = {"noop_max": 1}
    env = make_env(cfg)
    assert isinstance(env, envpool_backend.PoolEnv) and records_games(env)

    class Random:
        mask_width, recurrent = None, False
        rng = np.random.default_rng(0)

        def predict(self, *_args: Any) -> tuple[np.ndarray, None]:
            return np.asarray(self.rng.integers(0, 4)), None

    returns, lengths, _ = play(Random(), env, 1, True, seed=3)
    assert lengths[0] > 50 and returns[0] >= 0  # a whole game of random play, not one life of it
    lost = 0
    env.reset(seed=3)
    while True:  # the same game stepped by hand: 4 lost lives end learner episodes, the 5th ends the game
        _, reward, terminated, truncated, info = env.step(int(Random.rng.integers(0, 4)))
        assert reward in (-1.0, 0.0, 1.0)
        if "episode" in info:
            break
        if terminated:
            lost += 1
            env.reset()
    assert lost == 4 and terminated
    env.close()


@pytest.mark.slow
def test_cartpole_learns_on_envpool(tmp_path: Path) -> None:
    """The RL-Zoo CartPole config (conf/env/cartpole.yaml) for 30k steps. Seeds 3-6 on both backends
    ended at 242-500 (envpool) and 336-500 (gymnasium); random play scores ~22."""
    summary = ppo_fabric.run(
        [
            "env.backend=envpool",
            "algo.total_steps=30000",
            "eval.every=0",  # the training return is the claim; ~15 evaluations took a third of the time
            "logger=none",
            "seed=3",
            f"hydra.run.dir={tmp_path}",
        ]
    )
    assert summary["total_env_steps"] >= 30000
    assert summary["final_mean_return"] > 150, summary["final_mean_return"]


def test_resume_continues_with_fresh_episodes(tmp_path: Path) -> None:
    """A pool cannot be pickled: the checkpoint holds no env state, and the resumed run still reaches its
    step budget (episodes restart, as with async gymnasium envs)."""
    base = ["env.backend=envpool", "env.num_envs=4", "algo.rollout_steps=64", "logger=none"]
    ppo_fabric.run([*base, "algo.total_steps=512", f"hydra.run.dir={tmp_path / 'a'}"])
    with pytest.warns(UserWarning, match="no env state"):
        summary = ppo_fabric.run(
            [
                *base,
                "algo.total_steps=1024",
                f"resume={tmp_path / 'a' / 'checkpoints' / 'last.ckpt'}",
                f"hydra.run.dir={tmp_path / 'b'}",
            ]
        )
    assert summary["total_env_steps"] == 1024 and summary["resumed_from"] is not None


def test_a_resumed_sessions_fresh_envs_do_not_replay_the_opening() -> None:
    """A pool cannot be pickled, so every resumed session starts fresh envs: seeded from the step it
    resumes at, not the run's first seeds (a job requeued again and again trained on its first episodes)."""
    cfg, _ = compose(["env.backend=envpool", "env.num_envs=4", "algo.rollout_steps=8"])
    specs = policy_specs(cfg)

    def first_obs(start_step: int) -> torch.Tensor:
        collector = build_collector(cfg, specs, 0, "cpu", None, start_step=start_step)
        policy = ActorCritic(specs[SINGLE].obs_space, specs[SINGLE].action_space, cfg.model)
        collector.collect(policy, 0)
        collector.envs.close()
        return collector.storage["obs"][0].clone()

    opening = first_obs(0)
    torch.testing.assert_close(first_obs(0), opening)  # a fresh run: the run's own seeds
    resumed = first_obs(512)
    assert not torch.allclose(resumed, opening)
    torch.testing.assert_close(first_obs(512), resumed)  # reproducible all the same


@pytest.mark.multiprocess
def test_decoupled_run_on_envpool(tmp_path: Path) -> None:
    """Env construction is shared: a decoupled job (1 player + 1 trainer, gloo) collects from EnvPool."""
    done = subprocess.run(
        [sys.executable, "-m", "ppo_fabric", "strategy=decoupled", "fabric.devices=2", "env.backend=envpool",
         "env.num_envs=4", "algo.rollout_steps=32", "algo.minibatch_size=64", "algo.update_epochs=2",
         "algo.total_steps=1024", "logger=none", f"hydra.run.dir={tmp_path}"],
        cwd=tmp_path, env=job_env(supervisor=False), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["strategy"] == "decoupled" and summary["total_env_steps"] == 1024
    assert summary["episodes"] > 0 and summary["ranks_in_sync"] is True


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (["env.backend=envpool", "env=gym", "env.id=Taxi-v4"], ["env.id='Taxi-v4'", "env.backend=envpool"]),
        (["env.backend=envpool", "env.envpool.batch_size=3"], ["env.envpool.batch_size=3", "must divide", "async"]),
        (["env.backend=ray"], ["env.backend='ray'", "gymnasium, envpool"]),
        (["env.backend=envpool", "env.action_repeat=2"], ["env.action_repeat=2", "env.backend=envpool"]),
        (["env.backend=envpool", "env.observation_noise=0.1"], ["env.observation_noise=0.1", "env.backend=envpool"]),
        (["env=pettingzoo", "env.backend=envpool"], ["PettingZoo", "env.backend=gymnasium"]),
    ],
    ids=["id-not-in-envpool", "async", "unknown-backend", "action-repeat", "observation-noise", "pettingzoo"],
)  # fmt: skip
def test_bad_settings_are_one_line(overrides: list[str], fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load(overrides)
    message = str(info.value)
    assert "\n" not in message and all(f in message for f in fragments), message


def test_missing_envpool_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = envpool_backend.importlib.import_module

    def without_envpool(name: str) -> Any:
        if name == "envpool":
            raise ImportError("No module named 'envpool'")
        return real(name)

    monkeypatch.setattr(envpool_backend.importlib, "import_module", without_envpool)
    with pytest.raises(EnvError, match=r"pip install 'ppo-fabric\[envpool\]'"):
        probe_env(_cfg("envpool"))
