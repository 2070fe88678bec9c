"""Evaluation during training: the live policy scored on episodes of its own at a fixed cadence.

The training return is the mean of stochastic episodes that ran while the policy changed under them;
published numbers (RL Zoo's `--eval-freq`, SB3's `EvalCallback`, CleanRL's evaluation) come from separate
episodes with the policy as it stands. Every `eval.every` env steps, and at the run's last update, the writer
rank copies the policies and scores the copy:

- single-agent envs (`Episodes`): `eval.episodes` whole episodes on envs of their own, seeds
  `seed + EVAL_SEED_OFFSET + k` (never the training envs or their seeds), the observation statistics frozen
  at their training values, the mode of the action distribution unless `eval.deterministic=false`; all
  episodes side by side (one batched forward per step);
- PettingZoo Parallel envs (`ParallelEpisodes`): every policy playing its agents, each policy's return and
  all agents' together;
- two-player turn-based games (`Games`): the trained policy's greedy games against each of
  `eval.opponents` (seats alternated), its win rate against each and its score over all.

The record (`last`, `best` with their env steps) travels in checkpoints, so a resumed run keeps it, and
decides the coupled strategy's `best.ckpt`. A decoupled player evaluates in a process of its own
(`background`, `EvaluatorProcess`), off the critical path.
"""

from __future__ import annotations

import contextlib
import copy
import math
import multiprocessing
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
from omegaconf import DictConfig, OmegaConf

from ppo_fabric.config.values import ConfigError
from ppo_fabric.envs.guard import EnvFault, error_line, nonfinite_value, surely_finite
from ppo_fabric.envs.make import make_env, on_error
from ppo_fabric.envs.multiagent import SINGLE
from ppo_fabric.envs.normalize import normalizer_state
from ppo_fabric.learn.learners import PolicySpec
from ppo_fabric.models.agent import ActorCritic
from ppo_fabric.policy.evaluate import play
from ppo_fabric.policy.trained import Policy
from ppo_fabric.runs.session import RunSession

EVAL_SEED_OFFSET = 1_000_003  # training envs are seeded from SeedSequence(seed + rank): never these
EVALS_PER_RUN = 15  # eval.every=auto: about this many evaluations over algo.total_steps
METRICS = ("eval/return_mean", "eval/return_std", "eval/length_mean")


def cadence(cfg: DictConfig, per_update: int) -> int:
    """`eval.every` in env steps (0: off); `auto` spreads ~15 evaluations over the run, at least one
    update apart."""
    every = cfg.get("eval", {}).get("every", 0)
    if every in (None, 0):
        return 0
    if every == "auto":
        return max(int(cfg.algo.total_steps) // EVALS_PER_RUN, per_update)
    return int(every)


class EpisodeFailed(Exception):  # noqa: N818 - one evaluation episode's env failed; `str` is the cause
    """Raised by `Checked` when an evaluation env raises or returns a NaN or an inf."""


class Checked(gym.Wrapper):
    """An evaluation env whose failures end its episode as `EpisodeFailed`: an exception from `reset` or
    `step`, or a non-finite observation or reward (which would make the evaluation's mean NaN and every
    later comparison with it false)."""

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        try:
            obs, info = self.env.reset(**kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure of user code ends the episode
            raise EpisodeFailed(f"reset raised {type(exc).__name__}: {error_line(exc)}") from exc
        if (what := nonfinite_value(obs)) is not None:
            raise EpisodeFailed(f"reset returned bad data ({what})")
        return obs, info

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        try:
            obs, reward, terminated, truncated, info = self.env.step(action)
        except Exception as exc:  # noqa: BLE001 - see reset
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
        return Checked(make_env(self.env_cfg, action_mask=self.spec.action_mask))

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
        self.failed.append(k)

    def close(self) -> None:
        for env in self.envs:
            env.close()
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
            return {"eval/failed_episodes": float(self.episodes)}
        return {
            "eval/return_mean": float(np.mean(every)),
            "eval/return_std": float(np.std(every)),
            "eval/length_mean": float(np.mean(lengths)),
            **{f"eval/{name}/return_mean": float(np.mean(rs)) for name, rs in returns.items() if rs},
        }

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None


def game_opponents(cfg: DictConfig) -> list[str]:
    """`eval.opponents`, or by default `random` and, on Connect Four, the scripted players: `win_or_block`
    (the self-play recipe's sparring partner) and three it never trains against: `win_or_block:centre`,
    `win_or_block:careful` and `search:1`."""
    from ppo_fabric.games import scripted

    chosen = cfg.eval.get("opponents")
    if chosen:
        return [str(o) for o in chosen]
    known = any(game in str(cfg.env.id) for game in scripted.GAMES)
    held_out = ["win_or_block:centre", "win_or_block:careful", "search:1"]
    return ["random", *(["win_or_block", *held_out] if known else [])]


class Games:
    """A two-player turn-based game's evaluation: the trained policy's games against each of
    `game_opponents` (`eval.episodes` games each, seats alternated, `play_games`); its win rate against
    each, and over all its win, draw and loss rates and its score (win 1, draw 1/2)."""

    score = "score"

    def __init__(self, cfg: DictConfig, specs: dict[str, PolicySpec], seed: int) -> None:
        from ppo_fabric.games.play import aec_env_factory
        from ppo_fabric.policy.game_eval import GameEvalError, opponent_players

        self.name = next((n for n, s in specs.items() if s.trained), next(iter(specs)))
        self.games = int(cfg.eval.episodes)
        self.deterministic = bool(cfg.eval.deterministic)
        self.seed = seed
        self.factory = aec_env_factory(str(cfg.env.id), dict(cfg.env.get("kwargs") or {}))
        state = {"config": {"env": {"id": str(cfg.env.id)}}}
        self.opponents = []
        for opponent in game_opponents(cfg):
            if opponent == "pool" or opponent.startswith("snapshot:"):
                raise ConfigError(f"eval.opponents: {opponent} is for `python -m ppo_fabric.evaluate`; "
                                  "evaluation during training plays random, win_or_block or search[:DEPTH]")  # fmt: skip
            try:
                self.opponents += opponent_players(opponent, state, self.name, True, seed)
            except GameEvalError as exc:
                raise ConfigError(f"eval.opponents: {exc}") from None

    def snapshot(self, models: dict[str, ActorCritic], obs_normalization: Any = None) -> Any:
        from ppo_fabric.policy.game_eval import policy_player

        return policy_player(copy.deepcopy(models[self.name]).cpu(), self.deterministic)

    def play(self, player: Any) -> dict[str, float]:
        from ppo_fabric.games.play import GameResults, play_games

        total, metrics = GameResults(), {}
        for i, (label, opponent) in enumerate(self.opponents):
            results = play_games(self.factory, player, opponent, self.games, self.seed + i * self.games)
            metrics[f"eval/{label}/win_rate"] = results.summary()["win_rate"]
            total.outcomes += results.outcomes
        summary = total.summary()
        return {
            f"eval/{k}": float(summary[k]) for k in ("win_rate", "draw_rate", "loss_rate", "score")
        } | metrics

    def close(self) -> None:
        pass


class PeriodicEvaluation:
    """When evaluations are due, runs them with its scorer (`Episodes`, `ParallelEpisodes` or `Games`),
    here or in a process of its own (`background`), and keeps their record (`state`) for checkpoints and the summary."""

    def __init__(
        self,
        cfg: DictConfig,
        specs: dict[str, PolicySpec],
        per_update: int,
        start_step: int,
        saved: dict | None,
        background: bool = False,
    ) -> None:
        self.every = cadence(cfg, per_update)
        self.seed = int(cfg.seed) + EVAL_SEED_OFFSET
        self.scorer: Episodes | ParallelEpisodes | Games | None = None
        if self.every:
            self.scorer = scorer_for(cfg, specs, self.seed)
        self.next_step = (start_step // self.every + 1) * self.every if self.every else 0
        self.last: dict[str, Any] | None = (saved or {}).get("last")
        self.best: dict[str, Any] | None = (saved or {}).get("best")
        self.background = background and self.every > 0
        self.cfg, self.specs = cfg, specs
        self.evaluator: EvaluatorProcess | None = None  # started at the first evaluation in the background
        self.pending: int | None = None  # the env step of the evaluation in flight
        self.sent: tuple[dict[str, Any], Any] = ({}, None)  # the parameters and statistics it scores
        # (env step, parameters by policy, statistics) of the best evaluation in the background, until
        # `take_best_policy` hands them to the checkpoint that writes them
        self.best_policy: tuple[int, dict[str, Any], Any] | None = None

    @property
    def on(self) -> bool:
        return self.every > 0

    def due(self, env_step: int, last: bool = False) -> bool:
        """At the cadence, and at the run's last update (its final evaluation, what the tables report)."""
        return self.every > 0 and (env_step >= self.next_step or last)

    def run(
        self, models: dict[str, ActorCritic], obs_normalization: dict[str, Any] | None, env_step: int
    ) -> dict[str, float]:
        """Score a copy of `models` (the live policies by name) with `obs_normalization` frozen; returns the
        `eval/*` metrics and keeps the record. The next evaluation is due one `every` later."""
        assert self.scorer is not None
        start = time.perf_counter()
        self.next_step = (env_step // self.every + 1) * self.every
        metrics = self.scorer.play(self.scorer.snapshot(models, obs_normalization))
        return self._record(env_step, metrics, time.perf_counter() - start)

    # ------------------------------------------------------------------------------------ in the background
    @property
    def busy(self) -> bool:
        return self.pending is not None

    def start(
        self, models: dict[str, ActorCritic], obs_normalization: dict[str, Any] | None, env_step: int
    ) -> None:
        """`run` in the evaluator process: the parameters and statistics are copied now (the snapshot it
        scores), the episodes play while training goes on, and `collect` hands their metrics over."""
        assert self.background and self.pending is None, "one evaluation at a time, in the background"
        self.next_step = (env_step // self.every + 1) * self.every
        if self.evaluator is None:
            self.evaluator = EvaluatorProcess(self.cfg, self.specs, self.seed)
        weights = {
            name: {k: v.detach().cpu().clone() for k, v in m.state_dict().items()}
            for name, m in models.items()
        }
        frozen = copy.deepcopy(obs_normalization)
        self.evaluator.submit(weights, frozen)
        self.pending, self.sent = env_step, (weights, frozen)

    def collect(self, wait: bool = False) -> tuple[int, dict[str, float]] | None:
        """(env step, metrics) of the evaluation started last, once it has finished (`wait`: blocks until
        it has); None when none is in flight or it is still running. Raises the evaluator's fault."""
        if self.pending is None or self.evaluator is None or not (wait or self.evaluator.ready()):
            return None
        env_step, waited = self.pending, time.perf_counter()
        try:
            metrics, seconds = self.evaluator.result()
        finally:
            self.pending = None
        metrics = self._record(env_step, metrics, seconds)
        if self.improved(env_step):  # what best.ckpt will hold (`best_policy`)
            self.best_policy = (env_step, *self.sent)
        # the time the run waited for it (the final evaluation); the evaluator's own is time/eval_background_s
        metrics["time/eval_background_s"] = metrics["time/eval_s"]
        metrics["time/eval_s"] = time.perf_counter() - waited if wait else 0.0
        return env_step, metrics

    # ---------------------------------------------------------------------------------------- the record
    def _record(self, env_step: int, metrics: dict[str, float], seconds: float) -> dict[str, float]:
        """The metrics with `time/eval_s`; their score (`eval/return_mean`, games' `eval/score`) becomes
        `last`, and `best` when it beats it. An evaluation with nothing scored leaves the record as it was."""
        assert self.scorer is not None
        key = self.scorer.score
        if f"eval/{key}" in metrics:
            record = {"env_step": env_step, key: metrics[f"eval/{key}"]}
            if "eval/return_std" in metrics:
                record["return_std"] = metrics["eval/return_std"]
            if "eval/win_rate" in metrics:
                record["win_rate"] = metrics["eval/win_rate"]
            self.last = record
            if self.best is None or record[key] > self.best.get(key, -np.inf):
                self.best = record
        return metrics | {"time/eval_s": seconds}

    def take_best_policy(self) -> tuple[int, dict[str, Any], Any] | None:
        """The best evaluated parameters not yet written (background evaluation), once."""
        best, self.best_policy = self.best_policy, None
        return best

    def improved(self, env_step: int) -> bool:
        """Whether the evaluation at `env_step` is the best so far (what `best.ckpt` keeps when on)."""
        return self.best is not None and self.best["env_step"] == env_step

    def state(self) -> dict[str, Any]:
        return {"last": self.last, "best": self.best}

    def close(self) -> None:
        if self.evaluator is not None:
            self.evaluator.close()
            self.evaluator, self.pending = None, None
        if self.scorer is not None:
            self.scorer.close()


class EvaluatorProcess:
    """A process that scores the parameters it is sent with a scorer of its own (`scorer_for`), so that a
    decoupled player's evaluation takes neither its time nor its interpreter's lock: on 2 cores a thread
    cost the pipelined CartPole run ~20% of its SPS, more than evaluating in place (~14%), as the episodes'
    Python and the rollout's fought over the GIL (`benchmarks/results/eval_cost_pipelined.md`).

    Forked where the platform allows it (Linux: nothing to import again; it never touches the parent's
    devices or envs), spawned elsewhere. It ignores SIGINT and SIGTERM (the player that owns it stops it
    at its own boundary) and ends when its pipe closes, so it never outlives the player. A fault in it (a
    failing env) comes back as its one line, raised by `result` as `EnvFault`.
    """

    def __init__(self, cfg: DictConfig, specs: dict[str, PolicySpec], seed: int) -> None:
        methods = multiprocessing.get_all_start_methods()
        context = multiprocessing.get_context(
            "fork" if sys.platform == "linux" and "fork" in methods else "spawn"
        )
        self.conn, child = context.Pipe()
        config = OmegaConf.to_container(cfg, resolve=True)
        self.process = context.Process(
            target=_serve, args=(child, config, specs, seed), name="ppo-fabric-evaluator", daemon=True
        )
        self.process.start()
        child.close()

    def submit(self, weights: dict[str, dict[str, Any]], obs_normalization: dict[str, Any] | None) -> None:
        self.conn.send((weights, obs_normalization))

    def ready(self) -> bool:
        return self.conn.poll()

    def result(self) -> tuple[dict[str, float], float]:
        """(metrics, seconds) of the evaluation submitted last, waiting for it."""
        try:
            kind, value = self.conn.recv()
        except EOFError:
            self.process.join(5)
            raise EnvFault(
                f"the evaluation process ended without a result (exit code {self.process.exitcode})"
            ) from None
        if kind == "fault":
            raise EnvFault(value)
        return value

    def close(self) -> None:
        with contextlib.suppress(OSError):  # it may have gone already
            self.conn.send(None)
        self.process.join(10)
        if self.process.is_alive():  # stuck in an env: it holds nothing to keep
            self.process.kill()
            self.process.join()
        self.conn.close()


def _serve(conn: Any, config: dict[str, Any], specs: dict[str, PolicySpec], seed: int) -> None:
    """The evaluator process: score each (weights, statistics) received until None or the pipe closes."""
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(1)
    scorer = None
    try:
        scorer = scorer_for(OmegaConf.create(config), specs, seed)
        models = {n: ActorCritic(s.obs_space, s.action_space, s.model) for n, s in specs.items()}
        while (message := conn.recv()) is not None:
            weights, obs_normalization = message
            for name, state in weights.items():
                models[name].load_state_dict(state)
            start = time.perf_counter()
            metrics = scorer.play(scorer.snapshot(models, obs_normalization))
            conn.send(("ok", (metrics, time.perf_counter() - start)))
    except EOFError:  # the player has gone
        pass
    except Exception as exc:  # noqa: BLE001 - handed to the player as its one line
        line = (
            str(exc)
            if isinstance(exc, EnvFault | ConfigError)
            else f"{type(exc).__name__}: {error_line(exc)}"
        )
        with contextlib.suppress(OSError):
            conn.send(("fault", f"evaluation: {line}" if not line.startswith("evaluation") else line))
    finally:
        if scorer is not None:
            scorer.close()


def scorer_for(
    cfg: DictConfig, specs: dict[str, PolicySpec], seed: int
) -> Episodes | ParallelEpisodes | Games:
    """The evaluation that fits the env: episodes (single-agent), every policy's episodes (Parallel) or
    games against opponents (turn-based)."""
    if list(specs) == [SINGLE]:
        return Episodes(cfg, specs[SINGLE], seed)
    from ppo_fabric.policy.game_eval import is_aec_game

    if is_aec_game(str(cfg.env.id)):
        return Games(cfg, specs, seed)
    return ParallelEpisodes(cfg, specs, seed)


def evaluation_for(
    cfg: DictConfig,
    specs: dict[str, Any],
    per_update: int,
    session: RunSession,
    resume: dict | None,
    background: bool = False,
) -> PeriodicEvaluation:
    """The writer's evaluation during training (`eval.every`), its record resumed; `background`: in a
    process of its own (`evaluate_in_background`)."""
    saved = resume.get("evaluation") if resume is not None else None
    return PeriodicEvaluation(cfg, specs, per_update, session.start_step, saved, background)


def _models(learners: dict) -> dict[str, ActorCritic]:
    """The live policies by name: the coupled strategy's learners', or a player's own ActorCritics."""
    return {n: p if isinstance(p, ActorCritic) else p.policy for n, p in learners.items()}


def _frozen(collector: Any) -> dict[str, Any] | None:
    return normalizer_state(collector.envs).get("NormalizeObservation")


def evaluate_if_due(
    evaluation: PeriodicEvaluation | None, session: RunSession, done: int, learners: dict, collector: Any
) -> bool:
    """Run the evaluation due after update `done` (the writer only); returns whether it is the best yet.
    `learners`: the coupled strategy's learners, or a player's own policies (ActorCritic by name)."""
    step = session.env_step(done)
    if evaluation is None or not evaluation.due(step, last=done == session.end_update):
        return False
    metrics = evaluation.run(_models(learners), _frozen(collector), step)
    session.logger.log(metrics | {"time/wall_s": session.wall_s()}, step)
    return evaluation.improved(step)


def evaluate_in_background(
    evaluation: PeriodicEvaluation | None,
    session: RunSession,
    done: int,
    policies: dict,
    collector: Any,
    wait: bool = False,
) -> None:
    """A decoupled player's evaluation, off the critical path: log the one that finished, start the one due
    after update `done` on a snapshot of `policies` (one at a time: an evaluation due while another runs
    starts at the next update). At the run's last update, or with `wait` (a stop), the one in flight and
    the final evaluation are waited for, so the summary and the last checkpoint hold them."""
    if evaluation is None or not evaluation.on:
        return
    last = done == session.end_update
    _log_finished(evaluation, session, wait=last or wait)
    step = session.env_step(done)
    if evaluation.due(step, last) and not evaluation.busy and not wait:
        evaluation.start(_models(policies), _frozen(collector), step)
        if last:
            _log_finished(evaluation, session, wait=True)


def _log_finished(evaluation: PeriodicEvaluation, session: RunSession, wait: bool) -> None:
    finished = evaluation.collect(wait)
    if finished is not None:
        step, metrics = finished
        session.logger.log(metrics | {"time/wall_s": session.wall_s()}, step)


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
