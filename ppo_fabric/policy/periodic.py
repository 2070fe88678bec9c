"""Evaluation during training: the live policy scored on episodes of its own at a fixed cadence.

The training return is the mean of stochastic episodes that ran while the policy changed under them;
published numbers (RL Zoo's `--eval-freq`, SB3's `EvalCallback`, CleanRL's evaluation) come from separate
episodes with the policy as it stands. Every `eval.every` env steps the writer rank copies the policy and
plays `eval.episodes` whole episodes on envs of its own: seeds `seed + EVAL_SEED_OFFSET + k`, never the
training envs or their seeds, the observation statistics frozen at their training values, the mode of the
action distribution unless `eval.deterministic=false`. All episodes run side by side (one batched forward per
step), so an evaluation costs about as many forwards as its longest episode has steps.

The record (`last`, `best` with their env steps) travels in checkpoints, so a resumed run keeps it, and
decides `best.ckpt` when evaluation is on. Single-agent runs; multi-agent runs keep their training return.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import gymnasium as gym
import numpy as np
from omegaconf import DictConfig

from ppo_fabric.envs.guard import EnvFault, error_line, nonfinite_value
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
        if (what := nonfinite_value(obs, reward)) is not None:
            raise EpisodeFailed(f"step returned bad data ({what})")
        return obs, reward, terminated, truncated, info


class PeriodicEvaluation:
    """When evaluations are due, runs them (here, or on a thread with `background`), and keeps their record
    (`state`) for checkpoints and the summary.

    A failing evaluation env (`Checked`) ends the run with its one-line cause, as a failing training env
    does, unless `env.on_error=restart`: then its episode is left out of the evaluation (counted in
    `eval/failed_episodes`) and the env is rebuilt for the next one.
    """

    def __init__(
        self,
        cfg: DictConfig,
        spec: PolicySpec,
        per_update: int,
        start_step: int,
        saved: dict | None,
        background: bool = False,
    ) -> None:
        self.every = cadence(cfg, per_update) if spec.agents == 1 else 0
        self.episodes = int(cfg.eval.episodes) if self.every else 0
        self.deterministic = bool(cfg.eval.deterministic) if self.every else True
        self.restart = on_error(cfg.env) == "restart"
        self.seed = int(cfg.seed) + EVAL_SEED_OFFSET
        self.env_cfg = cfg.env
        self.spec = spec
        self.next_step = (start_step // self.every + 1) * self.every if self.every else 0
        self.last: dict[str, Any] | None = (saved or {}).get("last")
        self.best: dict[str, Any] | None = (saved or {}).get("best")
        self.envs: list[Any] = []
        self.failed: list[int] = []  # this evaluation's failed episodes (env.on_error=restart)
        self.pool = ThreadPoolExecutor(1, "evaluation") if background and self.every else None
        self.pending: tuple[int, Future] | None = None  # (env step, the thread's result) in flight

    @property
    def on(self) -> bool:
        return self.every > 0

    def due(self, env_step: int, last: bool = False) -> bool:
        """At the cadence, and at the run's last update (its final evaluation, what the tables report)."""
        return self.every > 0 and (env_step >= self.next_step or last)

    def run(self, model: Any, obs_normalization: dict[str, Any] | None, env_step: int) -> dict[str, float]:
        """Score a copy of `model` (the live `ActorCritic`) with `obs_normalization` frozen; returns the
        `eval/*` metrics and keeps the record. The next evaluation is due one `every` later."""
        start = time.perf_counter()
        self.next_step = (env_step // self.every + 1) * self.every
        returns, lengths = self._play(self._snapshot(model, obs_normalization))
        return self._record(env_step, returns, lengths, time.perf_counter() - start)

    # ------------------------------------------------------------------------------------ in the background
    @property
    def busy(self) -> bool:
        return self.pending is not None

    def start(self, model: Any, obs_normalization: dict[str, Any] | None, env_step: int) -> None:
        """`run` on a thread: the policy and its statistics are copied now (the snapshot it scores), the
        episodes play while training goes on, and `collect` hands their metrics over."""
        assert self.pool is not None and self.pending is None, "one evaluation at a time, in the background"
        self.next_step = (env_step // self.every + 1) * self.every
        policy = self._snapshot(model, obs_normalization)
        self.pending = (env_step, self.pool.submit(self._timed_play, policy))

    def collect(self, wait: bool = False) -> tuple[int, dict[str, float]] | None:
        """(env step, metrics) of the evaluation started last, once it has finished (`wait`: blocks until
        it has); None when none is in flight or it is still running. Raises what the thread raised."""
        if self.pending is None or not (wait or self.pending[1].done()):
            return None
        env_step, future = self.pending
        waited = time.perf_counter()
        returns, lengths, seconds = future.result()
        self.pending = None
        metrics = self._record(env_step, returns, lengths, seconds)
        # the time the run waited for it (the final evaluation); the thread's own is time/eval_thread_s
        metrics["time/eval_thread_s"] = metrics["time/eval_s"]
        metrics["time/eval_s"] = time.perf_counter() - waited if wait else 0.0
        return env_step, metrics

    def _timed_play(self, policy: Policy) -> tuple[list[float], list[int], float]:
        start = time.perf_counter()
        returns, lengths = self._play(policy)
        return returns, lengths, time.perf_counter() - start

    # ----------------------------------------------------------------------------------------- the episodes
    def _snapshot(self, model: Any, obs_normalization: dict[str, Any] | None) -> Policy:
        return Policy(
            copy.deepcopy(model).cpu(),
            self.spec.obs_space,
            self.spec.action_space,
            obs_normalization=copy.deepcopy(obs_normalization),
            mask_width=self.spec.action_mask,
        )

    def _make(self) -> gym.Env:
        return Checked(make_env(self.env_cfg, action_mask=self.spec.action_mask))

    def _play(self, policy: Policy) -> tuple[list[float], list[int]]:
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
        return returns, lengths

    def _episode_failed(self, k: int, cause: str) -> None:
        where = f"evaluation env {k} (seed {self.seed + k})"
        if not self.restart:
            raise EnvFault(f"{where}: {cause}; env.on_error=restart leaves such an episode out instead")
        self.failed.append(k)

    def _record(self, env_step: int, returns: list[float], lengths: list[int], seconds: float) -> dict:
        """The evaluation's metrics; its mean becomes `last` (and `best` when it beats it)."""
        failed = {"eval/failed_episodes": float(len(self.failed))} if self.failed else {}
        if not returns:  # every episode failed (env.on_error=restart): nothing to score
            return failed | {"time/eval_s": seconds}
        mean = float(np.mean(returns))
        record = {"env_step": env_step, "return_mean": mean, "return_std": float(np.std(returns))}
        self.last = record
        if self.best is None or mean > self.best["return_mean"]:
            self.best = record
        return {
            "eval/return_mean": mean,
            "eval/return_std": record["return_std"],
            "eval/length_mean": float(np.mean(lengths)),
            **failed,
            "time/eval_s": seconds,
        }

    def improved(self, env_step: int) -> bool:
        """Whether the evaluation at `env_step` is the best so far (what `best.ckpt` keeps when on)."""
        return self.best is not None and self.best["env_step"] == env_step

    def state(self) -> dict[str, Any]:
        return {"last": self.last, "best": self.best}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool, self.pending = None, None
        for env in self.envs:
            env.close()
        self.envs = []


def evaluation_for(
    cfg: DictConfig,
    specs: dict[str, Any],
    per_update: int,
    session: RunSession,
    resume: dict | None,
    background: bool = False,
) -> PeriodicEvaluation | None:
    """The writer's evaluation during training (single-agent runs; `eval.every`), its record resumed;
    `background`: on a thread (`evaluate_in_background`)."""
    if list(specs) != [SINGLE]:
        return None
    saved = resume.get("evaluation") if resume is not None else None
    return PeriodicEvaluation(cfg, specs[SINGLE], per_update, session.start_step, saved, background)


def _scored(learners: dict) -> ActorCritic:
    policy = learners[SINGLE]  # the coupled strategy's learner, or a player's own ActorCritic
    return policy if isinstance(policy, ActorCritic) else policy.policy


def evaluate_if_due(
    evaluation: PeriodicEvaluation | None, session: RunSession, done: int, learners: dict, collector: Any
) -> bool:
    """Run the evaluation due after update `done` (the writer only); returns whether it is the best yet.
    `learners`: the coupled strategy's learners, or a player's own policies (ActorCritic by name)."""
    step = session.env_step(done)
    if evaluation is None or not evaluation.due(step, last=done == session.end_update):
        return False
    frozen = normalizer_state(collector.envs).get("NormalizeObservation")
    metrics = evaluation.run(_scored(learners), frozen, step)
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
        frozen = normalizer_state(collector.envs).get("NormalizeObservation")
        evaluation.start(_scored(policies), frozen, step)
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
    while running:
        batch = _stack([obs[k] for k in running])
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
