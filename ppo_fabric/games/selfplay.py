"""Self-play in two-player turn-based games: the learner against frozen snapshots of itself.

Every `selfplay.snapshot_every` updates the learner's weights join an opponent pool (at most
`selfplay.pool_size`, the oldest leaves first). In every env copy each episode pairs the learner with one
snapshot, drawn by `selfplay.sampling`:

- `uniform`: every snapshot alike;
- `latest`: the newest with probability `latest_prob`, the rest uniformly;
- `pfsp` (prioritised fictitious self-play): weight (1 - p)^`pfsp_power` where p is the learner's smoothed
  score against the snapshot ((wins + draws/2 + 1) / (games + 2)), so opponents it still loses to play more.

With `selfplay.random_prob` > 0 that share of episodes is played against a uniformly random legal-move
player instead: an anchor that never leaves, so the learner keeps meeting the scattered positions weak play
leads to (pure self-play narrows to the lines its snapshots play and forgets them, measured in
benchmarks/results/selfplay_*.md). Those games are reported apart (`selfplay/random_*`).

With `selfplay.scripted_prob` > 0 that share of episodes is played against the scripted player
`selfplay.scripted` names (`win_or_block`, `search:DEPTH`: games/scripted.py, the players `evaluate
opponent=` measures against): an opponent that punishes every missed threat from the first update, which
snapshots of a weak learner never do. A list of names is a league of scripted styles: each of those
episodes meets one of them, drawn uniformly, so the learner cannot settle on beating one partner's habits.
Reported apart as `selfplay/scripted_*` (all of them together); each player's random choices come from a
generator of its own whose state checkpoints keep. `selfplay.scripted_noise` replaces that share of the
scripted players' moves with random legal ones: a nearly deterministic player repeats its lines, and a
learner that answers them by heart has not learned the game (docs/how-to/multi-agent.md#self-play).

Seats alternate per episode in each copy. The seat -> policy mapping therefore changes from episode to
episode: the rollout's `mask` keeps only the learner's decisions (`learner_rows`), the only rows trained.
The pool's snapshots and win statistics are plain tensors and numbers (`state`/`load_state`), saved with
each collecting rank's part of a checkpoint and restored on resume.

With `selfplay.elo=true` (rank 0 only) each new snapshot is rated (`elo.EloRater`: games against the
random player, rated 0, and the newest rated snapshots, played by `games.play_games`) within 5% of the
training time, and `selfplay/elo` is logged: a learning curve where the return is zero-sum.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from omegaconf import DictConfig, ListConfig

from ppo_fabric.envs.make import EnvError
from ppo_fabric.models.agent import ActorCritic

SAMPLING = ("uniform", "latest", "pfsp")
WIN, DRAW, LOSS = 1, 0, -1
RANDOM = -2  # the opponent id of a copy playing the uniformly random legal-move player
SCRIPTED = -3  # the opponent id of a copy playing the first scripted player; the k-th is SCRIPTED - k


def scripted_names(value: Any) -> list[str]:
    """`selfplay.scripted` as a list of player names: one name, or a list of them (a league)."""
    if isinstance(value, str):
        return [value]
    return [str(name) for name in value]


# ---------------------------------------------------------------------------------------------- config
def check_selfplay(cfg: DictConfig, specs: dict[str, Any], turn_based: bool) -> None:
    """One-line errors for `selfplay.*` (raised as EnvError, which the launcher reports as a config error)."""
    sp = cfg.selfplay
    if not bool(sp.enabled):
        return
    if not turn_based:
        raise EnvError(
            "selfplay.enabled=true needs a two-player turn-based PettingZoo game (env=pettingzoo "
            "env.id=pettingzoo.classic.connect_four_v3, ...)"
        )
    if len(specs) != 1:
        raise EnvError("selfplay.enabled=true trains one policy for both seats; set multiagent.policies=null")
    spec = next(iter(specs.values()))
    if spec.agents != 2:
        raise EnvError(f"selfplay needs a two-player game; env.id={cfg.env.id} has {spec.agents} players")
    if spec.action_mask is None:  # off, or a game without masks: the opponents could not play legal moves
        raise EnvError(
            "selfplay needs the game's action_mask (algo.action_mask=auto): its random, scripted and "
            f"snapshot opponents play legal moves from it (algo.action_mask={cfg.algo.action_mask})"
        )
    for key in ("snapshot_every", "pool_size"):
        value = sp.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EnvError(f"selfplay.{key}={value} must be a positive integer")
    opening = sp.opening_moves
    if isinstance(opening, bool) or not isinstance(opening, int) or opening < 0:
        raise EnvError(f"selfplay.opening_moves={opening} must be a whole number >= 0")
    if sp.get("sampling") not in SAMPLING:
        raise EnvError(f"selfplay.sampling={sp.get('sampling')} must be one of {', '.join(SAMPLING)}")
    for key in (
        "latest_prob",
        "random_prob",
        "scripted_prob",
        "opponent_noise",
        "scripted_noise",
        "greedy_prob",
    ):
        value = sp[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise EnvError(f"selfplay.{key}={value} must be a number in [0, 1]")
    if sp.random_prob + sp.scripted_prob > 1:
        raise EnvError(
            f"selfplay.random_prob={sp.random_prob} + selfplay.scripted_prob={sp.scripted_prob} "
            "must be at most 1"
        )
    if sp.scripted_prob > 0:
        from ppo_fabric.games import scripted

        value = sp.get("scripted")
        names = scripted_names(value) if isinstance(value, (str, ListConfig, list)) else []
        if not names:
            raise EnvError(f"selfplay.scripted={value} must name a scripted player or a list of them")
        for name in names:
            try:
                scripted.scripted_player(name)
            except ValueError as exc:
                raise EnvError(f"selfplay.scripted={exc}") from exc
        if not any(game in str(cfg.env.id) for game in scripted.GAMES):
            raise EnvError(
                f"selfplay.scripted={sp.get('scripted')} plays connect_four_v3 only, not env.id={cfg.env.id}"
            )
        board = spec.obs_space
        if isinstance(board, gym.spaces.Dict) and "observation" in board.spaces:
            board = board["observation"]
        shape, moves = getattr(board, "shape", None), getattr(spec.action_space, "n", None)
        if shape != scripted.BOARD or moves != scripted.COLS:  # a connect_four id of another board: the
            # players would fail at their first move, inside the rollout
            raise EnvError(
                f"selfplay.scripted={sp.get('scripted')} plays Connect Four's {list(scripted.BOARD)} board "
                f"and {scripted.COLS} moves; env.id={cfg.env.id} has {list(shape or ())} and {moves}"
            )
    if not isinstance(sp.elo, bool):
        raise EnvError(f"selfplay.elo={sp.elo} must be true or false")
    power = sp.get("pfsp_power")
    if isinstance(power, bool) or not isinstance(power, (int, float)) or not 0 <= power < math.inf:
        raise EnvError(f"selfplay.pfsp_power={power} must be a finite number >= 0")


# ------------------------------------------------------------------------------------------- sampling
def learner_scores(wins: np.ndarray, draws: np.ndarray, losses: np.ndarray) -> np.ndarray:
    """The learner's score against each snapshot, (wins + draws/2 + 1) / (games + 2): 1/2 before any game."""
    games = wins + draws + losses
    return (wins + 0.5 * draws + 1.0) / (games + 2.0)


def pfsp_weights(scores: np.ndarray, power: float) -> np.ndarray:
    """Prioritised fictitious self-play ("hard" weighting): (1 - score)^power, normalised. Computed in logs
    (a score is below 1, so every log is finite): a large power would underflow every weight to 0."""
    logs = power * np.log1p(-np.asarray(scores, dtype=np.float64))
    weights = np.exp(logs - logs.max())
    return weights / weights.sum()


def sampling_probabilities(
    mode: str, scores: np.ndarray, latest_prob: float = 0.5, power: float = 2.0
) -> np.ndarray:
    """Each snapshot's chance to be the next opponent; snapshots in the order they joined (newest last)."""
    n = len(scores)
    if mode == "uniform" or n == 1:
        return np.full(n, 1.0 / n)
    if mode == "latest":
        probs = np.full(n, (1.0 - latest_prob) / (n - 1))
        probs[-1] = latest_prob
        return probs
    if mode == "pfsp":
        return pfsp_weights(scores, power)
    raise ValueError(f"unknown sampling {mode!r}")


# ----------------------------------------------------------------------------------------------- pool
@dataclass
class Snapshot:
    id: int
    update: int  # the update the weights are from
    weights: dict[str, torch.Tensor]
    wins: int = 0
    draws: int = 0
    losses: int = 0


@dataclass
class OpponentPool:
    """Frozen snapshots of the learner and how the learner fared against each (from training games)."""

    size: int
    sampling: str = "pfsp"
    latest_prob: float = 0.5
    power: float = 2.0
    snapshots: list[Snapshot] = field(default_factory=list)
    next_id: int = 0

    def add(self, weights: dict[str, torch.Tensor], update: int) -> Snapshot:
        snap = Snapshot(self.next_id, update, {k: v.detach().cpu().clone() for k, v in weights.items()})
        self.next_id += 1
        self.snapshots.append(snap)
        del self.snapshots[: -self.size]
        return snap

    def get(self, snap_id: int) -> Snapshot | None:
        return next((s for s in self.snapshots if s.id == snap_id), None)

    def probabilities(self) -> np.ndarray:
        stats = np.array([[s.wins, s.draws, s.losses] for s in self.snapshots], dtype=np.float64)
        scores = learner_scores(stats[:, 0], stats[:, 1], stats[:, 2])
        return sampling_probabilities(self.sampling, scores, self.latest_prob, self.power)

    def sample(self) -> int:
        """A snapshot id, drawn with numpy's global generator (checkpoints save and restore its state)."""
        return self.snapshots[int(np.random.choice(len(self.snapshots), p=self.probabilities()))].id

    def record(self, snap_id: int, outcome: int) -> None:
        snap = self.get(snap_id)
        if snap is None:  # left the pool during the game
            return
        if outcome == WIN:
            snap.wins += 1
        elif outcome == LOSS:
            snap.losses += 1
        else:
            snap.draws += 1

    def state(self) -> dict[str, Any]:
        """Plain data (tensors, ints, lists): what `torch.load(weights_only=True)` reads back."""
        return {
            "next_id": self.next_id,
            "snapshots": [
                {
                    "id": s.id,
                    "update": s.update,
                    "weights": dict(s.weights),
                    "wins": s.wins,
                    "draws": s.draws,
                    "losses": s.losses,
                }  # fmt: skip
                for s in self.snapshots
            ],
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.next_id = int(state["next_id"])
        self.snapshots = [
            Snapshot(
                int(s["id"]),
                int(s["update"]),
                dict(s["weights"]),
                int(s["wins"]),
                int(s["draws"]),
                int(s["losses"]),
            )  # fmt: skip
            for s in state["snapshots"]
        ][-self.size :]


def _rates(prefix: str, counts: torch.Tensor) -> dict[str, float]:
    """`{prefix}win_rate`, `draw_rate`, `loss_rate` of [wins, draws, losses]."""
    wins, draws, losses = (counts / counts.sum()).tolist()
    return {f"{prefix}win_rate": wins, f"{prefix}draw_rate": draws, f"{prefix}loss_rate": losses}


# ----------------------------------------------------------------------------------- the acting side
class SelfPlay:
    """One collecting rank's opponents: which seat the learner holds and which snapshot it meets in each
    env copy, the frozen opponent networks, and the learner's results since the last `metrics()`."""

    def __init__(self, sp_cfg: DictConfig, spec: Any, num_envs: int, device: torch.device, rank: int = 0):
        self.every = int(sp_cfg.snapshot_every)
        self.pool = OpponentPool(
            int(sp_cfg.pool_size), str(sp_cfg.sampling), float(sp_cfg.latest_prob), float(sp_cfg.pfsp_power)
        )
        self.random_prob = float(sp_cfg.random_prob)
        self.scripted_prob = float(sp_cfg.scripted_prob)
        self.scripted: list[Any] = []  # the scripted players (selfplay.scripted), when scripted_prob > 0
        if self.scripted_prob > 0:
            from ppo_fabric.games.scripted import scripted_player

            # seeded from numpy's global generator (seeded per run and rank): a seeded run repeats
            self.scripted = [
                scripted_player(name, int(np.random.randint(2**31)))
                for name in scripted_names(sp_cfg.scripted)
            ]
        self.noise = float(sp_cfg.opponent_noise)
        self.scripted_noise = float(sp_cfg.scripted_noise)
        self.greedy_prob = float(sp_cfg.greedy_prob)
        self.spec, self.device, self.num_envs = spec, device, num_envs
        self.seat = (np.arange(num_envs) + rank) % 2  # the learner's seat in each copy
        self.opponent = np.full(num_envs, -1, dtype=np.int64)  # the snapshot id each copy plays
        self.greedy = np.zeros(num_envs, dtype=bool)  # copies whose snapshot plays its most likely moves
        self.nets: dict[int, ActorCritic] = {}
        # snapshots that left the pool while copies were still playing them: they finish those games
        self.retired: dict[int, dict[str, torch.Tensor]] = {}
        self.results = np.zeros(3, dtype=np.int64)  # wins, draws, losses since the last metrics()
        self.random_results = np.zeros(3, dtype=np.int64)  # the same, against the random player
        self.scripted_results = np.zeros(3, dtype=np.int64)  # the same, against the scripted player
        self.rater: Any = None  # an elo.EloRater where this rank rates the snapshots (rank 0)
        self.elo: float | None = None  # the newest snapshot's rating
        self.started = time.perf_counter()

    def start(self, policy: ActorCritic, update: int) -> None:
        """Seed an empty pool with the learner as it is, and give every copy an opponent."""
        if not self.pool.snapshots:
            self.pool.add(policy.state_dict(), update)
        for e in range(self.num_envs):
            if not self._playable(int(self.opponent[e])):
                self._assign(e)

    def _playable(self, opponent: int) -> bool:
        if opponent <= SCRIPTED:
            return SCRIPTED - opponent < len(self.scripted)
        return opponent == RANDOM or self.pool.get(opponent) is not None or opponent in self.retired

    def _draw(self) -> int:
        """The next opponent: the random player with probability `random_prob`, a scripted one with
        `scripted_prob` (uniformly among the league's), else a pool snapshot (drawn with numpy's global
        generator, which checkpoints save and restore; one uniform number picks among the three, none when
        both shares are 0, and it picks the scripted player too, so a single one draws as before)."""
        if self.random_prob > 0 or self.scripted_prob > 0:
            u = np.random.random()
            if u < self.random_prob:
                return RANDOM
            if u < self.random_prob + self.scripted_prob:
                k = int((u - self.random_prob) / self.scripted_prob * len(self.scripted))
                return SCRIPTED - min(k, len(self.scripted) - 1)
        return self.pool.sample()

    def _assign(self, e: int) -> None:
        """Copy `e`'s next opponent; a snapshot plays greedily in a `greedy_prob` share of its games (the
        draw is made only when the share is > 0, so runs without it keep their random stream)."""
        self.opponent[e] = self._draw()
        self.greedy[e] = (
            self.greedy_prob > 0 and self.opponent[e] >= 0 and np.random.random() < self.greedy_prob
        )

    def opponent_to_move(self, movers: np.ndarray) -> np.ndarray:
        """The copies whose opponent seat moves now."""
        copies = np.arange(self.num_envs)
        return copies[movers[copies * 2 + 1 - self.seat]]

    def learner_rows(self) -> np.ndarray:
        """[copies * 2] True where the learner holds the seat (row = copy * 2 + seat)."""
        rows = np.zeros(self.num_envs * 2, dtype=bool)
        rows[np.arange(self.num_envs) * 2 + self.seat] = True
        return rows

    def _net(self, snap_id: int) -> ActorCritic:
        net = self.nets.get(snap_id)
        if net is None:
            snap = self.pool.get(snap_id)
            weights = snap.weights if snap is not None else self.retired.get(snap_id)
            assert weights is not None, f"snapshot {snap_id} is no longer in the pool"
            with torch.random.fork_rng(devices=[]):  # its random init is overwritten: leave the RNG as it was
                net = ActorCritic(self.spec.obs_space, self.spec.action_space, self.spec.model)
            net.load_state_dict(weights)
            self.nets[snap_id] = net.to(self.device).eval()
        return net

    @torch.inference_mode()
    def act(
        self, obs: Any, masks: torch.Tensor | None, actions: np.ndarray, movers: np.ndarray
    ) -> np.ndarray:
        """`actions` with the entries of opponents about to move (`movers`: rows whose turn it is) replaced
        by their snapshots' choices."""
        actions = actions.copy()
        opponent_moves = self.opponent_to_move(movers)
        for snap_id in np.unique(self.opponent[opponent_moves]):
            copies = opponent_moves[self.opponent[opponent_moves] == snap_id]
            rows = torch.from_numpy(copies * 2 + 1 - self.seat[copies]).to(self.device)
            mask = None if masks is None else masks[rows]
            if snap_id == RANDOM:
                chosen = self._random_moves(len(copies), mask)
            elif snap_id <= SCRIPTED:
                chosen = self._scripted_moves(self.scripted[SCRIPTED - snap_id], obs[rows], mask)
                chosen = self._with_noise(chosen, self.scripted_noise, mask)
            else:
                chosen = self._snapshot_moves(int(snap_id), copies, obs[rows], mask)
                chosen = self._with_noise(chosen, self.noise, mask)
            actions[rows.cpu().numpy()] = chosen.cpu().numpy()
        return actions

    def _snapshot_moves(
        self, snap_id: int, copies: np.ndarray, obs: Any, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """The snapshot's moves in `copies`: sampled, or its most likely legal move where it plays greedily."""
        net = self._net(snap_id)
        greedy = self.greedy[copies] if self.greedy_prob > 0 else None
        if greedy is None or not greedy.any():
            return net.sample(obs, None, False, mask)[0]
        greedy = torch.from_numpy(greedy).to(self.device)
        chosen = torch.empty(len(copies), dtype=torch.long, device=self.device)
        for flag in (False, True):
            part = greedy == flag
            if bool(part.any()):
                chosen[part] = net.sample(obs[part], None, flag, None if mask is None else mask[part])[0]
        return chosen

    def _scripted_moves(self, player: Any, obs: Any, mask: torch.Tensor | None) -> torch.Tensor:
        """A scripted player's move in each row (plain Python per board: milliseconds per update)."""
        boards = np.asarray(obs.cpu())
        legal = None if mask is None else mask.cpu().numpy()
        moves = [player(boards[i], None if legal is None else legal[i]) for i in range(len(boards))]
        return torch.tensor(moves, dtype=torch.long, device=self.device)

    def _with_noise(self, chosen: torch.Tensor, noise: float, mask: torch.Tensor | None) -> torch.Tensor:
        """`chosen` with a `noise` share of its moves replaced by uniformly random legal ones (none drawn at
        noise 0, so a run without noise consumes torch's generator as before)."""
        if noise <= 0:
            return chosen
        swap = torch.rand(len(chosen), device=self.device) < noise
        return torch.where(swap, self._random_moves(len(chosen), mask), chosen)

    def _random_moves(self, n: int, mask: torch.Tensor | None) -> torch.Tensor:
        """Uniform over each row's legal moves (over the whole Discrete space without masks), drawn from
        torch's generator like the snapshots' moves, so a seeded run repeats."""
        width = int(mask.shape[1]) if mask is not None else int(self.spec.action_space.n)
        scores = torch.rand(n, width, device=self.device)
        if mask is not None:
            scores = scores.masked_fill(~mask, -1.0)
        return scores.argmax(1)

    def episodes_ended(self, ended: np.ndarray, returns: np.ndarray) -> None:
        """Per row (`_episode`, `episode.r`): record the learner's result in every copy whose game ended,
        then swap seats and draw the copy's next opponent."""
        for e in np.flatnonzero(ended.reshape(self.num_envs, 2).any(1)):
            ret = float(returns[e * 2 + self.seat[e]])
            outcome = WIN if ret > 0 else LOSS if ret < 0 else DRAW
            if self.opponent[e] == RANDOM:
                self.random_results[1 - outcome] += 1  # WIN -> 0, DRAW -> 1, LOSS -> 2
            elif self.opponent[e] <= SCRIPTED:
                self.scripted_results[1 - outcome] += 1
            else:
                self.pool.record(int(self.opponent[e]), outcome)
                self.results[1 - outcome] += 1
            self.seat[e] = 1 - self.seat[e]
            self._assign(e)
        self._prune()

    def after_update(self, policy: ActorCritic, update: int) -> None:
        """Every `snapshot_every` updates the learner's weights join the pool."""
        if update % self.every == 0:
            before = list(self.pool.snapshots)
            snap = self.pool.add(policy.state_dict(), update)
            playing = set(self.opponent.tolist())
            for gone in before[: len(before) + 1 - len(self.pool.snapshots)]:
                if gone.id in playing:  # a game in progress finishes against it (its results count nowhere)
                    self.retired[gone.id] = gone.weights
            self._prune()
            if self.rater is not None:
                self._rate(snap)

    def _rate(self, snap: Snapshot) -> None:
        """Rate the newcomer against the random player and the pool's rated snapshots. Its games sample
        moves from torch's generator: forked, so that rating leaves the training's random stream as it was
        (a resumed run stays exact)."""
        pool = [{"id": s.id, "weights": s.weights} for s in self.pool.snapshots]
        trained_s = time.perf_counter() - self.started - self.rater.seconds
        with torch.random.fork_rng(devices=[]):
            self.elo = self.rater.rate(snap.weights, pool, snap.id, train_seconds=trained_s)

    def _prune(self) -> None:
        playing = set(self.opponent.tolist())
        self.retired = {i: w for i, w in self.retired.items() if i in playing}
        keep = {s.id for s in self.pool.snapshots} | playing
        for snap_id in [i for i in self.nets if i not in keep]:
            del self.nets[snap_id]

    def metrics(
        self, sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> dict[str, float]:
        """Win/draw/loss rates of the learner in the training games finished since the last call, over
        every collecting rank (`sum_over_ranks`), and the pool's size; games against the random player
        (`random_prob`) and the scripted one (`scripted_prob`) apart, as `selfplay/random_*` and
        `selfplay/scripted_*`: training-time curves of what the benchmark judges."""
        groups = (self.results, self.random_results, self.scripted_results)
        every = torch.tensor(np.concatenate(groups), dtype=torch.float64)
        for counts in groups:
            counts[:] = 0
        if sum_over_ranks is not None:
            every = sum_over_ranks(every)
        counts, random_counts, scripted_counts = every[:3], every[3:6], every[6:]
        games = float(counts.sum())
        out = {"selfplay/games": games, "selfplay/pool_size": float(len(self.pool.snapshots))}
        if self.elo is not None:
            out["selfplay/elo"] = self.elo
        if games:
            out |= _rates("selfplay/", counts)
        for prefix, share, played in (
            ("selfplay/random_", self.random_prob, random_counts),
            ("selfplay/scripted_", self.scripted_prob, scripted_counts),
        ):
            if share > 0:
                out[f"{prefix}games"] = float(played.sum())
                if played.sum():
                    out |= _rates(prefix, played)
        return out

    def state(self) -> dict[str, Any]:
        out = {
            "pool": self.pool.state(),
            "seat": torch.from_numpy(self.seat.copy()),
            "opponent": torch.from_numpy(self.opponent.copy()),
        }
        if self.greedy_prob > 0:
            out["greedy"] = torch.from_numpy(self.greedy.copy())
        if self.retired:
            out["retired"] = [{"id": i, "weights": dict(w)} for i, w in self.retired.items()]
        if self.scripted:  # their generators' states: plain ints and strings (one dict for one player)
            states = [player.rng.bit_generator.state for player in self.scripted]
            out["scripted_rng"] = states[0] if len(states) == 1 else states
        if self.rater is not None and self.rater.calls:  # the rating curve goes on where it was: the newest
            # rating, the pool's ratings (later snapshots play them) and the count that seeds the next games
            rated = {s.id for s in self.pool.snapshots}
            out["elo"] = {"latest": self.elo, "calls": self.rater.calls,
                          "ratings": {i: r for i, r in self.rater.ratings.items() if i in rated}}  # fmt: skip
        return out

    def load_state(self, state: dict[str, Any], exact: bool) -> None:
        """The pool always; the seats and opponents per copy only when the copies are the same ones."""
        self.pool.load_state(state["pool"])
        self.nets.clear()
        if self.scripted and "scripted_rng" in state:
            saved = state["scripted_rng"]
            saved = saved if isinstance(saved, list) else [saved]
            # a resume that changed the league (resume_overrides=allow) restores the players both runs share
            for player, rng_state in zip(self.scripted, saved, strict=False):
                player.rng.bit_generator.state = rng_state
        if self.rater is not None and "elo" in state:
            self.elo = state["elo"]["latest"]
            self.rater.calls = int(state["elo"]["calls"])
            self.rater.ratings = {int(i): float(r) for i, r in state["elo"]["ratings"].items()}
        if exact:
            self.seat = np.asarray(state["seat"], dtype=np.int64).copy()
            self.opponent = np.asarray(state["opponent"], dtype=np.int64).copy()
            if "greedy" in state:
                self.greedy = np.asarray(state["greedy"], dtype=bool).copy()
            self.retired = {int(r["id"]): dict(r["weights"]) for r in state.get("retired", [])}
            # a smaller pool (resume_overrides=allow) drops its oldest snapshots: a game in progress against
            # one finishes against it, as when a snapshot leaves the pool during a run
            playing, kept = set(self.opponent.tolist()), {snap.id for snap in self.pool.snapshots}
            for snap in state["pool"]["snapshots"]:
                if int(snap["id"]) in playing - kept:
                    self.retired.setdefault(int(snap["id"]), dict(snap["weights"]))
        # a copy whose opponent is gone (another league, other copies) draws its next in `start`, after the
        # random state is restored
