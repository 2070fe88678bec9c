"""The multi-agent test environments: PettingZoo API conformance, rewards, agent removal, seeding, returns."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import ppo_fabric
from ppo_fabric.envs.toy_multiagent import MatchingGame, TeamsGame, matching_v0, teams_v0

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # pettingzoo.test imports its deprecated env modules
    from pettingzoo.test import parallel_api_test

Policy = Callable[[MatchingGame | TeamsGame, str, np.random.Generator], int]


def _optimal(env: MatchingGame | TeamsGame, agent: str, rng: np.random.Generator) -> int:
    return env.target(agent)


def _random(env: MatchingGame | TeamsGame, agent: str, rng: np.random.Generator) -> int:
    return int(rng.integers(env.num_symbols))


def _episode_returns(
    env: MatchingGame | TeamsGame, policies: dict[str, Policy], seed: int, rng: np.random.Generator
) -> dict[str, float]:
    env.reset(seed=seed)
    returns = dict.fromkeys(env.possible_agents, 0.0)
    while env.agents:
        actions = {a: policies[a](env, a, rng) for a in env.agents}
        _, rewards, _, _, _ = env.step(actions)
        for agent, reward in rewards.items():
            returns[agent] += reward
    return returns


def _mean_returns(
    env: MatchingGame | TeamsGame, policies: dict[str, Policy], episodes: int
) -> dict[str, float]:
    rng = np.random.default_rng(1234)
    totals = dict.fromkeys(env.possible_agents, 0.0)
    for episode in range(episodes):
        for agent, value in _episode_returns(env, policies, episode, rng).items():
            totals[agent] += value
    return {agent: total / episodes for agent, total in totals.items()}


@pytest.mark.parametrize(
    "make",
    [
        lambda: matching_v0(),
        lambda: matching_v0(leave_early=True),
        lambda: matching_v0(leave_early=True, truncate=True),
        lambda: teams_v0(),
        lambda: teams_v0(truncate=True),
    ],
    ids=["matching", "matching-leave-early", "matching-leave-early-truncate", "teams", "teams-truncate"],
)
def test_parallel_api(make: Callable[[], MatchingGame | TeamsGame]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the API test only warns about wrong dict keys or missing agents
        parallel_api_test(make(), num_cycles=50)


def test_spaces_and_observations() -> None:
    env = MatchingGame(n_agents=3, num_symbols=4, episode_length=8)
    obs, infos = env.reset(seed=0)
    assert set(obs) == set(infos) == {"agent_0", "agent_1", "agent_2"}
    for i, agent in enumerate(env.possible_agents):
        space = env.observation_space(agent)
        assert space.shape == (4 + 3 + 1,) and space.dtype == np.float32
        assert env.action_space(agent).n == 4
        assert obs[agent].dtype == np.float32 and space.contains(obs[agent])
        np.testing.assert_array_equal(obs[agent][4:7], np.eye(3)[i])
        assert obs[agent][-1] == 0.0
    assert len({tuple(o[:4]) for o in obs.values()}) == 1  # every agent sees the same cue

    teams = TeamsGame(n_per_team=2, num_symbols=3)
    obs, _ = teams.reset(seed=0)
    assert teams.possible_agents == ["adversary_0", "adversary_1", "agent_0", "agent_1"]
    assert teams.observation_space("adversary_0").shape == (3,)
    assert teams.observation_space("agent_0").shape == (4,)
    assert all(teams.observation_space(a).contains(obs[a]) for a in teams.possible_agents)
    np.testing.assert_array_equal(obs["adversary_0"], obs["agent_0"][:3])


def test_matching_rewards() -> None:
    env = MatchingGame(n_agents=3, num_symbols=4)
    env.reset(seed=0)
    _, rewards, *_ = env.step({a: env.target(a) for a in env.agents})
    assert rewards == dict.fromkeys(env.possible_agents, 1.0)

    cue = (env.target("agent_0"), env.target("agent_1"))
    assert cue[1] == (cue[0] + 1) % 4
    wrong = (env.target("agent_2") + 1) % 4
    _, rewards, *_ = env.step(
        {"agent_0": env.target("agent_0"), "agent_1": env.target("agent_1"), "agent_2": wrong}
    )
    assert rewards == dict.fromkeys(env.possible_agents, pytest.approx(2 / 3))

    same = {a: env.target("agent_0") for a in env.agents}  # ignoring the id: only agent_0 can hit
    _, rewards, *_ = env.step(same)
    assert rewards == dict.fromkeys(env.possible_agents, pytest.approx(1 / 3))


def test_teams_rewards_are_zero_sum() -> None:
    env = TeamsGame(n_per_team=2, num_symbols=3)
    env.reset(seed=0)
    actions = {a: env.target(a) for a in env.agents} | {"adversary_1": (env.target("adversary_1") + 1) % 3}
    _, rewards, *_ = env.step(actions)
    assert rewards == {"adversary_0": -0.5, "adversary_1": -0.5, "agent_0": 0.5, "agent_1": 0.5}

    rng = np.random.default_rng(0)
    for _ in range(20):
        _, rewards, *_ = env.step({a: int(rng.integers(3)) for a in env.agents})
        assert sum(rewards.values()) == pytest.approx(0.0)
        assert len(set(rewards[a] for a in env.good_agents)) == 1
        if not env.agents:
            env.reset()


def test_leave_early_removes_agents_then_ends() -> None:
    length = 5
    env = MatchingGame(n_agents=3, num_symbols=4, episode_length=length, leave_early=True)
    env.reset(seed=0)
    for step in range(1, length + 1):
        acting = list(env.agents)
        assert acting == [f"agent_{i}" for i in range(3) if step <= length - i]
        obs, rewards, terms, truncs, infos = env.step({a: env.target(a) for a in acting})
        assert set(obs) == set(rewards) == set(terms) == set(truncs) == set(infos) == set(acting)
        assert rewards == dict.fromkeys(acting, 1.0)  # averaged over the agents still present
        assert not any(truncs.values())
        assert terms == {a: step == length - int(a[-1]) for a in acting}
        assert env.agents == [a for a in acting if not terms[a]]
    assert env.agents == []
    with pytest.raises(RuntimeError):
        env.step({})

    env.reset(seed=1)
    for _ in range(length - 2):
        env.step({a: env.target(a) for a in env.agents})
    assert env.agents == ["agent_0", "agent_1"]  # agent_2 left after length - 2 steps
    _, rewards, *_ = env.step({"agent_0": env.target("agent_0"), "agent_1": (env.target("agent_1") + 1) % 4})
    assert rewards == {"agent_0": 0.5, "agent_1": 0.5}


def test_time_limit_sets_truncations() -> None:
    env = MatchingGame(episode_length=3, truncate=True)
    env.reset(seed=0)
    for _ in range(2):
        _, _, terms, truncs, _ = env.step({a: 0 for a in env.agents})
        assert not any(terms.values()) and not any(truncs.values())
    obs, _, terms, truncs, _ = env.step({a: 0 for a in env.agents})
    assert not any(terms.values()) and all(truncs.values())
    assert all(o[-1] == 1.0 for o in obs.values()) and env.agents == []


def test_seeding_is_deterministic() -> None:
    def cues(env: MatchingGame | TeamsGame, seed: int) -> list[int]:
        obs, _ = env.reset(seed=seed)
        seen = [int(np.argmax(obs["agent_0"][: env.num_symbols]))]
        while env.agents:
            obs, *_ = env.step({a: 0 for a in env.agents})
            seen.append(int(np.argmax(obs["agent_0"][: env.num_symbols])))
        return seen

    for make in (MatchingGame, TeamsGame):
        assert cues(make(), 7) == cues(make(), 7)
        env = make()
        first, second = cues(env, 7), cues(env, 7)
        assert first == second
        assert cues(env, 7) != cues(env, 8)


def test_matching_optimal_and_random_returns() -> None:
    env = MatchingGame(n_agents=3, num_symbols=4, episode_length=8)
    optimal = _mean_returns(env, dict.fromkeys(env.possible_agents, _optimal), episodes=5)
    assert optimal == dict.fromkeys(env.possible_agents, 8.0)
    random = _mean_returns(env, dict.fromkeys(env.possible_agents, _random), episodes=400)
    for value in random.values():
        assert value == pytest.approx(8 / 4, abs=0.15)

    early = MatchingGame(n_agents=3, num_symbols=4, episode_length=8, leave_early=True)
    optimal = _mean_returns(early, dict.fromkeys(early.possible_agents, _optimal), episodes=5)
    assert optimal == {"agent_0": 8.0, "agent_1": 7.0, "agent_2": 6.0}


def test_teams_returns_against_random_adversaries() -> None:
    env = TeamsGame(n_per_team=2, num_symbols=3, episode_length=8)
    policies: dict[str, Policy] = {a: _random for a in env.adversaries} | {
        a: _optimal for a in env.good_agents
    }
    returns = _mean_returns(env, policies, episodes=400)
    for agent in env.good_agents:
        assert returns[agent] == pytest.approx(8 * (1 - 1 / 3), abs=0.15)
    for agent in env.adversaries:
        assert returns[agent] == pytest.approx(-8 * (1 - 1 / 3), abs=0.15)

    both_optimal = _mean_returns(env, dict.fromkeys(env.possible_agents, _optimal), episodes=5)
    assert both_optimal == dict.fromkeys(env.possible_agents, 0.0)


def test_bad_arguments_and_actions() -> None:
    with pytest.raises(ValueError, match="leave_early"):
        MatchingGame(n_agents=5, episode_length=4, leave_early=True)
    with pytest.raises(ValueError, match="num_symbols"):
        TeamsGame(num_symbols=1)
    env = MatchingGame()
    env.reset(seed=0)
    with pytest.raises(KeyError, match="agent_2"):
        env.step({"agent_0": 0, "agent_1": 0})
    with pytest.raises(ValueError, match="outside"):
        env.step({"agent_0": 0, "agent_1": 0, "agent_2": 4})


def test_an_agents_observation_of_another_shape_names_the_agent() -> None:
    """NumPy's "could not broadcast input array from shape (4,) into shape (3,)" came as `env.step raised`,
    naming neither the agent nor its observation space."""
    from ppo_fabric.config.values import compose
    from ppo_fabric.envs.multiagent import make_multiagent_vector_env

    cfg, _ = compose(["env=pettingzoo", "env.id=tests.envs.factory_envs:misshapen_teams", "env.num_envs=2"])
    with pytest.raises(ValueError, match=r"^env 0, agent 'agent_0': an observation of shape \(4,\) where its "
                                         r"observation_space has \(3,\)$"):  # fmt: skip
        make_multiagent_vector_env(cfg.env, cfg.multiagent, 0, 0)


def test_an_agent_truncated_without_its_last_observation_is_named(tmp_path: Path) -> None:
    """Its return is bootstrapped from that observation: the rollout's bootstrap failed with NumPy's
    "can't convert np.ndarray of type numpy.object_" and a traceback."""
    from ppo_fabric.config.faults import RunFault

    with pytest.raises(RunFault, match=r"env 0, agent 'agent_0': truncated without an observation of where"):
        ppo_fabric.run(["env=pettingzoo", "env.id=tests.envs.factory_envs:unobserved_truncation", "env.num_envs=1",
                        "algo.rollout_steps=16", "algo.minibatch_size=16", "algo.total_steps=64", "eval.every=0",
                        "logger=none", f"hydra.run.dir={tmp_path}"])  # fmt: skip


def _step_faulty(fault: str, steps: int = 4) -> None:
    from ppo_fabric.config.values import compose
    from ppo_fabric.envs.multiagent import make_multiagent_vector_env

    cfg, _ = compose(["env=pettingzoo", "env.id=tests.envs.factory_envs:faulty_matching", "env.num_envs=2",
                      f"+env.kwargs.fault={fault}"])  # fmt: skip
    envs, _ = make_multiagent_vector_env(cfg.env, cfg.multiagent, 0, 0)
    for _ in range(steps):
        envs.step([np.zeros(envs.num_envs * len(a), np.int64) for a in envs.groups.values()])


@pytest.mark.parametrize(
    ("fault", "line"),
    [
        ("rewards", r"^env 0, agent 'agent_0': step\(\) returned rewards without this agent, which acted"),
        ("terminations", r"^env 0, agent 'agent_0': step\(\) returned terminations without this agent"),
        ("truncations", r"^env 0, agent 'agent_0': step\(\) returned truncations without this agent"),
        ("vanish", r"^env 0, agent 'agent_0': left env.agents after a step that set neither its termination"),
        ("ghost", r"^env 0: agent 'ghost' is not one of its possible_agents \('agent_0', 'agent_1'"),
        ("text_reward", r"^env 0, agent 'agent_0': a reward of 'high', which is not a number$"),
        ("text_truncation", r"^env 0, agent 'agent_0': step\(\) returned truncations='False' \(str\), where "),
        ("unobserved", r"^env 0, agent 'agent_0': step\(\) returned no observation for this agent, which is "),
        ("old_reset", r"^env 0: reset\(\) returned dict, where PettingZoo's Parallel API returns \(observations"),
    ],
    ids=lambda value: value if "env 0" not in value else "",
)  # fmt: skip
def test_a_parallel_env_off_the_api_is_named_with_its_agent(fault: str, line: str) -> None:
    """Missing entries were read as 0 or False (`.get(agent, False)`): an agent whose episode ended went on
    adding its return into the next one and the run ended with exit 0. An unknown agent was the package's own
    `KeyError: 'ghost'`, an old-API reset `KeyError: 0`, a text reward `float()`'s TypeError, and a text
    truncation ("False") was True."""
    with pytest.raises(ValueError, match=line):
        _step_faulty(fault)


def test_a_none_reward_of_a_parallel_env_ends_the_run_as_a_gymnasium_envs_does(tmp_path: Path) -> None:
    """The docs promise "reward holds NaN (or None ...)" with the env and agent; it was float()'s TypeError."""
    from ppo_fabric.config.faults import RunFault

    with pytest.raises(RunFault, match=r"agent 'agent_0'.*reward holds NaN \(or None"):
        ppo_fabric.run(["env=pettingzoo", "env.id=tests.envs.factory_envs:faulty_matching", "env.num_envs=1",
                        "+env.kwargs.fault=none_reward", "algo.rollout_steps=16", "algo.minibatch_size=16",
                        "algo.total_steps=64", "eval.every=0", "logger=none", f"hydra.run.dir={tmp_path}"])  # fmt: skip


def test_an_agent_gone_without_an_episode_end_fails_the_run(tmp_path: Path) -> None:
    """The whole run, not only the vector env: it ended with exit 0 and a return summed across episodes."""
    from ppo_fabric.config.faults import RunFault

    with pytest.raises(RunFault, match=r"env 0, agent 'agent_0': left env.agents after a step"):
        ppo_fabric.run(["env=pettingzoo", "env.id=tests.envs.factory_envs:faulty_matching", "env.num_envs=1",
                        "+env.kwargs.fault=vanish", "algo.rollout_steps=16", "algo.minibatch_size=16",
                        "algo.total_steps=64", "eval.every=0", "logger=none", f"hydra.run.dir={tmp_path}"])  # fmt: skip
