"""`algo.compile=graph`: the whole PPO minibatch step in one CUDA graph, replayed for every minibatch.

A minibatch step of a small network on a GPU is bound by kernel launches, not arithmetic. On an H100 the
Nature-CNN step of 256 samples took 3.4-3.6 ms eager and 1.65-1.75 ms with `algo.compile=true`, whose
`torch.compile` CUDA graphs cover the forward and backward passes while clipping and Adam run eagerly
after them. With forward, losses, backward, clipping and Adam captured in one graph it took 0.94-0.96 ms
(`benchmarks/results/gpu_h100.md`).

The graph records the eager step's own code, never a copy: `update.minibatch_losses`, `backward`, then
`optim.clip_and_adam` (clipping, the non-finite skip and the fused Adam kernel of `optim.GradientStep`'s
direct path). Only where things live differs from the eager step:
- inputs: each minibatch is copied into static buffers, one per batch column, that the graph reads;
- outputs: the losses, new log-probs and skip flag are the graph's own tensors, which each replay
  overwrites (the update copies them out);
- the learning rate: a one-element tensor on the device, refilled from the optimiser's float before each
  update, so an annealed schedule needs no new capture;
- gradients: made by the recorded backward in the graph's memory, and rewritten (not accumulated) by each
  replay.

A CUDA graph holds no reference to the memory it reads and writes. Everything it touches (parameters,
gradients, Adam's states, the lr tensors, the buffers) is held by its `WholeStepGraph`, which lives as long
as its model. Memory freed under a graph goes to other tensors, which every replay then overwrites: the
benchmark's first hand-made graph did that, and failed on three GPU leases with an out-of-range gather.

The graph is captured in an update after `WARMUP_STEPS` eager steps of it, run on a side stream as torch
asks (they create Adam's state and the cuBLAS/cuDNN workspaces). It is captured again whenever what it
recorded is no longer what the update holds: the optimiser's state replaced (a checkpoint loaded), or the
batch's columns changed (the decoupled objective's weights come with lagged batches only). Warm-up steps
are real steps of the update, so the arithmetic is the eager path's throughout.

Without CUDA nothing is captured: the same body runs directly on the static buffers with the tensor lr.
The CPU tests thus prove that the step the graph records computes what the eager step computes.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from tensordict import TensorDict

from ppo_fabric.learn.optim import AdamGroups, clip_and_adam
from ppo_fabric.learn.settings import LossCoefs

WARMUP_STEPS = 2  # eager steps of an update before its capture
Column = torch.Tensor | TensorDict | None  # a minibatch of one batch column; None where the batch has none

# One graph per model (each learner of a multi-agent run has its own), kept between updates. The graph holds
# the inner module, never the Fabric wrapper it is keyed by, so the entry goes with the model.
_GRAPHS: weakref.WeakKeyDictionary[Any, WholeStepGraph] = weakref.WeakKeyDictionary()


def signature(columns: list[Column]) -> tuple[Any, ...]:
    """What a capture depends on in the inputs: which columns exist, their shapes and dtypes."""

    def one(column: Column) -> Any:
        if column is None:
            return None
        if isinstance(column, TensorDict):
            return tuple((k, v.shape, v.dtype) for k, v in sorted(column.items(True, True)))
        return (column.shape, column.dtype)

    return tuple(one(c) for c in columns)


def same_state(a: AdamGroups, b: AdamGroups) -> bool:
    """The same parameters and the same Adam state tensors (not equal values: the same memory)."""
    flat = [[t for _, params, lists in g for t in (*params, *(x for s in lists for x in s))] for g in (a, b)]
    return len(flat[0]) == len(flat[1]) and all(x is y for x, y in zip(*flat, strict=True))


class WholeStepGraph:
    """One minibatch step of `net` (forward, PPO losses, backward, clipping, fused Adam), captured in a CUDA
    graph on CUDA and run directly elsewhere. `__call__` takes the minibatch's columns (`update.STEP_COLUMNS`
    then the importance weights) and returns (loss terms, new log-probs, skip flag), the graph's own tensors
    until the next call."""

    def __init__(
        self,
        losses: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        net: Any,
        groups: AdamGroups,
        max_norm: float,
        coefs: LossCoefs,
        columns: list[Column],
    ) -> None:
        # `losses` is `update.minibatch_losses`, passed in because `update` builds on this module
        self.losses, self.net, self.groups, self.max_norm, self.coefs = losses, net, groups, max_norm, coefs
        self.params = [p for _, params, _ in groups for p in params]
        device = self.params[0].device
        self.capture = device.type == "cuda"
        # The CUDA kernel reads a float32 lr; the CPU one reads a float64 exactly as it reads a Python float.
        dtype = torch.float32 if self.capture else torch.float64
        self.lrs = [torch.tensor(float(group["lr"]), dtype=dtype, device=device) for group, _, _ in groups]
        self.inputs = [None if c is None else c.clone() for c in columns]
        self.signature = signature(columns)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def fits(self, columns: list[Column], groups: AdamGroups) -> bool:
        return signature(columns) == self.signature and same_state(groups, self.groups)

    def set_lr(self) -> None:
        """The optimiser's learning rates as the update set them (one small copy per group, no sync)."""
        for lr, (group, _, _) in zip(self.lrs, self.groups, strict=True):
            lr.fill_(group["lr"])

    def body(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step on the static inputs. Dropping the gradients first makes the recorded backward write
        them afresh (in the graph's memory) rather than add to the last step's."""
        for p in self.params:
            p.grad = None
        *columns, weights = self.inputs
        loss, stats, new_logp = self.losses(self.net, *columns, self.coefs, weights)
        loss.backward()
        skipped = clip_and_adam([p.grad for p in self.params], self.groups, self.max_norm, self.lrs)
        return stats.detach(), new_logp.detach(), skipped

    def __call__(self, columns: list[Column]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        for buffer, column in zip(self.inputs, columns, strict=True):
            if buffer is not None:
                buffer.copy_(column, non_blocking=True)
        if not self.capture:
            return self.body()
        if self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.outputs = self.body()
        self.graph.replay()  # capturing only records: the first minibatch's step runs here too
        assert self.outputs is not None
        return self.outputs


def cached(model: Any) -> WholeStepGraph | None:
    return _GRAPHS.get(model)


def keep(model: Any, graph: WholeStepGraph) -> WholeStepGraph:
    _GRAPHS[model] = graph
    return graph


@contextlib.contextmanager
def warmup_stream(device: torch.device) -> Iterator[None]:
    """Eager steps before a capture run on a side stream (torch's CUDA graph docs); a no-op off CUDA."""
    if device.type != "cuda":
        yield
        return
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        yield
    torch.cuda.current_stream(device).wait_stream(side)
