"""One test per private name of `ppo_fabric.compat.private`: each checks the name still exists and still
does what the package uses it for, so a torch, Lightning or Hydra release that changes one fails here,
naming it."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import pytest
import torch
from lightning_fabric import Fabric
from lightning_fabric.plugins.precision import Precision
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from ppo_fabric.compat import private


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(5, 3, generator=gen)),
        torch.nn.Parameter(torch.randn(3, generator=gen)),
    ]


def _grads(params: list[torch.nn.Parameter], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def test_fused_adam_and_foreach_add_step_exactly_as_fused_adam() -> None:
    """The direct call (steps += 1, then the fused kernel) on the states `Adam.step()` made gives the
    same parameters and states as `Adam.step()` itself, bit for bit."""
    ref, mine = _params(0), _params(0)
    opts = [torch.optim.Adam(ps, lr=3e-4, eps=1e-5, fused=True) for ps in (ref, mine)]
    for step in range(3):
        for ps in (ref, mine):
            _grads(ps, step)
        opts[0].step()
        if step == 0:
            opts[1].step()  # creates the state the direct call reads
            continue
        group, state = opts[1].param_groups[0], opts[1].state
        steps = [state[p]["step"] for p in mine]
        private.foreach_add_(steps, 1)
        private.fused_adam_(
            mine, [p.grad for p in mine], [state[p]["exp_avg"] for p in mine], [state[p]["exp_avg_sq"] for p in mine],
            [], steps, amsgrad=False, lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"], grad_scale=None,
            found_inf=None,
        )  # fmt: skip
    for a, b in zip(ref, mine, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(opts[0].state[a]["exp_avg_sq"], opts[1].state[b]["exp_avg_sq"])


def test_foreach_norm_and_mul_clip_as_clip_grad_norm() -> None:
    ref, mine = _params(1), _params(1)
    _grads(ref, 5)
    _grads(mine, 5)
    total = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    grads = [p.grad for p in mine]
    norm = torch.linalg.vector_norm(torch.stack(private.foreach_norm(grads, 2.0)), 2.0)
    private.foreach_mul_(grads, torch.clamp(0.5 / (norm + 1e-6), max=1.0))
    assert torch.equal(total, norm)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ref, mine, strict=True))


def test_optimizer_step_hooks_are_seen() -> None:
    opt = torch.optim.Adam(_params(2), fused=True)
    assert not private.optimizer_has_step_hooks(opt)
    handle = opt.register_step_pre_hook(lambda *_: None)
    assert private.optimizer_has_step_hooks(opt)
    handle.remove()
    handle = register_optimizer_step_post_hook(lambda *_: None)
    try:
        assert private.optimizer_has_step_hooks(opt)
    finally:
        handle.remove()
    assert not private.optimizer_has_step_hooks(opt)


def test_linear_parameters_are_the_layers_own() -> None:
    layer = nn.Linear(3, 2)
    weight, bias = private.linear_parameters(layer)
    assert weight is layer.weight and bias is layer.bias


@pytest.fixture
def fabric() -> Fabric:
    return Fabric(accelerator="cpu", devices=1)


def test_fabric_inner_module_is_the_model(fabric: Fabric) -> None:
    model = nn.Linear(3, 2)
    wrapped = fabric.setup_module(model)
    assert wrapped is not model and private.fabric_inner_module(wrapped) is model
    assert private.fabric_inner_module(model) is None


def test_fabric_optimizer_callbacks_are_where_we_read_them(fabric: Fabric) -> None:
    """Without callbacks the direct step may run; with one that hooks the step, the wrapper's callbacks
    must be found where we read them, or the direct step would skip the user's callback unsaid."""
    optimizer = fabric.setup_optimizers(torch.optim.Adam(nn.Linear(3, 2).parameters()))
    assert not private.fabric_optimizer_callbacks(optimizer)

    class Hook:
        def on_before_optimizer_step(self, *_args: object, **_kwargs: object) -> None:
            pass

    hooked = Fabric(accelerator="cpu", devices=1, callbacks=[Hook()])
    optimizer = hooked.setup_optimizers(torch.optim.Adam(nn.Linear(3, 2).parameters()))
    assert private.fabric_optimizer_callbacks(optimizer), "Lightning moved the optimizer wrapper's callbacks"


def test_fabric_precision_reference_is_replaced(fabric: Fabric) -> None:
    """The plugin set after launch is the one Fabric's own `autocast()` enters."""
    entered: list[str] = []

    class Recording(Precision):
        @contextlib.contextmanager
        def forward_context(self) -> Iterator[None]:
            entered.append("forward")
            yield

    private.set_fabric_precision(fabric, Recording())
    with fabric.autocast():
        pass
    assert entered == ["forward"], "Lightning no longer reads the precision reference we replace"


def test_hydra_command_line_entry_points() -> None:
    parser = private.hydra_args_parser()
    args = parser.parse_args(["-m", "--cfg", "job", "a=1"])
    assert args.multirun and args.cfg == "job" and args.overrides == ["a=1"]
    from hydra._internal.utils import _run_hydra  # what `private.run_hydra` calls, with these arguments

    wanted = {"args", "args_parser", "task_function", "config_path", "config_name"}
    assert wanted <= set(inspect.signature(_run_hydra).parameters)


def test_hydra_override_values() -> None:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep

    choice, interval = OverridesParser.create().parse_overrides(
        ["a=choice(1,2)", "b=tag(log, interval(1e-5, 1e-2))"]
    )
    assert isinstance(private.hydra_override_value(choice), ChoiceSweep)
    assert isinstance(private.hydra_override_value(interval), IntervalSweep)
    assert private.hydra_value_as_str([1, "x y", {"k": 2.5}]) == "[1,x\\ y,{k:2.5}]"


def test_dynamos_profiler_note_is_where_the_filter_drops_it() -> None:
    """A compiled step of a DDP model: dynamo's once-per-process note that DDP's `record_function` is ignored
    came as a raw `[rank1]:W...` log line from every training rank. The filter is keyed on the logger's name
    (its module) and the message's start: a torch that moves or rewords it fails here."""
    import importlib
    import inspect
    import logging

    from ppo_fabric.app.process import DYNAMO_CONTEXTS, PROFILER_NOTE, quiet_libraries

    source = inspect.getsource(importlib.import_module(DYNAMO_CONTEXTS))
    assert f'"{PROFILER_NOTE} %s will be ignored"' in source and "getLogger(__name__)" in source
    quiet_libraries()
    logger = logging.getLogger(DYNAMO_CONTEXTS)
    note = logger.makeRecord(
        DYNAMO_CONTEXTS, logging.WARNING, "x", 1, f"{PROFILER_NOTE} %s will be ignored", (1,), None
    )
    other = logger.makeRecord(DYNAMO_CONTEXTS, logging.WARNING, "x", 1, "Graph break: %s", (1,), None)
    assert not logger.filter(note) and logger.filter(other)


def test_the_launchers_processes_are_where_we_read_them() -> None:
    """Fabric's subprocess launcher keeps the ranks it starts in `procs`, in local-rank order: a rank that
    lost contact reads there whether a signal ended one (without, a killed rank 1 is blamed on rank 0)."""
    from lightning_fabric.plugins.environments import LightningEnvironment
    from lightning_fabric.strategies import DDPStrategy
    from lightning_fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    strategy = DDPStrategy(cluster_environment=LightningEnvironment(), start_method="popen")
    strategy._configure_launcher()
    launcher = strategy.launcher
    assert isinstance(launcher, _SubprocessScriptLauncher) and launcher.procs == []
    assert "self.procs.append(proc)" in inspect.getsource(_SubprocessScriptLauncher._call_children_scripts)
    launcher.procs.append("rank 1")

    class Job:
        pass

    job = Job()
    job.strategy = strategy  # type: ignore[attr-defined]
    assert private.launched_processes(job) == ["rank 1"]
    job.strategy = Job()  # type: ignore[attr-defined]  # fabric run, torchrun: no launcher of ours
    assert private.launched_processes(job) == []
