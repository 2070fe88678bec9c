"""`env.id=module:callable`: an env that is not registered, built by a function of the user's, in both
strategies with 2 processes (the callable is imported anew in every process), and refused in one line when
it returns something else."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import pytest
from omegaconf import DictConfig

from ppo_fabric.config.values import compose
from ppo_fabric.envs.make import EnvError, make_env
from tests.conftest import REPO, job_env

FACTORY = "tests.envs.factory_envs"


def _env_cfg(env_id: str, *overrides: str) -> DictConfig:
    return compose([f"env.id={env_id}", *overrides])[0].env


def test_factory_env_gets_kwargs_and_the_time_limit() -> None:
    env = make_env(_env_cfg(f"{FACTORY}:short_cartpole", "+env.kwargs.limit=7", "env.max_episode_steps=null"))
    env.reset(seed=0)
    steps, done = 0, False
    while not done:
        _, _, terminated, truncated, _ = env.step(0 if steps % 2 else 1)
        steps, done = steps + 1, terminated or truncated
    assert steps <= 7 and isinstance(env.unwrapped, gym.Env)
    env.close()
    capped = make_env(_env_cfg(f"{FACTORY}:short_cartpole", "env.max_episode_steps=3"))
    capped.reset(seed=0)
    assert [capped.step(i % 2)[3] for i in range(3)] == [False, False, True]  # env.max_episode_steps applies


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("pettingzoo_matching", "returned a PettingZoo env: add env=pettingzoo"),
        ("not_an_env", "returned object, not a gymnasium.Env"),
        ("missing_function", "is not a registered gymnasium environment"),
    ],
)
def test_factory_that_gives_no_gymnasium_env_fails_in_one_line(name: str, fragment: str) -> None:
    with pytest.raises(EnvError, match=fragment) as info:
        make_env(_env_cfg(f"{FACTORY}:{name}"))
    assert "\n" not in str(info.value)


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["coupled", "decoupled"])
def test_factory_env_in_both_strategies_with_two_processes(strategy: str, tmp_path: Path) -> None:
    args = [
        f"strategy={strategy}",
        "fabric.devices=2",
        f"env.id={FACTORY}:short_cartpole",
        "env.num_envs=2",
        "algo.rollout_steps=32",
        "algo.minibatch_size=32",
        "algo.total_steps=256",
        "logger.tensorboard=false",
        f"hydra.run.dir={tmp_path}",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "ppo_fabric", *args],
        cwd=REPO,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["total_env_steps"] >= 256 and summary["env_id"] == f"{FACTORY}:short_cartpole"
