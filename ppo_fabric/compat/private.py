"""The private names of other libraries that ppo_fabric relies on, and nothing else.

A private name can change in any release. Each one here is kept because it does something no public API
does (Hydra's command line), or because the public path costs a measured share of a workload's wall time
(the figures are in the docs' performance page, the A/B in `benchmarks/update_layers.py`). Every name has
a test in `tests/compat/test_private.py` that checks the name still exists and still does what we use it
for, so a torch, Lightning or Hydra upgrade that moves one fails there, with the name in the message,
instead of in a run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

# --------------------------------------------------------------------------------------------- torch
# The kernels `torch.optim.Adam(fused=True).step()` and `clip_grad_norm_` call, without the per-call
# grouping, profiler scope and hook checks around them (`learn.optim.GradientStep`). Looked up on first
# import (`from ppo_fabric.compat.private import fused_adam_`), so the command line's parsing, which
# imports this module for Hydra's names, does not import torch.
_TORCH_KERNELS = {
    "fused_adam_": "_fused_adam_",
    "foreach_norm": "_foreach_norm",
    "foreach_mul_": "_foreach_mul_",
    "foreach_add_": "_foreach_add_",
}


def __getattr__(name: str) -> Any:
    if name in _TORCH_KERNELS:
        import torch

        return getattr(torch, _TORCH_KERNELS[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def optimizer_has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether any step hook (global or the optimiser's own) would run in `optimizer.step()`: the direct
    Adam call skips `step()`, so it may only be taken when none would."""
    from torch.optim import optimizer as module

    return bool(
        module._global_optimizer_pre_hooks
        or module._global_optimizer_post_hooks
        or optimizer._optimizer_step_pre_hooks
        or optimizer._optimizer_step_post_hooks
    )


def linear_parameters(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, bias) of an `nn.Linear` read from its parameter dict: `layer.weight` goes through
    `nn.Module.__getattr__` (~0.5 us a read), which the rollout's forward pays several times per env step."""
    params = layer._parameters
    return params["weight"], params["bias"]  # type: ignore[return-value]


# ------------------------------------------------------------------------------------------ Lightning
def fabric_inner_module(wrapper: Any) -> nn.Module | None:
    """The module Fabric's `_FabricModule` wrapper forwards to (the DDP module, or the model itself), or
    None for anything else: calling it skips the wrapper's per-output backward hooks (`learn.optim`)."""
    return getattr(wrapper, "_forward_module", None)


def fabric_optimizer_callbacks(optimizer: Any) -> Any:
    """The callbacks Fabric's optimizer wrapper calls around `step()` (none: the direct step may run)."""
    return getattr(optimizer, "_callbacks", None)


def copy_state_dict_metadata(source: Any, target: Any) -> None:
    """torch's state dicts carry `_metadata` (each module's version, which `load_state_dict` reads to
    upgrade old layouts): a copy of a state dict keeps it (tests/app/test_placement.py)."""
    if hasattr(source, "_metadata"):
        target._metadata = source._metadata


def set_fabric_precision(fabric: Any, plugin: Any) -> None:
    """Give Fabric a precision plugin after launch: Fabric keeps its own reference (`_precision`) for
    `setup()` and `autocast()`, besides the strategy's, and a decoupled trainer takes its GPU (and its
    mixed precision) only after the CPU launch (`app.launch.GroupDDPStrategy.take_device`)."""
    fabric._precision = plugin


def launched_processes(fabric: Any) -> list[Any]:
    """The processes Fabric's launcher started for this node's other ranks (`subprocess.Popen`s of local
    rank 1, 2, ... in order; `procs` of its subprocess launcher), [] where it started none (`fabric run`,
    torchrun, one process). Only their parent can learn that a signal ended one (kill -9, the OOM killer),
    which its peers see only as a closed connection (`app.launch.killed_peer`)."""
    launcher = getattr(fabric.strategy, "launcher", None)
    return list(getattr(launcher, "procs", None) or [])


# -------------------------------------------------------------------------------------------- Hydra
def hydra_args_parser() -> Any:
    """Hydra's own command-line parser (`-m`, `--cfg`, `--config-path`, ...): what `@hydra.main` uses; there
    is no public way to run Hydra's whole command line from a function we call (`app.hydra_app`)."""
    from hydra._internal.utils import get_args_parser

    return get_args_parser()


def run_hydra(**kwargs: Any) -> None:
    """Hydra's entry behind `@hydra.main` (`_run_hydra`), called with the arguments we parsed."""
    from hydra._internal.utils import _run_hydra

    _run_hydra(**kwargs)


def hydra_override_value(override: Any) -> Any:
    """The parsed value of an override as Hydra holds it (a sweep object for `choice(...)`,
    `interval(...)`, ...), which the tuner turns into an Optuna distribution (`tune.space`)."""
    return override._value


def hydra_value_as_str(value: Any) -> str:
    """A value written back in Hydra's override grammar (quoting and nesting as Hydra parses them)."""
    from hydra.core.override_parser.types import Override

    return Override._get_value_element_as_str(value)
