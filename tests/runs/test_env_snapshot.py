"""A checkpoint keeps the envs' episodes only where pickling keeps them.

gymnasium's Box2D, MuJoCo and Atari envs (and PettingZoo's games) pickle as `EzPickle`: the copy is
rebuilt from the constructor arguments and was never reset. Resuming from such a snapshot failed on the first
step of a Box2D env (BipedalWalker: `assert self.hull is not None`) and silently restarted a MuJoCo one from
its initial pose mid-episode. Such envs are now left out of the snapshot (the run resumes with fresh
episodes and says so), and a snapshot written before that is set aside on load. The turn-based games'
vector env restores its games itself (it replays their moves) and keeps its snapshot
(tests/games/test_selfplay.py resumes one exactly)."""

from __future__ import annotations

import functools
import pickle
import warnings
from pathlib import Path

import gymnasium as gym
import pytest
import torch

import ppo_fabric
from ppo_fabric.runs import checkpoint as ckpt
from ppo_fabric.runs import signing
from tests.probe_envs import ProbeResetFirst

RESET_FIRST = "tests.probe_envs:ProbeResetFirst-v0"
RUN = ["env=gym", f"env.id={RESET_FIRST}", "env.num_envs=2", "algo.rollout_steps=64", "algo.minibatch_size=64",
       "logger.tensorboard=false"]  # fmt: skip


def _vector(env_fn) -> gym.vector.VectorEnv:  # type: ignore[no-untyped-def]
    envs = gym.vector.SyncVectorEnv([env_fn, env_fn])
    return gym.wrappers.vector.NormalizeObservation(envs)  # a wrapper between the run and the sub-envs


def test_envs_rebuilt_by_their_pickle_are_left_out_of_the_snapshot() -> None:
    resets_first = _vector(ProbeResetFirst)
    resets_first.reset(seed=0)
    resets_first.step(resets_first.action_space.sample())
    copy = pickle.loads(pickle.dumps(resets_first))  # what a snapshot held: a copy never reset
    with pytest.raises(AssertionError, match="step before reset"):
        copy.step(copy.action_space.sample())
    assert not ckpt.pickle_keeps_state(resets_first)
    assert ckpt.pickle_envs(resets_first) is None

    cartpole = _vector(functools.partial(gym.make, "CartPole-v1"))  # picklable, as the run's factories are
    cartpole.reset(seed=0)
    assert ckpt.pickle_keeps_state(cartpole)
    assert ckpt.pickle_envs(cartpole) is not None


def test_a_snapshot_of_such_envs_written_earlier_is_set_aside_on_load() -> None:
    old = _vector(ProbeResetFirst)
    old.reset(seed=0)
    blob = pickle.dumps(old)  # as a checkpoint written before these envs were left out holds it
    snapshot = {"pickle": torch.frombuffer(bytearray(blob), dtype=torch.uint8), "hmac": signing.sign(blob)}
    fresh = _vector(ProbeResetFirst)
    fresh.reset(seed=1)
    with pytest.warns(UserWarning, match="episodes restart on resume"):
        envs = ckpt.restore_envs(snapshot, fresh)
    assert envs is fresh
    envs.step(envs.action_space.sample())  # the fresh envs were reset and step


def test_a_run_of_such_envs_resumes_with_fresh_episodes(tmp_path: Path) -> None:
    """Stopped mid-episode (64-step rollouts, 40-step episodes) and resumed: the resumed run steps its envs
    (before, its first step failed) and says that its episodes restart."""
    first = ppo_fabric.run([*RUN, "algo.total_steps=256", f"hydra.run.dir={tmp_path / 'a'}"])
    assert first["total_env_steps"] == 256
    last = tmp_path / "a" / "checkpoints" / "last.ckpt"
    assert ckpt.load(last)["ranks"][0]["envs"] is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = ppo_fabric.run(
            [*RUN, "algo.total_steps=512", f"hydra.run.dir={tmp_path / 'b'}", f"resume={last}"]
        )
    assert resumed["total_env_steps"] == 512
    assert any("episodes restart on resume" in str(w.message) for w in caught)


def test_a_pettingzoo_parallel_env_converted_from_aec_is_seen_through() -> None:
    """MPE's parallel envs are PettingZoo's AEC-to-parallel conversion, which keeps its env in `.aec_env`:
    the walk stopped there, the rebuilt-by-pickle env under it was missed, and a resumed MPE run failed
    its first step ('raw_env' object has no attribute 'agent_selection')."""
    pytest.importorskip("mpe2")
    from ppo_fabric.config.values import compose
    from ppo_fabric.envs.multiagent import make_multiagent_vector_env

    cfg, _ = compose(["exp=mpe_spread", "env.num_envs=2"])
    envs, _ = make_multiagent_vector_env(cfg.env, cfg.multiagent, 0, 0, False)
    try:
        assert not ckpt.pickle_keeps_state(envs)
    finally:
        envs.close()
