"""The PPO minibatch step of `exp=atari`'s Nature-CNN learner alone ([4, 84, 84] uint8 frames, 6 actions),
in milliseconds per step over whole updates after a warm-up one: `eager`, `compiled` and `compile-graph` are
`update.update_policy` as a run calls it with `algo.compile=false`, `true` and `graph`; `graph` replays that
update's `learn/graph.WholeStepGraph` alone for every minibatch (the floor `compile-graph` is measured
against; without CUDA its step runs uncaptured). The `graph` rows recorded so far (results/gpu_h100.md,
gpu_h200.md) timed a hand-made copy of that step: rerun them in a worktree at 7c45d9d.
Target: <= 1.5 ms per step on an H100.

    python -m benchmarks minibatch_step [--device cuda] [--updates 5] [--variants graph]
    python -m benchmarks minibatch_step --device cpu --batch 64 --minibatch 32 --epochs 1 --updates 2   # dry run
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from ppo_fabric.compat.imports import skip_torchmetrics_probe  # noqa: E402

skip_torchmetrics_probe()  # a process of the project's own, as the command line's (compat/imports.py)

import common  # noqa: E402
import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from ppo_fabric.app.launch import build_fabric  # noqa: E402
from ppo_fabric.config.values import compose  # noqa: E402
from ppo_fabric.envs.multiagent import SINGLE  # noqa: E402
from ppo_fabric.learn import graph as whole  # noqa: E402
from ppo_fabric.learn.accel import set_cuda_math  # noqa: E402
from ppo_fabric.learn.learners import PolicySpec, build_learners  # noqa: E402
from ppo_fabric.learn.settings import UpdateSettings  # noqa: E402
from ppo_fabric.learn.update import STEP_COLUMNS, update_policy  # noqa: E402

ACTIONS = 6  # Pong's
VARIANTS = ("eager", "compiled", "compile-graph", "graph")


def make_batch(n: int, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    batch = {
        "obs": torch.randint(0, 256, (n, 4, 84, 84), dtype=torch.uint8, generator=g),
        "actions": torch.randint(0, ACTIONS, (n,), generator=g),
        "logprobs": -torch.rand(n, generator=g) - 1.0,
        "values": torch.randn(n, generator=g),
        "advantages": torch.randn(n, generator=g),
        "returns": torch.randn(n, generator=g),
    }
    return {k: v.to(device) for k, v in batch.items()}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_updates(update: Callable[[], None], device: torch.device, args: Any) -> tuple[float, float]:
    """(ms per minibatch step over the timed updates, seconds of the first (warm-up) update)."""
    t0 = time.perf_counter()
    update()
    sync(device)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(args.updates):
        update()
    sync(device)
    steps = args.updates * args.epochs * (args.batch // args.minibatch)
    return (time.perf_counter() - t0) / steps * 1e3, first


def package_update(
    device: torch.device, compile_step: str, batch: dict[str, torch.Tensor], args: Any, epochs: int = 0
) -> tuple[Callable[[], None], Any]:
    """One update as a run makes it, of the learner `exp=atari` composes (the env's spaces given, not probed:
    no ALE needed) with `epochs` (0: --epochs) per update; also the Fabric-wrapped model."""
    cfg, _ = compose([
        "exp=atari", f"fabric={'gpu' if device.type == 'cuda' else 'cpu'}", f"algo.compile={compile_step}",
        f"algo.minibatch_size={args.minibatch}", f"algo.update_epochs={epochs or args.epochs}", "algo.anneal_lr=false",
    ])  # fmt: skip
    fabric = build_fabric(cfg, 1)
    space = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
    spec = PolicySpec(SINGLE, space, gym.spaces.Discrete(ACTIONS), cfg.model, float(cfg.algo.lr), True, 1)
    torch.manual_seed(0)
    learner = build_learners(fabric, {SINGLE: spec}, None, float(cfg.algo.adam_eps))[SINGLE]
    settings = UpdateSettings.of(cfg.algo)
    data = TensorDict(batch, batch_size=[args.batch], device=device)

    def update() -> None:
        update_policy(fabric, learner.model, learner.optimizer, data, settings)

    return update, learner.model


def graph_replays(device: torch.device, batch: dict[str, torch.Tensor], args: Any) -> Callable[[], None]:
    """The `WholeStepGraph` one `algo.compile=graph` update captures, then replayed alone: per epoch a shuffle,
    then per minibatch its columns (`STEP_COLUMNS`, then no importance weights) into the graph's buffers."""
    # an update captures after its first WARMUP_STEPS steps: this one has more, however small the sizes
    update, model = package_update(device, "graph", batch, args, epochs=whole.WARMUP_STEPS + 1)
    update()
    step = whole.cached(model)
    assert step is not None, "the algo.compile=graph update kept no whole-step graph"
    step.set_lr()

    def replays() -> None:
        for _ in range(args.epochs):
            perm = torch.randperm(args.batch, device=device)
            columns = [batch[k][perm] if k in batch else None for k in (*STEP_COLUMNS, "weights")]
            for start in range(0, args.batch, args.minibatch):
                step([None if c is None else c[start : start + args.minibatch] for c in columns])

    return replays


def main() -> None:
    p = common.argument_parser(__doc__)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--minibatch", type=int, default=256)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--updates", type=int, default=5, help="timed updates after one warm-up update")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                   help="these variants only, each in this process (one per process isolates a variant from "
                   "the CUDA state the others leave); the report keeps the other rows of the same device")  # fmt: skip
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("SKIP minibatch_step: no CUDA device; --device cpu runs a dry run on the CPU")
        return
    if args.batch % args.minibatch:
        p.error("--minibatch must divide --batch")
    device = torch.device(args.device)
    set_cuda_math(True)  # what a run gets by default (fabric.tf32=true); a no-op without CUDA
    batch = make_batch(args.batch, device)
    rows = earlier_rows(args, device)
    variants: dict[str, Callable[[], Callable[[], None]]] = {
        "eager": lambda: package_update(device, "false", batch, args)[0],
        "compiled": lambda: package_update(device, "true", batch, args)[0],
        "compile-graph": lambda: package_update(device, "graph", batch, args)[0],
        "graph": lambda: graph_replays(device, batch, args),
    }
    variants = {k: v for k, v in variants.items() if k in args.variants}
    for name, build in variants.items():
        t0 = time.perf_counter()
        try:
            update = build()  # the graph variant captures here
            built = time.perf_counter() - t0
            ms, first = time_updates(update, device, args)
        except Exception as err:  # noqa: BLE001 - a CUDA error poisons the context: report it, run no more
            rows[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
            print(f"{name}: FAILED {rows[name]['error']}", flush=True)
            write(args, device, rows)
            raise
        rows[name] = {"ms_per_step": ms, "first_update_s": first + built}
        print(f"{name}: {ms:.3f} ms per minibatch step (first update {first:.1f} s)", flush=True)
        write(args, device, rows)  # after every variant: a job cut short keeps what it measured


def report_name(device: torch.device) -> str:
    return "minibatch_step" if device.type == "cuda" else "minibatch_step_cpu_dry_run"


def earlier_rows(args: Any, device: torch.device) -> dict[str, dict[str, Any]]:
    """The rows of the variants this run does not redo, from the report it replaces, when that report was made
    on the same device with the same sizes (a variant run alone adds its row to the others)."""
    path = args.out / f"{report_name(device)}.json"
    if set(args.variants) == set(VARIANTS) or not path.is_file():
        return {}
    old = json.loads(path.read_text())
    sizes = ("batch", "minibatch", "epochs", "updates")
    if old.get("device") != device_name(device) or any(old["args"].get(k) != getattr(args, k) for k in sizes):
        return {}
    return {k: v for k, v in old["rows"].items() if k not in args.variants}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU: {common.cpu_model()}"


def write(args: Any, device: torch.device, rows: dict[str, dict[str, Any]]) -> None:
    m = common.machine()
    where = device_name(device)

    def row(name: str, v: dict[str, Any]) -> str:
        if "error" in v:
            return f"| {name} | failed: {v['error']} | |"
        return f"| {name} | {v['ms_per_step']:.3f} | {v['first_update_s']:.1f} |"

    md = "\n".join(
        [
            "# Nature-CNN PPO minibatch step",
            "",
            f"{where}, torch {m['torch']}; batch {args.batch}, minibatch {args.minibatch}, {args.epochs} "
            f"epochs, {args.updates} timed updates; commit {common.git_commit()}.",
            f"Command: `{common.command_line(__file__)}`",
            "",
            "| variant | ms per minibatch step | set-up + first update s (compile, capture) |",
            "|---|---:|---:|",
            *(row(k, rows[k]) for k in VARIANTS if k in rows),
            "",
            "Target: <= 1.5 ms per step on an H100.",
            "",
        ]
    )
    name = report_name(device)
    common.write_report(args.out, name, {"device": where, "args": vars(args) | {"out": str(args.out)},
                                         "machine": m, "rows": rows}, md)  # fmt: skip


if __name__ == "__main__":
    main()
