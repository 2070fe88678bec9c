"""Self-play: opponent sampling (hand-computed PFSP weights), the pool's cap and plain-data state, which rows
train when seats alternate, win/draw/loss counting, tictactoe runs, and the pool across a resume."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import ppo_fabric
from ppo_fabric.collect.rollout import build_collector
from ppo_fabric.config.values import compose
from ppo_fabric.games.play import PolicyPlayer, RandomPlayer, aec_env_factory, play_games
from ppo_fabric.games.scripted import SearchPlayer, WinOrBlockPlayer
from ppo_fabric.games.selfplay import (
    RANDOM,
    SCRIPTED,
    OpponentPool,
    SelfPlay,
    learner_scores,
    pfsp_weights,
    sampling_probabilities,
)
from ppo_fabric.learn.learners import policy_specs
from ppo_fabric.models.agent import ActorCritic
from ppo_fabric.runs import checkpoint as ckpt
from ppo_fabric.runs.metrics_file import read_rows

CONNECT_FOUR = [
    "env=pettingzoo", "env.id=pettingzoo.classic.connect_four_v3", "env.num_envs=4", "algo.rollout_steps=32",
    "algo.minibatch_size=64", "algo.update_epochs=2", "selfplay.enabled=true", "selfplay.snapshot_every=2",
    "selfplay.pool_size=3", "seed=1",
]  # fmt: skip
TICTACTOE = [
    "env=pettingzoo", "env.id=pettingzoo.classic.tictactoe_v3", "env.num_envs=4", "algo.rollout_steps=32",
    "algo.minibatch_size=64", "algo.update_epochs=2", "selfplay.enabled=true", "selfplay.snapshot_every=2",
    "selfplay.pool_size=3", "seed=1",
]  # fmt: skip


def _selfplay(overrides: list[str], collect: bool = False) -> SelfPlay:
    """The SelfPlay of a fresh collector with a fresh learner: after one rollout (`collect`) or just started."""
    cfg, _ = compose(overrides)
    specs = policy_specs(cfg)
    spec = specs["shared"]
    collector = build_collector(cfg, specs, 0, "cpu", None)
    learner = ActorCritic(spec.obs_space, spec.action_space, spec.model)
    if collect:
        collector.collect({"shared": learner}, 0)
    else:
        collector.selfplay.start(learner, 0)
    return collector.selfplay


# ------------------------------------------------------------------------------------------- sampling
def test_learner_scores_are_smoothed_win_rates() -> None:
    # (wins + draws/2 + 1) / (games + 2): 3 wins, 2 draws, 1 loss -> 5/8; no games -> 1/2
    scores = learner_scores(np.array([3.0, 0.0]), np.array([2.0, 0.0]), np.array([1.0, 0.0]))
    assert scores.tolist() == [0.625, 0.5]


def test_pfsp_weights_favour_opponents_the_learner_loses_to() -> None:
    # (1 - score)^2 = 0.5625, 0.25, 0.0625; sum 0.875
    weights = pfsp_weights(np.array([0.25, 0.5, 0.75]), 2.0)
    np.testing.assert_allclose(weights, [0.5625 / 0.875, 0.25 / 0.875, 0.0625 / 0.875])
    np.testing.assert_allclose(pfsp_weights(np.array([0.25, 0.75]), 0.0), [0.5, 0.5])  # power 0: uniform
    # a large power: every (1 - score)^power underflows to 0 in floats; the weights still sum to 1
    huge = pfsp_weights(np.array([0.5, 0.5, 0.75]), 1100.0)
    np.testing.assert_allclose(huge, [0.5, 0.5, 0.0], atol=1e-12)


def test_uniform_and_latest_sampling() -> None:
    scores = np.full(4, 0.5)
    np.testing.assert_allclose(sampling_probabilities("uniform", scores), [0.25] * 4)
    np.testing.assert_allclose(
        sampling_probabilities("latest", scores, latest_prob=0.7), [0.1, 0.1, 0.1, 0.7]
    )
    np.testing.assert_allclose(sampling_probabilities("latest", scores[:1], latest_prob=0.7), [1.0])


def test_pool_samples_by_pfsp_from_recorded_results() -> None:
    pool = OpponentPool(size=2, sampling="pfsp", power=2.0)
    for version in range(3):  # the oldest leaves: ids 1 and 2 stay
        pool.add({"w": torch.full((1,), float(version))}, version)
    assert [s.id for s in pool.snapshots] == [1, 2]
    for _ in range(6):
        pool.record(1, 1)  # the learner beats snapshot 1 every time: score 7/8
    pool.record(2, -1)  # and lost to snapshot 2 once: score 1/3
    pool.record(0, 1)  # a snapshot that left the pool: ignored
    w1, w2 = (1 - 7 / 8) ** 2, (1 - 1 / 3) ** 2
    np.testing.assert_allclose(pool.probabilities(), [w1 / (w1 + w2), w2 / (w1 + w2)])
    np.random.seed(0)
    draws = [pool.sample() for _ in range(2000)]
    assert abs(draws.count(2) / 2000 - w2 / (w1 + w2)) < 0.03


def test_pool_state_is_plain_data(tmp_path: Path) -> None:
    pool = OpponentPool(size=3)
    pool.add({"a.weight": torch.ones(2, 2)}, 4)
    pool.record(0, 0)
    torch.save({"pool": pool.state()}, tmp_path / "pool.pt")
    back = OpponentPool(size=3)
    back.load_state(torch.load(tmp_path / "pool.pt", weights_only=True)["pool"])
    assert back.next_id == 1 and back.snapshots[0].draws == 1 and back.snapshots[0].update == 4
    assert torch.equal(back.snapshots[0].weights["a.weight"], torch.ones(2, 2))


# ------------------------------------------------------------------------------------------ rollouts
def test_only_the_learners_rows_train_and_seats_alternate() -> None:
    """turn_v0 (4 moves, the last mover - `second` - wins), 2 copies, 7 steps. The learner opens as seat
    0 in copy 0 and seat 1 in copy 1, and swaps seats when a game ends (after t3).

    copy 0: game 1 learner=first (t0, t2; loses), game 2 learner=second (t5; moves next, so it trains)
    copy 1: game 1 learner=second (t1, t3; wins), game 2 learner=first (t4; t6 awaits the reply: dropped)
    """
    cfg, _ = compose(
        [
            "env=pettingzoo",
            "env.id=ppo_fabric.envs.toy_multiagent:turn_v0",
            "env.num_envs=2",
            "algo.rollout_steps=7",
            "algo.minibatch_size=14",
            "selfplay.enabled=true",
        ]  # fmt: skip
    )
    specs = policy_specs(cfg)
    spec = specs["shared"]
    collector = build_collector(cfg, specs, 0, "cpu", None)
    learner = ActorCritic(spec.obs_space, spec.action_space, spec.model)
    collector.collect({"shared": learner}, 0)
    mask = collector.storages["shared"]["mask"].T.tolist()  # [row][t], row = copy * 2 + seat
    f, t = False, True
    assert mask == [
        [t, f, t, f, f, f, f],
        [f, f, f, f, f, t, f],
        [f, f, f, f, t, f, f],
        [f, t, f, t, f, f, f],
    ]
    sp = collector.selfplay
    assert sp.seat.tolist() == [1, 0]
    assert sp.metrics() == {
        "selfplay/games": 2.0, "selfplay/pool_size": 1.0, "selfplay/win_rate": 0.5, "selfplay/draw_rate": 0.0,
        "selfplay/loss_rate": 0.5,
    }  # fmt: skip
    snap = sp.pool.snapshots[0]
    assert (snap.wins, snap.draws, snap.losses) == (1, 0, 1)


def test_random_opponent_plays_legal_moves_and_is_reported_apart() -> None:
    """selfplay.random_prob=1: every game is against the random legal-move player. Its moves are legal
    (tictactoe rejects an illegal one), uniform over the legal ones, no snapshot records a result, and the
    learner's results come out as selfplay/random_*, not as pool games."""
    sp = _selfplay([*TICTACTOE, "selfplay.random_prob=1.0"], collect=True)
    assert (sp.opponent == RANDOM).all()
    snap = sp.pool.snapshots[0]
    assert (snap.wins, snap.draws, snap.losses) == (0, 0, 0)
    metrics = sp.metrics()
    assert metrics["selfplay/games"] == 0 and metrics["selfplay/random_games"] > 0
    rates = [metrics[f"selfplay/random_{k}_rate"] for k in ("win", "draw", "loss")]
    assert sum(rates) == pytest.approx(1.0)
    # uniform over the legal moves: 3 legal of 5, 30000 draws, each near 1/3
    mask = torch.tensor([[True, False, True, False, True]]).expand(30000, 5)
    counts = torch.bincount(sp._random_moves(30000, mask), minlength=5) / 30000
    assert counts[[1, 3]].sum() == 0
    torch.testing.assert_close(counts[[0, 2, 4]], torch.full((3,), 1 / 3), atol=0.02, rtol=0)


def test_random_prob_mixes_the_random_player_into_the_draws() -> None:
    """random_prob=0.25: about a quarter of draws are the random player, the rest pool snapshots."""
    sp = _selfplay([*TICTACTOE, "selfplay.random_prob=0.25"])
    np.random.seed(0)
    draws = np.array([sp._draw() for _ in range(4000)])
    assert set(np.unique(draws).tolist()) == {RANDOM, sp.pool.snapshots[0].id}
    assert (draws == RANDOM).mean() == pytest.approx(0.25, abs=0.03)


def test_scripted_opponent_takes_its_win_and_blocks_and_is_reported_apart() -> None:
    """selfplay.scripted_prob=1 on Connect Four: every game is against win_or_block. On hand-built boards
    its move is the win (column 3 completes its vertical three) or else the block (column 5 stops the
    learner's row of three); its games end as selfplay/scripted_*, never as pool games."""
    sp = _selfplay(
        [*CONNECT_FOUR, "selfplay.scripted_prob=1.0", "selfplay.scripted=win_or_block"], collect=True
    )
    assert (sp.opponent == SCRIPTED).all()
    assert len(sp.scripted) == 1 and isinstance(sp.scripted[0], WinOrBlockPlayer)
    metrics = sp.metrics()
    assert metrics["selfplay/games"] == 0 and metrics["selfplay/scripted_games"] > 0
    assert sum(metrics[f"selfplay/scripted_{k}_rate"] for k in ("win", "draw", "loss")) == pytest.approx(1.0)
    # two copies, the learner in seat 0: rows 1 and 3 are the scripted player's, seen from its side
    sp.num_envs, sp.seat, sp.opponent = 2, np.zeros(2, dtype=np.int64), np.full(2, SCRIPTED)
    obs = torch.zeros(4, 6, 7, 2)
    obs[1, 3:6, 3, 0] = 1  # copy 0: three of its own in column 3 (rows 5, 4, 3 from the top)
    obs[1, 5, 0:3, 1] = 1  # and the learner's three on the bottom row, which it could also block
    obs[3, 5, 2:5, 1] = 1  # copy 1: only the learner's three in a row (columns 2-4): block at 1 or 5
    obs[3, 5, 1, 0] = 1  # column 1 taken by its own piece: the block is at column 5
    masks = torch.ones(4, 7, dtype=torch.bool)
    actions = sp.act(obs, masks, np.full(4, -1), np.array([False, True, False, True]))
    assert actions.tolist() == [-1, 3, -1, 5]


def test_scripted_opponent_mixes_into_the_draws_and_its_generator_resumes(tmp_path: Path) -> None:
    """random_prob=0.2, scripted_prob=0.3: about those shares of draws are the random and the scripted
    player, the rest the pool. The scripted player's generator travels in state(): a SelfPlay that loads it
    makes the same random choices next."""
    overrides = [*CONNECT_FOUR, "selfplay.random_prob=0.2", "selfplay.scripted_prob=0.3"]
    sp = _selfplay(overrides)
    np.random.seed(0)
    draws = np.array([sp._draw() for _ in range(4000)])
    assert (draws == RANDOM).mean() == pytest.approx(0.2, abs=0.03)
    assert (draws == SCRIPTED).mean() == pytest.approx(0.3, abs=0.03)
    assert (draws >= 0).mean() == pytest.approx(0.5, abs=0.03)
    torch.save(sp.state(), tmp_path / "selfplay.pt")  # as a checkpoint holds it: plain data only
    saved = torch.load(tmp_path / "selfplay.pt", weights_only=True)
    other = _selfplay(overrides)
    other.load_state(saved, exact=True)
    empty = np.zeros((6, 7, 2))
    player, restored = sp.scripted[0], other.scripted[0]
    assert [player(empty, None) for _ in range(20)] == [restored(empty, None) for _ in range(20)]


def test_a_league_of_scripted_players_shares_the_scripted_games(tmp_path: Path) -> None:
    """selfplay.scripted=[win_or_block, search:1] with scripted_prob=0.4: each player meets ~20% of the
    draws (ids SCRIPTED and SCRIPTED - 1), each acts for its own copies, their results count together, and
    every player's generator resumes."""
    overrides = [*CONNECT_FOUR, "selfplay.random_prob=0.2", "selfplay.scripted_prob=0.4",
                 "selfplay.scripted=[win_or_block,search:1]"]  # fmt: skip
    sp = _selfplay(overrides)
    assert [type(p) for p in sp.scripted] == [WinOrBlockPlayer, SearchPlayer]
    np.random.seed(0)
    draws = np.array([sp._draw() for _ in range(4000)])
    assert (draws == RANDOM).mean() == pytest.approx(0.2, abs=0.03)
    assert (draws == SCRIPTED).mean() == pytest.approx(0.2, abs=0.03)
    assert (draws == SCRIPTED - 1).mean() == pytest.approx(0.2, abs=0.03)
    assert (draws >= 0).mean() == pytest.approx(0.4, abs=0.03)
    # copy 0 plays win_or_block, copy 1 search:1; both opponents move on a board where the learner (seat 0)
    # has an open two on the bottom row (columns 2-3): win_or_block has nothing to win or block and plays
    # at random, search:1 takes a side of the two (1 or 4), where the open lines it counts are fewest
    sp.num_envs, sp.seat, sp.opponent = 2, np.zeros(2, dtype=np.int64), np.array([SCRIPTED, SCRIPTED - 1])
    obs = torch.zeros(4, 6, 7, 2)
    obs[1, 5, 2:4, 1] = obs[3, 5, 2:4, 1] = 1
    masks = torch.ones(4, 7, dtype=torch.bool)
    moves = {sp.act(obs, masks, np.full(4, -1), np.array([False, True, False, True]))[3] for _ in range(20)}
    assert moves <= {1, 4}
    sp.episodes_ended(np.array([True, True, True, True]), np.array([1.0, -1.0, -1.0, 1.0]))
    metrics = sp.metrics()
    assert metrics["selfplay/scripted_games"] == 2 and metrics["selfplay/scripted_win_rate"] == 0.5
    torch.save(sp.state(), tmp_path / "selfplay.pt")
    other = _selfplay(overrides)
    other.load_state(torch.load(tmp_path / "selfplay.pt", weights_only=True), exact=False)
    empty = np.zeros((6, 7, 2))
    for player, restored in zip(sp.scripted, other.scripted, strict=True):
        assert [player(empty, None) for _ in range(20)] == [restored(empty, None) for _ in range(20)]


@pytest.mark.parametrize("noise", [0.0, 0.5])
def test_opponent_noise_replaces_that_share_of_a_snapshots_moves(noise: float) -> None:
    """A snapshot that always plays move 0 (its head biased there): with opponent_noise=0 every opponent
    move is 0; with 0.5 about half are random legal moves (1/8 of those are 0 again), never illegal."""
    cfg, _ = compose([*TICTACTOE, f"selfplay.opponent_noise={noise}"])
    specs = policy_specs(cfg)
    spec = specs["shared"]
    sp = build_collector(cfg, specs, 0, "cpu", None).selfplay
    stubborn = ActorCritic(spec.obs_space, spec.action_space, spec.model)
    with torch.no_grad():
        stubborn.head.linear.bias.copy_(torch.tensor([50.0] + [0.0] * 8))
    sp.pool.snapshots.clear()
    sp.start(stubborn, 0)
    n = 4000
    sp.num_envs, sp.seat = n, np.zeros(n, dtype=np.int64)  # the learner holds seat 0: rows 2e+1 are opponents
    sp.opponent = np.full(n, sp.pool.snapshots[0].id)
    movers = np.tile([False, True], n)
    masks = torch.ones(2 * n, 9, dtype=torch.bool)
    masks[1::2, 8] = False  # one illegal move for every opponent
    obs = torch.zeros(2 * n, *spec.obs_space.shape)
    actions = sp.act(obs, masks, np.full(2 * n, -1), movers)
    moves = torch.from_numpy(actions[1::2])
    assert (actions[0::2] == -1).all()  # the learner's rows are left as they were
    assert (moves != 8).all()
    expected = (1 - noise) + noise / 8  # the stubborn move, plus random draws that happen to pick it
    assert (moves == 0).float().mean().item() == pytest.approx(expected, abs=0.03)


@pytest.mark.parametrize("noise", [0.0, 0.3])
def test_scripted_noise_replaces_that_share_of_a_scripted_players_moves(noise: float) -> None:
    """win_or_block facing three of the learner's pieces on the bottom row (columns 1-3) always blocks
    column 0 (the first winning column); with scripted_noise=0.3 about 30% of its moves are random legal
    ones instead (1/6 of those land on 0 again, column 6 is masked), and never an illegal one. Snapshot
    moves are untouched by it (opponent_noise is their share)."""
    overrides = [*CONNECT_FOUR, "selfplay.scripted_prob=1.0", f"selfplay.scripted_noise={noise}"]
    sp = _selfplay(overrides)
    n = 1500
    sp.num_envs, sp.seat, sp.opponent = n, np.zeros(n, dtype=np.int64), np.full(n, SCRIPTED)
    obs = torch.zeros(2 * n, 6, 7, 2)
    obs[1::2, 5, 1:4, 1] = 1  # the opponent rows see the learner's three as the other side's pieces
    masks = torch.ones(2 * n, 7, dtype=torch.bool)
    masks[1::2, 6] = False
    actions = sp.act(obs, masks, np.full(2 * n, -1), np.tile([False, True], n))
    moves = torch.from_numpy(actions[1::2])
    assert (actions[0::2] == -1).all() and (moves != 6).all()
    assert (moves == 0).float().mean().item() == pytest.approx((1 - noise) + noise / 6, abs=0.03)
    if noise:
        assert len(set(moves.tolist())) == 6  # every legal column drawn


@pytest.mark.parametrize("greedy_prob", [0.0, 0.5, 1.0])
def test_greedy_snapshot_games_play_the_most_likely_legal_move(greedy_prob: float, tmp_path: Path) -> None:
    """A snapshot whose favourite move is 0 (logit 1.5 against 0 for the other 8): sampled it plays 0 in
    e^1.5 / (e^1.5 + e + 7) = 32% of its moves; greedily always, and 7 (the next best, logit 1) where 0 is
    illegal. `greedy_prob` of the snapshot games are greedy; the flags survive a checkpoint."""
    cfg, _ = compose([*TICTACTOE, f"selfplay.greedy_prob={greedy_prob}"])
    specs = policy_specs(cfg)
    spec = specs["shared"]
    sp = build_collector(cfg, specs, 0, "cpu", None).selfplay
    leaning = ActorCritic(spec.obs_space, spec.action_space, spec.model)
    with torch.no_grad():
        leaning.head.linear.weight.zero_()
        leaning.head.linear.bias.copy_(torch.tensor([1.5] + [0.0] * 6 + [1.0, 0.0]))
    sp.pool.snapshots.clear()
    sp.start(leaning, 0)
    n = 4000
    sp.num_envs, sp.seat = n, np.zeros(n, dtype=np.int64)
    sp.opponent = np.full(n, sp.pool.snapshots[0].id)
    np.random.seed(3)
    sp.greedy = np.zeros(n, dtype=bool)
    for e in range(n):
        sp._assign(e)
    assert sp.greedy.mean() == pytest.approx(greedy_prob, abs=0.03)
    movers = np.tile([False, True], n)
    masks = torch.ones(2 * n, 9, dtype=torch.bool)
    masks[1 : 2 * n : 4, 0] = False  # every other opponent may not play 0
    obs = torch.zeros(2 * n, *spec.obs_space.shape)
    moves = sp.act(obs, masks, np.full(2 * n, -1), movers)[1::2]
    greedy, allowed = sp.greedy, np.arange(n) % 2 == 1
    assert (moves[greedy & allowed] == 0).all() and (moves[greedy & ~allowed] == 7).all()
    sampled = moves[~greedy & allowed]
    if len(sampled):
        assert (sampled == 0).mean() == pytest.approx(np.exp(1.5) / (np.exp(1.5) + np.e + 7), abs=0.04)
    state = sp.state()
    assert ("greedy" in state) == (greedy_prob > 0)  # runs without greedy games save what they always did
    torch.save(state, tmp_path / "selfplay.pt")
    restored = build_collector(cfg, specs, 0, "cpu", None).selfplay
    restored.num_envs = n
    restored.load_state(torch.load(tmp_path / "selfplay.pt", weights_only=True), exact=True)
    assert greedy_prob == 0 or (restored.greedy == sp.greedy).all()


def test_a_snapshot_that_leaves_the_pool_finishes_its_games_and_resumes_with_them(tmp_path: Path) -> None:
    """Pool of 2, a snapshot every update: after two more snapshots the first copies' opponent has left the
    pool with their games still going. Each finishes its game against it (not against another snapshot
    drawn mid-game, whose statistics the result would reach), and a checkpoint taken meanwhile holds its
    weights, so a resume plays the same opponent (and draws nothing before the random state is back)."""
    sp = _selfplay([*TICTACTOE, "selfplay.pool_size=2", "selfplay.snapshot_every=1"])
    learner = ActorCritic(sp.spec.obs_space, sp.spec.action_space, sp.spec.model)
    assert sp.opponent.tolist() == [0, 0, 0, 0]  # the only snapshot
    sp.after_update(learner, 1)
    sp.after_update(learner, 2)  # snapshot 0 leaves the pool; no game has ended
    assert [s.id for s in sp.pool.snapshots] == [1, 2]
    sp.start(learner, 2)  # what the next rollout does first
    assert sp.opponent.tolist() == [0, 0, 0, 0], "games in progress keep their opponent"
    sp._net(0)  # its moves come from its own weights  # noqa: SLF001
    torch.save(sp.state(), tmp_path / "selfplay.pt")
    again = _selfplay([*TICTACTOE, "selfplay.pool_size=2", "selfplay.snapshot_every=1"])
    state = np.random.get_state()
    again.load_state(torch.load(tmp_path / "selfplay.pt", weights_only=True), exact=True)
    assert np.random.get_state()[2] == state[2] and (np.random.get_state()[1] == state[1]).all()
    again.start(learner, 2)
    assert again.opponent.tolist() == [0, 0, 0, 0]
    for key, value in sp._net(0).state_dict().items():  # noqa: SLF001
        torch.testing.assert_close(again._net(0).state_dict()[key], value, rtol=0, atol=0)  # noqa: SLF001
    sp.episodes_ended(np.ones(8, dtype=bool), np.zeros(8))  # every game ends: the next come from the pool
    assert set(sp.opponent.tolist()) <= {1, 2} and sp.retired == {}
    assert sp.pool.get(0) is None and 0 not in sp.nets
    # resumed with a smaller pool (resume_overrides=allow): snapshot 1 leaves it, and the games against it
    # finish against it rather than against a snapshot drawn mid-game
    torch.save(sp.state(), tmp_path / "selfplay.pt")
    smaller = _selfplay([*TICTACTOE, "selfplay.pool_size=1", "selfplay.snapshot_every=1"])
    smaller.load_state(torch.load(tmp_path / "selfplay.pt", weights_only=True), exact=True)
    smaller.start(learner, 2)
    assert [s.id for s in smaller.pool.snapshots] == [2] and smaller.opponent.tolist() == sp.opponent.tolist()
    assert 1 in sp.opponent.tolist() and set(smaller.retired) == {1}


# ----------------------------------------------------------------------------------------------- runs
def _pool(path: Path) -> dict:
    return ckpt.load(path)["ranks"][0]["selfplay"]["pool"]


@pytest.mark.slow  # seconds in process (a run, or every option composed): not the unit tier
def test_selfplay_run_logs_results_and_pool_survives_resume(tmp_path: Path) -> None:
    """8 updates, a snapshot every 2, pool of 3: the initial weights (id 0), then updates 2, 4, 6, 8 join
    (ids 1-4) and ids 2, 3, 4 remain. Resumed after update 4, the run must continue the saved pool (a fresh
    pool would restart the ids at 0) and end exactly as the uninterrupted run."""
    run = [*TICTACTOE, "algo.total_steps=1024", "logger=none"]
    full = ppo_fabric.run([*run, f"hydra.run.dir={tmp_path / 'full'}"])
    assert full["total_env_steps"] == 1024
    pool = _pool(tmp_path / "full" / "checkpoints" / "last.ckpt")
    assert pool["next_id"] == 5 and [s["update"] for s in pool["snapshots"]] == [4, 6, 8]
    assert sum(s["wins"] + s["draws"] + s["losses"] for s in pool["snapshots"]) > 0

    part = tmp_path / "part"
    ppo_fabric.run([*run, "checkpoint.every=4", "checkpoint.keep=0", f"hydra.run.dir={part}"])
    middle = next(p for p in (part / "checkpoints").glob("step_*512_*.ckpt"))
    assert [s["update"] for s in _pool(middle)["snapshots"]] == [0, 2, 4]
    ppo_fabric.run([*run, f"resume={middle}", f"hydra.run.dir={tmp_path / 'resumed'}"])
    resumed = _pool(tmp_path / "resumed" / "checkpoints" / "last.ckpt")
    final = ckpt.load(tmp_path / "full" / "checkpoints" / "last.ckpt")["agent"]["shared"]
    again = ckpt.load(tmp_path / "resumed" / "checkpoints" / "last.ckpt")["agent"]["shared"]
    for key in final:  # seats, opponents, games in progress and RNG all continued exactly
        torch.testing.assert_close(final[key], again[key], rtol=0, atol=0)
    assert resumed["next_id"] == 5 and [s["update"] for s in resumed["snapshots"]] == [4, 6, 8]
    assert ckpt.load(tmp_path / "full" / "checkpoints" / "last.ckpt")["action_masks"] == {"shared": 9}
    for a, b in zip(pool["snapshots"], resumed["snapshots"], strict=True):
        assert (a["wins"], a["draws"], a["losses"]) == (b["wins"], b["draws"], b["losses"])
        for key in a["weights"]:
            torch.testing.assert_close(a["weights"][key], b["weights"][key])


def test_selfplay_metrics_in_the_csv(tmp_path: Path) -> None:
    """Win/draw/loss rates every update; an Elo rating once the first snapshot after the start (update 2)
    joined, rating it without touching the training's random stream (the same weights as a run without)."""
    run = [*TICTACTOE, "algo.total_steps=512", "logger.tensorboard=false", "logger.log_every=1"]
    ppo_fabric.run([*run, "checkpoint.every=2", "checkpoint.keep=0", f"hydra.run.dir={tmp_path / 'elo'}"])
    rows = read_rows(tmp_path / "elo" / "metrics.csv")
    assert len(rows) == 4 and all(float(r["selfplay/games"]) > 0 for r in rows)
    rates = [float(rows[-1][f"selfplay/{k}_rate"]) for k in ("win", "draw", "loss")]
    assert abs(sum(rates) - 1) < 1e-6
    # the learner's seat only: with its opponents' seats a zero-sum game's return was 0 at every update
    returns = [float(r["rollout/episode_return"]) for r in rows if r["rollout/episode_return"]]
    assert returns and any(r != 0 for r in returns), returns
    assert rows[0]["selfplay/elo"] == "" and np.isfinite(float(rows[-1]["selfplay/elo"]))
    # resumed at update 2 (its snapshot rated): the rating curve goes on from the first update, and the next
    # snapshot's rating games are seeded where the run left off (the rater's count)
    middle = ckpt.load(tmp_path / "elo" / "checkpoints" / "last.ckpt")["ranks"][0]["selfplay"]["elo"]
    assert middle["calls"] == 2 and set(middle["ratings"]) <= {1, 2}  # snapshots 1 (update 2), 2 (update 4)
    mid = next((tmp_path / "elo" / "checkpoints").glob("step_*256_*.ckpt"))
    saved = ckpt.load(mid)["ranks"][0]["selfplay"]["elo"]
    assert saved["calls"] == 1 and list(saved["ratings"]) == [1]
    ppo_fabric.run([*run, f"resume={mid}", f"hydra.run.dir={tmp_path / 'resumed'}"])
    resumed = read_rows(tmp_path / "resumed" / "metrics.csv")
    assert float(resumed[0]["selfplay/elo"]) == pytest.approx(saved["latest"])
    assert (
        ckpt.load(tmp_path / "resumed" / "checkpoints" / "last.ckpt")["ranks"][0]["selfplay"]["elo"]["calls"]
        == 2
    )
    ppo_fabric.run([*run, "selfplay.elo=false", f"hydra.run.dir={tmp_path / 'plain'}"])
    rated = ckpt.load(tmp_path / "elo" / "checkpoints" / "last.ckpt")["agent"]["shared"]
    plain = ckpt.load(tmp_path / "plain" / "checkpoints" / "last.ckpt")["agent"]["shared"]
    for key in rated:
        torch.testing.assert_close(rated[key], plain[key], rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["coupled"])
def test_selfplay_learns_to_beat_random_tictactoe(tmp_path: Path, strategy: str) -> None:
    """A few thousand moves of self-play already beat a random player more often than chance: a score
    (win 1, draw 1/2) above 0.6 over 400 games, where a random policy with alternating seats scores 0.5
    (seeds 1-3 score 0.67 here; the win rate alone, 0.61-0.64, sat too near its threshold for 200 games)."""
    ppo_fabric.run(
        [
            *TICTACTOE,
            "algo.total_steps=12288",
            "env.num_envs=8",
            "algo.rollout_steps=64",
            "algo.lr=1e-3",
            "algo.minibatch_size=128",
            "algo.update_epochs=4",
            "logger=none",
            f"strategy={strategy}",
            f"hydra.run.dir={tmp_path}",
        ]  # fmt: skip
    )
    state = ckpt.load(tmp_path / "checkpoints" / "last.ckpt")
    cfg, _ = compose(["env=pettingzoo", "env.id=pettingzoo.classic.tictactoe_v3", "env.num_envs=16"])
    spec = policy_specs(cfg)["shared"]
    policy = ActorCritic(spec.obs_space, spec.action_space, spec.model)
    policy.load_state_dict(state["agent"]["shared"])
    player = PolicyPlayer(policy.eval(), deterministic=False, masked=True)
    results = play_games(aec_env_factory(str(cfg.env.id)), player, RandomPlayer(0), 400, seed=7)
    assert results.rate(1) + results.rate(0) / 2 > 0.6


def test_a_policy_player_takes_pettingzoos_int8_masks() -> None:
    """PettingZoo hands `action_mask` as int8; a PolicyPlayer driven straight from `env.last()` plays the
    best legal move with it (here the policy's favourite, 0, is masked: the next best, 4)."""
    cfg, _ = compose(TICTACTOE)
    spec = policy_specs(cfg)["shared"]
    policy = ActorCritic(spec.obs_space, spec.action_space, spec.model)
    with torch.no_grad():
        policy.head.linear.weight.zero_()
        policy.head.linear.bias.copy_(torch.tensor([2.0, 0, 0, 0, 1.0, 0, 0, 0, 0]))
    mask = np.ones(9, dtype=np.int8)
    mask[0] = 0
    player = PolicyPlayer(policy.eval(), deterministic=True, masked=True)
    assert player(np.zeros(spec.obs_space.shape, dtype=np.int8), mask) == 4
