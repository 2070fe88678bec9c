"""Decoupled PPO: player ranks step the environments, trainer ranks learn under DDP among themselves.

`main()` builds the process groups and sends each rank to `player()` or `trainer()`. Players use the
same rollout loop, storage and GAE as the coupled strategy; trainers use the same `train()` update.
The messages between them live in `collectives.py`.

With `algo.pipeline=true` a player collects rollout k+1 with the parameters it has while the trainers
learn from rollout k, then loads the new parameters before sending: the policy lag is one update, which
PPO tolerates because its ratio uses the stored behaviour log-probabilities. The lag is measured (each
batch carries the parameter version it was collected with) and logged as `train/policy_lag`.

Run as a script under `fabric run --accelerator=cpu --devices=3 ppo_fabric/ppo_decoupled.py [overrides]`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from omegaconf import DictConfig
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from ppo_fabric import checkpoint as ckpt
from ppo_fabric.agent import ActorCritic
from ppo_fabric.buffer import training_batch
from ppo_fabric.collectives import (
    BatchCodec,
    GroupDDPStrategy,
    Kind,
    Topology,
    broadcast_params,
    gather_objects,
    mean_over_trainers,
    recv_batches,
    recv_params,
    send_batch,
    setup_topology,
)
from ppo_fabric.config import training_layout
from ppo_fabric.metrics import (
    RunLogger,
    Stopwatch,
    final_mean_return,
    parameters_digest,
    save_resolved_config,
    write_json,
)
from ppo_fabric.normalize import make_reduce
from ppo_fabric.plots import save_learning_curve
from ppo_fabric.policies import (
    PolicySpec,
    all_parameters,
    build_collector,
    build_learners,
    learners_state,
    metric_name,
    policies_of,
    policy_specs,
    policy_storage,
    trained,
)
from ppo_fabric.ppo import (
    TRAIN_METRICS,
    collector_state,
    episode_metrics,
    policy_returns,
    policy_windows,
    restore_collector,
    train_policies,
)


def metric_names(specs: dict[str, PolicySpec]) -> list[str]:
    """What the first trainer appends to the parameters after each update (averaged over trainers)."""
    names = [metric_name(n, k) for n in trained(specs) for k in (*TRAIN_METRICS, "train/lr")]
    return [*names, "train/policy_lag", "time/trainer_sps", "time/train_s"]


def _schedule(cfg: DictConfig) -> tuple[int, int]:
    """(env steps per update over all players, number of updates): both sides derive the same."""
    per_update = int(cfg.algo.rollout_steps) * int(cfg.env.num_envs) * int(cfg.algo.players)
    return per_update, int(cfg.algo.total_steps) // per_update


def _checkpoint_due(cfg: DictConfig, version: int, updates: int) -> bool:
    every = int(cfg.checkpoint.every)
    return version == updates or (every > 0 and version % every == 0)


def main(fabric: Fabric, cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Build the groups (a collective on every rank), then play or train; returns this rank's summary."""
    if not isinstance(fabric.strategy, GroupDDPStrategy):
        raise ValueError(
            "strategy=decoupled brings its own DDP strategy; do not pass --strategy to `fabric run` "
            "(or fabric.strategy other than auto)"
        )
    topo = setup_topology(int(cfg.algo.players), float(cfg.collectives.timeout))
    resume = ckpt.load(cfg.resume) if cfg.resume is not None else None
    if topo.is_player:
        return player(fabric, cfg, run_dir, topo, resume)
    return trainer(fabric, cfg, run_dir, topo, resume)


def _checkpoint(
    fabric: Fabric, cfg: DictConfig, topo: Topology, state: dict[str, Any], version: int
) -> list[dict[str, Any]]:
    """CHECKPOINT: every rank contributes its part, rank 0 writes one file; returns every rank's part."""
    parts = gather_objects(topo, state)
    if topo.rank == 0:
        learner = parts[topo.first_trainer]["learner"]
        per_update, _ = _schedule(cfg)
        full = learner | {
            "iteration": version,
            "env_step": version * per_update,
            "world_size": fabric.world_size,
            "ranks": [part["rank_state"] for part in parts],
        }
        ckpt_dir = Path(state["run_dir"]) / "checkpoints"
        ckpt.save(
            full, ckpt_dir, version, numbered=int(cfg.checkpoint.every) > 0, keep=int(cfg.checkpoint.keep)
        )
    return parts


# ------------------------------------------------------------------------------------------------ player
def player(
    fabric: Fabric, cfg: DictConfig, run_dir: Path, topo: Topology, resume: dict | None
) -> dict[str, Any]:
    rank, algo = topo.rank, cfg.algo
    device = torch.device("cpu") if algo.player_device == "cpu" else fabric.device
    reduce = make_reduce(topo.player_group, "cpu")  # normalisation statistics are merged over players
    specs = policy_specs(cfg)
    policies = {n: ActorCritic(s.obs_space, s.action_space, s.model).to(device) for n, s in specs.items()}
    params = all_parameters(policies)
    collector = build_collector(cfg, specs, rank, device, reduce)
    storages = collector.storages
    # One DATA message per trained policy, in this order; STOP goes with the first one's codec.
    codecs = {
        n: BatchCodec(training_batch(storages[n], specs[n].seq_len), len(topo.trainers))
        for n in trained(specs)
    }
    names = metric_names(specs)
    per_update, updates = _schedule(cfg)
    num_params = sum(p.numel() for p in params)

    version = 0
    in_flight: dict[str, Any] | None = None  # pipeline resume: parameters the first rollout is collected with
    if resume is not None:
        version = int(resume["iteration"])
        if len(resume["ranks"]) == fabric.world_size:
            restore_collector(collector, resume["ranks"][rank])
            if algo.pipeline and "policy" in resume["ranks"][rank]:
                in_flight = resume["ranks"][rank]
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_resolved_config(cfg, run_dir)
    logger = RunLogger(run_dir, cfg, updates * per_update, enabled=rank == 0)
    watch = Stopwatch()
    start_version = version

    def receive(snapshot: dict[str, Any] | None = None) -> int:
        """PARAMS: load the newest parameters, log the update they came from, checkpoint when due.

        `snapshot` is this player's state from before the rollout now in flight (pipeline), which is what
        a checkpoint of the new version must hold for an exact resume.
        """
        t0 = time.perf_counter()
        new_version, flat, metrics = recv_params(topo, num_params, len(names))
        vector_to_parameters(flat.to(device), params)
        watch.add("wait_params", time.perf_counter() - t0)
        if new_version > start_version:
            _log(new_version, metrics)
        if new_version > start_version and _checkpoint_due(cfg, new_version, updates):
            rank_state = snapshot if snapshot is not None else collector_state(collector)
            _checkpoint(fabric, cfg, topo, {"rank_state": rank_state, "run_dir": str(run_dir)}, new_version)
        return new_version

    def sum_over_players(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=topo.player_group)
        return t

    def _log(new_version: int, metrics: torch.Tensor) -> None:
        episodes = episode_metrics(collector, sum_over_players if len(topo.players) > 1 else None)
        if rank != 0 or (new_version % int(cfg.logger.log_every) and new_version != updates):
            return
        env_step = new_version * per_update
        sps = (new_version - start_version) * per_update / watch.elapsed()
        recent = final_mean_return([collector.episodes.window])
        row = dict(zip(names, metrics.tolist(), strict=True)) | episodes
        row["time/sps"] = sps
        if recent is not None:
            row["rollout/return_mean20"] = recent
        logger.log(row, env_step)
        logger.progress(env_step, sps, recent)

    version = receive()  # the trainers' initial (or resumed) parameters: every player starts identical
    behaviour = version  # the version of the parameters the policy holds (stamped on each batch)
    resumed_params = None
    if in_flight is not None:  # as in the original run, the first rollout uses the previous parameters
        resumed_params = parameters_to_vector(params).clone()
        vector_to_parameters(in_flight["policy"].to(device), params)
        behaviour = int(in_flight["policy_version"])
    in_transit: list[Any] = []  # the previous DATA messages, still being sent (pipeline)
    for iteration in range(version, updates):
        pipelined = bool(algo.pipeline) and iteration > start_version
        snapshot = None
        if pipelined and _checkpoint_due(cfg, iteration, updates):
            policy_now = parameters_to_vector(params).detach().cpu().clone()
            snapshot = collector_state(collector) | {"policy": policy_now, "policy_version": behaviour}
        t0 = time.perf_counter()
        collector.collect(policies, iteration * per_update)
        watch.add("collect", time.perf_counter() - t0)
        t0 = time.perf_counter()
        for message in in_transit:
            if message is not None:
                message.wait()
        in_transit = [
            send_batch(
                topo, codec, training_batch(storages[n], specs[n].seq_len), behaviour, bool(algo.pipeline)
            )
            for n, codec in codecs.items()
        ]
        watch.add("send", time.perf_counter() - t0)
        if pipelined:
            version = behaviour = receive(snapshot)  # update `iteration - 1` finished during this rollout
        elif resumed_params is not None:
            vector_to_parameters(resumed_params, params)
            behaviour, resumed_params = version, None
        if not algo.pipeline:
            version = behaviour = receive()
    if algo.pipeline and version < updates:
        version = receive()
    for message in in_transit:
        if message is not None:
            message.wait()
    send_batch(topo, next(iter(codecs.values())), None, version)  # STOP

    parts = gather_objects(topo, {"window": list(collector.episodes.window), "episodes": collector.episodes.count,
                                  "policy_windows": policy_windows(collector),
                                  "digest": parameters_digest(*policies.values()), "time": watch.totals})  # fmt: skip
    logger.close()
    collector.envs.close()
    wall = watch.elapsed()
    players = [parts[p] for p in topo.players]
    summary = {
        "strategy": "decoupled",
        "env_id": str(cfg.env.id),
        "world_size": fabric.world_size,
        "players": len(topo.players),
        "trainers": len(topo.trainers),
        "pipeline": bool(algo.pipeline),
        "seed": int(cfg.seed),
        "iterations": updates,
        "total_env_steps": version * per_update,
        "steps_this_run": (version - start_version) * per_update,
        "wall_seconds": wall,
        "sps": (version - start_version) * per_update / wall if wall > 0 else 0.0,
        "final_mean_return": final_mean_return([p["window"] for p in players]),
        "episodes": sum(p["episodes"] for p in players),
        "time_split": {"player": watch.totals, "trainer": parts[topo.first_trainer]["time"]},
        "ranks_in_sync": len({part["digest"] for part in parts}) == 1,
        "run_dir": str(run_dir),
        "checkpoint": str(run_dir / "checkpoints" / "last.ckpt"),
        "resumed_from": None if cfg.resume is None else str(cfg.resume),
    }
    if collector.multiagent:
        per_policy = policy_returns([p["policy_windows"] for p in players])
        summary["policies"] = {
            n: {"final_mean_return": per_policy.get(n), "agents_per_env": s.agents, "trained": s.trained}
            for n, s in specs.items()
        }
    if rank == 0:
        write_json(run_dir / "summary.json", summary)
        save_learning_curve(run_dir, title=str(cfg.env.id))
    return summary


# ----------------------------------------------------------------------------------------------- trainer
def trainer(
    fabric: Fabric, cfg: DictConfig, run_dir: Path, topo: Topology, resume: dict | None
) -> dict[str, Any]:
    # Fabric's DDP wraps the model over the trainers' group only: players never join it.
    fabric.strategy.use_group(topo.trainer_group, len(topo.trainers))
    specs = policy_specs(cfg)
    learners = build_learners(fabric, cfg, specs, resume)
    params = all_parameters(policies_of(learners))
    if resume is not None and len(resume["ranks"]) == fabric.world_size:
        ckpt.set_rng_state(resume["ranks"][topo.rank]["rng"])
    codecs = {
        n: BatchCodec(
            training_batch(policy_storage(cfg, specs[n], "cpu"), specs[n].seq_len), len(topo.trainers)
        )
        for n in trained(specs)
    }
    names = metric_names(specs)
    _, updates = _schedule(cfg)
    rank_minibatch = training_layout(cfg, fabric.world_size).rank_minibatch
    version = int(resume["iteration"]) if resume is not None else 0
    first = topo.rank == topo.first_trainer
    watch = Stopwatch()

    def publish(metrics: torch.Tensor) -> None:
        if first:
            broadcast_params(topo, parameters_to_vector(params), metrics, version)

    def mean_across(t: torch.Tensor) -> torch.Tensor:
        return mean_over_trainers(topo, t.to(fabric.device))

    publish(torch.zeros(len(names)))
    while True:
        t0 = time.perf_counter()
        batches, kind, versions = {}, Kind.DATA, []
        for n, codec in codecs.items():
            kind, versions, batches[n] = recv_batches(topo, codec, fabric.device)
            if kind == Kind.STOP:
                break
        watch.add("wait_data", time.perf_counter() - t0)
        if kind == Kind.STOP:
            break
        t0 = time.perf_counter()
        stats = train_policies(fabric, learners, batches, cfg, version, updates, mean_across, rank_minibatch)
        elapsed = time.perf_counter() - t0
        watch.add("train", elapsed)
        lag = version - sum(versions) / len(versions)
        version += 1
        samples = sum(b["logprobs"].numel() for b in batches.values())  # steps, also inside sequences
        stats |= {"train/policy_lag": lag, "time/trainer_sps": samples / elapsed, "time/train_s": elapsed}
        metrics = mean_across(torch.tensor([stats[k] for k in names], dtype=torch.float32))
        metrics[names.index("time/trainer_sps")] *= len(topo.trainers)  # samples/s of all trainers
        publish(metrics.cpu())
        if _checkpoint_due(cfg, version, updates):
            state = {"rank_state": {"rng": ckpt.rng_state()}, "run_dir": str(run_dir)}
            if first:
                state["learner"] = learners_state(cfg, learners)
            _checkpoint(fabric, cfg, topo, state, version)
    gather_objects(topo, {"digest": parameters_digest(*policies_of(learners).values()), "time": watch.totals})
    return {"strategy": "decoupled", "rank": topo.rank, "role": "trainer"}


if __name__ == "__main__":
    from ppo_fabric.cli import run_script

    run_script("decoupled")
