"""Observation/reward normalisation: exact merged statistics, final observations, ranks in agreement,
checkpoints, evaluation and export."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import ppo_fabric
from ppo_fabric.envs.make import make_vector_env
from ppo_fabric.envs.normalize import RunningMoments, normalizers
from ppo_fabric.runs import checkpoint as ckpt
from tests.conftest import env_section, job_env, numbered_checkpoint

REPO = Path(__file__).resolve().parents[2]


def _env_cfg(**extra: object) -> OmegaConf:
    base = {"id": "CartPole-v1", "num_envs": 3, "vector": "sync", "action_repeat": 1, "max_episode_steps": None,
            "kwargs": {}, "normalize_obs": True, "normalize_reward": False}  # fmt: skip
    return env_section(**(base | extra))


def _all_reduce(ranks: list[RunningMoments]) -> None:
    """Every rank's `commit` at once, with a reduce that sums what each hands in, as gloo's all-reduce does
    (each commit calls it twice)."""
    barrier, handed = threading.Barrier(len(ranks)), [None] * len(ranks)

    def commit(k: int) -> None:
        def reduce(flat: np.ndarray) -> np.ndarray:
            handed[k] = flat
            barrier.wait()
            total = np.sum(handed, axis=0)
            barrier.wait()  # everyone has read this round's sum
            return total

        ranks[k].commit(reduce)

    threads = [threading.Thread(target=commit, args=(k,)) for k in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@pytest.mark.parametrize("offset", [3.0, 1e9])
def test_moments_merge_equals_statistics_of_all_data(offset: float) -> None:
    """Two ranks' pending moments, merged over two commits, give the mean/var of everything seen; also for
    a dimension far from 0 (a timestamp: N(1e9, 2) read as a variance of ~114 from raw sums of squares)."""
    rng = np.random.default_rng(0)
    data = [rng.normal(offset, 2.0, size=(n, 2)) for n in (5, 7, 11, 13)]
    ranks = [RunningMoments((2,)), RunningMoments((2,))]
    ranks[0].observe(data[0][:2])
    ranks[0].observe(data[0][2:])  # two batches before a commit
    ranks[1].observe(data[1])
    _all_reduce(ranks)
    ranks[0].observe(data[2])
    ranks[1].observe(data[3])
    _all_reduce(ranks)
    everything = np.concatenate(data)
    for m in ranks:
        np.testing.assert_allclose(m.mean, everything.mean(0), rtol=1e-12)
        np.testing.assert_allclose(m.var, everything.var(0), rtol=1e-6)
        assert m.count == len(everything)
    one = RunningMoments((2,))  # one process: no reduce
    for batch in data:
        one.observe(batch)
        one.commit(None)
    np.testing.assert_allclose(one.var, everything.var(0), rtol=1e-6)


def test_statistics_that_overflow_are_refused_and_left_as_they_were() -> None:
    """Finite values beyond ~1e154 have squares float64 cannot hold: the merge refuses them (the run ends
    in one line: tests/runs/test_faults.py) instead of normalising by an inf or NaN variance."""
    moments = RunningMoments((2,))
    moments.observe(np.array([[1.0, 2.0], [3.0, 4.0]]))
    moments.commit(None)
    before = (moments.mean.copy(), moments.var.copy(), moments.count)
    moments.observe(np.array([[1.0, 1e200]]))
    with pytest.raises(FloatingPointError):
        moments.commit(None)
    np.testing.assert_array_equal(moments.mean, before[0])
    np.testing.assert_array_equal(moments.var, before[1])
    assert moments.count == before[2]


def test_final_observation_is_normalised_like_the_others() -> None:
    """With same-step autoreset the final observation of a truncated episode comes in `info`: it must be
    normalised with the same statistics, or the bootstrap value would see raw inputs."""
    raw_envs, _ = make_vector_env(_env_cfg(normalize_obs=False, max_episode_steps=5), seed=1, rank=0)
    envs, _ = make_vector_env(_env_cfg(max_episode_steps=5), seed=1, rank=0)
    moments = normalizers(envs)[0].moments
    actions = np.zeros(3, dtype=np.int64)
    for _ in range(5):
        raw = raw_envs.step(actions)
        normed = envs.step(actions)
    assert normed[3].all(), "the 5-step time limit must truncate every env"
    for i in range(3):
        np.testing.assert_allclose(
            normed[4]["final_obs"][i], moments.normalize(raw[4]["final_obs"][i]), atol=1e-6
        )


def test_reward_scaling_uses_the_return_spread() -> None:
    envs, _ = make_vector_env(_env_cfg(normalize_obs=False, normalize_reward=True), seed=1, rank=0, gamma=0.9)
    wrapper = normalizers(envs)[0]
    _, reward, *_ = envs.step(np.zeros(3, dtype=np.int64))
    np.testing.assert_allclose(reward, 1.0 / np.sqrt(1.0 + 1e-8), rtol=1e-6)  # var starts at 1
    np.testing.assert_allclose(wrapper.returns, 1.0)
    wrapper.moments.commit(None)
    _, reward, *_ = envs.step(np.zeros(3, dtype=np.int64))
    # Every return seen so far was 1.0: the spread is ~0, so a reward of 1 is huge and clipped to 10.
    np.testing.assert_array_equal(reward, 10.0)


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit.load in torch 2.13
def test_two_ranks_normalise_alike_and_resume_evaluate_export_use_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "ppo_fabric", "fabric.devices=2", "env.normalize_obs=true", "env.normalize_reward=true",
           "algo.total_steps=4096", "logger.tensorboard=false", "logger.plot=false", f"hydra.run.dir={run}"]  # fmt: skip
    env = job_env(supervisor=False)  # the job's own normalisation, not the supervisor's
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((run / "summary.json").read_text())["ranks_in_sync"]
    state = ckpt.load(run / "checkpoints" / "last.ckpt")
    first, second = (r["normalizers"] for r in state["ranks"])
    assert set(first) == {"NormalizeObservation", "NormalizeReward"}
    for key in first:
        np.testing.assert_array_equal(first[key]["mean"], second[key]["mean"])
        np.testing.assert_array_equal(first[key]["var"], second[key]["var"])
        assert first[key]["count"] == second[key]["count"] > 0
    # Both ranks' warm-up (64 random steps of 8 envs; observations also of the first reset) was merged before
    # the first rollout, and is not part of the 4096 training steps.
    assert first["NormalizeObservation"]["count"] == 2 * (8 + 64 * 8) + 4096
    assert first["NormalizeReward"]["count"] == 2 * 64 * 8 + 4096
    norm = ckpt.observation_normalization(state)
    assert norm is not None and not np.allclose(norm["var"], 1.0)

    from ppo_fabric.policy.evaluate import main as evaluate_main
    from ppo_fabric.policy.export import main as export_main

    result = evaluate_main([f"checkpoint={run}", "episodes=2"])
    assert result is not None and len(result["returns"]) == 2
    path = export_main([f"checkpoint={run}", "format=torchscript"])
    exported = torch.jit.load(str(path))
    _, agent = ckpt.load_policy(run)
    raw = torch.randn(16, 4)
    normed = torch.clamp((raw - torch.as_tensor(norm["mean"]).float()) / torch.as_tensor(np.sqrt(norm["var"] + 1e-8)).float(),
                         -10, 10)  # fmt: skip
    with torch.no_grad():
        expected = agent.act(normed, deterministic=True)[0]
    assert torch.equal(exported(raw), expected), "the exported policy must normalise raw observations itself"


@pytest.mark.slow
def test_resume_is_exact_with_normalisation(tmp_path: Path) -> None:
    base = ["logger.tensorboard=false", "logger.plot=false", "algo.total_steps=3072", "seed=3", "env.num_envs=4", "algo.rollout_steps=64",
            "env.normalize_obs=true", "env.normalize_reward=true"]  # fmt: skip
    ppo_fabric.run([*base, f"hydra.run.dir={tmp_path / 'full'}"])
    ppo_fabric.run([*base, f"hydra.run.dir={tmp_path / 'part'}", "checkpoint.every=6"])
    middle = numbered_checkpoint(tmp_path / "part", 6)
    ppo_fabric.run([*base, f"hydra.run.dir={tmp_path / 'resumed'}", f"resume={middle}"])
    full = ckpt.load(tmp_path / "full" / "checkpoints" / "last.ckpt")
    resumed = ckpt.load(tmp_path / "resumed" / "checkpoints" / "last.ckpt")
    for key, value in full["agent"].items():
        assert torch.equal(value, resumed["agent"][key]), key
    assert full["ranks"][0]["normalizers"]["NormalizeObservation"]["count"] == pytest.approx(
        resumed["ranks"][0]["normalizers"]["NormalizeObservation"]["count"]
    )


# ------------------------------------------------------------------------------------------- warm-up
def _first_rollout_clipped(tmp_path: Path, num_envs: int, warmup: int) -> float:
    """Share of clipped values among the observations the first rollout stores, built as training does."""
    from ppo_fabric.collect.rollout import build_collector
    from ppo_fabric.config.values import compose
    from ppo_fabric.envs.normalize import CLIP
    from ppo_fabric.learn.learners import policy_specs
    from ppo_fabric.models.agent import ActorCritic

    cfg, _ = compose([f"env.num_envs={num_envs}", "env.normalize_obs=true", f"env.normalize_warmup={warmup}",
                      f"hydra.run.dir={tmp_path}"])  # fmt: skip
    torch.manual_seed(0)
    specs = policy_specs(cfg)
    collector = build_collector(cfg, specs, 0, "cpu", None)
    spec = specs["main"]
    collector.collect(ActorCritic(spec.obs_space, spec.action_space, spec.model), 0)
    obs = collector.storage["obs"].numpy()
    collector.envs.close()
    return float((np.abs(obs) >= CLIP).mean())


@pytest.mark.parametrize("num_envs", [1, 8])
def test_first_rollout_is_normalised_with_warm_up_statistics(tmp_path: Path, num_envs: int) -> None:
    """Issue 15's bar: under 1% of the first rollout's values clipped on CartPole; without the warm-up the
    reset states alone make the statistics so narrow that most values hit the clip bound."""
    from ppo_fabric.config.values import compose

    default = int(compose([])[0].env.normalize_warmup)
    assert default > 0
    assert _first_rollout_clipped(tmp_path, num_envs, default) < 0.01
    assert _first_rollout_clipped(tmp_path, num_envs, 0) > 0.01


def test_warm_up_leaves_the_episodes_of_a_fresh_run() -> None:
    """After the warm-up the envs restart from the first reset's seeds: stepped alike, they see exactly the
    raw observations of envs that never warmed up; the reward normaliser's returns start from zero."""
    cold, cold_first = make_vector_env(_env_cfg(normalize_obs=False), seed=5, rank=1)
    warm, warm_first = make_vector_env(_env_cfg(normalize_reward=True, normalize_warmup=32), seed=5, rank=1)
    obs_norm, reward_norm = normalizers(warm)[::-1]  # outermost first: reward, then observation
    assert obs_norm.moments.count == 3 + 32 * 3  # the first reset and the warm-up steps, merged
    assert reward_norm.moments.count == 32 * 3 and not reward_norm.returns.any()
    np.testing.assert_allclose(warm_first, obs_norm.moments.normalize(cold_first), atol=1e-6)
    actions = np.array([0, 1, 1], dtype=np.int64)
    for _ in range(20):
        raw = cold.step(actions)[0]
        normed = warm.step(actions)[0]
        np.testing.assert_allclose(normed, obs_norm.moments.normalize(raw), atol=1e-6)
    again, _ = make_vector_env(_env_cfg(normalize_reward=True, normalize_warmup=32), seed=5, rank=1)
    np.testing.assert_array_equal(normalizers(again)[1].moments.mean, obs_norm.moments.mean)  # reproducible


def test_warm_up_statistics_are_merged_and_identical_on_every_rank() -> None:
    """Two ranks (threads, with an all-reduce SUM made of a barrier) warm up on their own envs and end with
    the same statistics: those of both ranks' warm-up data together."""
    import threading

    barrier = threading.Barrier(2)
    shared: list[np.ndarray] = []
    results: dict[int, tuple] = {}

    def all_reduce_sum(flat: np.ndarray) -> np.ndarray:
        shared.append(flat.copy())
        barrier.wait()  # both ranks' sums are in
        total = shared[0] + shared[1]
        if barrier.wait() == 0:  # both have read them: one clears for the next call
            shared.clear()
        barrier.wait()
        return total

    def rank(r: int) -> None:
        envs, first = make_vector_env(_env_cfg(normalize_warmup=16), seed=9, rank=r, reduce=all_reduce_sum)
        results[r] = (normalizers(envs)[0].moments.state_dict(), first)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    (state0, first0), (state1, first1) = results[0], results[1]
    np.testing.assert_array_equal(state0["mean"], state1["mean"])
    np.testing.assert_array_equal(state0["var"], state1["var"])
    assert state0["count"] == state1["count"] == 2 * (3 + 16 * 3)
    alone, _ = make_vector_env(_env_cfg(normalize_warmup=16), seed=9, rank=0)
    assert not np.array_equal(normalizers(alone)[0].moments.mean, state0["mean"]), "rank 1's data must count"
    assert not np.array_equal(first0, first1)  # each rank's own episodes, normalised alike


def test_a_resume_without_env_snapshot_normalises_the_first_observation_with_the_saved_statistics() -> None:
    """Envs a checkpoint cannot hold (async, Box2D, MuJoCo) start fresh on resume: their first observation
    must be normalised with the statistics loaded, not the fresh envs' warm-up ones it was built with."""
    from ppo_fabric.collect.rollout import build_collector
    from ppo_fabric.config.values import compose
    from ppo_fabric.envs.normalize import NormalizeObservation
    from ppo_fabric.learn.learners import policy_specs
    from ppo_fabric.models.agent import ActorCritic

    overrides = ["env=gym", "env.id=Pendulum-v1", "env.num_envs=2", "algo.rollout_steps=64",
                 "algo.minibatch_size=32", "env.normalize_obs=true", "env.max_episode_steps=50"]  # fmt: skip
    cfg, _ = compose(overrides)
    specs = policy_specs(cfg)
    (spec,) = specs.values()
    model = ActorCritic(spec.obs_space, spec.action_space, spec.model)
    trained = build_collector(cfg, specs, 0, "cpu", None)
    for _ in range(3):
        trained.collect(model, 0)
    state = trained.state_dict()
    resumed = build_collector(cfg, specs, 0, "cpu", None)
    resumed.load_state_dict(state, None)
    wrapper = next(w for w in normalizers(resumed.envs) if isinstance(w, NormalizeObservation))
    np.testing.assert_allclose(wrapper.moments.mean, state["normalizers"]["NormalizeObservation"]["mean"])
    want = wrapper.moments.normalize(wrapper.last_reset)
    np.testing.assert_allclose(resumed.groups[0].next_obs.numpy(), want, rtol=1e-6)
    trained.envs.close()
    resumed.envs.close()


def test_normalize_obs_on_uint8_images_is_refused_in_one_line() -> None:
    """Normalised floats written into the uint8 pixel storage would be garbage: refused before start."""
    from ppo_fabric.app.preflight import load
    from ppo_fabric.config.values import ConfigError

    for overrides in (
        ["exp=atari", "env.normalize_obs=true"],
        ["env=gym", "env.id=tests.pixel_envs:DictPixels-v0", "env.normalize_obs=true"],
    ):
        with pytest.raises(ConfigError) as info:
            load([*overrides, "logger=none"])
        message = str(info.value)
        assert "\n" not in message and message == message.strip()
        assert all(part in message for part in ("env.normalize_obs=true", "uint8", "env.normalize_obs=false"))
    load(["exp=atari", "env.normalize_reward=true", "logger=none"])  # rewards may still be scaled


def test_restored_envs_scale_rewards_with_the_runs_discount(tmp_path: Path) -> None:
    """Envs restored from a checkpoint carry the reward normaliser pickled with them, discount included: a
    resume that changes `algo.gamma` (resume_overrides=allow) scaled rewards by the old one's returns."""
    from ppo_fabric.collect.rollout import build_collector
    from ppo_fabric.config.values import compose
    from ppo_fabric.envs.normalize import NormalizeReward, normalizers
    from ppo_fabric.learn.learners import policy_specs

    built = []
    for gamma in (0.99, 0.95):
        cfg, _ = compose(["env.num_envs=2", "env.normalize_reward=true", f"algo.gamma={gamma}",
                          f"hydra.run.dir={tmp_path}"])  # fmt: skip
        built.append(build_collector(cfg, policy_specs(cfg), 0, "cpu", None))
    saved, resumed = built
    resumed.envs.close()
    resumed.load_state_dict(saved.state_dict(), saved.envs)  # the envs as a checkpoint restores them
    gammas = [w.gamma for w in normalizers(resumed.envs) if isinstance(w, NormalizeReward)]
    assert gammas == [0.95]
    resumed.envs.close()
