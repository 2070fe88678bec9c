"""A minibatch step without Fabric's and torch's generic layers around it, where they add nothing.

`forward_module`: Fabric's module wrapper converts inputs and outputs for the precision (a no-op at full
precision), then registers a Python backward hook on every output tensor, after four `is_overridden`
checks each, to tell users who call `loss.backward()` to use `fabric.backward` (~50-70 us per minibatch
step, hooks firing in the backward pass included); the update calls `fabric.backward` anyway.

`GradientStep`, the end of a minibatch step (gradient clipping then Adam): on CartPole-sized models a minibatch step is a few hundred microseconds of arithmetic, and the layers
around clipping and the optimiser cost about as much again: Fabric's `clip_gradients` (~160 us: its
precision and strategy hooks, then `clip_grad_norm_` grouping the gradients by device and dtype) and
`optimizer.step()` (~115 us: Fabric's wrapper, torch's profiler `record_function` and step hooks, the
per-call grouping of parameters and states). `GradientStep` calls the same kernels directly when nothing
those layers add is in use (no gradient scaler, no step hooks or Fabric callbacks, torch's fused Adam with
a float learning rate): the same operations in the same order, so the parameters and optimiser states are
bit-identical to the layered path (tests/learn/test_optim.py) for a third of the time (~45 + ~40 us). Anything
else, and the first step (which creates Adam's state), takes the layered path.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning_fabric import Fabric
from lightning_fabric.plugins.precision import Precision
from lightning_fabric.strategies import Strategy
from torch.nn.utils import get_total_norm

from ppo_fabric.compat.private import (
    fabric_inner_module,
    fabric_optimizer_callbacks,
    foreach_add_,
    foreach_mul_,
    foreach_norm,
    fused_adam_,
    optimizer_has_step_hooks,
)

_ADAM_FLAGS_OFF = ("amsgrad", "capturable", "differentiable", "decoupled_weight_decay")


def clip_grad_norm_(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` (2-norm) for gradients on one device: the same ops, in place;
    returns the total norm before clipping."""
    total = torch.linalg.vector_norm(torch.stack(foreach_norm(grads, 2.0)), 2.0)
    foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all gradients together, without clipping (`algo.max_grad_norm=0`): torch's public
    `get_total_norm`, off the direct path's hot loop (which clips, and has the norm then)."""
    return get_total_norm(grads, 2.0)


def nonfinite_flag(total: torch.Tensor) -> torch.Tensor:
    """1.0 when the gradient norm is NaN or infinite, else 0.0: a float32 tensor on its device, made in two
    ops and no host sync (`total - total` is 0 or NaN), as the fused Adam kernel's `found_inf` takes it. A
    loss that is not finite shows here too: its gradients are not finite either."""
    return torch.nan_to_num(total - total, nan=1.0)


def _plain_precision(fabric: Fabric, methods: tuple[str, ...]) -> bool:
    precision = fabric.strategy.precision
    return all(getattr(type(precision), name) is getattr(Precision, name) for name in methods)


def forward_module(fabric: Fabric, model: Any) -> Any:
    """What Fabric's wrapper `model` calls in its forward (the DDP wrapper, or the module itself), when the
    precision plugin converts nothing and adds no context (full precision); else `model` itself."""
    inner = fabric_inner_module(model)
    plain = _plain_precision(fabric, ("convert_input", "convert_output", "forward_context"))
    return inner if inner is not None and plain else model


def _plain_layers(fabric: Fabric, optimizer: Any) -> bool:
    """Fabric's strategy and precision add nothing to clipping and stepping: no scaler, no overrides
    (FSDP, DeepSpeed, mixed precision), no callbacks."""
    strategy = fabric.strategy
    plain_strategy = all(
        getattr(type(strategy), name) is getattr(Strategy, name)
        for name in ("clip_gradients_norm", "optimizer_step")
    )
    plain_precision = _plain_precision(fabric, ("optimizer_step", "unscale_gradients", "main_params"))
    return plain_strategy and plain_precision and not fabric_optimizer_callbacks(optimizer)


def _plain_fused_adam(optimizer: Any) -> bool:
    """torch's own Adam (not a subclass), fused, with the options the direct kernel call passes on, and no
    step hooks."""
    if type(optimizer) is not torch.optim.Adam or optimizer_has_step_hooks(optimizer):
        return False
    return all(
        group.get("fused")
        and not any(group.get(flag) for flag in _ADAM_FLAGS_OFF)
        and not any(isinstance(beta, torch.Tensor) for beta in group["betas"])
        for group in optimizer.param_groups
    )


AdamGroups = list[tuple[dict[str, Any], list[torch.Tensor], list[list[torch.Tensor]]]]


@torch.no_grad()
def clip_and_adam(
    grads: list[torch.Tensor], groups: AdamGroups, max_norm: float, lrs: list[float | torch.Tensor]
) -> torch.Tensor:
    """The direct path's end of a minibatch step: clip `grads` to `max_norm` (<= 0: no clipping), then one
    fused Adam kernel per parameter group at its learning rate in `lrs` (a float, or a one-element tensor on
    the device, which the whole-step CUDA graph reads at each replay). The kernel leaves parameters and
    moments as they are when the gradient norm is not finite (`found_inf`), and Adam's step count is given
    back right after it, as torch's fused Adam does: the next steps' bias correction counts only the steps
    taken. Returns that flag: 1.0 skipped, 0.0 taken. No host sync, so it can be recorded in a CUDA graph
    (`learn/graph.py`)."""
    total = clip_grad_norm_(grads, max_norm) if max_norm > 0 else grad_norm(grads)
    skipped = nonfinite_flag(total)  # the kernel's `found_inf`: 1.0 leaves everything as it is
    for (group, params, (exp_avgs, exp_avg_sqs, steps)), lr in zip(groups, lrs, strict=True):
        beta1, beta2 = group["betas"]
        foreach_add_(steps, 1)
        fused_adam_(
            params,
            [p.grad for p in params],
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            amsgrad=False,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            grad_scale=None,
            found_inf=skipped,
        )
        foreach_add_(steps, [skipped] * len(steps), alpha=-1.0)  # a skipped step is not counted
    return skipped


class GradientStep:
    """Clip the gradients to `max_norm` (<= 0: no clipping) and step the optimiser, after `backward`;
    a step whose gradient norm is not finite is skipped, parameters and Adam's moments untouched.
    `__call__` returns 1.0 for a step skipped, 0.0 for one taken, as a tensor: the direct path never waits
    for the device, its fused Adam kernel skips the step itself (`found_inf`, as for a gradient scaler's
    inf) and `clip_and_adam` gives the step count back at once.

    Built once per update (an optimiser state loaded since is picked up by the next update's). The direct
    path holds each parameter group's lists of parameters and Adam states; it is taken on a call where
    every parameter has a gradient and a state and the learning rate is a float, else the call goes through
    Fabric (`fabric.clip_gradients`, `optimizer.step()`)."""

    def __init__(self, fabric: Fabric, model: Any, optimizer: Any, max_norm: float) -> None:
        self.fabric, self.model, self.optimizer, self.max_norm = fabric, model, optimizer, max_norm
        inner = getattr(optimizer, "optimizer", optimizer)  # Fabric's wrapper holds torch's optimiser
        self.inner = inner
        self.direct = _plain_layers(fabric, optimizer) and _plain_fused_adam(inner)
        self.params = [p for group in inner.param_groups for p in group["params"]]
        self._groups: AdamGroups | None = None

    def states(self) -> AdamGroups | None:
        """Per group: (options, params, [exp_avgs, exp_avg_sqs, steps]); None until every state exists, or
        where the direct path is not taken (`algo.compile=graph` records that path and needs it)."""
        if not self.direct:
            return None
        groups = []
        state = self.inner.state
        for group in self.inner.param_groups:
            params = group["params"]
            if not all(p in state and "step" in state[p] for p in params):
                return None
            lists = [[state[p][key] for p in params] for key in ("exp_avg", "exp_avg_sq", "step")]
            if len({(t.device, t.dtype) for t in (*params, *lists[0])}) != 1:
                return None  # the kernel takes one device and dtype (torch groups them per call)
            groups.append((group, params, lists))
        return groups

    def __call__(self) -> torch.Tensor:
        if self.direct and self._groups is None:
            self._groups = self.states()
        grads = [p.grad for p in self.params]
        groups = self._groups
        if (
            groups is None
            or any(g is None for g in grads)
            or not all(isinstance(group["lr"], float) for group, _, _ in groups)
        ):
            return self._layered()
        return clip_and_adam(grads, groups, self.max_norm, [group["lr"] for group, _, _ in groups])

    def _layered(self) -> torch.Tensor:
        """Through Fabric: clipping, then `optimizer.step()` unless the norm is not finite (one host sync,
        on this path only). A gradient scaler (16-mixed) skips such steps itself and must see every one to
        lower its scale, so with one the step is always called."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.max_norm > 0:
            total = self.fabric.clip_gradients(
                self.model, self.optimizer, max_norm=self.max_norm, error_if_nonfinite=False
            )
        else:
            total = grad_norm(grads) if grads else None
        if total is None:  # nothing to step on
            total = torch.zeros((), device=self.fabric.device)
        skipped = nonfinite_flag(total.detach().float())
        if getattr(self.fabric.strategy.precision, "scaler", None) is not None or not bool(skipped):
            self.optimizer.step()  # a scaler skips a non-finite step itself, counting nothing
        return skipped
