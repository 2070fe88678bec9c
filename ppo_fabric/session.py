"""What a run owns whatever its strategy: the run directory, logging and progress, the checkpoint rule,
each collecting rank's part of a checkpoint, episode statistics, summary.json and the final line.

A strategy builds one `RunSession` per process and tells it what happened (a log row, an update that
finished, the end); the session decides what to write and where. Only the writing rank (global rank 0)
touches the disk; every other rank goes through the same calls, so the strategies never branch on the
rank for bookkeeping.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from ppo_fabric import checkpoint as ckpt
from ppo_fabric.learners import PolicySpec, metric_name
from ppo_fabric.metrics import (
    RunLogger,
    Stopwatch,
    episode_means,
    episode_sums,
    final_mean_return,
    save_resolved_config,
    write_json,
)
from ppo_fabric.multiagent import SINGLE
from ppo_fabric.normalize import load_normalizer_state, normalizer_state
from ppo_fabric.plots import save_learning_curve
from ppo_fabric.rollout import RolloutCollector

Gather = Callable[[Any], list[Any]]  # every rank's object, in rank order (a collective)
Reduce = Callable[[torch.Tensor], torch.Tensor]


class RunSession:
    """One process's view of the run: `writer` is the rank that writes (global rank 0)."""

    def __init__(
        self,
        cfg: DictConfig,
        run_dir: Path,
        writer: bool,
        per_update: int,
        updates: int,
        start_update: int,
    ) -> None:
        self.cfg, self.run_dir, self.writer = cfg, run_dir, writer
        self.per_update, self.updates, self.start_update = per_update, updates, start_update
        self.every, self.keep = int(cfg.checkpoint.every), int(cfg.checkpoint.keep)
        self.log_every = int(cfg.logger.log_every)
        if writer:
            run_dir.mkdir(parents=True, exist_ok=True)
            save_resolved_config(cfg, run_dir)
        self.logger = RunLogger(run_dir, cfg, updates * per_update, enabled=writer)
        self.watch = Stopwatch()

    # ------------------------------------------------------------------------------------------ progress
    @property
    def final_step(self) -> int:
        """The env step the run ends at: the last whole update at or below `algo.total_steps`."""
        return self.updates * self.per_update

    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / "checkpoints" / "last.ckpt"

    def steps_since_start(self, update: int) -> int:
        return (update - self.start_update) * self.per_update

    def sps(self, update: int) -> float:
        return self.steps_since_start(update) / self.watch.elapsed()

    def log_due(self, update: int) -> bool:
        return update % self.log_every == 0 or update == self.updates

    def log(self, update: int, metrics: dict[str, float], collector: RolloutCollector) -> None:
        """A log row of the update just finished, with the SPS so far and the recent mean return."""
        sps = self.sps(update)
        recent = final_mean_return([collector.episodes.window])
        row = metrics | {"time/sps": sps}
        if recent is not None:
            row["rollout/return_mean20"] = recent
        env_step = update * self.per_update
        self.logger.log(row, env_step)
        self.logger.progress(env_step, sps, recent)

    # ---------------------------------------------------------------------------------------- checkpoints
    def checkpoint_due(self, update: int) -> bool:
        """Every `checkpoint.every` updates, and always after the last one."""
        return update == self.updates or (self.every > 0 and update % self.every == 0)

    def write_checkpoint(
        self, learner: dict[str, Any], rank_states: list[dict[str, Any]], update: int
    ) -> Path:
        """`last.ckpt` (and a numbered copy when `checkpoint.every` is set), by the writing rank only."""
        if self.writer:
            state = learner | {
                "iteration": update,
                "env_step": update * self.per_update,
                "world_size": len(rank_states),
                "ranks": rank_states,
            }
            ckpt.save(state, self.checkpoint_path.parent, update, numbered=self.every > 0, keep=self.keep)
        return self.checkpoint_path

    # ------------------------------------------------------------------------------------------- the end
    def summary(
        self,
        strategy: str,
        update: int,
        players: list[dict[str, Any]],
        digests: list[str],
        time_split: dict[str, Any],
        specs: dict[str, PolicySpec],
        world_size: int,
    ) -> dict[str, Any]:
        """summary.json's content from every collecting rank's `end_of_run` part and every rank's digest."""
        wall = self.watch.elapsed()
        steps = self.steps_since_start(update)
        summary = {
            "strategy": strategy,
            "env_id": str(self.cfg.env.id),
            "world_size": world_size,
            "seed": int(self.cfg.seed),
            "iterations": self.updates,
            "total_env_steps": update * self.per_update,
            "steps_this_run": steps,
            "wall_seconds": wall,
            "sps": steps / wall if wall > 0 else 0.0,
            "final_mean_return": final_mean_return([p["window"] for p in players]),
            "episodes": sum(p["episodes"] for p in players),
            "time_split": time_split,
            "ranks_in_sync": len(set(digests)) == 1,
            "run_dir": str(self.run_dir),
            "checkpoint": str(self.checkpoint_path),
            "resumed_from": None if self.cfg.resume is None else str(self.cfg.resume),
        }
        if list(specs) != [SINGLE]:
            per_policy = policy_returns([p["policy_windows"] for p in players])
            summary["policies"] = {
                n: {"final_mean_return": per_policy.get(n), "agents_per_env": s.agents, "trained": s.trained}
                for n, s in specs.items()
            }
        return summary

    def finish(self, summary: dict[str, Any]) -> None:
        """Close the logger; the writer saves summary.json and the learning curve and says the final line."""
        self.logger.close()
        if not self.writer:
            return
        write_json(self.run_dir / "summary.json", summary)
        save_learning_curve(self.run_dir, title=str(self.cfg.env.id))
        ret = summary.get("final_mean_return")
        ret_text = "n/a" if ret is None else f"{ret:.1f}"
        print(
            f"ppo-fabric: {summary['strategy']} {summary['env_id']}: {summary['total_env_steps']} steps in "
            f"{summary['wall_seconds']:.1f}s ({summary['sps']:,.0f} steps/s), final mean return {ret_text}; "
            f"outputs in {self.run_dir}",
            file=sys.stdout,
            flush=True,
        )


# ------------------------------------------------------------------------------ a collecting rank's state
def collector_state(collector: RolloutCollector) -> dict[str, Any]:
    """What one collecting rank needs to continue its rollouts exactly."""
    return {
        "rng": ckpt.rng_state(),
        "envs": ckpt.pickle_envs(collector.envs),
        "normalizers": normalizer_state(collector.envs),  # also for async envs and for evaluation
        "carry": collector.carry(),  # next observations, recurrent states
        "episodes": list(collector.episodes.window),
        "episode_count": collector.episodes.count,
        "policy_episodes": {g.name: (list(g.episodes.window), g.episodes.count) for g in collector.groups},
    }


def restore_collector(collector: RolloutCollector, state: dict[str, Any]) -> None:
    collector.envs = ckpt.restore_envs(state["envs"], collector.envs)
    if state["envs"] is not None:
        collector.restore_carry(state["carry"])
    else:
        load_normalizer_state(collector.envs, state.get("normalizers", {}))
    collector.episodes.window.extend(state["episodes"])
    collector.episodes.count = state["episode_count"]
    if collector.multiagent:
        for g in collector.groups:
            window, count = state["policy_episodes"][g.name]
            g.episodes.window.extend(window)
            g.episodes.count = count
    ckpt.set_rng_state(state["rng"])


def end_of_run(collector: RolloutCollector) -> dict[str, Any]:
    """A collecting rank's part of the summary: its recent episodes, their count, per policy windows."""
    return {
        "window": list(collector.episodes.window),
        "episodes": collector.episodes.count,
        "policy_windows": policy_windows(collector),
    }


# ------------------------------------------------------------------------------------------- episodes
def episode_metrics(collector: RolloutCollector, sum_over_ranks: Reduce | None) -> dict[str, float]:
    """Mean return and length of the episodes finished since the last call, over every collecting rank;
    per policy too in multi-agent runs (an episode there is one agent's)."""
    logs = [(SINGLE, collector.episodes)]
    if collector.multiagent:
        logs += [(g.name, g.episodes) for g in collector.groups]
    sums = torch.stack([episode_sums(*log.drain()) for _, log in logs])
    if sum_over_ranks is not None:
        sums = sum_over_ranks(sums)
    out: dict[str, float] = {}
    for (name, _), row in zip(logs, sums, strict=True):
        out |= {metric_name(name, k): v for k, v in episode_means(row).items()}
    return out


def policy_returns(windows: list[dict[str, list]]) -> dict[str, float | None]:
    """Per policy `final_mean_return` from every collecting rank's `policy_windows`."""
    names = windows[0].keys() if windows else []
    return {n: final_mean_return([w[n] for w in windows]) for n in names}


def policy_windows(collector: RolloutCollector) -> dict[str, list]:
    return {g.name: list(g.episodes.window) for g in collector.groups} if collector.multiagent else {}
