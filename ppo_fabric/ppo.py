"""Coupled PPO: every rank collects with its own envs and trains; Fabric DDP all-reduces the gradients.

Each update, on every rank: collect a rollout (`rollout.py`), update every trained policy on it
(`update.py`), log and checkpoint when due (`session.py`).

Run as a script under `fabric run --accelerator=cpu --devices=2 ppo_fabric/ppo.py [overrides]`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, NoReturn

import torch
from lightning_fabric import Fabric
from omegaconf import DictConfig

from ppo_fabric.collect.rollout import build_collector, training_batches
from ppo_fabric.config.values import training_layout
from ppo_fabric.learn.learners import build_learners, learners_state, policies_of, policy_specs
from ppo_fabric.learn.settings import UpdateSettings
from ppo_fabric.learn.update import update_policies
from ppo_fabric.policy.periodic import evaluate_if_due, evaluation_for
from ppo_fabric.runs import checkpoint as ckpt
from ppo_fabric.runs.metrics import parameters_digest
from ppo_fabric.runs.session import (
    RunSession,
    closing_after,
    collector_state,
    end_of_run,
    env_settings,
    episode_metrics,
    recent_windows,
    resume_collector,
)
from ppo_fabric.wire.protocol import all_gather_objects, boundary_group, max_over, sum_reduce


def main(fabric: Fabric, cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Collect with every rank, update with every rank; returns the run summary (on every rank)."""
    rank, world = fabric.global_rank, fabric.world_size
    specs = policy_specs(cfg)
    resume = ckpt.load(cfg.resume, env_state=str(cfg.resume_env)) if cfg.resume is not None else None
    learners = build_learners(fabric, specs, resume, float(cfg.algo.adam_eps))
    start = 0 if resume is None else int(resume["env_step"])
    collector = build_collector(
        cfg, specs, rank, fabric.device, sum_reduce(None, fabric.device), start_step=start
    )
    policies = policies_of(learners)

    layout = training_layout(cfg, world)
    per_update = layout.env_steps
    settings = UpdateSettings.of(cfg.algo)
    if resume is not None:
        changed = resume_collector(collector, resume, rank, world, int(cfg.seed), env_settings(cfg))
        if changed and rank == 0:
            fabric.print(changed)
    session = RunSession(cfg, run_dir, rank == 0, per_update, resume)
    evaluation = evaluation_for(cfg, specs, per_update, session, resume) if rank == 0 else None
    # the agreement after rank 0's evaluation: the other ranks wait for it there, however long it plays
    boundary = boundary_group(float(cfg.collectives.timeout) + float(cfg.stall_timeout or 0))

    def mean_across(t: torch.Tensor) -> torch.Tensor:
        return fabric.all_reduce(t, reduce_op="mean")

    def sum_across(t: torch.Tensor) -> torch.Tensor:
        return fabric.all_reduce(t.to(fabric.device), reduce_op="sum").cpu()

    def checkpoint(update: int, best: bool | None = None, numbered: bool = True) -> None:
        rank_states = all_gather_objects(collector_state(collector))
        state = learners_state(cfg, learners)
        if evaluation is not None and evaluation.keeps_record:
            state["evaluation"] = evaluation.state()
        session.write_checkpoint(state, rank_states, update, best, numbered)

    def summary(update: int, signum: int = 0) -> dict[str, Any]:
        """summary.json's content at the end or at a stop (every rank gathers: all agreed to get here)."""
        players = all_gather_objects(end_of_run(collector))
        digests = all_gather_objects(parameters_digest(*policies.values()))
        summary = session.summary(
            "coupled", update, players, digests, session.watch.totals, specs, world, signum
        )
        if evaluation is not None and evaluation.keeps_record:
            summary["evaluation"] = evaluation.state()
        return summary

    def stop(update: int, signum: int) -> NoReturn:
        with closing_after(collector):
            session.stop(signum, update, summary(update, signum))

    def abandoned() -> bool:  # a stop left the writer's evaluation unfinished (`evaluate_if_due`)
        return evaluation is not None and evaluation.busy

    # a stop left the checkpoint's evaluation unfinished: it is played first, on the checkpoint's parameters
    if resume is not None:
        owed = evaluation is not None and evaluation.owed
        improved = owed and evaluate_if_due(evaluation, session, session.start_update, learners, collector)
        flags = session.boundary_flags(improved, abandoned())
        signum, _, best, _ = session.agreed(max_over(flags, "cpu", boundary))
        # a stop during the final evaluation left nothing to train: last.ckpt gets its record
        owed_final = (resume.get("evaluation") or {}).get("in_flight") == session.env_step(session.end_update)
        if best or signum or (owed_final and session.start_update == session.end_update):
            evaluating = evaluation is not None and evaluation.keeps_record
            checkpoint(session.start_update, best=best if evaluating else None, numbered=False)
        if signum:  # during that evaluation, or before: it stays owed
            stop(session.start_update, signum)

    for update in range(session.start_update, session.end_update):
        t0 = time.perf_counter()
        collector.collect(policies, session.env_step(update))
        t1 = time.perf_counter()
        stats = update_policies(
            fabric,
            learners,
            training_batches(collector, specs),
            settings=settings,
            env_step=session.env_step(update),
            lr_schedule=session.lr_schedule,
            mean_across=mean_across if world > 1 else None,
            rank_minibatch=layout.rank_minibatch,
        )
        t2 = time.perf_counter()
        collector.after_update(policies, update + 1)
        session.watch.add("collect", t1 - t0)
        session.watch.add("train", t2 - t1)
        done = update + 1
        if session.log_due(done):
            episodes = episode_metrics(collector, sum_across if world > 1 else None)
            windows = recent_windows(
                collector.episodes.window, rank, world, sum_across if world > 1 else None
            )
            row = stats | episodes | {"time/collect_s": t1 - t0, "time/train_s": t2 - t1}
            session.log(done, row, collector, windows)
        improved = evaluate_if_due(evaluation, session, done, learners, collector)
        flags = session.boundary_flags(improved, abandoned())  # a new best is saved by every rank
        signum, clock_due, best, unfinished = session.agreed(max_over(flags, "cpu", boundary))
        due = session.checkpoint_due(done) or clock_due
        if due or best or (signum and session.last_checkpoint < done):
            evaluating = evaluation is not None and evaluation.keeps_record
            checkpoint(done, best=improved if evaluating else None, numbered=due or bool(signum))
        if signum and (done < session.end_update or unfinished):  # the final evaluation's too
            stop(done, signum)

    finished = summary(session.end_update)
    # the outputs first: an env whose close() hangs (the watchdog then ends the run) or raises loses nothing
    with closing_after(collector, evaluation):
        session.finish(finished)
    return finished


if __name__ == "__main__":
    from ppo_fabric.app.launch import run_script

    run_script("coupled", main)
