"""Where the time of CleanRL's CartPole workload goes, measured with the package's own objects.

Builds the experiment's Fabric learner and rollout collector in this process (one torch thread), then
times: whole iterations (collect vs update, as `ppo.main` runs them), with the vector-env steps and the
policy steps (`ActorCritic.sample`, or `NumpyActor.sample` where `algo.numpy_rollout` applies) inside them
timed by wrappers on those two calls; the same two calls
alone, in a tight loop (they run faster there: the loop around them evicts their caches); inside the
update, each phase of
one minibatch step (forward, losses, zero_grad, backward, gradient clipping, optimizer step) on a real
batch. It ends with single torch ops of the minibatch's sizes, which show that the update is bound by
per-op overhead, not arithmetic. Writes benchmarks/results/profile_split.{json,md}.

    .venv/bin/python benchmarks/profile_split.py [--iterations 40] [--repeats 2000] [--name N] [overrides]
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from ppo_fabric.app.launch import build_fabric  # noqa: E402
from ppo_fabric.app.preflight import load  # noqa: E402
from ppo_fabric.collect.numpy_actor import NumpyActor, unsupported  # noqa: E402
from ppo_fabric.collect.rollout import build_collector, training_batches  # noqa: E402
from ppo_fabric.config.values import training_layout  # noqa: E402
from ppo_fabric.envs.multiagent import SINGLE  # noqa: E402
from ppo_fabric.learn.learners import build_learners, policies_of, policy_specs  # noqa: E402
from ppo_fabric.learn.loss import entropy_loss, normalize, policy_loss, value_loss  # noqa: E402
from ppo_fabric.learn.schedule import LrSchedule  # noqa: E402
from ppo_fabric.learn.settings import UpdateSettings  # noqa: E402
from ppo_fabric.learn.update import update_policies  # noqa: E402


def per_call_us(fn: Callable[[], Any], repeats: int) -> float:
    """Median of 5 timed blocks of `repeats // 5` calls, after a warm-up, in microseconds per call."""
    block = max(repeats // 5, 1)
    for _ in range(min(block, 200)):
        fn()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(block):
            fn()
        times.append((time.perf_counter() - t) / block * 1e6)
    return float(np.median(times))


def timed(fn: Callable[..., Any], totals: dict[str, float], key: str) -> Callable[..., Any]:
    """`fn`, adding its wall time to `totals[key]` on every call."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - t

    return wrapper


def minibatch_phases(fabric: Any, learner: Any, batch: Any, algo: Any, repeats: int) -> dict[str, float]:
    """Microseconds per phase of one minibatch step, timed phase by phase over `repeats` steps (the
    parameters change as in training; the values are restored afterwards)."""
    model, optimizer = learner.model, learner.optimizer
    saved = ({k: v.clone() for k, v in model.module.state_dict().items()}, optimizer.state_dict())
    mb = int(algo.minibatch_size)
    clip, vf, ent, max_norm = (float(algo.clip_coef), float(algo.vf_coef), float(algo.ent_coef),
                               float(algo.max_grad_norm))  # fmt: skip
    phases = ["forward", "losses", "zero_grad", "backward", "clip_gradients", "optimizer_step"]
    totals = dict.fromkeys(phases, 0.0)
    n = batch.batch_size[0]
    steps = 0
    for i in range(repeats + 100):
        start = (i * mb) % n
        mini = batch[start : start + mb]
        t0 = time.perf_counter()
        logp, entropy, values = model(mini["obs"], mini["actions"])
        t1 = time.perf_counter()
        adv = normalize(mini["advantages"])
        pg = policy_loss(logp, mini["logprobs"], adv, clip)
        vl = value_loss(values, mini["values"], mini["returns"], clip, bool(algo.clip_vloss))
        loss = pg.add(vl, alpha=vf).add(entropy_loss(entropy), alpha=ent)
        t2 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        fabric.backward(loss)
        t4 = time.perf_counter()
        fabric.clip_gradients(model, optimizer, max_norm=max_norm, error_if_nonfinite=False)
        t5 = time.perf_counter()
        optimizer.step()
        t6 = time.perf_counter()
        if i >= 100:  # warm-up excluded
            for name, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5), strict=True):
                totals[name] += dt
            steps += 1
    model.module.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    return {k: v / steps * 1e6 for k, v in totals.items()}


def main() -> None:
    parser = common.argument_parser(__doc__)
    parser.add_argument("--iterations", type=int, default=40, help="whole collect+update iterations timed")
    parser.add_argument("--repeats", type=int, default=2000, help="calls per micro-measurement")
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    parser.add_argument("--name", default="profile_split", help="report file name (without extension)")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides (default: exp=cleanrl_cartpole)")
    args = parser.parse_args()

    overrides = ["exp=cleanrl_cartpole", "logger=none", *args.overrides]
    cfg, _, _ = load(overrides)
    torch.set_num_threads(int(cfg.torch_threads))
    fabric = build_fabric(cfg, 1)
    specs = policy_specs(cfg)
    learners = build_learners(fabric, specs, None, float(cfg.algo.adam_eps))
    collector = build_collector(cfg, specs, 0, fabric.device, None)
    policies = policies_of(learners)
    layout = training_layout(cfg, 1)
    algo = cfg.algo
    steps_per_iter = layout.batch
    num_envs, rollout = int(cfg.env.num_envs), int(algo.rollout_steps)

    # whole iterations, as ppo.main runs them, with the env and policy steps inside them timed
    in_loop = {"env": 0.0, "act": 0.0}
    envs, policy = collector.envs, policies[SINGLE]
    envs.step = timed(envs.step, in_loop, "env")  # instance attributes: this process's objects only
    policy.sample = timed(policy.sample, in_loop, "act")
    numpy_sample = NumpyActor.sample
    NumpyActor.sample = timed(numpy_sample, in_loop, "act")  # a new actor each rollout: the class's method
    collect_s = train_s = 0.0
    warmup = 3
    for it in range(warmup + args.iterations):
        if it == warmup:
            in_loop.update(env=0.0, act=0.0)
        t0 = time.perf_counter()
        collector.collect(policies, it * steps_per_iter)
        t1 = time.perf_counter()
        update_policies(fabric, learners, training_batches(collector, specs), settings=UpdateSettings.of(cfg.algo),
                        env_step=it * steps_per_iter, lr_schedule=LrSchedule(10**6 * steps_per_iter), mean_across=None,
                        rank_minibatch=layout.rank_minibatch)  # fmt: skip
        t2 = time.perf_counter()
        if it >= warmup:
            collect_s += t1 - t0
            train_s += t2 - t1
    iters = args.iterations
    per_step_collect = collect_s / (iters * steps_per_iter) * 1e6
    per_step_train = train_s / (iters * steps_per_iter) * 1e6

    del envs.step, policy.sample  # back to the classes' methods
    NumpyActor.sample = numpy_sample
    vector_steps = iters * rollout
    env_loop_us, act_loop_us = (in_loop[k] / vector_steps * 1e6 for k in ("env", "act"))

    # the same calls alone: one vector-env step, one policy step on a real observation batch
    rng = np.random.default_rng(0)
    actions = iter(rng.integers(0, envs.single_action_space.n, size=(args.repeats * 2 + 400, num_envs)))
    env_us = per_call_us(lambda: envs.step(next(actions)), args.repeats)
    obs = collector.storage["obs"][0].clone()
    if collector.numpy_rollout and unsupported(policy) is None:  # the actor the rollout used
        actor, obs_np = NumpyActor(policy), obs.numpy()
        noise = actor.noise(1, num_envs)[0]
        act_us = per_call_us(lambda: actor.sample(obs_np, noise), args.repeats)
    else:
        with torch.inference_mode():
            act_us = per_call_us(lambda: policy.sample(obs, None), args.repeats)
    other_collect_us = collect_s / vector_steps * 1e6 - env_loop_us - act_loop_us

    # inside the update: one minibatch step, phase by phase
    learner = learners[SINGLE]
    batch = training_batches(collector, specs)[SINGLE]
    phases = minibatch_phases(fabric, learner, batch, algo, args.repeats)
    minibatches = int(algo.update_epochs) * (steps_per_iter // int(algo.minibatch_size))
    minibatch_total = sum(phases.values())
    update_other_us = train_s / iters * 1e6 - minibatches * minibatch_total

    # single ops of the minibatch's sizes: the arithmetic is a few microseconds per op
    hidden = int(cfg.model.actor_hidden[0])
    x, w, b = torch.randn(int(algo.minibatch_size), hidden), torch.randn(hidden, hidden), torch.randn(hidden)
    ops = {
        f"linear [{x.shape[0]}x{hidden}] x [{hidden}x{hidden}]": per_call_us(
            lambda: F.linear(x, w, b), args.repeats
        ),
        f"tanh [{x.shape[0]}x{hidden}]": per_call_us(lambda: torch.tanh(x), args.repeats),
        f"add [{x.shape[0]}x{hidden}]": per_call_us(lambda: x + x, args.repeats),
    }
    collector.envs.close()

    per_env_step = {
        "env step": env_loop_us / num_envs,
        "policy step (actor forward + sample)": act_loop_us / num_envs,
        "rest of collection (storage writes, episode statistics, batched critic, GAE)": other_collect_us
        / num_envs,
        "minibatch steps": minibatches * minibatch_total / steps_per_iter,
        "rest of the update (shuffles, ratio statistics, lr)": update_other_us / steps_per_iter,
    }
    total = per_step_collect + per_step_train
    result = {
        "machine": common.machine(),
        "git": common.git_commit(),
        "overrides": overrides,
        "iterations": iters,
        "steps_per_iteration": steps_per_iter,
        "sps": 1e6 / total,
        "collect_us_per_env_step": per_step_collect,
        "update_us_per_env_step": per_step_train,
        "env_step_us_per_vector_step": {"in_loop": env_loop_us, "alone": env_us},
        "act_us_per_vector_step": {"in_loop": act_loop_us, "alone": act_us},
        "minibatch_phase_us": phases,
        "minibatches_per_update": minibatches,
        "per_env_step_us": per_env_step,
        "single_ops_us": ops,
    }
    common.write_report(args.out, args.name, result, report(result))


def report(r: dict[str, Any]) -> str:
    m, env, act = r["machine"], r["env_step_us_per_vector_step"], r["act_us_per_vector_step"]
    total = r["collect_us_per_env_step"] + r["update_us_per_env_step"]
    lines = [
        f"# Where the time goes: `{' '.join(r['overrides'])}`, coupled, 1 process",
        "",
        f"Generated by `benchmarks/profile_split.py` at git {r['git']} on {m['cpu']} ({m['cores']} cores), "
        f"torch {m['torch']}, one torch thread. Overrides: `{' '.join(r['overrides'])}`.",
        "",
        f"{r['iterations']} iterations of {r['steps_per_iteration']} env steps: "
        f"**{r['sps']:,.0f} SPS** in this process ({total:.1f} us per env step: collect "
        f"{r['collect_us_per_env_step']:.1f}, update {r['update_us_per_env_step']:.1f}).",
        "",
        "## Per env step",
        "",
        "| part | us per env step | share |",
        "|---|---:|---:|",
    ]
    for name, us in r["per_env_step_us"].items():
        lines.append(f"| {name} | {us:.1f} | {us / total:.0%} |")
    free_env = total - r["per_env_step_us"]["env step"]
    lines += [
        "",
        f"With env stepping free (its in-loop time removed, everything else as measured): {1e6 / free_env:,.0f} "
        f"SPS, {total / free_env:.2f}x this run: the most any env backend could give this workload here.",
        "",
        f"One vector-env step: {env['in_loop']:.1f} us in the loop, {env['alone']:.1f} us alone; one policy "
        f"step (actor forward and sampling, all envs at once): {act['in_loop']:.1f} us in the loop, "
        f"{act['alone']:.1f} us alone. Alone they run in a tight loop on warm caches; in the rollout the "
        "other calls between them evict those.",
        "",
        f"## One minibatch step ({r['minibatches_per_update']} per update)",
        "",
        "| phase | us |",
        "|---|---:|",
    ]
    lines += [f"| {k} | {v:.0f} |" for k, v in r["minibatch_phase_us"].items()]
    lines += [f"| **total** | **{sum(r['minibatch_phase_us'].values()):.0f}** |", "", "## Single ops", ""]
    lines += [f"- {k}: {v:.1f} us" for k, v in r["single_ops_us"].items()]
    lines += [
        "",
        "A minibatch step runs some 40 forward ops (two 64x64 MLPs, heads, losses) and as many backward "
        "nodes, plus the optimizer's and the clipping's Python: with each op a few microseconds whatever "
        "its size, the step costs about a millisecond of which the matrix arithmetic is a small part.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
