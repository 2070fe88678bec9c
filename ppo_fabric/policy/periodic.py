"""Evaluation during training: the live policy scored on episodes of its own at a fixed cadence.

The training return is the mean of stochastic episodes that ran while the policy changed under them;
published numbers (RL Zoo's `--eval-freq`, SB3's `EvalCallback`, CleanRL's evaluation) come from separate
episodes with the policy as it stands. Every `eval.every` env steps, and at the run's last update, the writer
rank copies the policies and scores the copy with the scorer that fits the env (`policy/scorers.py`):
episodes for single-agent envs, every policy's episodes for PettingZoo Parallel envs, games against
opponents for two-player turn-based games.

The record (`last`, `best` with their env steps) travels in checkpoints, so a resumed run keeps it, and
decides `best.ckpt`. A decoupled player evaluates in a process of its own (`background`,
`policy/evaluator.py`), off the critical path.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import numpy as np
from omegaconf import DictConfig

from ppo_fabric.envs.guard import EnvFault
from ppo_fabric.envs.normalize import normalizer_state
from ppo_fabric.learn.learners import PolicySpec
from ppo_fabric.models.agent import ActorCritic
from ppo_fabric.policy.evaluator import EvaluatorProcess
from ppo_fabric.policy.scorers import (
    Episodes,
    Games,
    ParallelEpisodes,
    evaluation_seed,
    said,
    score,
    scorer_for,
)
from ppo_fabric.runs.session import STOP, AbandonEvaluation, RunSession

UNSCORED_IN_A_ROW = 3  # evaluations in a row whose every episode failed (env.on_error=restart) end the run
EVALS_PER_RUN = 15  # eval.every=auto: about this many evaluations over algo.total_steps
COSTLY_S = 10.0  # an evaluation shorter than this is never said to cost too much (`say_cost`)
METRICS = ("eval/return_mean", "eval/return_std", "eval/length_mean")


def cadence(cfg: DictConfig, per_update: int) -> int:
    """`eval.every` in env steps (0: off); `auto` spreads ~15 evaluations over the run, at least one
    update apart."""
    every = cfg.eval.every
    if every in (None, 0):
        return 0
    if every == "auto":
        return max(int(cfg.algo.total_steps) // EVALS_PER_RUN, per_update)
    return int(every)


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
        in_flight_policy: dict | None = None,
    ) -> None:
        self.every = cadence(cfg, per_update)
        self.seed = evaluation_seed(int(cfg.seed))
        self.scorer: Episodes | ParallelEpisodes | Games | None = None
        if self.every:
            self.scorer = scorer_for(cfg, specs, self.seed)
        self.next_step = (start_step // self.every + 1) * self.every if self.every else 0
        # the checkpoint's own update was being evaluated (in the background) when it was written, and the
        # run stopped before that evaluation reached it: the resumed run owes it, on the same parameters
        self.owed = bool(self.every) and (saved or {}).get("in_flight") == start_step
        if self.owed:
            self.next_step = start_step

        # a checkpoint's own record ends at its step (`state(upto=...)`); one written before that rule may
        # hold later evaluations, from a timeline the resumed run does not follow: they are dropped
        def own(record: dict[str, Any] | None) -> dict[str, Any] | None:
            return record if record is not None and record["env_step"] <= start_step else None

        self.last: dict[str, Any] | None = own((saved or {}).get("last"))
        # a best dropped: the last kept is the best left of what the checkpoint's timeline scored
        self.best: dict[str, Any] | None = own((saved or {}).get("best")) or self.last
        # every evaluation's record in step order (the resumed ones first): a checkpoint keeps the record
        # as it stood at its own step (`state(upto=...)`)
        kept = [r for r in (self.best, self.last) if r is not None]
        self.records = sorted({r["env_step"]: r for r in kept}.values(), key=lambda r: r["env_step"])
        self.background = background and self.every > 0
        # an evaluation of an earlier update in flight when the checkpoint was written (in the background,
        # where evaluations run while training goes on): the checkpoint kept the parameters and statistics
        # it scores (`in_flight_policy`), and the resumed run plays it first. Without them the resumed
        # record had a gap where the uninterrupted run's had that evaluation.
        self.replay: tuple[int, dict[str, Any], Any] | None = None
        flying = (saved or {}).get("in_flight")
        policy = in_flight_policy if in_flight_policy is not None else {}
        if (
            self.background
            and flying is not None
            and flying < start_step
            and policy.get("env_step") == flying
        ):
            self.replay = (flying, policy["weights"], policy.get("obs_normalization"))
        self.cfg, self.specs = cfg, specs
        self.evaluator: EvaluatorProcess | None = None  # started at the first evaluation in the background
        self.pending: int | None = None  # the env step of the evaluation in flight
        self.submitted: int | None = None  # the env step of the last evaluation started
        self.sent: tuple[dict[str, Any], Any] = ({}, None)  # the parameters and statistics it scores
        # (env step, parameters by policy, statistics) of the best evaluation in the background, until
        # `take_best_policy` hands them to the checkpoint that writes them
        self.best_policy: tuple[int, dict[str, Any], Any] | None = None
        self.since = time.perf_counter()  # the end of the last evaluation in this process (or its creation)
        self.cost_said = False
        self.unscored = 0  # evaluations in a row whose every episode failed and was left out

    def say_cost(self, seconds: float, env_step: int) -> None:
        """Once a run: an evaluation in the run's process that took over twice the training since the last
        one (and over COSTLY_S). On a slow simulator `eval.every=auto`'s 10 whole episodes took 28 times the
        training of a short run, which crawled with no word of why."""
        now = time.perf_counter()
        between, self.since = now - seconds - self.since, now
        if self.cost_said or seconds < COSTLY_S or seconds < 2 * between:
            return
        self.cost_said = True
        said(f"the evaluation at env step {env_step:,} took {seconds:.0f} s, {seconds / max(between, 1e-9):.0f} "
             f"times the training since the one before; lower eval.episodes ({self.cfg.eval.episodes}) or raise "
             "eval.every (0: none)")  # fmt: skip

    @property
    def on(self) -> bool:
        return self.every > 0

    @property
    def keeps_record(self) -> bool:
        """On, or off in a session resumed from a run that evaluated: its checkpoints and summary carry the
        record on as it was, and best.ckpt (the best evaluation's) is left alone. Dropped, the next resume
        with evaluation on started a fresh record and overwrote best.ckpt with a worse policy."""
        return self.on or self.last is not None or self.best is not None

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
        self.owed, self.pending = False, None  # one left unfinished before is given up (a stop ends there)
        metrics = score(self.scorer, models, obs_normalization)
        return self._record(env_step, metrics, time.perf_counter() - start)

    def abandoned(self, env_step: int) -> None:
        """The evaluation at `env_step` was left unfinished by a stop: the stop's checkpoint names it in
        flight, and a run resumed from it plays it first, on the same parameters (`owed`). Dropped, the
        resumed run went on at its cadence without it, and its record (and best.ckpt) differed from the
        uninterrupted run's."""
        self.pending = env_step

    # ------------------------------------------------------------------------------------ in the background
    @property
    def busy(self) -> bool:
        return self.pending is not None

    def start(
        self, models: dict[str, ActorCritic], obs_normalization: dict[str, Any] | None, env_step: int
    ) -> None:
        """`run` in the evaluator process: the parameters and statistics are copied now (the snapshot it
        scores), the episodes play while training goes on, and `collect` hands their metrics over."""
        weights = {
            name: {k: v.detach().cpu().clone() for k, v in m.state_dict().items()}
            for name, m in models.items()
        }
        self._submit(weights, copy.deepcopy(obs_normalization), env_step)

    def start_replay(self) -> None:
        """Play the evaluation a resumed checkpoint had in flight, on the parameters it kept (`replay`)."""
        assert self.replay is not None
        (env_step, weights, frozen), self.replay = self.replay, None
        self._submit(weights, frozen, env_step)

    def _submit(self, weights: dict[str, Any], frozen: Any, env_step: int) -> None:
        assert self.background and self.pending is None, "one evaluation at a time, in the background"
        self.next_step = (env_step // self.every + 1) * self.every
        self.owed = False
        if self.evaluator is None:
            self.evaluator = EvaluatorProcess(self.cfg, self.specs, self.seed)
        self.evaluator.submit(weights, frozen)
        self.pending, self.submitted, self.sent = env_step, env_step, (weights, frozen)

    def in_flight_policy(self, upto: int) -> dict[str, Any] | None:
        """What a checkpoint at env step `upto` keeps of the evaluation in flight of an earlier update: the
        parameters and statistics it scores, which a run resumed from it replays (`replay`). None when none
        is, or it is the checkpoint's own update (its parameters are the checkpoint's: `owed`)."""
        if self.pending is None or self.pending >= upto:
            return None
        weights, frozen = self.sent
        return {"env_step": self.pending, "weights": weights, "obs_normalization": frozen}

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
            self.records.append(record)
            if self.best is None or record[key] > self.best.get(key, -np.inf):
                self.best = record
            self.unscored = 0
        elif "eval/failed_episodes" in metrics:
            self.unscored += 1
            self._check_unscored(env_step)
        return metrics | {"time/eval_s": seconds}

    def _check_unscored(self, env_step: int) -> None:
        """`env.on_error=restart` leaves a failed evaluation episode out, which a transient fault needs; an
        evaluation env that always fails left every evaluation out, and the run ended with exit 0, no
        evaluation in its summary, no best.ckpt and no word beyond each evaluation's line. Three in a row,
        or a final evaluation with none scored before it, end the run."""
        final = env_step >= int(self.cfg.algo.total_steps)
        if self.unscored >= UNSCORED_IN_A_ROW:
            raise EnvFault(
                f"{self.unscored} evaluations in a row had every episode fail (env.on_error=restart left them "
                f"out; the lines above name why), the last at env step {env_step:,}: the run ends rather than "
                "go on unevaluated; fix the evaluation env or set eval.every=0"
            )
        if final and self.last is None:
            raise EnvFault(
                f"the final evaluation (env step {env_step:,}) had every episode fail, and no evaluation of the "
                "run scored one (env.on_error=restart left them out; the lines above name why): the run has no "
                "evaluation; fix the evaluation env or set eval.every=0"
            )

    def take_best_policy(self, upto: int | None = None) -> tuple[int, dict[str, Any], Any] | None:
        """The best evaluated parameters not yet written (background evaluation), once; with `upto`, only
        when they are from that env step or before (best.ckpt is never ahead of the checkpoint written
        with it: a crash would leave it from a timeline the resumed run does not follow)."""
        if self.best_policy is None or (upto is not None and self.best_policy[0] > upto):
            return None
        best, self.best_policy = self.best_policy, None
        return best

    def improved(self, env_step: int) -> bool:
        """Whether the evaluation at `env_step` is the best so far (what `best.ckpt` keeps when on)."""
        return self.best is not None and self.best["env_step"] == env_step

    def state(self, upto: int | None = None) -> dict[str, Any]:
        """The record a checkpoint keeps: the last and best evaluation, and the env step of the one in
        flight (None: none), which a run resumed from that checkpoint owes (`owed`). `upto`: as it stood
        at that env step, the checkpoint's: an evaluation in the background may finish after later updates,
        and a checkpoint holding it named a best from a timeline its resumed run does not follow. `seed`:
        the first evaluation episode's (episode k: + k), what `ppo_fabric.evaluate seed=` replays."""
        if upto is None:
            return {"last": self.last, "best": self.best, "in_flight": self.pending, "seed": self.seed}
        kept = [r for r in self.records if r["env_step"] <= upto]
        if self.scorer is None:  # off (`keeps_record`): the resumed record as it came, nothing scored since
            best = self.best if self.best is not None and self.best["env_step"] <= upto else None
            return {"last": kept[-1] if kept else None, "best": best, "in_flight": None, "seed": self.seed}
        key = self.scorer.score
        best = None
        for record in kept:  # the first of the highest, as `_record` keeps it
            if best is None or record.get(key, -np.inf) > best.get(key, -np.inf):
                best = record
        pending = self.pending if self.pending is not None and self.pending <= upto else None
        return {"last": kept[-1] if kept else None, "best": best, "in_flight": pending, "seed": self.seed}

    def close(self) -> None:
        if self.evaluator is not None:
            self.evaluator.close(0.0 if self.pending is not None else 10.0)  # a running one is given up
            self.evaluator, self.pending = None, None
        if self.scorer is not None:
            self.scorer.close()


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
    policy = resume.get("evaluation_policy") if resume is not None else None
    return PeriodicEvaluation(cfg, specs, per_update, session.start_step, saved, background, policy)


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
    try:
        with STOP.abandoning():  # a stop signal leaves it unfinished: the run checkpoints at this boundary
            metrics = evaluation.run(_models(learners), _frozen(collector), step)
    except AbandonEvaluation:
        evaluation.abandoned(step)  # not recorded: a session resumed from this boundary plays it first
        return False
    # the final one: nothing left to save; a resume's owed one: no training of this session to weigh it by
    if session.start_update < done < session.end_update:
        evaluation.say_cost(metrics["time/eval_s"], step)
    session.logger.log_evaluation(metrics | {"time/wall_s": session.wall_s()}, step)
    return evaluation.improved(step)


def evaluate_in_background(
    evaluation: PeriodicEvaluation | None, session: RunSession, done: int, policies: dict, collector: Any
) -> int | None:
    """A decoupled player's evaluation, off the critical path: log the one that finished, start the one due
    after update `done` on a snapshot of `policies` (one at a time: an evaluation due while another runs
    starts at the next update, or, the final one, in `finish_in_background`). Never waits. Returns the env
    step of the evaluation that finished, if one did (its checkpoint may have been written without it)."""
    if evaluation is None or not evaluation.on:
        return None
    finished = _log_finished(evaluation, session, wait=False)
    if evaluation.replay is not None and not evaluation.busy:  # a resumed checkpoint's, first
        evaluation.start_replay()
    step = session.env_step(done)
    if evaluation.due(step, done == session.end_update) and not evaluation.busy:
        evaluation.start(_models(policies), _frozen(collector), step)
    return finished


def finish_in_background(
    evaluation: PeriodicEvaluation | None,
    session: RunSession,
    done: int,
    policies: dict,
    collector: Any,
    final: bool,
) -> int:
    """The run's end, after its last collectives (the trainers wait in those only `collectives.timeout`):
    the evaluation in flight and, at the last update (`final`), the final one if it could not start there,
    waited for and logged, so that the checkpoint and the summary written next hold them. At a stop
    (`final=False`) only one already finished is taken: one still running on a slow env held the stop
    checkpoint for minutes; the checkpoint keeps it in flight, and a resume evaluates it again.

    A stop signal during the final wait gives the final evaluation up (it held the stop for as long as
    its episodes took, past a cluster's grace period): returns that signal (0: none), the evaluation left
    in flight at the last update, which the stop's checkpoint then owes, as a coupled run's does."""
    if evaluation is None or not evaluation.on:
        return 0
    if not final:
        _log_finished(evaluation, session, wait=False)
        return 0
    step = session.env_step(done)
    try:
        with STOP.abandoning():
            _log_finished(evaluation, session, wait=True)
            if evaluation.submitted != step:
                evaluation.start(_models(policies), _frozen(collector), step)
                _log_finished(evaluation, session, wait=True)
    except AbandonEvaluation:
        evaluation.abandoned(step)  # an earlier one still running is given up with it
        return STOP.signum
    return 0


def _log_finished(evaluation: PeriodicEvaluation, session: RunSession, wait: bool) -> int | None:
    finished = evaluation.collect(wait)
    if finished is None:
        return None
    step, metrics = finished
    session.logger.log_evaluation(metrics | {"time/wall_s": session.wall_s()}, step)
    return step
