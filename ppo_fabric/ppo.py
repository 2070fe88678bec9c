"""Coupled PPO: every rank collects with its own envs and trains; Fabric DDP all-reduces the gradients.

`main()` runs the collect/update loop, `train()` is one PPO update on a rank's batch of one policy. The
decoupled strategy reuses `train_policies()`, the policy set-up (`policies.py`) and the rollout loop
unchanged.

Run as a script under `fabric run --accelerator=cpu --devices=2 ppo_fabric/ppo.py [overrides]`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
import torch
from lightning.fabric import Fabric
from omegaconf import DictConfig
from tensordict import TensorDict

from ppo_fabric import checkpoint as ckpt
from ppo_fabric.config import training_layout
from ppo_fabric.loss import entropy_loss, masked_mean, normalize, policy_loss, value_loss
from ppo_fabric.metrics import (
    RunLogger,
    Stopwatch,
    all_gather_objects,
    episode_means,
    episode_sums,
    final_mean_return,
    parameters_digest,
    save_resolved_config,
    write_json,
)
from ppo_fabric.normalize import load_normalizer_state, make_reduce, normalizer_state
from ppo_fabric.plots import save_learning_curve
from ppo_fabric.policies import (
    Learner,
    PolicySpec,
    build_collector,
    build_learners,
    learners_state,
    metric_name,
    policies_of,
    policy_specs,
    set_lr,
    trained,
    training_batches,
)
from ppo_fabric.rollout import SINGLE, RolloutCollector

# ----------------------------------------------------------------------------------------------- update
TRAIN_METRICS = (
    "loss/policy",
    "loss/value",
    "loss/entropy",
    "train/approx_kl",
    "train/clip_fraction",
    "train/explained_variance",
    "train/epochs",
)


def train(
    fabric: Fabric,
    model: Any,
    optimizer: Any,
    batch: TensorDict,
    algo: DictConfig,
    mean_across_trainers: Callable[[torch.Tensor], torch.Tensor] | None = None,
    rank_minibatch: int | None = None,
) -> dict[str, float]:
    """One PPO update: `update_epochs` passes over shuffled minibatches of this rank's batch.

    `rank_minibatch` is this rank's share of `algo.minibatch_size` (all of it on a single rank), in steps.
    The batch's units are single steps, or for recurrent policies whole sequences (`initial_state`,
    `starts`), so a minibatch then holds `rank_minibatch / seq_len` sequences. A `mask` (multi-agent rows of
    agents that had left) keeps absent steps out of every mean.
    With `target_kl` set, the KL estimate is averaged over all training ranks (`mean_across_trainers`)
    before deciding to stop, so every rank runs the same number of backward passes (DDP would hang).
    """
    n = batch.batch_size[0]
    keys = batch.keys()
    recurrent, masked = "initial_state" in keys, "mask" in keys
    seq_len = batch["starts"].shape[1] if recurrent else 1
    mb = (int(algo.minibatch_size) if rank_minibatch is None else rank_minibatch) // seq_len
    # Plain Python values: a DictConfig attribute read costs ~50 us, and the loop below runs thousands of times.
    clip, clip_vloss, norm_adv = float(algo.clip_coef), bool(algo.clip_vloss), bool(algo.norm_adv)
    vf_coef, ent_coef, max_norm = float(algo.vf_coef), float(algo.ent_coef), float(algo.max_grad_norm)
    target_kl = None if algo.target_kl is None else float(algo.target_kl)
    losses: list[torch.Tensor] = []  # (policy, value, entropy) per minibatch
    ratio_stats: list[torch.Tensor] = []  # (approx KL, clip fraction) per epoch
    epochs, mask = 0, None
    for _ in range(int(algo.update_epochs)):
        shuffled = batch[torch.randperm(n, device=batch.device)]
        obs, actions, old_logp = shuffled["obs"], shuffled["actions"], shuffled["logprobs"]
        old_values, advantages, returns = shuffled["values"], shuffled["advantages"], shuffled["returns"]
        masks = shuffled["mask"] if masked else None
        states, starts = (shuffled["initial_state"], shuffled["starts"]) if recurrent else (None, None)
        new_logps = []
        for start in range(0, n, mb):
            sl = slice(start, start + mb)
            if recurrent:
                new_logp, entropy, new_values = model(obs[sl], actions[sl], states[sl], starts[sl])
            else:
                new_logp, entropy, new_values = model(obs[sl], actions[sl])
            if masked:
                mask = masks[sl]
            adv = normalize(advantages[sl], mask=mask) if norm_adv else advantages[sl]
            pg = policy_loss(new_logp, old_logp[sl], adv, clip, mask)
            vl = value_loss(new_values, old_values[sl], returns[sl], clip, clip_vloss, mask)
            el = entropy_loss(entropy, mask)
            loss = pg.add(vl, alpha=vf_coef).add(el, alpha=ent_coef)  # 2 autograd nodes instead of 4
            optimizer.zero_grad(set_to_none=True)
            fabric.backward(loss)
            if max_norm > 0:
                fabric.clip_gradients(model, optimizer, max_norm=max_norm, error_if_nonfinite=False)
            optimizer.step()
            new_logps.append(new_logp.detach())
            losses.append(torch.stack((pg, vl, el)).detach())
        epochs += 1
        # The ratio statistics of the whole epoch at once: a dozen small ops per epoch, not per minibatch.
        with torch.no_grad():
            logratio = torch.cat(new_logps) - old_logp
            ratio = logratio.exp()
            approx_kl = masked_mean((ratio - 1) - logratio, masks)
            clipfrac = masked_mean(((ratio - 1).abs() > clip).float(), masks)
            ratio_stats.append(torch.stack((approx_kl, clipfrac)))
        if target_kl is not None:
            kl = approx_kl
            if mean_across_trainers is not None:
                kl = mean_across_trainers(kl)
            if kl.item() > target_kl:
                break
    pg_mean, vl_mean, el_mean = torch.stack(losses).mean(0).tolist()
    kl_mean, clipfrac_mean = torch.stack(ratio_stats).mean(0).tolist()
    means = [pg_mean, vl_mean, -el_mean, kl_mean, clipfrac_mean]
    values, returns = batch["values"], batch["returns"]
    if masked:
        values, returns = values[batch["mask"]], returns[batch["mask"]]
    var_returns = returns.var() if returns.numel() > 1 else returns.new_zeros(())
    explained = (1 - (returns - values).var() / var_returns).item() if var_returns > 0 else float("nan")
    return dict(zip(TRAIN_METRICS, [*means, explained, epochs], strict=True))


# ------------------------------------------------------------------------------------------- set-up
def build_learner(
    fabric: Fabric, cfg: DictConfig, obs_space: gym.Space, action_space: gym.Space, resume: dict | None
) -> Learner:
    """The one learner of a single-agent run (`build_learners` for any number of policies)."""
    spec = PolicySpec(SINGLE, obs_space, action_space, cfg.model, float(cfg.algo.lr), True, 1)
    return build_learners(fabric, cfg, {SINGLE: spec}, resume)[SINGLE]


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


def episode_metrics(
    collector: RolloutCollector, sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None
) -> dict[str, float]:
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


def train_policies(
    fabric: Fabric,
    learners: dict[str, Learner],
    batches: dict[str, TensorDict],
    cfg: DictConfig,
    iteration: int,
    iterations: int,
    mean_across: Callable[[torch.Tensor], torch.Tensor] | None,
    rank_minibatch: int,
) -> dict[str, float]:
    """One update of every trained policy on its batch. `rank_minibatch` counts env steps: a policy acting
    for k agents per env copy takes k times as many samples per minibatch, so every policy makes the same
    number of gradient steps per update (and every rank too: DDP needs it)."""
    metrics: dict[str, float] = {}
    for name in trained({n: learner.spec for n, learner in learners.items()}):
        learner = learners[name]
        lr = set_lr(learner.optimizer, cfg, iteration, iterations, learner.spec.lr)
        stats = train(
            fabric,
            learner.model,
            learner.optimizer,
            batches[name],
            cfg.algo,
            mean_across,
            rank_minibatch * learner.spec.agents,
        )
        metrics |= {metric_name(name, k): v for k, v in (stats | {"train/lr": lr}).items()}
    return metrics


# ------------------------------------------------------------------------------------------------ loop
def main(fabric: Fabric, cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Collect with every rank, update with every rank; returns the run summary (on every rank)."""
    rank, world = fabric.global_rank, fabric.world_size
    algo = cfg.algo
    reduce = make_reduce(None, fabric.device)  # every coupled rank collects
    specs = policy_specs(cfg)
    resume = ckpt.load(cfg.resume) if cfg.resume is not None else None
    learners = build_learners(fabric, cfg, specs, resume)
    collector = build_collector(cfg, specs, rank, fabric.device, reduce)
    policies = policies_of(learners)

    layout = training_layout(cfg, world)
    steps_per_iter = layout.batch
    mean_across = (lambda t: fabric.all_reduce(t, reduce_op="mean")) if world > 1 else None
    sum_across = (
        (lambda t: fabric.all_reduce(t.to(fabric.device), reduce_op="sum").cpu()) if world > 1 else None
    )
    iterations = int(algo.total_steps) // steps_per_iter
    start_iter, env_step = 0, 0
    if resume is not None:
        start_iter, env_step = resume["iteration"], resume["env_step"]
        ranks = resume["ranks"]
        if len(ranks) == world:
            restore_collector(collector, ranks[rank])
        elif rank == 0:
            fabric.print(f"resume: checkpoint has {len(ranks)} ranks, this run {world}; episodes restart")

    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_resolved_config(cfg, run_dir)
    logger = RunLogger(run_dir, cfg, iterations * steps_per_iter, enabled=rank == 0)
    ckpt_dir = run_dir / "checkpoints"
    watch = Stopwatch()
    start_step = env_step

    def save_checkpoint(iteration: int, numbered: bool) -> Path:
        ranks = all_gather_objects(collector_state(collector))
        state = learners_state(cfg, learners)
        state |= {"iteration": iteration, "env_step": env_step, "world_size": world, "ranks": ranks}
        if rank == 0:
            ckpt.save(state, ckpt_dir, iteration, numbered, int(cfg.checkpoint.keep))
        return ckpt_dir / "last.ckpt"

    for iteration in range(start_iter, iterations):
        t0 = time.perf_counter()
        collector.collect(policies, env_step)
        env_step += steps_per_iter
        t1 = time.perf_counter()
        batches = training_batches(collector, specs)
        stats = train_policies(
            fabric, learners, batches, cfg, iteration, iterations, mean_across, layout.rank_minibatch
        )
        t2 = time.perf_counter()
        watch.add("collect", t1 - t0)
        watch.add("train", t2 - t1)
        done = iteration + 1
        if done % int(cfg.logger.log_every) == 0 or done == iterations:
            episodes = episode_metrics(collector, sum_across)
            recent = final_mean_return([collector.episodes.window])
            sps = (env_step - start_step) / watch.elapsed()
            metrics = stats | episodes | {"time/sps": sps}
            metrics |= {"time/collect_s": t1 - t0, "time/train_s": t2 - t1}
            if recent is not None:
                metrics["rollout/return_mean20"] = recent
            logger.log(metrics, env_step)
            logger.progress(env_step, sps, recent)
        if int(cfg.checkpoint.every) and done % int(cfg.checkpoint.every) == 0 and done != iterations:
            save_checkpoint(done, numbered=True)

    last = save_checkpoint(iterations, numbered=bool(int(cfg.checkpoint.every)))
    wall = watch.elapsed()
    windows = all_gather_objects(list(collector.episodes.window))
    per_policy = policy_returns(all_gather_objects(policy_windows(collector)))
    episodes = sum(all_gather_objects(collector.episodes.count))
    digests = all_gather_objects(parameters_digest(*policies.values()))
    summary = {
        "strategy": "coupled",
        "env_id": str(cfg.env.id),
        "world_size": world,
        "seed": int(cfg.seed),
        "iterations": iterations,
        "total_env_steps": env_step,
        "steps_this_run": env_step - start_step,
        "wall_seconds": wall,
        "sps": (env_step - start_step) / wall if wall > 0 else 0.0,
        "final_mean_return": final_mean_return(windows),
        "episodes": episodes,
        "time_split": watch.totals,
        "ranks_in_sync": len(set(digests)) == 1,
        "run_dir": str(run_dir),
        "checkpoint": str(last),
        "resumed_from": None if cfg.resume is None else str(cfg.resume),
    }
    if collector.multiagent:
        summary["policies"] = {
            n: {"final_mean_return": per_policy.get(n), "agents_per_env": s.agents, "trained": s.trained}
            for n, s in specs.items()
        }
    logger.close()
    collector.envs.close()
    if rank == 0:
        write_json(run_dir / "summary.json", summary)
        save_learning_curve(run_dir, title=str(cfg.env.id))
    return summary


if __name__ == "__main__":
    from ppo_fabric.cli import run_script

    run_script("coupled")
