"""What the direct minibatch-step layers of `ppo_fabric/learn/optim.py` save, measured in one process.

An experiment's whole updates (`update.update_policies`, one torch thread) in three variants alternated update
by update: "fabric layers" (Fabric's module wrapper, `fabric.clip_gradients`, `optimizer.step()`), "direct
step" (`GradientStep`: clipping and fused Adam called directly) and "direct step + forward" (also
`forward_module`: what the package runs). The direct step is bit-identical (tests/learn/test_optim.py).
Median CPU time of an update and the speed-ups, to benchmarks/results/update_layers.{json,md}.

    .venv/bin/python benchmarks/update_layers.py [--updates 30] [--exps cleanrl_cartpole fast]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # ppo_fabric of this checkout
import common  # noqa: E402

import ppo_fabric.learn.update as update  # noqa: E402
from ppo_fabric.app.launch import build_fabric  # noqa: E402
from ppo_fabric.app.preflight import load  # noqa: E402
from ppo_fabric.collect.rollout import build_collector, training_batches  # noqa: E402
from ppo_fabric.config.values import training_layout  # noqa: E402
from ppo_fabric.learn.learners import build_learners, policies_of, policy_specs  # noqa: E402
from ppo_fabric.learn.optim import GradientStep, forward_module  # noqa: E402
from ppo_fabric.learn.schedule import LrSchedule  # noqa: E402
from ppo_fabric.learn.settings import UpdateSettings  # noqa: E402


class LayeredStep(GradientStep):
    """GradientStep that always goes through `fabric.clip_gradients` and `optimizer.step()`."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.direct = False


VARIANTS = {
    "fabric layers": (lambda fabric, model: model, LayeredStep),
    "direct step": (lambda fabric, model: model, GradientStep),
    "direct step + forward": (forward_module, GradientStep),
}


def measure(exp: str, updates: int) -> dict[str, Any]:
    cfg, _, _ = load([f"exp={exp}", "logger=none"])
    torch.set_num_threads(1)
    fabric = build_fabric(cfg, 1)
    specs = policy_specs(cfg)
    learners = build_learners(fabric, specs, None, float(cfg.algo.adam_eps))
    collector = build_collector(cfg, specs, 0, fabric.device, None)
    policies = policies_of(learners)
    layout = training_layout(cfg, 1)
    n = layout.batch
    for i in range(3):
        collector.collect(policies, i * n)
    times: dict[str, list[float]] = {k: [] for k in VARIANTS}
    loads = [os.getloadavg()[0]]
    try:
        for r in range(updates + 2):
            for name, (fwd, step) in VARIANTS.items():
                update.forward_module, update.GradientStep = fwd, step  # type: ignore[assignment]
                batches = training_batches(collector, specs)
                t = time.thread_time()
                update.update_policies(
                    fabric,
                    learners,
                    batches,
                    settings=UpdateSettings.of(cfg.algo),
                    env_step=r * n,
                    lr_schedule=LrSchedule(10**9),
                    mean_across=None,
                    rank_minibatch=layout.rank_minibatch,
                )
                if r >= 2:  # the first updates create Adam's state and warm the caches
                    times[name].append(time.thread_time() - t)
    finally:
        update.forward_module, update.GradientStep = forward_module, GradientStep  # type: ignore[assignment]
    collector.envs.close()
    loads.append(os.getloadavg()[0])
    medians = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    base = medians["fabric layers"]
    return {
        "exp": exp,
        "samples_per_update": n,
        "minibatch_size": int(cfg.algo.minibatch_size),
        "updates": updates,
        "median_update_ms": medians,
        "speedup": {k: base / v for k, v in medians.items()},
        "load": loads,
    }


def main() -> None:
    parser = common.argument_parser(__doc__)
    parser.add_argument("--updates", type=common.positive, default=30, help="timed updates per variant")
    recipes = sorted(p.stem for p in (common.RESULTS.parent.parent / "conf" / "exp").glob("*.yaml"))
    parser.add_argument(
        "--exps",
        nargs="+",
        default=["cleanrl_cartpole", "fast"],
        choices=recipes,
        metavar="EXP",
        help=f"recipes (conf/exp): {', '.join(recipes)}",
    )
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    args = parser.parse_args()
    rows = [measure(exp, args.updates) for exp in args.exps]
    m = common.machine()
    lines = [
        "# Direct minibatch-step layers (optim.py): update time with and without them",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}; git {common.git_commit()}. One process, "
        f"one torch thread, the three variants alternated update by update, {args.updates} updates each; "
        "median CPU time of one update (all epochs and minibatches).",
        "",
        "| exp | samples per update | minibatch | variant | update ms | speed-up | 1-min load (start, end) |",
        "|---|---:|---:|---|---:|---:|---|",
    ]
    for r in rows:
        for k in VARIANTS:
            lines.append(
                f"| {r['exp']} | {r['samples_per_update']} | {r['minibatch_size']} | {k} | "
                f"{r['median_update_ms'][k]:.2f} | {r['speedup'][k]:.2f}x | {r['load'][0]:.1f}, {r['load'][1]:.1f} |"
            )
    lines += ["", f"Command: `{common.command_line(__file__)}`", ""]
    common.write_report(
        args.out, "update_layers", {"machine": m, "git": common.git_commit(), "rows": rows}, "\n".join(lines)
    )


if __name__ == "__main__":
    main()
