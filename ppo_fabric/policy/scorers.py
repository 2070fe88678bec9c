"""What an evaluation during training plays (`policy/periodic.py` decides when): a scorer per kind of env.

- `Episodes` (single-agent envs): `eval.episodes` whole episodes on envs of their own, seeds
  `evaluation_seed(seed) + k` (never the training envs or their seeds), the observation statistics frozen
  at their training values, the mode of the action distribution unless `eval.deterministic=false`; all
  episodes side by side (one batched forward per step, in NumPy for MLP policies).
- `ParallelEpisodes` (PettingZoo Parallel envs): every policy playing its agents, each policy's return and
  all agents' together.
- `Games` (two-player turn-based games): the trained policy's games against each of `eval.opponents` (seats
  alternated), its win rate against each and its score over all.

Each has `snapshot(models, statistics)` (a copy of the live policies, taken on the training side) and
`play(snapshot)` (the `eval/*` metrics), so the same scorer runs in place or in the evaluator process.
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
from omegaconf import DictConfig

from ppo_fabric.config import faults
from ppo_fabric.config.values import ConfigError
from ppo_fabric.envs.guard import USER_CODE_FAILURES, EnvFault, error_line, nonfinite_value, surely_finite
from ppo_fabric.envs.make import close_envs, make_env, on_error
from ppo_fabric.envs.multiagent import SINGLE, is_turn_based, make_parallel_env, trained_policies
from ppo_fabric.learn.learners import PolicySpec
from ppo_fabric.models.agent import ActorCritic
from ppo_fabric.policy.evaluate import capped, play
from ppo_fabric.policy.trained import Policy
from ppo_fabric.wire.progress import PROGRESS

EVAL_SEED_STREAM = 0xE7A1  # the evaluation's own stream of a run's seed (the training envs': `env_seeds`)


def evaluation_seed(seed: int) -> int:
    """The seed of the first evaluation episode of a run of `seed` (episode k: + k), drawn from a stream of
    its own, below 2**31 with room for k. It was `seed + 1000003`: consecutive training seeds shared 9 of
    their 10 evaluation episodes (seed 43's episodes 1-9 were seed 44's 0-8), so evaluations over seeds
    1-10 drew on 19 starting states, not 100, and their confidence intervals were too narrow."""
    state = np.random.SeedSequence([seed, EVAL_SEED_STREAM]).generate_state(1, dtype=np.uint32)[0]
    return int(state) % (2**31 - 2**24)


class EpisodeFailed(Exception):  # noqa: N818 - one evaluation episode's env failed; `str` is the cause
    """Raised by `Checked` when an evaluation env raises or returns a NaN or an inf."""


class Checked(gym.Wrapper):
    """An evaluation env whose failures end its episode as `EpisodeFailed`: an exception from `reset` or
    `step`, or a non-finite observation or reward (which would make the evaluation's mean NaN and every
    later comparison with it false)."""

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        PROGRESS.mark("evaluation env.reset")  # the stall watchdog's heartbeat, as the rollout's
        try:
            obs, info = self.env.reset(**kwargs)
        except USER_CODE_FAILURES as exc:  # any failure of user code ends the episode
            raise EpisodeFailed(f"reset raised {type(exc).__name__}: {error_line(exc)}") from exc
        if (what := nonfinite_value(obs)) is not None:
            raise EpisodeFailed(f"reset returned bad data ({what})")
        return obs, info

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        PROGRESS.mark("evaluation env.step")
        try:
            obs, reward, terminated, truncated, info = self.env.step(action)
        except USER_CODE_FAILURES as exc:  # see reset
            raise EpisodeFailed(f"step raised {type(exc).__name__}: {error_line(exc)}") from exc
        if not (surely_finite(obs) and math.isfinite(reward)) and (what := nonfinite_value(obs, reward)):
            raise EpisodeFailed(f"step returned bad data ({what})")
        return obs, reward, terminated, truncated, info


class Episodes:
    """A single-agent env's evaluation: `episodes` whole episodes on `Checked` envs of its own, side by side
    (one by one for recurrent policies and whole Atari games). A failing env raises `EnvFault`, or with
    `restart` its episode is left out (`eval/failed_episodes`) and the env rebuilt."""

    score = "return_mean"

    def __init__(self, cfg: DictConfig, spec: PolicySpec, seed: int) -> None:
        self.env_cfg, self.spec, self.seed = cfg.env, spec, seed
        self.episodes = int(cfg.eval.episodes)
        self.deterministic = bool(cfg.eval.deterministic)
        self.restart = on_error(cfg.env) == "restart"
        self.envs: list[Any] = []
        self.failed: list[int] = []  # this evaluation's failed episodes (env.on_error=restart)
        self.first_cause = ""  # the first failed episode's, for the evaluation's line
        self.limited = False  # whether `capped` gave the envs their time limit (they have none of their own)
        self.cut_said = False

    def snapshot(self, models: dict[str, ActorCritic], obs_normalization: dict[str, Any] | None) -> Policy:
        (model,) = models.values()
        return Policy(
            copy.deepcopy(model).cpu(),
            self.spec.obs_space,
            self.spec.action_space,
            obs_normalization=copy.deepcopy(obs_normalization),
            mask_width=self.spec.action_mask,
        )

    def _make(self) -> gym.Env:
        env = make_env(self.env_cfg, action_mask=self.spec.action_mask)
        limited = capped(env)
        self.limited = limited is not env
        return Checked(limited)

    def _say_cut(self, lengths: list[int]) -> None:
        """Once a run: episodes cut at the cap of an env with no time limit. A greedy policy that never ends
        an episode made each evaluation `eval.episodes` x 100,000 env steps, the run crawling with no word."""
        cut = sum(n >= faults.EVAL_MAX_EPISODE_STEPS for n in lengths)
        if cut and self.limited and not self.cut_said:
            self.cut_said = True
            said(f"{cut} of {len(lengths)} evaluation episodes ran {faults.EVAL_MAX_EPISODE_STEPS:,} steps without "
                 f"ending and were cut there: env.id={self.env_cfg.id} has no time limit of its own; set "
                 "env.max_episode_steps (or eval.every=0)")  # fmt: skip

    def play(self, policy: Policy) -> dict[str, float]:
        if not self.envs:
            self.envs = [self._make() for _ in range(self.episodes)]
        from ppo_fabric.envs.atari import records_games

        self.failed = []
        if policy.recurrent or records_games(self.envs[0]):  # per-episode state and whole games: one by one
            returns, lengths = [], []
            for k, env in enumerate(self.envs):
                try:
                    r, n, _ = play(policy, env, 1, self.deterministic, self.seed + k)
                except EpisodeFailed as failure:
                    self._episode_failed(k, str(failure))
                    continue
                returns += r
                lengths += n
        else:
            returns, lengths = play_side_by_side(
                policy, self.envs, self.deterministic, self.seed, self._episode_failed
            )
        for k in self.failed:  # rebuilt for the next evaluation
            self.envs[k].close()
            self.envs[k] = self._make()
        if self.failed:  # as training's rebuilt envs each say so (an evaluation that failed whole was silent)
            said(f"{len(self.failed)} of {self.episodes} evaluation episodes failed ({self.first_cause}); left "
                 "out of the evaluation, their envs rebuilt")  # fmt: skip
        self._say_cut(lengths)
        failed = {"eval/failed_episodes": float(len(self.failed))} if self.failed else {}
        if not returns:  # every episode failed (env.on_error=restart): nothing to score
            return failed
        return {
            "eval/return_mean": float(np.mean(returns)),
            "eval/return_std": float(np.std(returns)),
            "eval/length_mean": float(np.mean(lengths)),
            **failed,
        }

    def _episode_failed(self, k: int, cause: str) -> None:
        where = f"evaluation env {k} (seed {self.seed + k})"
        if not self.restart:
            raise EnvFault(f"{where}: {cause}; env.on_error=restart leaves such an episode out instead")
        if not self.failed:
            self.first_cause = f"first: {where}: {cause}"
        self.failed.append(k)

    def close(self) -> None:
        for env in self.envs:
            close_envs(env, "the evaluation envs")  # one that raises is a warning: the results stand
        self.envs = []


class ParallelEpisodes:
    """A PettingZoo Parallel env's evaluation: `episodes` episodes, one after another, on an env of its own,
    every policy playing its agents (`play_parallel`): all agents' mean return and each policy's. An env
    that raises or returns a non-finite reward ends the run (`EnvFault`), or with `restart` the evaluation
    is left out and the env rebuilt."""

    score = "return_mean"

    def __init__(self, cfg: DictConfig, specs: dict[str, PolicySpec], seed: int) -> None:
        self.env_cfg, self.specs, self.seed = cfg.env, specs, seed
        self.multiagent = cfg.multiagent
        self.episodes = int(cfg.eval.episodes)
        self.deterministic = bool(cfg.eval.deterministic)
        self.restart = on_error(cfg.env) == "restart"
        self.env: Any = None

    def snapshot(self, models: dict[str, ActorCritic], obs_normalization: Any = None) -> dict[str, Policy]:
        return {
            name: Policy(
                copy.deepcopy(model).cpu(),
                self.specs[name].obs_space,
                self.specs[name].action_space,
                mask_width=self.specs[name].action_mask,
            )
            for name, model in models.items()
        }

    def play(self, policies: dict[str, Policy]) -> dict[str, float]:
        from ppo_fabric.envs.multiagent import make_parallel_env, policy_mapping
        from ppo_fabric.policy.evaluate import play_parallel

        if self.env is None:
            self.env = make_parallel_env(self.env_cfg)
        groups = policy_mapping(list(self.env.possible_agents), self.multiagent)
        try:
            returns, lengths = play_parallel(
                policies, groups, self.env, self.episodes, self.deterministic, self.seed
            )
            every = [r for rs in returns.values() for r in rs]
            if not np.isfinite(every).all():
                raise EpisodeFailed("step returned bad data (a reward holds NaN or inf)")
        except Exception as exc:  # noqa: BLE001 - any failure of the env's code
            cause = str(exc) if isinstance(exc, EpisodeFailed) else f"{type(exc).__name__}: {error_line(exc)}"
            if not self.restart:
                raise EnvFault(
                    f"evaluation env (seeds {self.seed}+): {cause}; env.on_error=restart leaves such an "
                    "evaluation out instead"
                ) from exc
            self.close()
            said(
                f"the evaluation failed (evaluation env, seeds {self.seed}+: {cause}); left out, its env rebuilt"
            )
            return {"eval/failed_episodes": float(self.episodes)}
        # The record is the trained policies' agents: with a frozen opponent (policies_to_train) the mean
        # over every agent of a zero-sum game stayed at 0, and best.ckpt kept the first evaluation's weights.
        trained = set(trained_policies(self.multiagent))
        scored = [r for name, rs in returns.items() if name in trained for r in rs] or every
        return {
            "eval/return_mean": float(np.mean(scored)),
            "eval/return_std": float(np.std(scored)),
            "eval/length_mean": float(np.mean(lengths)),
            **{f"eval/{name}/return_mean": float(np.mean(rs)) for name, rs in returns.items() if rs},
        }

    def close(self) -> None:
        if self.env is not None:
            close_envs(self.env, "the evaluation env")
            self.env = None


# Connect Four's scripted players that the recipes never train against: what the agent learned transfers
# to them or it does not (docs/how-to/multi-agent.md).
HELD_OUT = ("win_or_block:centre", "win_or_block:careful", "search:1")


def game_opponents(cfg: DictConfig) -> list[str]:
    """`eval.opponents`, or by default `random` and, on Connect Four, the scripted players: `win_or_block`
    (the self-play recipe's sparring partner) and the three of `HELD_OUT`."""
    from ppo_fabric.games import scripted

    chosen = cfg.eval.get("opponents")
    if isinstance(chosen, str):  # eval.opponents=random: one opponent, not its letters
        return [chosen]
    if chosen:
        return [str(o) for o in chosen]
    known = any(game in str(cfg.env.id) for game in scripted.GAMES)
    return ["random", *(["win_or_block", *HELD_OUT] if known else [])]


def check_opponents(cfg: DictConfig) -> list[str]:
    """`game_opponents`, each one a player the evaluation during training can build; ConfigError (one line)
    otherwise. The checks before a run call it too, so a misspelt opponent ends the command, not a job."""
    from ppo_fabric.policy.game_eval import GameEvalError, opponent_players

    chosen = cfg.eval.get("opponents")
    if chosen is not None and not isinstance(chosen, str) and len(chosen) == 0:  # was read as the default set
        raise ConfigError(
            "eval.opponents=[] names no opponent: drop it for the default ones, or set eval.every=0 for no "
            "evaluation during training"
        )
    names = game_opponents(cfg)
    state = {"config": {"env": {"id": str(cfg.env.id)}}}
    for opponent in names:
        if opponent == "pool" or opponent.startswith("snapshot:"):
            raise ConfigError(f"eval.opponents: {opponent} is for `python -m ppo_fabric.evaluate`; "
                              "evaluation during training plays random, win_or_block or search[:DEPTH]")  # fmt: skip
        try:
            opponent_players(opponent, state, "policy", True, 0)
        except GameEvalError as exc:
            raise ConfigError(
                f"eval.opponents: {str(exc).partition('; choose')[0]}; {TRAINING_OPPONENTS}"
            ) from None
    return names


def held_out(cfg: DictConfig, opponents: list[str]) -> set[str]:
    """The opponents of `opponents` that this run never trains against: those of `HELD_OUT`, less the
    scripted players its self-play spars with (`selfplay.scripted` with `scripted_prob` > 0). Every
    opponent when all of them are such players (there is then nothing else to keep a record on)."""
    sparring: set[str] = set()
    if float(cfg.selfplay.scripted_prob) > 0:
        scripted = cfg.selfplay.scripted
        sparring = {str(scripted)} if isinstance(scripted, str) else {str(o) for o in scripted}
    unseen = {o for o in opponents if o in HELD_OUT and o not in sparring}
    return unseen if len(unseen) < len(opponents) else set()


# per opponent: the win rate, and from each seat (a game's first move weighs a lot: GameResults.seat_win_rate)
SEAT_RATES = ("win_rate", "win_rate_moving_first", "win_rate_moving_second")


TRAINING_OPPONENTS = "choose random, win_or_block[:centre|:careful] or search[:DEPTH]"


class Games:
    """A two-player turn-based game's evaluation: the trained policy's games against each of
    `game_opponents` (`eval.episodes` games each, seats alternated, `play_games`); its win rate against
    each; over the opponents it trains against or may be tuned on (random, its sparring partners) its win,
    draw and loss rates and its score (win 1, draw 1/2: the record, which picks `best.ckpt`); and over the
    `held_out` ones their own win rate and score (`eval/held_out/*`), which choose nothing: a checkpoint
    picked on the players it is tested against would be tuned on the test."""

    score = "score"

    def __init__(self, cfg: DictConfig, specs: dict[str, PolicySpec], seed: int) -> None:
        from ppo_fabric.games.play import aec_env_factory

        self.name = next((n for n, s in specs.items() if s.trained), next(iter(specs)))
        self.games = int(cfg.eval.episodes)
        self.deterministic = bool(cfg.eval.deterministic)
        self.seed = seed
        self.factory = aec_env_factory(str(cfg.env.id), dict(cfg.env.get("kwargs") or {}))
        self.state = {"config": {"env": {"id": str(cfg.env.id)}}}
        self.names = check_opponents(cfg)
        self.held_out = held_out(cfg, self.names)

    def _opponents(self) -> list[tuple[str, Any]]:
        """The opponents as new: each evaluation's random and scripted players draw the same moves (each its
        own seed), so a policy scores alike at every evaluation and a resumed run as the uninterrupted one."""
        from ppo_fabric.policy.game_eval import opponent_players

        return [
            player
            for i, opponent in enumerate(self.names)
            for player in opponent_players(opponent, self.state, self.name, True, self.seed + i)
        ]

    def snapshot(self, models: dict[str, ActorCritic], obs_normalization: Any = None) -> Any:
        from ppo_fabric.policy.game_eval import policy_player

        return policy_player(copy.deepcopy(models[self.name]).cpu(), self.deterministic)

    def play(self, player: Any) -> dict[str, float]:
        from ppo_fabric.games.play import GameResults, play_games

        record, unseen, metrics = GameResults(), GameResults(), {}
        for i, (label, opponent) in enumerate(self._opponents()):
            results = play_games(self.factory, player, opponent, self.games, self.seed + i * self.games)
            rates = results.summary()
            metrics |= {f"eval/{label}/{k}": rates[k] for k in SEAT_RATES if rates[k] is not None}
            (unseen if label in self.held_out else record).extend(results)
        summary = record.summary()
        overall = ("win_rate", "draw_rate", "loss_rate", "score", *SEAT_RATES[1:])
        out = {f"eval/{k}": float(summary[k]) for k in overall if summary[k] is not None} | metrics
        if unseen.games:
            rest = unseen.summary()
            kept = ("win_rate", "score", *SEAT_RATES[1:])
            out |= {f"eval/held_out/{k}": float(rest[k]) for k in kept if rest[k] is not None}
        return out

    def close(self) -> None:
        pass


def score(
    scorer: Episodes | ParallelEpisodes | Games, models: dict[str, ActorCritic], obs_normalization: Any
) -> dict[str, float]:
    """One evaluation of `models`. Its sampled actions (`eval.deterministic=false`) draw from torch's
    stream seeded anew from the scorer's seed, in a fork of the caller's: an evaluation leaves training's
    random state where it was (a coupled run evaluates in its own process) and scores as it would in the
    uninterrupted run (after a resume, whatever evaluations came before)."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(scorer.seed)
        return scorer.play(scorer.snapshot(models, obs_normalization))


def check_players(cfg: DictConfig) -> None:
    """A turn-based game's evaluation during training plays two-player games against opponents: one of
    another number of players is refused before the run (it trained, then failed at its first evaluation with
    a traceback and no checkpoint written)."""
    env = make_parallel_env(cfg.env)
    try:
        players = list(env.possible_agents)
        if is_turn_based(env) and len(players) != 2:
            raise ConfigError(
                f"evaluation during training plays two-player games against opponents, and env.id={cfg.env.id} "
                f"has {len(players)} players ({', '.join(map(str, players))}): set eval.every=0"
            )
    finally:
        env.close()


def scorer_for(
    cfg: DictConfig, specs: dict[str, PolicySpec], seed: int
) -> Episodes | ParallelEpisodes | Games:
    """The evaluation that fits the env: episodes (single-agent), every policy's episodes (Parallel) or
    games against opponents (turn-based)."""
    if list(specs) == [SINGLE]:
        return Episodes(cfg, specs[SINGLE], seed)
    # the env training steps decides: a module offering both APIs (MPE's) trains, so evaluates, as Parallel
    env = make_parallel_env(cfg.env)
    try:
        turn_based = is_turn_based(env)
    finally:
        env.close()
    return Games(cfg, specs, seed) if turn_based else ParallelEpisodes(cfg, specs, seed)


def play_side_by_side(
    policy: Policy,
    envs: list[Any],
    deterministic: bool,
    seed: int,
    failed: Callable[[int, str], None] | None = None,
) -> tuple[list[float], list[int]]:
    """One whole episode on each env (env k reset with `seed + k`), all stepped together with one batched
    `predict` per step; finished envs wait. Feed-forward policies (no state to carry per episode).

    An env that raises `EpisodeFailed` (a `Checked` env) is handed to `failed(k, cause)`, which raises or
    lets the others play on; the returns and lengths are those of the episodes that ended."""
    obs: list[Any] = [None] * len(envs)
    info: list[Any] = [None] * len(envs)
    returns = [0.0] * len(envs)
    lengths = [0] * len(envs)
    running, lost = [], set()

    def give_up(k: int, failure: EpisodeFailed) -> None:
        if failed is None:
            raise failure
        failed(k, str(failure))
        lost.add(k)

    for k, env in enumerate(envs):
        try:
            obs[k], info[k] = env.reset(seed=seed + k)
            running.append(k)
        except EpisodeFailed as failure:
            give_up(k, failure)
    greedy = policy.greedy_actor() if deterministic and policy.mask_width is None else None
    while running:
        batch = _stack([obs[k] for k in running])
        if greedy is not None:  # NumPy, no torch call: the evaluation's forwards cost ~1/7 of predict's
            actions = greedy(batch)
        else:
            masks = [info[k].get("action_mask") for k in running]
            mask = np.stack(masks) if masks[0] is not None else None
            actions, _ = policy.predict(batch, None, None, deterministic, mask)
        still = []
        for row, k in enumerate(running):
            action = actions[row]
            try:
                obs[k], reward, terminated, truncated, info[k] = envs[k].step(
                    int(action) if action.ndim == 0 else action
                )
            except EpisodeFailed as failure:
                give_up(k, failure)
                continue
            returns[k] += float(reward)
            lengths[k] += 1
            if not (terminated or truncated):
                still.append(k)
        running = still
    kept = [k for k in range(len(envs)) if k not in lost]
    return [returns[k] for k in kept], [lengths[k] for k in kept]


def _stack(observations: list[Any]) -> Any:
    if isinstance(observations[0], dict):
        return {key: np.stack([o[key] for o in observations]) for key in observations[0]}
    return np.stack(observations)


def said(line: str) -> None:
    """One line on stderr from the process that evaluates (rank 0, or a decoupled player's evaluator)."""
    print(f"ppo-fabric: {line}", file=sys.stderr, flush=True)
