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
from ppo_fabric.envs.guard import error_line
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
        ("missing_function", f"module '{FACTORY}' has no attribute 'missing_function'"),
        ("short_cartpol", "has no attribute 'short_cartpol'.*; did you mean short_cartpole"),
        ("NOT_CALLABLE", r"has 'NOT_CALLABLE', but it is not callable \(int\)"),
        ("Missing-v0", ":Missing-v0' is not a registered gymnasium environment"),  # an id: the registry's
    ],
)
def test_factory_that_gives_no_gymnasium_env_fails_in_one_line(name: str, fragment: str) -> None:
    with pytest.raises(EnvError, match=fragment) as info:
        make_env(_env_cfg(f"{FACTORY}:{name}"))
    assert "\n" not in str(info.value)
    assert name.endswith("-v0") or "registered gymnasium environment" not in str(info.value)


@pytest.mark.parametrize(
    ("source", "fragment"),
    [
        (
            "import nosuch_dependency_xyz\n",
            r"cannot import module 'user_envs' \(No module named 'nosuch_dependency_xyz'\)",
        ),
        ("raise RuntimeError('no config file\\nmore')\n", "it raised RuntimeError: no config file$"),
        ("def make_env(:\n", "it raised SyntaxError: "),
    ],
)
def test_a_module_that_does_not_import_is_named_with_its_error(
    source: str, fragment: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "user_envs.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "user_envs", raising=False)
    with pytest.raises(EnvError, match=fragment) as info:
        make_env(_env_cfg("user_envs:make_env"))
    assert "\n" not in str(info.value) and "registered" not in str(info.value)


def test_rejected_kwargs_give_the_envs_whole_error_on_one_line() -> None:
    with pytest.raises(TypeError) as raw:
        gym.make("CartPole-v1", a_keyword_cartpole_does_not_take=1)
    whole = str(raw.value).splitlines()[0]
    assert len(whole) > 120  # the length the message used to be cut at, mid-word
    with pytest.raises(EnvError) as info:
        make_env(_env_cfg("CartPole-v1", "+env.kwargs.a_keyword_cartpole_does_not_take=1"))
    assert str(info.value) == f"env.id='CartPole-v1' rejected env.kwargs: {whole}"
    with pytest.raises(EnvError) as value:  # a value the env refuses: its own message, named as such
        make_env(_env_cfg(f"{FACTORY}:sized_cartpole", "+env.kwargs.size=0"))
    assert str(value.value) == (
        f"env.id='{FACTORY}:sized_cartpole' with env.kwargs={{'size': 0}}: "
        "ValueError: size must be at least 1, got 0"
    )


def test_error_line_cuts_a_long_message_at_a_word_boundary() -> None:
    assert error_line(ValueError("short\nsecond line")) == "short"
    assert error_line(AssertionError()) == "AssertionError"
    cut = error_line(ValueError("word " * 100), limit=50)
    assert len(cut) <= 50 and cut.endswith("word...") and "\n" not in cut


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
        "logger.plot=false",
        f"hydra.run.dir={tmp_path}",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "ppo_fabric", *args],
        cwd=REPO,
        env=job_env(supervisor=False),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["total_env_steps"] >= 256 and summary["env_id"] == f"{FACTORY}:short_cartpole"


@pytest.mark.parametrize(
    ("kind", "fragment"),
    [
        ("scalar", "observation space Box of shape () (one number, unbatched) is not supported; give it shape "
                   "(1,) (gymnasium.wrappers.ReshapeObservation(env, (1,)))"),
        ("graph", "observation space Graph (of varying size) is not supported; wrap the env to return a "
                  "fixed-size Box or a Dict of Boxes (pad or summarise it)"),
    ],
    ids=["scalar", "graph"],
)  # fmt: skip
def test_observation_spaces_the_model_cannot_read_are_one_line(
    kind: str, fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Box of shape () crashed in the first matmul with NumPy's (or torch's) shape message; a Graph was
    told to use FlattenObservation, which returns Graph and Sequence spaces unchanged."""
    from ppo_fabric import cli
    from tests.conftest import assert_cli_failure

    argv = ["env=gym", "env.id=tests.envs.factory_envs:odd_observations", f"+env.kwargs.kind={kind}"]
    assert_cli_failure(capsys, cli.main, argv, fragment)


@pytest.mark.parametrize("kind", ["discrete_int32", "multidiscrete_int8", "box_float16", "box_float64"])
def test_the_env_gets_actions_in_its_action_spaces_dtype(kind: str, tmp_path: Path) -> None:
    """Actions were sampled as int64 or float32 and passed on as they were: an env checking
    `action_space.contains(action)` refused every one (Discrete(3, dtype=int32)), and one that does not
    got actions outside its space. `predict` returns them in the space's dtype too."""
    import numpy as np

    import ppo_fabric

    ppo_fabric.run(["env=gym", "env.id=tests.envs.factory_envs:strict_actions", f"+env.kwargs.kind={kind}",
                    "env.num_envs=2", "algo.rollout_steps=16", "algo.minibatch_size=32", "algo.total_steps=64",
                    "eval.every=32", "eval.episodes=2", "logger=none", f"hydra.run.dir={tmp_path}"])  # fmt: skip
    policy = ppo_fabric.load_policy(tmp_path / "checkpoints" / "last.ckpt")
    action, _ = policy.predict(np.zeros(3, np.float32))
    assert policy.action_space.contains(action), (action, np.asarray(action).dtype)


def test_a_fresh_run_whose_actions_sit_at_one_bound_is_warned(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Bounds [100, 200]: every action the initial policy took was clipped to 100, and the run learned
    nothing and ended with exit 0 without a word. A resume is not warned: its policy has moved."""
    import ppo_fabric

    run = ["env=gym", "env.id=tests.envs.factory_envs:strict_actions", "+env.kwargs.kind=box_far", "eval.every=0",
           "env.num_envs=2", "algo.rollout_steps=16", "algo.minibatch_size=32", "logger=none"]  # fmt: skip
    ppo_fabric.run([*run, "algo.total_steps=32", f"hydra.run.dir={tmp_path / 'a'}"])
    err = capfd.readouterr().err
    assert ("ppo-fabric: warning: action dimension 1 has bounds [100, 200]: the initial policy (mean 0, std 1) "
            "is clipped to the lower bound in 100.0% of its actions") in err, err  # fmt: skip
    ppo_fabric.run([*run, "algo.total_steps=64", f"resume={tmp_path / 'a' / 'checkpoints' / 'last.ckpt'}",
                    f"hydra.run.dir={tmp_path / 'b'}"])  # fmt: skip
    assert "warning: action dimension" not in capfd.readouterr().err
