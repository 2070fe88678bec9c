"""What the fault checks cost on CleanRL's CartPole workload (`exp=cleanrl_cartpole`), measured in one
process, each piece with and without its check, alternated block by block (a 2-core machine's load drifts
by more than these costs between two training runs, which an end-to-end A/B cannot resolve).

Pieces: the boundary check of one vector step's outputs (`guard.check_step`, 4 envs) and the indirection
of its wrapper (`FiniteCheck`); the heartbeat mark (`PROGRESS.mark`, one per env step); the end of a
minibatch step (`GradientStep`) with its skip flag and `found_inf`, against the same kernels without (the
step before the checks); the magnitude check after an update (`check_magnitude`). Their sum per iteration (128 vector steps, 16 minibatch steps,
one update) is set against the wall time of one iteration of the same workload (a rollout and an update)
timed here too.

    python -m benchmarks fault_checks_cost [--repeats 7]

Writes benchmarks/results/fault_checks_cost.{json,md}.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import RESULTS  # noqa: E402


def per_call(fn: Callable[[], Any], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def alternated(
    pairs: dict[str, tuple[Callable[[], Any], Callable[[], Any]]], calls: int, repeats: int
) -> dict:
    """Median microseconds per call of (without, with) for each piece, blocks alternated."""
    out: dict[str, dict[str, float]] = {}
    for name, (bare, checked) in pairs.items():
        a, b = [], []
        for _ in range(repeats):
            a.append(per_call(bare, calls))
            b.append(per_call(checked, calls))
        out[name] = {"without_us": statistics.median(a), "with_us": statistics.median(b)}
        out[name]["cost_us"] = out[name]["with_us"] - out[name]["without_us"]
    return out


def main() -> None:
    parser = common.argument_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    import numpy as np
    import torch
    from gymnasium.vector import AutoresetMode, SyncVectorEnv, VectorWrapper
    from lightning_fabric import Fabric

    from ppo_fabric.collect.rollout import build_collector, training_batches
    from ppo_fabric.config.values import compose, training_layout
    from ppo_fabric.envs.guard import check_step
    from ppo_fabric.envs.make import make_env
    from ppo_fabric.learn.learners import build_learners, policies_of, policy_specs
    from ppo_fabric.learn.optim import GradientStep, clip_grad_norm_
    from ppo_fabric.learn.schedule import LrSchedule
    from ppo_fabric.learn.settings import UpdateSettings
    from ppo_fabric.learn.update import check_magnitude, update_policies
    from ppo_fabric.wire.progress import PROGRESS

    torch.set_num_threads(1)
    cfg, _ = compose(["exp=cleanrl_cartpole"])
    envs = cfg.env.num_envs
    vector = SyncVectorEnv(
        [lambda: make_env(cfg.env) for _ in range(envs)], autoreset_mode=AutoresetMode.SAME_STEP
    )
    vector.reset(seed=0)
    stepped = vector.step(np.ones(envs, dtype=np.int64))  # what FiniteCheck checks: one step's outputs
    passing = VectorWrapper(vector)

    # one iteration of the workload, and the learner the minibatch pieces use
    fabric = Fabric(accelerator="cpu", devices=1)
    specs = policy_specs(cfg)
    learners = build_learners(fabric, specs, None, float(cfg.algo.adam_eps))
    collector = build_collector(cfg, specs, 0, "cpu", None)
    settings = UpdateSettings.of(cfg.algo)
    layout = training_layout(cfg, 1)
    policies = policies_of(learners)

    def iteration() -> None:
        collector.collect(policies, 0)
        batches = training_batches(collector, specs)
        update_policies(
            fabric, learners, batches, settings=settings, env_step=0, lr_schedule=LrSchedule(10**9),
            mean_across=None, rank_minibatch=layout.rank_minibatch,
        )  # fmt: skip

    iteration()
    iteration_ms = statistics.median(per_call(iteration, 3) for _ in range(args.repeats)) / 1000

    learner = next(iter(learners.values()))
    model, optimizer = learner.model, learner.optimizer
    finish = GradientStep(fabric, model, optimizer, float(cfg.algo.max_grad_norm))
    obs = torch.randn(128, 4)
    loss = model(obs, torch.zeros(128, dtype=torch.long))[2].pow(2).mean()
    fabric.backward(loss)
    finish()  # creates Adam's state: the direct path from now on
    finish = GradientStep(fabric, model, optimizer, float(cfg.algo.max_grad_norm))
    grads = [p.grad for p in finish.params]
    assert finish.direct and finish._states() is not None
    groups = finish._states()
    from ppo_fabric.compat.private import foreach_add_, fused_adam_

    lr0 = 1e-12  # tiny steps: the parameters barely move over the repeats

    def kernels_only() -> None:  # the end of a minibatch step as it was before the checks
        with torch.no_grad():
            clip_grad_norm_(grads, 0.5)
            for _group, params, (exp_avgs, exp_avg_sqs, steps) in groups:
                foreach_add_(steps, 1)
                fused_adam_(params, [p.grad for p in params], exp_avgs, exp_avg_sqs, [], steps, amsgrad=False,
                            lr=lr0, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-5, maximize=False,
                            grad_scale=None, found_inf=None)  # fmt: skip

    for group in optimizer.param_groups:
        group["lr"] = lr0

    pieces = alternated(
        {
            "boundary check (one vector step)": (lambda: None, lambda: check_step(*stepped[:2], stepped[4])),
            "the wrapper's indirection (attribute lookup only)": (
                lambda: vector.step,
                lambda: passing.env.step,
            ),
            "heartbeat mark": (lambda: None, lambda: PROGRESS.mark("env.step")),
            "minibatch step end (skip flag, found_inf)": (kernels_only, finish),
            "magnitude check (per update)": (lambda: None, lambda: check_magnitude(learner, 1e6, 0)),
        },
        calls=2000,
        repeats=args.repeats,
    )
    steps = int(cfg.algo.rollout_steps)
    minibatches = int(cfg.algo.update_epochs) * (steps * envs // int(cfg.algo.minibatch_size))
    per_iteration_us = (
        steps * pieces["boundary check (one vector step)"]["cost_us"]
        + steps * pieces["the wrapper's indirection (attribute lookup only)"]["cost_us"]
        + steps * pieces["heartbeat mark"]["cost_us"]
        + minibatches * pieces["minibatch step end (skip flag, found_inf)"]["cost_us"]
        + pieces["magnitude check (per update)"]["cost_us"]
    )
    share = per_iteration_us / 1000 / iteration_ms
    report = {
        "command": common.command_line(__file__), "commit": common.git_commit(), "machine": common.machine(),
        "pieces": pieces, "iteration_ms": iteration_ms, "checks_per_iteration_us": per_iteration_us,
        "share": share, "vector_steps_per_iteration": steps, "minibatch_steps_per_iteration": minibatches,
    }  # fmt: skip
    lines = [
        "# What the fault checks cost (CleanRL's CartPole workload, one process)", "",
        f"Command: `{report['command']}`  ", f"Commit: {report['commit']}; machine: {report['machine']['cpu']}, "
        f"{report['machine']['cores']} cores, torch {report['machine']['torch']}, one torch thread; medians of "
        f"{args.repeats} alternated blocks of 2,000 calls.", "",
        "| piece | without (us) | with (us) | cost (us) | per iteration |", "|---|---:|---:|---:|---:|",
    ]  # fmt: skip
    counts = {"boundary check (one vector step)": steps, "the wrapper's indirection (attribute lookup only)": steps, "heartbeat mark": steps,
              "minibatch step end (skip flag, found_inf)": minibatches, "magnitude check (per update)": 1}  # fmt: skip
    for name, p in pieces.items():
        lines.append(
            f"| {name} | {p['without_us']:.2f} | {p['with_us']:.2f} | {p['cost_us']:.2f} | x{counts[name]} |"
        )
    lines += [
        "", f"Per iteration ({steps} vector steps of {envs} envs, {minibatches} minibatch steps, one update): "
        f"{per_iteration_us / 1000:.3f} ms of checks in an iteration of {iteration_ms:.2f} ms: {share:.2%}.", "",
    ]  # fmt: skip
    common.write_report(args.out, "fault_checks_cost", report, "\n".join(lines))


if __name__ == "__main__":
    main()
