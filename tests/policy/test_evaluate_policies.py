"""`python -m ppo_fabric.evaluate` on every kind of policy a run trains: multi-agent checkpoints (each
policy's returns), recurrent ones (the state carried through the episode, checked against a replay by
hand), and two-player games against `opponent=random|snapshot:PATH|pool` (win / draw / loss rates).

The games tests use a tictactoe checkpoint written by hand whose policy prefers lower-numbered moves
whatever it sees, so it plays exactly as `games.first_legal_player`: its results are known.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import ppo_fabric
from ppo_fabric.config.values import compose
from ppo_fabric.envs.multiagent import make_parallel_env, policy_mapping
from ppo_fabric.games.play import LOSS, WIN, RandomPlayer, aec_env_factory, first_legal_player, play_games
from ppo_fabric.models.agent import ActorCritic, single_obs_batch
from ppo_fabric.policy import evaluate
from ppo_fabric.runs import checkpoint as ckpt
from tests.conftest import assert_cli_failure

TEAMS_LSTM = [
    "env=pettingzoo",
    "env.id=ppo_fabric.envs.toy_multiagent:teams_v0",
    "multiagent.policies={adversary:{},agent:{model:{actor_hidden:[32]}}}",
    "multiagent.policy_mapping={adversary_*:adversary,agent_*:agent}",
    "model=lstm",
    "model.lstm.hidden_size=8",
    "model.lstm.seq_len=4",
    "env.num_envs=2",
    "algo.rollout_steps=32",
    "algo.minibatch_size=32",
    "algo.total_steps=128",
    "algo.update_epochs=1",
    "logger=none",
]


@pytest.fixture(scope="module")
def teams_lstm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two recurrent policies (one with its own model override) on the zero-sum teams_v0."""
    run_dir = tmp_path_factory.mktemp("teams_lstm")
    ppo_fabric.run([*TEAMS_LSTM, f"hydra.run.dir={run_dir}"])
    return run_dir / "checkpoints" / "last.ckpt"


def _replay(path: Path, episodes: int, seed: int) -> dict[str, list[float]]:
    """Each agent's returns, stepped here by hand: the policies rebuilt from the checkpoint, every agent
    carrying its own LSTM state from zeros at each episode start."""
    state = ckpt.load(path, key="checkpoint", env_state="fresh")
    cfg = state["config"]
    obs_spaces, action_spaces = ckpt.saved_spaces(state)
    nets = {}
    for name, weights in state["agent"].items():
        model = OmegaConf.merge(cfg["model"], cfg["multiagent"]["policies"][name].get("model") or {})
        nets[name] = ActorCritic(obs_spaces[name], action_spaces[name], model)
        nets[name].load_state_dict(weights)
    env = make_parallel_env(OmegaConf.create(cfg["env"]))
    groups = policy_mapping(env.possible_agents, OmegaConf.create(cfg["multiagent"]))
    policy_of = {a: p for p, agents in groups.items() for a in agents}
    out: dict[str, list[float]] = {p: [] for p in groups}
    for episode in range(episodes):
        obs, _ = env.reset(seed=seed + episode)
        hidden = {a: torch.zeros(1, *nets[policy_of[a]].state_shape) for a in env.agents}
        totals = dict.fromkeys(env.agents, 0.0)
        while env.agents:
            actions = {}
            for a in env.agents:
                with torch.no_grad():
                    act, _, _, hidden[a] = nets[policy_of[a]].act_with_state(
                        single_obs_batch(obs[a]), hidden[a], True
                    )
                actions[a] = int(act[0])
            obs, rewards, _, _, _ = env.step(actions)
            for a, r in rewards.items():
                totals[a] += r
        for a, total in totals.items():
            out[policy_of[a]].append(total)
    return out


def test_multiagent_recurrent_checkpoint_reports_each_policy(teams_lstm: Path, tmp_path: Path) -> None:
    result = evaluate.main([f"checkpoint={teams_lstm}", "episodes=3", "seed=4", f"out={tmp_path}"])
    assert result is not None
    policies = result["policies"]
    assert set(policies) == {"adversary", "agent"}
    assert policies["agent"]["agents"] == ["agent_0", "agent_1"]
    expected = _replay(teams_lstm, 3, 4)
    for name in ("adversary", "agent"):
        assert len(policies[name]["returns"]) == 3 * 2  # two agents, three episodes
        assert policies[name]["returns"] == pytest.approx(expected[name])
        assert policies[name]["mean_return"] == pytest.approx(np.mean(expected[name]))
    # zero-sum: the teams' totals cancel in every episode
    assert sum(policies["agent"]["returns"]) == pytest.approx(-sum(policies["adversary"]["returns"]))
    assert result["lengths"] == [8, 8, 8]
    assert json.loads((tmp_path / "eval.json").read_text())["policies"]["agent"]["returns"] == pytest.approx(
        expected["agent"]
    )


def test_recurrent_state_is_carried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A single-agent LSTM policy: every step after an episode's first gets the state the previous step
    returned, and the returns equal a replay by hand that carries it."""
    run_dir = tmp_path / "run"
    summary = ppo_fabric.run(
        [
            "model=lstm",
            "env.mask_velocity=true",
            "algo.total_steps=256",
            "algo.rollout_steps=64",
            "algo.minibatch_size=128",
            "env.num_envs=4",
            "logger=none",
            f"hydra.run.dir={run_dir}",
        ]  # fmt: skip
    )
    state, agent = ckpt.load_policy(summary["checkpoint"])
    assert agent.recurrent
    seen: list[tuple[torch.Tensor | None, torch.Tensor]] = []
    real = ActorCritic.act_with_state

    def spy(self: ActorCritic, obs: Any, hidden: Any, *args: Any) -> Any:
        out = real(self, obs, hidden, *args)
        seen.append((hidden, out[3]))
        return out

    monkeypatch.setattr(ActorCritic, "act_with_state", spy)
    result = evaluate.evaluate(summary["checkpoint"], episodes=2, out=tmp_path / "eval")
    monkeypatch.undo()
    starts = {0, result["lengths"][0]}
    assert len(seen) == sum(result["lengths"])
    for i, (given, _) in enumerate(seen):
        if i in starts:
            assert given is None or not given.any()
        else:
            assert torch.equal(given, seen[i - 1][1])  # the state the previous step returned
    from ppo_fabric.envs.make import make_env

    env = make_env(OmegaConf.create(state["config"]["env"]))
    returns = []
    for episode in range(2):
        obs, _ = env.reset(seed=episode)
        hidden, total, done = None, 0.0, False
        while not done:
            with torch.no_grad():
                action, _, _, hidden = agent.act_with_state(single_obs_batch(obs), hidden, True)
            obs, reward, terminated, truncated, _ = env.step(int(action[0]))
            total, done = total + float(reward), terminated or truncated
        returns.append(total)
    env.close()
    assert result["returns"] == returns


# ------------------------------------------------------------------------------------------------ games
def _tictactoe_checkpoint(path: Path, with_pool: bool = True) -> Path:
    """A self-play style checkpoint of one shared policy on tictactoe whose head ignores its features and
    ranks moves 0 > 1 > ... > 8: with the mask it plays the first legal move, like `first_legal_player`.
    Written with the update counter's old names (`iteration`, a snapshot's `version`): what checkpoints of
    earlier releases hold, which `runs.checkpoint.renamed_counter` migrates on load."""
    cfg, _ = compose(["env=pettingzoo", "env.id=pettingzoo.classic.tictactoe_v3"])
    obs_space = gym.spaces.Box(0, 1, (3, 3, 2), np.int8)
    action_space = gym.spaces.Discrete(9)
    net = ActorCritic(obs_space, action_space, cfg.model)
    weights = net.state_dict()
    weights["head.linear.weight"].zero_()
    weights["head.linear.bias"].copy_(torch.arange(9, 0, -1, dtype=torch.float32))
    state: dict[str, Any] = {
        "config": OmegaConf.to_container(cfg, resolve=True),
        "observation_space": {"shared": obs_space},
        "action_space": {"shared": action_space},
        "multiagent": True,
        "agent": {"shared": weights},
        "iteration": 1,
        "env_step": 100,
        "ranks": [{}],
    }
    if with_pool:
        snaps = [
            {"id": i, "version": i, "weights": weights, "wins": 0, "draws": 0, "losses": 0} for i in (3, 5)
        ]
        state["ranks"][0]["selfplay"] = {"pool": {"next_id": 6, "snapshots": snaps}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(ckpt.encode(state))
    return path


def test_loading_a_multiagent_checkpoint_builds_no_env_it_names(tmp_path: Path) -> None:
    """Checkpoints record each policy's mask width; one that does not (an older one) has it read from a game
    of a known env package only: a checkpoint naming `os:system` with a command in `env.kwargs` is refused
    in one line by every loader, and the command never runs."""
    path = _tictactoe_checkpoint(tmp_path / "game.ckpt", with_pool=False)
    assert ppo_fabric.load_policy(path).mask_width == 9  # an older checkpoint of a known game: read from it
    with pytest.MonkeyPatch.context() as patch:  # the game's package missing: unknown, not "no masks"
        patch.setitem(sys.modules, "pettingzoo.classic.tictactoe_v3", None)
        with pytest.raises(ValueError, match="does not record its action-mask width.*cannot be built here"):
            ppo_fabric.load_policy(path)
    marker = tmp_path / "MARKER"
    state = ckpt.load(path, env_state="fresh")
    state["config"]["env"] |= {"id": "os:system", "kwargs": {"command": f"touch {marker}"}}
    crafted = tmp_path / "crafted.ckpt"
    crafted.write_bytes(ckpt.encode(state))
    with pytest.raises(ValueError, match=r"would import and run module 'os'"):
        ppo_fabric.load_policy(crafted)
    with pytest.raises(evaluate.EvalError, match=r"would import and run module 'os'"):
        evaluate.evaluate(crafted, episodes=1, out=tmp_path)
    assert not marker.exists()
    # ppo-fabric's own callables are no env package: one that builds the env its arguments name would run
    # the first crafted checkpoint's command
    state["config"]["env"] |= {
        "id": "ppo_fabric.policy.evaluate:main",
        "kwargs": {"argv": [f"checkpoint={crafted}", "trust_env=true", f"out={tmp_path}"]},
    }
    chained = tmp_path / "chained.ckpt"
    chained.write_bytes(ckpt.encode(state))
    with pytest.raises(ValueError, match=r"would import and run module 'ppo_fabric.policy.evaluate'"):
        ppo_fabric.load_policy(chained)
    assert not marker.exists()
    state["action_masks"] = {"shared": 9}  # what a checkpoint records now: nothing to build
    crafted.write_bytes(ckpt.encode(state))
    assert ppo_fabric.load_policy(crafted).mask_width == 9
    assert not marker.exists()


def test_games_against_random_match_the_scripted_player(tmp_path: Path) -> None:
    path = _tictactoe_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    result = evaluate.main([f"checkpoint={path}", "opponent=random", "games=30", "seed=2"])
    assert result is not None and result["policy"] == "shared" and result["games"] == 30
    assert result["win_rate"] + result["draw_rate"] + result["loss_rate"] == pytest.approx(1.0)
    expected = play_games(
        aec_env_factory("pettingzoo.classic.tictactoe_v3"), first_legal_player, RandomPlayer(3), 30, 2
    )
    assert result["win_rate"] == pytest.approx(expected.rate(WIN))
    assert result["loss_rate"] == pytest.approx(expected.rate(LOSS))
    assert (tmp_path / "eval.json").is_file()  # the run directory of checkpoints/last.ckpt


def test_games_against_a_snapshot_and_the_pool(tmp_path: Path) -> None:
    """The same greedy player on both sides: the opener always wins on move 7 (see test_games)."""
    path = _tictactoe_checkpoint(tmp_path / "a.ckpt")
    other = _tictactoe_checkpoint(tmp_path / "b.ckpt", with_pool=False)
    result = evaluate.evaluate(path, opponent=f"snapshot:{other}", games=4, out=tmp_path)
    assert result["win_rate"] == 0.5 and result["loss_rate"] == 0.5
    assert result["win_rate_moving_first"] == 1.0 and result["win_rate_moving_second"] == 0.0
    pool = evaluate.evaluate(path, opponent="pool", games=8, out=tmp_path)
    assert set(pool["opponents"]) == {"pool:3", "pool:5"} and pool["games"] == 8
    assert all(row["win_rate"] == 0.5 for row in pool["opponents"].values())
    odd = evaluate.evaluate(path, opponent="pool", games=7, out=tmp_path)
    assert odd["games"] == 4, (
        "an even share of each snapshot, as many games from each seat, never more than N"
    )
    with pytest.raises(
        evaluate.EvalError, match=r"games=3 is fewer than 2 per opponent .* use games=4 or more"
    ):
        evaluate.evaluate(path, opponent="pool", games=3, out=tmp_path)


def test_opponents_that_do_not_fit_the_game(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A snapshot of another env's run and a pool snapshot of another model: one line each, exit 2 (they
    were a matrix-shape traceback and a ValueError traceback with an empty cause)."""
    path = _tictactoe_checkpoint(tmp_path / "last.ckpt")
    cfg, _ = compose(["env.id=CartPole-v1"])
    spaces = gym.spaces.Box(-1, 1, (4,), np.float32), gym.spaces.Discrete(2)
    cartpole = tmp_path / "cartpole.ckpt"
    cartpole.write_bytes(
        ckpt.encode(
            {
                "config": OmegaConf.to_container(cfg, resolve=True),
                "observation_space": spaces[0],
                "action_space": spaces[1],
                "agent": ActorCritic(*spaces, cfg.model).state_dict(),
                "update": 1,
                "env_step": 8,
                "ranks": [{}],
            }
        )  # fmt: skip
    )
    argv = [f"checkpoint={path}", f"opponent=snapshot:{cartpole}"]
    assert_cli_failure(capsys, evaluate.main, argv, "its policy 'main' plays observations Box")
    # the same game trained without masks records the whole Dict observation: the same board, it fits
    from ppo_fabric.envs.spaces import space_to_data
    from ppo_fabric.policy.game_eval import _spaces

    board = gym.spaces.Box(0, 1, (3, 3, 2), np.int8)
    whole = gym.spaces.Dict({"observation": board, "action_mask": gym.spaces.Box(0, 1, (9,), np.int8)})
    unmasked = {"multiagent": True, "action_space": {"shared": space_to_data(gym.spaces.Discrete(9))},
                "observation_space": {"shared": space_to_data(whole)}}  # fmt: skip
    assert _spaces(unmasked, "shared") == _spaces(ckpt.load(path, env_state="fresh"), "shared")
    state = ckpt.load(path, env_state="fresh")
    for snap in state["ranks"][0]["selfplay"]["pool"]["snapshots"]:
        snap["weights"] = ActorCritic(*spaces, cfg.model).state_dict()
    path.write_bytes(ckpt.encode(state))
    argv = [f"checkpoint={path}", "opponent=pool"]
    why = "opponent=pool: snapshot 3: policy 'shared': the weights do not fit the model its config describes"
    assert_cli_failure(capsys, evaluate.main, argv, f"{why} (size mismatch for ")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        pytest.param(["opponent=nobody"], "opponent=nobody is unknown", id="unknown-opponent"),
        pytest.param(["opponent=win_or_block"], "plays connect_four_v3 only", id="scripted-on-tictactoe"),
        pytest.param(["opponent=search:9"], "depth is a whole number from 1 to 6", id="scripted-depth"),
        pytest.param(["opponent=pool"], "holds no self-play pool", id="no-pool"),
        pytest.param(["opponent=random", "policy=red"], "policy=red is not in", id="unknown-policy"),
        pytest.param(["opponent=random", "games=0"], "games=0 must be > 0", id="no-games"),
        pytest.param(["opponent=snapshot:{missing}"], "no such checkpoint", id="missing-snapshot"),
        pytest.param([], "is a turn-based game: play it with opponent=", id="game-without-opponent"),
        # the count of the other kind was ignored: 100 games played after episodes=6 was asked for
        pytest.param(
            ["opponent=random", "episodes=6"],
            "episodes=6 counts episodes; opponent= evaluates a two-player game, whose games against an opponent "
            "are counted by games= (default 100)",
            id="episodes-of-a-game",
        ),
        pytest.param(
            ["policy=p", "episodes=6"],
            "episodes=6 counts episodes; policy= evaluates a two-player game",
            id="episodes-with-policy",
        ),  # fmt: skip
    ],
)
def test_bad_game_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], fragment: str
) -> None:
    path = _tictactoe_checkpoint(tmp_path / "last.ckpt", with_pool=False)
    argv = [f"checkpoint={path}", *(a.format(missing=tmp_path / "nope.ckpt") for a in args)]
    assert_cli_failure(capsys, evaluate.main, argv, fragment)


def test_games_need_a_game(tiny_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [f"checkpoint={tiny_run / 'checkpoints' / 'last.ckpt'}", "opponent=random"]
    assert_cli_failure(capsys, evaluate.main, argv, "two-player PettingZoo AEC games")


def test_games_count_only_games(tiny_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`games=7` on a CartPole checkpoint was ignored: 10 episodes played, exit 0."""
    argv = [f"checkpoint={tiny_run / 'checkpoints' / 'last.ckpt'}", "games=7"]
    assert_cli_failure(capsys, evaluate.main, argv, "games=7 counts games against an opponent")
