"""The env boundary (envs/guard.py): non-finite observations and rewards are found where they arrive and
named (which key, which env, what value), a sub-env that fails is rebuilt with `env.on_error=restart`, and
the collector turns either into one line naming the rank, the env and the env step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from omegaconf import OmegaConf

import ppo_fabric
from ppo_fabric.collect.rollout import RolloutCollector
from ppo_fabric.envs.guard import (
    RESTART_INFO,
    EnvFault,
    FiniteCheck,
    NonFiniteData,
    RecreateOnError,
    env_error_text,
    find_nonfinite,
    misshapen,
    nonfinite_rows,
    step_flag,
)
from ppo_fabric.envs.make import make_vector_env
from ppo_fabric.learn.buffer import rollout_storage
from ppo_fabric.models.agent import ActorCritic
from tests.conftest import cartpole_env_cfg
from tests.faulty_env import FaultyCartPole

pytestmark = pytest.mark.unit


def test_nonfinite_rows_names_the_first_row_key_and_kind() -> None:
    obs = np.zeros((4, 3), dtype=np.float32)
    assert nonfinite_rows(obs, np.zeros(4)) is None
    obs[2, 1], obs[3, 0] = np.nan, np.inf
    assert nonfinite_rows(obs, np.zeros(4)) == (2, "observation holds NaN")
    assert nonfinite_rows(np.zeros((4, 3)), np.array([0, 0, 0, -np.inf])) == (3, "reward holds -inf")
    rewards = np.array([0.0, np.inf, 0, 0])
    assert nonfinite_rows(obs, rewards) == (1, "reward holds +inf")  # the first row wins
    pos = np.zeros((2, 2))
    pos[1, 0] = np.inf
    found = nonfinite_rows({"img": np.full((2, 4, 4), 255, np.uint8), "pos": pos}, np.zeros(2))
    assert found == (1, 'observation["pos"] holds +inf')  # integer pixels are never checked


def _vector(fault: str, after: int, envs: int = 3, **kw: Any) -> SyncVectorEnv:
    """Sub-env 1 goes wrong at its `after`-th step, the others never."""
    fns = [
        (lambda i=i: FaultyCartPole(fault=fault if i == 1 else "none", after=after, **kw))
        for i in range(envs)
    ]
    return SyncVectorEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP)


def test_values_float32_cannot_hold_are_named_where_they_arrive() -> None:
    """The rollout stores float32: a finite float64 reward of 1e200 (or 1e100, whose square still passes
    float64's quick test) became inf there, and the update's NaN losses were blamed three updates later."""
    for big in (1e200, 1e100, -4e38):
        rewards = np.array([0.0, 0.0, big])
        assert find_nonfinite(np.zeros((3, 2)), rewards) == (2, f"reward holds {big:.3g}, beyond float32's "
                                                                   "range (the rollout stores float32)")  # fmt: skip
    assert nonfinite_rows(np.full((2, 2), 3e38), np.zeros(2)) is None  # within range: fine
    assert nonfinite_rows(np.array([[1e39], [0.0]], np.float64), np.zeros(2))[0] == 0


@pytest.mark.parametrize(
    ("fault", "what"),
    [("nan_obs", "observation holds NaN"), ("inf_reward", "reward holds +inf"),
     ("huge_reward", "reward holds 1e+200, beyond float32's range (the rollout stores float32)"),
     ("none_reward", "reward holds NaN (or None, which the vector env stores as NaN)")],  # said NaN alone
)  # fmt: skip
def test_finite_check_raises_with_the_env_index(fault: str, what: str) -> None:
    envs = FiniteCheck(_vector(fault, after=3))
    envs.reset(seed=0)
    for _ in range(2):
        envs.step(np.zeros(3, dtype=np.int64))
    with pytest.raises(NonFiniteData) as found:
        envs.step(np.zeros(3, dtype=np.int64))
    assert (found.value.index, found.value.what) == (1, what)


def test_recreate_on_error_ends_the_episode_and_reports_the_cause() -> None:
    built: list[FaultyCartPole] = []

    def factory() -> gym.Env:
        env = FaultyCartPole(fault="raise", after=2)
        built.append(env)
        return env

    envs = SyncVectorEnv([lambda: RecreateOnError(factory)], autoreset_mode=AutoresetMode.SAME_STEP)
    obs0, _ = envs.reset(seed=0)
    obs1, *_ = envs.step(np.zeros(1, dtype=np.int64))
    obs, reward, terminated, truncated, info = envs.step(np.zeros(1, dtype=np.int64))
    assert len(built) == 2  # the failing env was replaced
    assert truncated[0] and not terminated[0] and reward[0] == 0.0
    assert np.array_equal(info["final_obs"][0], obs1[0])  # the last good observation, bootstrapped from
    assert info["_" + RESTART_INFO][0]
    assert info[RESTART_INFO][0] == "step raised RuntimeError: simulator crashed (injected by the test env)"
    obs, *_, info = envs.step(np.zeros(1, dtype=np.int64))
    assert RESTART_INFO not in info  # reported once


def test_recreate_rebuilds_an_env_whose_observation_has_another_shape() -> None:
    """The docs promise `env.on_error=restart` recovers an observation of another shape: it reached the
    vector env's buffer, whose NumPy error ended the run although the user had asked for recovery."""
    envs = SyncVectorEnv(
        [(lambda i=i: RecreateOnError(lambda: FaultyCartPole(fault="wrong_shape" if i == 1 else "none",
                                                             after=3))) for i in range(2)],
        autoreset_mode=AutoresetMode.SAME_STEP,
    )  # fmt: skip
    envs.reset(seed=0)
    for _ in range(2):
        envs.step(np.zeros(2, dtype=np.int64))
    obs, reward, terminated, truncated, info = envs.step(np.zeros(2, dtype=np.int64))
    assert obs.shape == (2, 4) and truncated[1] and not truncated[0] and reward[1] == 0.0
    assert info[RESTART_INFO][1] == (
        "step returned bad data (observation of shape (5,) where observation_space has (4,))"
    )


def test_misshapen_names_the_key_of_a_dict_observation() -> None:
    space = gym.spaces.Dict({"pos": gym.spaces.Box(-1, 1, (2,)), "img": gym.spaces.Box(0, 255, (3, 3))})
    assert misshapen({"pos": np.zeros(2), "img": np.zeros((3, 3))}, space) is None
    assert misshapen({"pos": np.zeros(3), "img": np.zeros((3, 3))}, space) == (
        'observation["pos"] of shape (3,) where observation_space has (2,)'
    )
    assert misshapen({"img": np.zeros((3, 3))}, space) == 'observation["pos"] missing'
    assert misshapen(3, gym.spaces.Discrete(4)) is None  # only Box shapes are checked


def test_recreate_gives_up_after_resets_that_keep_failing() -> None:
    class Broken(FaultyCartPole):
        def reset(self, **kwargs: Any) -> Any:
            raise OSError("simulator license expired")

    with pytest.raises(EnvFault, match=r"reset raised OSError: simulator license expired, 3 times in a row"):
        RecreateOnError(Broken).reset(seed=0)


def _collector(env_cfg: Any, restarts: int | None = None) -> RolloutCollector:
    envs, first = make_vector_env(env_cfg, 0, 0)
    storage = rollout_storage(8, 4, envs.single_observation_space, envs.single_action_space, "cpu")
    return RolloutCollector(envs, first, storage, 0.99, 0.95, label="player rank 1", max_restarts=restarts)


def _policy(collector: RolloutCollector) -> ActorCritic:
    cfg = OmegaConf.create(
        {"encoder": "auto", "actor_hidden": [8], "critic_hidden": [8], "activation": "tanh"}
    )
    return ActorCritic(collector.envs.single_observation_space, collector.envs.single_action_space, cfg)


def _faulty(fault: str, after: int, **extra: Any) -> Any:
    cfg = cartpole_env_cfg(4, 500, **extra)
    cfg.id = "tests.faulty_env:FaultyCartPole-v0"
    cfg.kwargs = {"fault": fault, "after": after}
    return cfg


@pytest.mark.parametrize(
    ("fault", "line"),
    [
        ("nan_obs", "player rank 1, env 0: observation holds NaN at env step 44"),  # 11th vector step x 4
        ("inf_reward", "player rank 1, env 0: reward holds +inf at env step 44"),
        (
            "raise",
            "player rank 1: env.step raised RuntimeError: simulator crashed (injected by the test env)",
        ),
    ],
)
def test_the_collector_names_rank_env_and_step(fault: str, line: str) -> None:
    # the policy's actions decide whether env 0's episode ends at the faulty step (its observation is then a
    # final one, found after the other envs'): seeded, not left to the runs of earlier tests
    torch.manual_seed(0)
    collector = _collector(_faulty(fault, after=11))
    policy = _policy(collector)
    collector.collect(policy, 0)  # 8 steps: fine
    with pytest.raises(EnvFault) as raised:
        collector.collect(policy, 32)
    assert str(raised.value).startswith(line), raised.value
    collector.envs.close()


def test_restarts_are_counted_and_bounded() -> None:
    """Every sub-env fails at its 6th step: four restarts at env step 24, four more 5 steps after each new
    env's reset; with env.max_restarts=6 the second round ends the run."""
    collector = _collector(_faulty("nan_obs", after=6, on_error="restart"), restarts=6)
    policy = _policy(collector)
    collector.collect(policy, 0)
    assert collector.restarts == 4
    stored = collector.storage
    assert np.isfinite(stored["obs"].numpy()).all() and np.isfinite(stored["rewards"].numpy()).all()
    assert stored["truncated"][5].all() and (stored["rewards"][5] == 0).all()  # the bad step, cut
    with pytest.raises(EnvFault, match=r"more than env.max_restarts=6 restarts in the run"):
        collector.collect(policy, 32)
    collector.envs.close()


def test_bad_data_before_the_run_names_the_warm_up_too() -> None:
    """A NaN in the normalisers' warm-up steps (random actions before the run) was reported as found at
    the first reset, where the env had done nothing wrong."""
    from ppo_fabric.collect.rollout import build_collector
    from ppo_fabric.config.values import compose
    from ppo_fabric.learn.learners import policy_specs

    cfg, _ = compose(["env.id=tests.faulty_env:FaultyCartPole-v0", "+env.kwargs.fault=nan_obs",
                      "+env.kwargs.after=5", "env.normalize_obs=true", "env.num_envs=2"])  # fmt: skip
    with pytest.raises(EnvFault, match=r"^rank 0, env \d: observation holds NaN at its first reset, or in "
                                       r"the normalisers' warm-up steps before the run \(env.normalize_warmup\)"):  # fmt: skip
        build_collector(cfg, policy_specs(cfg), 0, "cpu", None)


def test_an_observation_of_another_shape_at_the_first_reset_is_one_line() -> None:
    """It came as a ~50-line traceback through Hydra's, ending in NumPy's "Output array is the wrong shape",
    which names no env and no space; a step's says the same (`test_the_collector_names_rank_env_and_step`)."""
    from ppo_fabric.collect.rollout import build_collector
    from ppo_fabric.config.values import compose
    from ppo_fabric.learn.learners import policy_specs

    cfg, _ = compose(["env.id=tests.faulty_env:FaultyCartPole-v0", "+env.kwargs.fault=wrong_shape_reset"])
    with pytest.raises(EnvFault, match=r"^rank 0: the envs raised ValueError: Output array is the wrong shape "
                                       r"\(an observation's shape differs from the env's observation_space\) "
                                       r"at its first reset$"):  # fmt: skip
        build_collector(cfg, policy_specs(cfg), 0, "cpu", None)


def test_an_observation_of_another_shape_in_a_step_is_named_so() -> None:
    """NumPy says "Output array is the wrong shape" or "all input arrays must have the same shape" (every
    env's observation, or some of them): neither names the env's observation_space."""
    collector = _collector(_faulty("wrong_shape", after=11))
    collector.collect(_policy(collector), 0)
    with pytest.raises(EnvFault, match=r"^player rank 1: env.step raised ValueError: .*shape \(an observation's "
                                       r"shape differs from the env's observation_space\) at env step 44$"):  # fmt: skip
        collector.collect(_policy(collector), 32)
    collector.envs.close()


def test_an_unpicklable_step_result_of_an_async_env_is_named_so() -> None:
    """The worker failing to send a step back was reported as `env.step raised`, with no word of pickling."""
    exc = AttributeError("Can't pickle local object 'OddInfoEnv.step.<locals>.<lambda>'")
    assert env_error_text(exc).endswith(
        "(an async env's worker sends each step's observation and info back pickled: one of them does not "
        "pickle; keep such objects out of info, or use env.vector=sync)"
    )
    assert env_error_text(RuntimeError("pickles are sour")) == "RuntimeError: pickles are sour"


def test_a_reward_that_is_not_one_number_is_named_so() -> None:
    """A reward of shape (1,) fails where the vector env stores one reward per env, in NumPy's words that
    name neither the reward nor the env ("setting an array element with a sequence"); the line says what
    they mean. (An async env's, "non-broadcastable output operand", in tests/runs/test_faults.py.)"""
    from gymnasium.vector import SyncVectorEnv

    from tests.faulty_env import FaultyCartPole

    envs = SyncVectorEnv([lambda: FaultyCartPole(fault="array_reward", after=1)] * 2)
    try:
        envs.reset(seed=0)
        with pytest.raises(ValueError, match="setting an array element with a sequence") as raised:
            envs.step(np.zeros(2, dtype=np.int64))
    finally:
        envs.close()
    assert env_error_text(raised.value).endswith(
        " (a step's reward, terminated or truncated is not one number: a reward of shape (1,)?)"
    ), env_error_text(raised.value)


def test_an_observation_with_another_number_of_dimensions_at_the_first_reset_is_named_so() -> None:
    """An observation of shape (1, 3) for a space of (3,): NumPy's "Output array has wrong dimensionality"
    came without the hint the other shape errors get."""
    from ppo_fabric.collect.rollout import build_collector
    from ppo_fabric.config.values import compose
    from ppo_fabric.learn.learners import policy_specs

    cfg, _ = compose(["env=gym", "env.id=tests.envs.factory_envs:odd_observations", "+env.kwargs.kind=rows"])
    with pytest.raises(EnvFault, match=r"^rank 0: the envs raised ValueError: Output array has wrong "
                                       r"dimensionality \(an observation's shape differs from the env's "
                                       r"observation_space\) at its first reset$"):  # fmt: skip
        build_collector(cfg, policy_specs(cfg), 0, "cpu", None)


@pytest.mark.parametrize(
    ("value", "flag"),
    [(True, True), (False, False), (np.bool_(True), True), (1, True), (np.int64(0), False), (1.0, True),
     (np.array(False), False), (np.array([True]), True), (torch.tensor(False), False), ([1], True),
     ("False", None), ("True", None), (None, None), (0.5, None), (float("nan"), None), (np.array([1, 0]), None),
     (np.array(["False"]), None), (object(), None)],
)  # fmt: skip
def test_a_step_flag_is_a_bool_or_a_number_zero_or_one(value: Any, flag: bool | None) -> None:
    """NumPy stores "False", NaN and 0.5 as True into the vector env's array: refused (None), not read. One
    number in an array or a tensor is what gymnasium warns of and stores: taken."""
    assert step_flag(value) is flag


@pytest.mark.parametrize("on_error", ["raise", "restart"])
def test_a_text_terminated_ends_the_run_in_one_line(tmp_path: Path, on_error: str) -> None:
    """terminated="False" (a str) was stored as True: every step ended an episode, nothing was learnt and
    the run ended with exit 0. `env.on_error=restart` does not rebuild the env: a fresh one sends it again."""
    with pytest.raises(EnvFault, match=(
        r"^rank 0: step\(\) returned terminated='False' \(str\), where gymnasium's API returns a bool; NumPy would "
        r"read it as True or False by its type, not its meaning \(env step 6\)$"
    )):  # fmt: skip
        ppo_fabric.run(["env.id=tests.faulty_env:FaultyCartPole-v0", "+env.kwargs.fault=text_terminated",
                        "+env.kwargs.after=3", "env.num_envs=2", "env.vector=sync", "algo.rollout_steps=16",
                        "algo.minibatch_size=32", "algo.total_steps=64", "eval.every=0", "logger=none",
                        f"env.on_error={on_error}", f"hydra.run.dir={tmp_path}"])  # fmt: skip
