"""What TensorDict storage costs: the same training run on TensorDict and on plain preallocated tensors.

The rollout storage and the training batch are TensorDicts everywhere in the package. This benchmark
swaps them, for the duration of one in-process run, for `PlainBatch`: a dict of the same preallocated
tensors offering only the operations the rollout loop, GAE and `train()` use (key access, `select`,
`reshape`, row indexing). Everything else is the package's own code. Runs alternate between the two
storages, one at a time, and the median SPS of each is compared. Writes
benchmarks/results/tensordict_overhead.{json,md}.

    .venv/bin/python benchmarks/tensordict_overhead.py [--repeats 5] [--steps 100000]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import ppo_fabric  # noqa: E402
from ppo_fabric import buffer, rollout  # noqa: E402


class PlainBatch(dict):
    """A dict of tensors sharing leading dims: just enough of the TensorDict API for the training loop."""

    def __init__(self, tensors: dict[str, torch.Tensor], batch_size: tuple[int, ...]) -> None:
        super().__init__(tensors)
        self.batch_size = torch.Size(batch_size)
        self.device = next(iter(tensors.values())).device

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return dict.__getitem__(self, key)
        rows = {k: v[key] for k, v in self.items()}
        return PlainBatch(rows, tuple(next(iter(rows.values())).shape[:1]))

    def select(self, *keys: str) -> PlainBatch:
        return PlainBatch({k: dict.__getitem__(self, k) for k in keys}, tuple(self.batch_size))

    def reshape(self, *shape: int) -> PlainBatch:
        lead = len(self.batch_size)
        out = {k: v.reshape(*shape, *v.shape[lead:]) for k, v in self.items()}
        return PlainBatch(out, tuple(next(iter(out.values())).shape[: len(shape)]))


def plain_storage(*args: Any, **kwargs: Any) -> PlainBatch:
    td = original_storage(*args, **kwargs)
    return PlainBatch(dict(td.items()), tuple(td.batch_size))


original_storage = buffer.rollout_storage


def run(storage: str, steps: int, seed: int) -> float:
    # rollout.policy_storage builds every rollout storage through this name
    rollout.rollout_storage = plain_storage if storage == "plain tensors" else original_storage
    try:
        with tempfile.TemporaryDirectory() as tmp:
            overrides = ["exp=cleanrl_cartpole", f"algo.total_steps={steps}", f"seed={seed}", "logger=none",
                         f"hydra.run.dir={tmp}/run"]  # fmt: skip
            return ppo_fabric.run(overrides)["sps"]
    finally:
        rollout.rollout_storage = original_storage


def main() -> None:
    parser = common.argument_parser(__doc__)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    run("tensordict", 8192, 0)  # warm-up: imports, first allocations
    sps: dict[str, list[float]] = {"tensordict": [], "plain tensors": []}
    for repeat in range(args.repeats):
        for name in sps if repeat % 2 == 0 else list(sps)[::-1]:
            sps[name].append(run(name, args.steps, seed=repeat + 1))
            print(f"{name:14s} run {repeat + 1}: {sps[name][-1]:,.0f} SPS", flush=True)
    td, plain = statistics.median(sps["tensordict"]), statistics.median(sps["plain tensors"])
    slowdown = 1 - td / plain
    m = common.machine()
    report = {"machine": m, "steps": args.steps, "sps": sps, "median": {"tensordict": td, "plain": plain},
              "tensordict_slowdown": slowdown}  # fmt: skip
    lines = [
        "# TensorDict storage vs plain preallocated tensors",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}. CleanRL CartPole workload, coupled, "
        f"1 process, {args.steps} steps per run, {args.repeats} runs each (alternating, in one process).",
        "",
        "| storage | median SPS | runs |",
        "|---|---:|---|",
        f"| TensorDict | {td:,.0f} | {', '.join(f'{x:,.0f}' for x in sps['tensordict'])} |",
        f"| plain tensors | {plain:,.0f} | {', '.join(f'{x:,.0f}' for x in sps['plain tensors'])} |",
        "",
        f"TensorDict is {100 * slowdown:.1f}% slower (negative: faster) than plain tensors.",
        "",
        f"Command: `{common.command_line(__file__)}`",
        "",
    ]
    common.write_report(args.out, "tensordict_overhead", report, "\n".join(lines))


if __name__ == "__main__":
    main()
