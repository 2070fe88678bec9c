"""The PPO minibatch step of a Nature-CNN policy, alone: eager vs `algo.compile` vs one CUDA graph.

Atari's update (`exp=atari`: batch 2048, minibatches of 256, 4 epochs) on a [4, 84, 84] uint8 frame stack
with 6 actions. Each variant runs whole updates (shuffle, then every minibatch: forward, PPO losses,
backward, gradient clipping at 0.5, Adam) and reports milliseconds per minibatch step after warm-up:

  eager     `update.update_policy` on a Fabric-wrapped model, as a run with `algo.compile=false` calls it:
            the same minibatch step, the direct clip + fused Adam path (`optim.GradientStep`), the
            per-epoch ratio statistics and the update's metrics (a few host syncs per update);
  compiled  the same with `algo.compile=true` (CUDA graphs via `mode="reduce-overhead"` on CUDA, plain
            inductor on the CPU);
  compile-graph  the same with `algo.compile=graph`: the package's whole step (forward, losses, backward,
            clipping, the fused Adam kernel with a tensor lr) in one CUDA graph (`learn/graph.py`), after 2
            eager warm-up steps; on the CPU the same step runs uncaptured;
  graph     CUDA only: a bare whole step (forward, losses, backward, clipping, `Adam(capturable=True)` with
            a tensor lr) captured in one `torch.cuda.CUDAGraph`; each minibatch is copied into the static
            input buffers before `replay()`: the floor `compile-graph` is measured against.
  tdgraph   the same whole step recorded and replayed by tensordict's `CudaGraphModule` (the public API
            LeanRL's compiled PPO uses), which copies each minibatch into its buffers and checks the inputs
            itself: whether a library-level whole-step graph can match `graph` (without CUDA it runs the
            step directly, which the CPU dry run exercises);
  tdgraph-compiled  CUDA only: `CudaGraphModule(torch.compile(step))`, the compiled kernels in one graph.

Target: <= 1.5 ms per step on an H100. TF32 is on on CUDA, as `fabric.tf32` defaults. On a CPU
pass small sizes for a dry run (the CUDA graph row is skipped):

    python benchmarks/minibatch_step.py [--device cuda] [--updates 5]
    python benchmarks/minibatch_step.py --device cpu --batch 64 --minibatch 32 --epochs 1 --updates 2
    python benchmarks/minibatch_step.py --variants graph     # one variant alone; the report keeps the others
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
from lightning_fabric import Fabric  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from ppo_fabric.config.defaults import with_defaults  # noqa: E402
from ppo_fabric.learn.accel import set_cuda_math  # noqa: E402
from ppo_fabric.learn.learners import fused_adam_ok  # noqa: E402
from ppo_fabric.learn.settings import LossCoefs, UpdateSettings  # noqa: E402
from ppo_fabric.learn.update import minibatch_losses, update_policy  # noqa: E402
from ppo_fabric.models.agent import ActorCritic  # noqa: E402

COEFS = LossCoefs(clip=0.1, clip_vloss=False, norm_adv=True, vf_coef=0.5, ent_coef=0.01)  # exp=atari's
MAX_NORM, LR, ACTIONS = 0.5, 2.5e-4, 6
KEYS = ("obs", "actions", "logprobs", "values", "advantages", "returns")
VARIANTS = (
    "eager",
    "compiled",
    "compile-graph",
    "graph",
    "tdgraph",
    "tdgraph-compiled",
)  # graph, tdgraph-compiled: CUDA only


def make_model(device: torch.device) -> ActorCritic:
    cfg = OmegaConf.create({"encoder": "cnn", "actor_hidden": [], "critic_hidden": [], "activation": "relu"})
    space = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
    torch.manual_seed(0)
    return ActorCritic(space, gym.spaces.Discrete(ACTIONS), cfg).to(device)


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
    device: torch.device, compile_step: bool | str, batch: dict[str, torch.Tensor], args: Any
) -> Callable[[], None]:
    """One update as a run makes it: `update_policy` on a Fabric-wrapped model and the optimiser the
    learners build (`learners.build_learners`)."""
    fabric = Fabric(accelerator=device.type, devices=1)
    model = make_model(torch.device("cpu"))
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, eps=1e-5, fused=fused_adam_ok(fabric))
    model, optimizer = fabric.setup(model, optimizer)
    algo = dict(
        {"minibatch_size": args.minibatch, "update_epochs": args.epochs, "clip_coef": COEFS.clip,
         "clip_vloss": COEFS.clip_vloss, "norm_adv": COEFS.norm_adv, "vf_coef": COEFS.vf_coef,
         "ent_coef": COEFS.ent_coef, "max_grad_norm": MAX_NORM, "target_kl": None, "compile": compile_step,
         "anneal_lr": False, "gamma": 0.99, "gae_lambda": 0.95}
    )  # fmt: skip
    settings = UpdateSettings.of(OmegaConf.create(with_defaults({"algo": algo})["algo"]))
    data = TensorDict(batch, batch_size=[args.batch], device=device)

    def update() -> None:
        update_policy(fabric, model, optimizer, data, settings)

    return update


def graph_update(
    step: Callable[[dict[str, torch.Tensor]], None], batch: dict[str, torch.Tensor], args: Any
) -> Callable[[], None]:
    """An update of `step`s: shuffle, then the minibatches in order."""
    device = batch["obs"].device

    def update() -> None:
        for _ in range(args.epochs):
            perm = torch.randperm(args.batch, device=device)
            shuffled = {k: v[perm] for k, v in batch.items()}
            for start in range(0, args.batch, args.minibatch):
                step({k: v[start : start + args.minibatch] for k, v in shuffled.items()})

    return update


def whole_step(model: ActorCritic) -> tuple[Callable[..., torch.Tensor], tuple[Any, ...]]:
    """The step a graph records, on `model`'s device: forward, losses, backward, clipping (no host sync:
    without error_if_nonfinite) and Adam, capturable with its lr as a tensor on CUDA (an annealed schedule
    would `fill_` it between updates). It takes the minibatch's `KEYS` tensors and returns the loss
    statistics. It drops the gradients first, so a recorded backward writes them afresh at each replay
    instead of adding to the last ones. Also returned: what the graph's memory belongs to (model,
    optimiser, lr), which whoever replays it must keep alive."""
    params = list(model.parameters())
    capturable = params[0].device.type == "cuda"  # capturable Adam needs CUDA
    lr: float | torch.Tensor = torch.tensor(LR, device=params[0].device) if capturable else LR
    optimizer = torch.optim.Adam(params, lr=lr, eps=1e-5, capturable=capturable, foreach=True)

    def body(*tensors: torch.Tensor) -> torch.Tensor:
        for p in params:
            p.grad = None
        loss, stats, _ = minibatch_losses(model, *tensors, None, None, None, None, COEFS)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
        optimizer.step()
        return stats.detach()

    return body, (model, optimizer, lr)


def graph_step(device: torch.device, minibatch: int) -> Callable[[dict[str, torch.Tensor]], None]:
    """`whole_step` in one `torch.cuda.CUDAGraph`, captured by hand."""
    body, alive = whole_step(make_model(device))
    static = make_batch(minibatch, device)
    inputs = [static[k] for k in KEYS]
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up outside the graph: optimizer state, cuBLAS/cuDNN workspaces
        for _ in range(3):
            body(*inputs)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body(*inputs)

    # The graph reads and writes the memory of the model, the optimiser's state and the lr, but holds no
    # reference to them: `step` must. Freed when this function returned, their blocks went to the update's next
    # allocations (the shuffled batch), which each replay's Adam step then overwrote, so a later copy put
    # garbage into the static actions: the out-of-range gather index three leases saw at a replay.
    def step(mb: dict[str, torch.Tensor], _alive: tuple[Any, ...] = alive) -> None:
        for k in KEYS:
            static[k].copy_(mb[k], non_blocking=True)
        graph.replay()

    return step


def tdgraph_step(model: ActorCritic, compile_body: bool) -> Callable[[dict[str, torch.Tensor]], None]:
    """`graph_step`'s whole step, recorded by `tensordict.nn.CudaGraphModule` (optionally around
    `torch.compile` of it). Without CUDA, `CudaGraphModule` calls the step directly."""
    from tensordict.nn import CudaGraphModule

    body, _ = whole_step(model)
    fn = torch.compile(body) if compile_body else body
    # the module holds `body`, whose closure holds the model, the optimiser and the lr the graph uses
    device = next(model.parameters()).device
    module = CudaGraphModule(
        fn, warmup=3 if compile_body else 2, device=device if device.type == "cuda" else None
    )

    def step(mb: dict[str, torch.Tensor]) -> None:
        module(*(mb[k] for k in KEYS))

    return step


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
        "eager": lambda: package_update(device, False, batch, args),
        "compiled": lambda: package_update(device, True, batch, args),
        "compile-graph": lambda: package_update(device, "graph", batch, args),
        "tdgraph": lambda: graph_update(tdgraph_step(make_model(device), False), batch, args),
    }
    if device.type == "cuda":
        variants["graph"] = lambda: graph_update(graph_step(device, args.minibatch), batch, args)
        variants["tdgraph-compiled"] = lambda: graph_update(
            tdgraph_step(make_model(device), True), batch, args
        )
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
