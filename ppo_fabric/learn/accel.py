"""Speed switches of the update: `algo.compile` (the minibatch step under `torch.compile`) and the CUDA
math settings (`fabric.tf32`: TF32 matmuls/convolutions and `cudnn.benchmark`).

The compiled step is the eager step's own function (`update.minibatch_losses`) handed to `torch.compile`,
never a second copy of the losses: the two cannot drift apart. What is compiled is the forward pass and the
losses; autograd then runs the compiled backward. Gradient clipping and the (fused) optimizer step stay
eager: the learning rate is then an ordinary float that the compiled graph never sees, so the annealed
schedule cannot cause a recompile.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

# One compiled step per model: each learner of a multi-agent run has its own shapes and parameters, so
# each gets its own function (and its own recompile budget) instead of all of them sharing one.
_COMPILED: weakref.WeakKeyDictionary[Any, Callable[..., Any]] = weakref.WeakKeyDictionary()


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def uses_cuda_graphs(model: torch.nn.Module) -> bool:
    """The compiled step of a CUDA model replays CUDA graphs (`mode="reduce-overhead"`): PPO's minibatch
    step is bound by kernel launches on a GPU, and its shapes are static (the minibatch divides the
    batch, checked in config), so every step after the first replays the same graph."""
    return model_device(model).type == "cuda"


def compile_mode(device: torch.device) -> str:
    """CUDA graphs on CUDA; plain inductor elsewhere (CUDA graphs exist only there)."""
    return "reduce-overhead" if device.type == "cuda" else "default"


def compiled(step: Callable[..., Any], model: torch.nn.Module) -> Callable[..., Any]:
    """`step` compiled for `model`, built once per model and reused for every update.

    `dynamic=False`: every minibatch has the same shape, and a shape-generic graph would be slower.
    The model goes in as it is (the Fabric wrapper, DDP inside it with several trainers): DDP's forward is
    not traced by torch.compile, it runs eagerly and calls the compiled module, so its gradient hooks
    still all-reduce every gradient.
    """
    fn = _COMPILED.get(model)
    if fn is None:
        fn = torch.compile(step, dynamic=False, mode=compile_mode(model_device(model)))
        _COMPILED[model] = fn
    return fn


def set_cuda_math(tf32: bool) -> bool:
    """TF32 matmuls and convolutions and cuDNN's autotuner on (or off) for this process's CUDA work.

    On by default: on Ampere and later GPUs TF32 runs float32 matmuls several times faster at ~10 bits of
    mantissa, which PPO's noisy gradients do not notice, and the autotuner picks the fastest convolution
    for the fixed shapes of a run. Checks that compare numbers across devices turn it off
    (`fabric.tf32=false`). Process-wide flags, set once where Fabric is set up; without CUDA nothing is
    touched. Returns whether TF32 is now on.
    """
    if not torch.cuda.is_available():
        return False
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = tf32
    return tf32
