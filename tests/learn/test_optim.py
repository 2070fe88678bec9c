"""optim.py: the direct clip + fused Adam path (GradientStep) gives bit-identical parameters and optimiser
states to Fabric's `clip_gradients` + `optimizer.step()`, and is the path actually taken; `forward_module`
skips Fabric's module wrapper only where it adds nothing."""

from __future__ import annotations

import copy

import pytest
import torch
from lightning_fabric import Fabric
from torch import nn

from ppo_fabric.learn.optim import GradientStep, clip_grad_norm_, forward_module


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))


def _setup(fused: bool = True) -> tuple[Fabric, nn.Module, torch.optim.Optimizer]:
    fabric = Fabric(accelerator="cpu", devices=1)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-5, fused=fused)
    return fabric, *fabric.setup(model, opt)


def _train(steps: int, direct: bool, max_norm: float, fused: bool = True, hook: bool = False) -> tuple:
    """`steps` minibatch steps on fixed data, the end of each by GradientStep or by Fabric's calls."""
    fabric, model, opt = _setup(fused)
    if hook:
        opt.optimizer.register_step_post_hook(lambda *args: None)
    gen = torch.Generator().manual_seed(1)
    taken = {"layered": 0}
    inner_step = opt.optimizer.step

    def counted(*args, **kwargs):
        taken["layered"] += 1
        return inner_step(*args, **kwargs)

    opt.optimizer.step = counted
    finish = GradientStep(fabric, model, opt, max_norm)
    for i in range(steps):
        if i % 3 == 0:  # a new one per update, as update_policy makes it
            finish = GradientStep(fabric, model, opt, max_norm)
        x = torch.randn(32, 4, generator=gen) * 3
        loss = model(x).pow(2).mean() * 50  # large gradients: clipping acts
        for p in model.parameters():
            p.grad = None
        fabric.backward(loss)
        if direct:
            finish()
        else:
            if max_norm > 0:
                fabric.clip_gradients(model, opt, max_norm=max_norm, error_if_nonfinite=False)
            opt.step()
        if i % 4 == 0:  # the schedule changes the lr between steps, as set_lr does
            for group in opt.param_groups:
                group["lr"] = 1e-2 * (1 - i / steps)
    state = copy.deepcopy(opt.optimizer.state_dict())
    return [p.detach().clone() for p in model.parameters()], state, taken["layered"]


@pytest.mark.parametrize("max_norm", [0.5, 0.0, 1e9])
def test_direct_path_is_bit_identical_to_fabric(max_norm: float) -> None:
    ref_params, ref_state, _ = _train(12, direct=False, max_norm=max_norm)
    params, state, layered = _train(12, direct=True, max_norm=max_norm)
    assert layered == 1  # only the first step (it creates Adam's state) went through optimizer.step()
    for a, b in zip(ref_params, params, strict=True):
        assert torch.equal(a, b)
    for k, s in ref_state["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(s[key], state["state"][k][key])


@pytest.mark.parametrize("case", ["not fused", "step hook"])
def test_other_optimisers_take_fabrics_path(case: str) -> None:
    fused, hook = case != "not fused", case == "step hook"
    ref_params, _, _ = _train(6, direct=False, max_norm=0.5, fused=fused, hook=hook)
    params, _, layered = _train(6, direct=True, max_norm=0.5, fused=fused, hook=hook)
    assert layered == 6
    for a, b in zip(ref_params, params, strict=True):
        assert torch.equal(a, b)


def test_clip_grad_norm_matches_torch() -> None:
    gen = torch.Generator().manual_seed(2)
    for scale in (0.01, 10.0):
        grads = [torch.randn(s, generator=gen) * scale for s in ((16, 4), (16,), (3, 16))]
        ref = [g.clone() for g in grads]
        params = [nn.Parameter(torch.zeros_like(g)) for g in ref]
        for p, g in zip(params, ref, strict=True):
            p.grad = g
        total_ref = torch.nn.utils.clip_grad_norm_(params, 1.0)
        total = clip_grad_norm_(grads, 1.0)
        assert torch.equal(total, total_ref)
        for a, p in zip(grads, params, strict=True):
            assert torch.equal(a, p.grad)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_forward_module_skips_the_wrapper_at_full_precision_only(precision: str) -> None:
    fabric = Fabric(accelerator="cpu", devices=1, precision=precision)
    model = fabric.setup_module(_model())
    net = forward_module(fabric, model)
    x = torch.randn(8, 4)
    if precision == "32-true":
        assert net is model.module  # single device: no DDP wrapper in between
        assert torch.equal(net(x), model(x))
    else:  # the wrapper autocasts: kept
        assert net is model


def test_fp16_loss_scaling_keeps_fabrics_path() -> None:
    """16-mixed (CUDA's fp16 AMP) has a GradScaler: the direct path would step on scaled gradients, and a
    fused Adam would unscale inside its kernel, which Fabric's clipping refuses (NotImplementedError). So
    the learners get a plain Adam there, and GradientStep goes through Fabric, which unscales, clips,
    skips steps with inf gradients and updates the scale. (The CPU's GradScaler stands in for CUDA's.)"""
    from lightning_fabric.plugins.precision import MixedPrecision

    from ppo_fabric.learn.learners import fused_adam_ok

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    assert not fused_adam_ok(fabric)
    assert fused_adam_ok(Fabric(accelerator="cpu", devices=1))
    assert fused_adam_ok(Fabric(accelerator="cpu", devices=1, precision="bf16-mixed"))
    model = _model()
    start = [p.detach().clone() for p in model.parameters()]
    model, opt = fabric.setup(
        model, torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused_adam_ok(fabric))
    )
    finish = GradientStep(fabric, model, opt, 0.5)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p in model.parameters():
            p.grad = None
        fabric.backward(model(torch.randn(32, 4, generator=gen) * 3).pow(2).mean() * 50)
        finish()
        assert not finish.direct
    moved = [(p.detach() - s).abs().max().item() for p, s in zip(model.parameters(), start, strict=True)]
    assert all(0 < m <= 3 * 1e-2 * 1.01 for m in moved)  # Adam moves each weight by at most ~lr per step
