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
from typing import Any

import numpy as np
from omegaconf import DictConfig

from ppo_fabric.envs.make import make_env
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


class PeriodicEvaluation:
    """When evaluations are due, runs them, and keeps their record (`state`) for checkpoints and the summary."""

    def __init__(
        self, cfg: DictConfig, spec: PolicySpec, per_update: int, start_step: int, saved: dict | None
    ) -> None:
        self.every = cadence(cfg, per_update) if spec.agents == 1 else 0
        self.episodes = int(cfg.eval.episodes) if self.every else 0
        self.deterministic = bool(cfg.eval.deterministic) if self.every else True
        self.seed = int(cfg.seed) + EVAL_SEED_OFFSET
        self.env_cfg = cfg.env
        self.spec = spec
        self.next_step = (start_step // self.every + 1) * self.every if self.every else 0
        self.last: dict[str, Any] | None = (saved or {}).get("last")
        self.best: dict[str, Any] | None = (saved or {}).get("best")
        self.envs: list[Any] = []

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
        policy = Policy(
            copy.deepcopy(model).cpu(),
            self.spec.obs_space,
            self.spec.action_space,
            obs_normalization=obs_normalization,
            mask_width=self.spec.action_mask,
        )
        returns, lengths = self._play(policy)
        self.next_step = (env_step // self.every + 1) * self.every
        mean = float(np.mean(returns))
        record = {"env_step": env_step, "return_mean": mean, "return_std": float(np.std(returns))}
        self.last = record
        if self.best is None or mean > self.best["return_mean"]:
            self.best = record
        return {
            "eval/return_mean": mean,
            "eval/return_std": record["return_std"],
            "eval/length_mean": float(np.mean(lengths)),
            "time/eval_s": time.perf_counter() - start,
        }

    def _play(self, policy: Policy) -> tuple[list[float], list[int]]:
        if not self.envs:
            self.envs = [
                make_env(self.env_cfg, action_mask=self.spec.action_mask) for _ in range(self.episodes)
            ]
        from ppo_fabric.envs.atari import records_games

        if policy.recurrent or records_games(self.envs[0]):  # per-episode state and whole games: one by one
            returns, lengths = [], []
            for k, env in enumerate(self.envs):
                r, n, _ = play(policy, env, 1, self.deterministic, self.seed + k)
                returns += r
                lengths += n
            return returns, lengths
        return play_side_by_side(policy, self.envs, self.deterministic, self.seed)

    def improved(self, env_step: int) -> bool:
        """Whether the evaluation at `env_step` is the best so far (what `best.ckpt` keeps when on)."""
        return self.best is not None and self.best["env_step"] == env_step

    def state(self) -> dict[str, Any]:
        return {"last": self.last, "best": self.best}

    def close(self) -> None:
        for env in self.envs:
            env.close()
        self.envs = []


def evaluation_for(
    cfg: DictConfig, specs: dict[str, Any], per_update: int, session: RunSession, resume: dict | None
) -> PeriodicEvaluation | None:
    """The writer's evaluation during training (single-agent runs; `eval.every`), its record resumed."""
    if list(specs) != [SINGLE]:
        return None
    saved = resume.get("evaluation") if resume is not None else None
    return PeriodicEvaluation(cfg, specs[SINGLE], per_update, session.start_step, saved)


def evaluate_if_due(
    evaluation: PeriodicEvaluation | None, session: RunSession, done: int, learners: dict, collector: Any
) -> bool:
    """Run the evaluation due after update `done` (the writer only); returns whether it is the best yet.
    `learners`: the coupled strategy's learners, or a player's own policies (ActorCritic by name)."""
    step = session.env_step(done)
    if evaluation is None or not evaluation.due(step, last=done == session.end_update):
        return False
    frozen = normalizer_state(collector.envs).get("NormalizeObservation")
    policy = learners[SINGLE]
    metrics = evaluation.run(policy if isinstance(policy, ActorCritic) else policy.policy, frozen, step)
    session.logger.log(metrics | {"time/wall_s": session.wall_s()}, step)
    return evaluation.improved(step)


def play_side_by_side(
    policy: Policy, envs: list[Any], deterministic: bool, seed: int
) -> tuple[list[float], list[int]]:
    """One whole episode on each env (env k reset with `seed + k`), all stepped together with one batched
    `predict` per step; finished envs wait. Feed-forward policies (no state to carry per episode)."""
    observations, infos = zip(*(env.reset(seed=seed + k) for k, env in enumerate(envs)), strict=True)
    obs, info = list(observations), list(infos)
    returns = [0.0] * len(envs)
    lengths = [0] * len(envs)
    running = list(range(len(envs)))
    while running:
        batch = _stack([obs[k] for k in running])
        masks = [info[k].get("action_mask") for k in running]
        mask = np.stack(masks) if masks[0] is not None else None
        actions, _ = policy.predict(batch, None, None, deterministic, mask)
        still = []
        for row, k in enumerate(running):
            action = actions[row]
            obs[k], reward, terminated, truncated, info[k] = envs[k].step(
                int(action) if action.ndim == 0 else action
            )
            returns[k] += float(reward)
            lengths[k] += 1
            if not (terminated or truncated):
                still.append(k)
        running = still
    return returns, lengths


def _stack(observations: list[Any]) -> Any:
    if isinstance(observations[0], dict):
        return {key: np.stack([o[key] for o in observations]) for key in observations[0]}
    return np.stack(observations)
