"""Environment construction: action repeat, seeding, and every supported action space end to end."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

import ppo_fabric
from ppo_fabric.envs.make import ActionRepeat, env_seeds, make_vector_env
from tests.conftest import env_section


class Counter(gym.Env):
    """Reward = step index; ends (terminated) after `length` steps, so sums are easy to check by hand."""

    observation_space = gym.spaces.Box(-1, 1, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, length: int = 5) -> None:
        self.length, self.t = length, 0

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(1, np.float32), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        self.t += 1
        return np.zeros(1, np.float32), float(self.t), self.t >= self.length, False, {}


class MultiDiscreteTarget(gym.Env):
    """Two sub-actions; reward 1 per sub-action matching the observed target bits, one step per episode."""

    observation_space = gym.spaces.Box(0, 1, (2,), np.float32)
    action_space = gym.spaces.MultiDiscrete([2, 2])

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.target = self.np_random.integers(0, 2, size=2)
        return self.target.astype(np.float32), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        reward = float((np.asarray(action) == self.target).sum())
        return self.target.astype(np.float32), reward, True, False, {}


gym.register("TestMultiDiscreteTarget-v0", entry_point=MultiDiscreteTarget)


def test_action_repeat_sums_rewards_and_stops_at_episode_end() -> None:
    env = ActionRepeat(Counter(length=5), repeat=2)
    env.reset()
    assert env.step(0)[1:3] == (1 + 2, False)
    assert env.step(0)[1:3] == (3 + 4, False)
    _, reward, terminated, _, _ = env.step(0)  # only one frame left: stops there
    assert (reward, terminated) == (5, True)


def test_env_seeds_differ_across_ranks_and_envs_but_repeat() -> None:
    a, b = env_seeds(7, 0, 4), env_seeds(7, 1, 4)
    assert len(set(a) | set(b)) == 8
    assert a == env_seeds(7, 0, 4)
    # nor across runs: rank 1 of seed 7 is no rank of seeds 8-17 (it was rank 0 of seed 8: `seed + rank`)
    others = {s for seed in range(8, 18) for rank in range(4) for s in env_seeds(seed, rank, 4)}
    assert not set(b) & others
    from ppo_fabric.envs.make import rank_seed

    assert rank_seed(7, 0) == 7 and rank_seed(7, 1) not in range(8, 18)


def test_vector_env_reproduces_with_seed_and_rank() -> None:
    cfg = env_section(id="CartPole-v1", num_envs=3, vector="sync", action_repeat=1, max_episode_steps=None)
    obs = [make_vector_env(cfg, seed=1, rank=r)[1] for r in (0, 0, 1)]
    np.testing.assert_array_equal(obs[0], obs[1])
    assert not np.array_equal(obs[0], obs[2])


@pytest.mark.parametrize(
    ("env_id", "extra"),
    [("Pendulum-v1", ["algo.minibatch_size=128"]), ("CartPole-v1", ["env.action_repeat=2"])],
    ids=["box", "action-repeat"],
)
def test_short_runs_on_other_spaces(env_id: str, extra: list[str], tmp_path: Path) -> None:
    summary = ppo_fabric.run(
        [
            "env=gym",
            f"env.id={env_id}",
            "algo.total_steps=1024",
            "algo.rollout_steps=64",
            "logger=none",
            f"hydra.run.dir={tmp_path}",
            *extra,
        ]  # fmt: skip
    )
    assert summary["total_env_steps"] == 1024 and summary["env_id"] == env_id


@pytest.mark.slow  # seconds in process (a run, or every option composed): not the unit tier
def test_multidiscrete_policy_learns(tmp_path: Path) -> None:
    """Both sub-actions must follow their target bit: the MultiDiscrete head's log-probs are summed right."""
    summary = ppo_fabric.run(
        [
            "env=gym",
            "env.id=tests.envs.test_envs:TestMultiDiscreteTarget-v0",
            "env.num_envs=8",
            "algo.rollout_steps=16",
            "algo.minibatch_size=64",
            "algo.total_steps=8192",
            "algo.lr=3e-3",
            "logger=none",
            f"hydra.run.dir={tmp_path}",
            "seed=1",
        ]  # fmt: skip
    )
    assert summary["final_mean_return"] > 1.9  # 2.0 is perfect, random play gives 1.0


@pytest.mark.skipif(importlib.util.find_spec("mujoco") is None, reason="mujoco extra not installed")
def test_mujoco_warnings_are_printed_once_a_process(capfd: pytest.CaptureFixture[str]) -> None:
    """gymnasium's HalfCheetah model compiles with a deprecated attribute: exp=mujoco printed MuJoCo's
    two-line warning for every env it built (24 over a run), nothing a user can change."""
    import mujoco

    from ppo_fabric.envs.make import make_env

    cfg = env_section(id="HalfCheetah-v5")
    for _ in range(3):
        make_env(cfg).close()
    assert capfd.readouterr().err.count("settotalmass") <= 1  # none if an earlier test's env said it
    hook = mujoco.get_mju_user_warning()
    hook("a warning of this test")
    hook("a warning of this test")
    assert capfd.readouterr().err == "WARNING: a warning of this test\n"
