"""Turn-based PettingZoo games (AEC): which rows act, where each player's rewards land, how each player's
moves bootstrap from its own next move, legal moves only, and whole runs on tictactoe_v3.

The routing test steps the scripted `turn_v0` game (rewards known move by move) through the real collector
with a stand-in policy whose value is a known function of the observation, and compares the stored
rewards, flags, mask and advantages with numbers worked out by hand in the comments.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from omegaconf import DictConfig

import ppo_fabric
from ppo_fabric import cli
from ppo_fabric.collect.rollout import build_collector
from ppo_fabric.config.values import compose
from ppo_fabric.envs.guard import EnvFault
from ppo_fabric.envs.make import EnvError
from ppo_fabric.envs.multiagent import make_multiagent_vector_env, make_parallel_env
from ppo_fabric.envs.turn_based import TurnBasedVectorEnv
from ppo_fabric.learn.learners import policy_specs
from tests.conftest import assert_cli_failure, job_env

REPO = Path(__file__).resolve().parents[2]
TURN = ["env=pettingzoo", "env.id=ppo_fabric.envs.toy_multiagent:turn_v0"]
TICTACTOE = ["env=pettingzoo", "env.id=pettingzoo.classic.tictactoe_v3"]


def _cfg(*extra: str) -> DictConfig:
    cfg, _ = compose([*TURN, "env.num_envs=1", "algo.rollout_steps=7", "algo.minibatch_size=7", *extra])
    return cfg


class ValuePolicy:
    """Stands in for ActorCritic: plays the first legal move, V(k, seat) = 1 + k + 3 * seat."""

    recurrent = False

    def sample(self, obs: torch.Tensor, state: Any, deterministic: bool = False, mask: Any = None) -> Any:
        action = mask.to(torch.int64).argmax(1)
        return action, torch.zeros(len(obs)), None

    def get_value(self, obs: torch.Tensor, state: Any = None) -> torch.Tensor:
        return 1 + obs[:, 0] + 3 * obs[:, 1]


def test_aec_env_is_detected_and_masks_split_off() -> None:
    cfg = _cfg()
    specs = policy_specs(cfg)
    spec = specs["shared"]
    assert spec.agents == 2 and spec.action_mask == 3
    assert spec.obs_space.shape == (2,)  # the `observation` key alone: the mask restricts actions instead
    collector = build_collector(cfg, specs, 0, "cpu", None)
    assert isinstance(collector.envs, TurnBasedVectorEnv) and collector.turn_based
    assert collector.groups[0].alive.tolist() == [True, False]  # `first` opens
    assert collector.groups[0].next_mask.tolist() == [[False, True, True], [True, True, True]]


def test_rewards_reach_each_player_and_bootstrap_from_its_own_moves() -> None:
    """turn_v0 with length 4 (two games' worth of moves in 7 steps), gamma 0.9, lambda 0.5.

    step  mover   k  rewards (mover, other)      first's row            second's row
    t0    first   0  +1, +0.5                    decides                0.5 before its first move: dropped
    t1    second  1  +1, +0.5                    +0.5 -> its t0         decides
    t2    first   2  +1, +0.5                    decides                +0.5 -> its t1
    t3    second  3  +10 (last move), -10       -10 -> its t2, ended   decides, ended
    t4    first   0  +1, +0.5 (new game)         decides                dropped (no move yet)
    t5    second  1  +1, +0.5                    +0.5 -> its t4         decides
    t6    first   2  +1, +0.5                    decides, then waits    +0.5 -> its t5

    first: t0 r=1.5 V=1, t2 r=-9 V=3 terminated, t4 r=1.5 V=1, t6 r=1 V=3 but second's reply is not in
    this rollout: t6 leaves training and t4 bootstraps from its value 3.
      A(t4) = 1.5 + 0.9*3 - 1 = 3.2;  A(t2) = -9 - 3 = -12;  A(t0) = 1.5 + 0.9*3 - 1 + 0.45*(-12) = -2.2
    second: t1 r=1.5 V=5, t3 r=10 V=7 terminated, t5 r=1.5 V=5; second moves next (k=3, V=7).
      A(t5) = 1.5 + 0.9*7 - 5 = 2.8;  A(t3) = 10 - 7 = 3;  A(t1) = 1.5 + 0.9*7 - 5 + 0.45*3 = 4.15
    """
    cfg = _cfg("algo.gamma=0.9", "algo.gae_lambda=0.5")
    collector = build_collector(cfg, policy_specs(cfg), 0, "cpu", None)
    steps = collector.collect({"shared": ValuePolicy()}, 0)
    assert steps == 7
    s = collector.storages["shared"]
    mask = s["mask"]
    assert mask[:, 0].tolist() == [True, False, True, False, True, False, False]
    assert mask[:, 1].tolist() == [False, True, False, True, False, True, False]
    first, second = [0, 2, 4], [1, 3, 5]
    assert s["rewards"][first, 0].tolist() == [1.5, -9.0, 1.5]
    assert s["rewards"][second, 1].tolist() == [1.5, 10.0, 1.5]
    assert s["terminated"][first, 0].tolist() == [False, True, False]
    assert s["terminated"][second, 1].tolist() == [False, True, False]
    assert s["values"][first, 0].tolist() == [1.0, 3.0, 1.0]
    torch.testing.assert_close(s["advantages"][first, 0], torch.tensor([-2.2, -12.0, 3.2]))
    torch.testing.assert_close(s["advantages"][second, 1], torch.tensor([4.15, 3.0, 2.8]))
    torch.testing.assert_close(s["returns"][first, 0], torch.tensor([-1.2, -9.0, 4.2]))
    # every stored action was legal under the stored mask, and each game ended for both players at once
    legal = s["action_mask"].gather(2, s["actions"].unsqueeze(-1)).squeeze(-1)
    assert legal[mask].all()
    assert [ep[1:] for ep in collector.episodes.window] == [(-7.5, 2), (12.0, 2)]


def test_rewards_route_to_the_waiting_player_in_tictactoe() -> None:
    """Scripted tictactoe: player_1 takes the top row; player_2's -1 arrives during player_1's move."""
    cfg, _ = compose([*TICTACTOE, "env.num_envs=1"])
    specs = policy_specs(cfg)
    assert specs["shared"].action_mask == 9
    envs = TurnBasedVectorEnv(
        [lambda: make_parallel_env(cfg.env)], {"shared": ["player_1", "player_2"]}, True
    )
    envs.reset(seed=[0])
    rows = {"player_1": 0, "player_2": 1}
    for cell, mover in [(0, "player_1"), (1, "player_2"), (3, "player_1"), (4, "player_2"), (6, "player_1")]:
        assert envs.alive["shared"].tolist() == [mover == "player_1", mover == "player_2"]
        actions = np.zeros(2, dtype=np.int64)
        actions[rows[mover]] = cell
        _, rew, term, _, info = envs.step([actions])[0]
    assert rew.tolist() == [1.0, -1.0] and term.all() and info["_episode"].all()
    assert info["acted"].tolist() == [True, False]
    assert info["episode"]["l"].tolist() == [3, 2]  # each player's own moves


def test_only_legal_moves_and_masks_off_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """turn_v0 raises on an illegal move: a run with masks completes; with algo.action_mask=off the policy
    (seeing the mask as an input only) soon plays one and the run fails."""
    base = [
        *TURN,
        "env.num_envs=4",
        "algo.rollout_steps=16",
        "algo.minibatch_size=32",
        "algo.total_steps=1024",
    ]
    summary = ppo_fabric.run([*base, "logger=none", f"hydra.run.dir={tmp_path / 'on'}"])
    assert summary["total_env_steps"] == 1024
    with pytest.raises(EnvFault, match="env.step raised ValueError: illegal move"):
        ppo_fabric.run([*base, "logger=none", "algo.action_mask=off", f"hydra.run.dir={tmp_path / 'off'}"])


def test_an_opening_too_long_for_the_game_is_one_line_not_a_hang() -> None:
    """No tictactoe game outlasts 9 moves, so openings of up to 10**6 random moves are all but always
    discarded and drawn again: after `OPENING_TRIES` in a row the env refuses the length (it redrew for
    ever)."""
    cfg, _ = compose([*TICTACTOE, "env.num_envs=1"])
    envs = TurnBasedVectorEnv(
        [partial(make_parallel_env, cfg.env)], {"shared": ["player_1", "player_2"]}, True, opening_moves=10**6
    )
    with pytest.raises(EnvError, match=r"selfplay.opening_moves=1000000: 1000 random openings in a row"):
        envs.reset(seed=[0])


def _marks(env: Any) -> int:
    """Pieces on a tictactoe board: both players' planes of the observation."""
    return int(env.observe(env.agent_selection)["observation"].sum())


def test_random_openings_belong_to_nobody() -> None:
    """`opening_moves=3`: each game starts after 0..3 random legal moves (all four counts occur over 40
    games), seeded by `reset`, replayed by a checkpoint; the seats' own moves are their lengths, and the
    opening is no seat's move."""
    cfg, _ = compose([*TICTACTOE, "env.num_envs=1"])
    factories = [partial(make_parallel_env, cfg.env)] * 40
    envs = TurnBasedVectorEnv(factories, {"shared": ["player_1", "player_2"]}, True, opening_moves=3)
    envs.reset(seed=list(range(40)))
    openings = [len(moves) for moves in envs._moves]
    assert set(openings) == {0, 1, 2, 3}
    assert [_marks(env) for env in envs.envs] == openings
    # after an odd opening the second seat moves first
    first_mover = [int(envs.alive["shared"][2 * e + 1]) for e in range(40)]
    assert first_mover == [n % 2 for n in openings]
    again = TurnBasedVectorEnv(factories, {"shared": ["player_1", "player_2"]}, True, opening_moves=3)
    again.reset(seed=list(range(40)))
    assert again._moves == envs._moves  # the same seeds, the same openings
    # play every game to its end with the first legal move: its seats' lengths are the steps it took, the
    # opening's moves are nobody's, and the board held opening + steps pieces (a win needs >= 5)
    lengths = np.zeros(80, dtype=np.int64)
    steps = np.zeros(40, dtype=np.int64)
    ended = np.zeros(80, dtype=bool)
    while not ended.all():
        actions = envs.action_masks["shared"].argmax(1)
        info = envs.step([actions])[0][4]
        steps += ~ended[::2]
        done = info["_episode"] & ~ended
        lengths[done] = info["episode"]["l"][done]
        ended |= info["_episode"]
    assert (lengths[::2] + lengths[1::2] == steps).all()
    assert all(5 <= steps[e] + openings[e] <= 9 for e in range(40))
    restored = pickle.loads(pickle.dumps(envs))  # a checkpoint replays the new games' openings
    for env, copy in zip(envs.envs, restored.envs, strict=True):
        assert _marks(copy) == _marks(env) and copy.agent_selection == env.agent_selection
    assert restored._rng.integers(1 << 30) == envs._rng.integers(1 << 30)


@pytest.mark.parametrize(("enabled", "expected"), [("true", 2), ("false", 0)])
def test_openings_are_a_selfplay_setting(enabled: str, expected: int) -> None:
    cfg, _ = compose(
        [*TICTACTOE, "env.num_envs=2", f"selfplay.enabled={enabled}", "selfplay.opening_moves=2"]
    )
    collector = build_collector(cfg, policy_specs(cfg), 0, "cpu", None)
    assert collector.envs.opening_moves == expected


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["coupled", "decoupled"])
def test_tictactoe_selfplay_two_processes(tmp_path: Path, strategy: str) -> None:
    """Self-play over two processes: two coupled ranks (each its own pool, results summed for the log), or
    a player (keeps the pool) and a trainer (learns the learner's rows); all end with the same parameters."""
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "ppo_fabric", *TICTACTOE, f"strategy={strategy}", "fabric.devices=2",
        "algo.players=1", "env.num_envs=4", "algo.rollout_steps=32", "algo.minibatch_size=64",
        "algo.total_steps=1024", "logger=none", "selfplay.enabled=true", "selfplay.snapshot_every=2",
        f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    env = job_env(supervisor=False)  # the job's self-play, not the supervisor
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["strategy"] == strategy and summary["ranks_in_sync"] is True
    assert summary["total_env_steps"] == 1024


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        (["model=lstm"], "feed-forward policies only"),
        (["selfplay.enabled=true", "selfplay.pool_size=0"], "selfplay.pool_size=0"),
        (["selfplay.enabled=true", "algo.action_mask=off"], "selfplay needs the game's action_mask"),
        (["selfplay.enabled=true", "selfplay.opening_moves=-1"], "opening_moves=-1 must be a whole"),
        (["selfplay.enabled=true", "selfplay.sampling=best"], "selfplay.sampling=best"),
        (["selfplay.enabled=true", "selfplay.latest_prob=2"], "selfplay.latest_prob=2"),
        (["selfplay.enabled=true", "selfplay.random_prob=-0.1"], "selfplay.random_prob=-0.1"),
        (["selfplay.enabled=true", "selfplay.scripted_prob=1.5"], "selfplay.scripted_prob=1.5"),
        (["selfplay.enabled=true", "selfplay.pfsp_power=inf"], "selfplay.pfsp_power=inf must be a finite"),
        (["selfplay.enabled=true", "selfplay.pfsp_power=nan"], "selfplay.pfsp_power=nan must be a finite"),
        (["selfplay.enabled=true", "selfplay.random_prob=0.6", "selfplay.scripted_prob=0.6"], "at most 1"),
        (["selfplay.enabled=true", "selfplay.scripted_prob=0.2"], "plays connect_four_v3 only"),
        (
            ["selfplay.enabled=true", "selfplay.scripted_prob=0.2", "selfplay.scripted=search:9"],
            "from 1 to 6",
        ),
        (["selfplay.enabled=true", "selfplay.scripted_prob=0.2", "selfplay.scripted=minimax"], "minimax"),
        (
            [
                "selfplay.enabled=true",
                "selfplay.scripted_prob=0.2",
                "selfplay.scripted=[win_or_block,search:0]",
            ],
            "depth is a whole number",
        ),
        (["selfplay.enabled=true", "selfplay.scripted_prob=0.2", "selfplay.scripted=[]"], "a list of them"),
    ],
)
def test_turn_based_config_errors(
    capsys: pytest.CaptureFixture[str], override: list[str], fragment: str
) -> None:
    assert_cli_failure(capsys, cli.main, [*TICTACTOE, *override], fragment)


def test_scripted_players_refuse_a_board_they_cannot_read(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scripted players read Connect Four's [6, 7, 2] board: an env whose id names a game they know but
    whose board is another (here tictactoe, let through by its id) is refused before the run, not at its
    first scripted move inside the rollout."""
    from ppo_fabric.games import scripted

    monkeypatch.setattr(scripted, "GAMES", ("tictactoe",))
    assert_cli_failure(
        capsys, cli.main, [*TICTACTOE, "selfplay.enabled=true", "selfplay.scripted_prob=0.2"],
        "plays Connect Four's [6, 7, 2] board and 7 moves; env.id=pettingzoo.classic.tictactoe_v3 has [3, 3, 2] and 9",
    )  # fmt: skip


def test_selfplay_needs_a_turn_based_game(capsys: pytest.CaptureFixture[str]) -> None:
    assert_cli_failure(capsys, cli.main, ["selfplay.enabled=true"], "two-player turn-based")


@pytest.mark.parametrize(
    ("part", "line"),
    [
        ("observation", r"^env 0, agent 'first': an observation of shape \(3,\) where its observation_space has \(2,\)$"),
        ("action_mask", r"^env 0, agent 'first': an action mask of shape \(4,\) where its action_space has \(3,\)$"),
    ],
    ids=["observation", "action_mask"],
)  # fmt: skip
def test_a_turn_based_observation_of_another_shape_names_the_agent(part: str, line: str) -> None:
    """NumPy's "could not broadcast input array from shape (3,) into shape (2,)" named neither."""
    cfg, _ = compose(["env=pettingzoo", "env.id=tests.envs.factory_envs:misshapen_turns", "env.num_envs=1",
                      f"+env.kwargs.part={part}"])  # fmt: skip
    with pytest.raises(ValueError, match=line):
        make_multiagent_vector_env(cfg.env, cfg.multiagent, 0, 0, masked=True)
