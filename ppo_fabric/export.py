"""Export a checkpoint's policy: `python -m ppo_fabric.export checkpoint=PATH format=torchscript|onnx`.

The file maps a float32 observation batch [B, *obs_shape] to the deterministic action [B, *action_shape]
(and, with `value=true`, the critic's value [B]), and runs without this package: `torch.jit.load(f)(obs)`
in plain PyTorch, or `onnxruntime.InferenceSession(f).run(None, {"obs": obs})`. Box actions come out
clipped to the action space, as the training rollout clips them before `env.step`, so the output is what
the env receives. Every export is loaded back and checked against the checkpoint's model before returning.
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import Tensor, nn

from ppo_fabric.normalize import CLIP as NORM_CLIP
from ppo_fabric.normalize import EPS as NORM_EPS

USAGE = """usage: python -m ppo_fabric.export checkpoint=PATH [key=value ...]

  checkpoint=PATH       a .ckpt file, or a run directory (its checkpoints/last.ckpt)   (required)
  format=torchscript    torchscript (torch.jit.load) or onnx (needs: pip install 'ppo-fabric[onnx]')
  out=FILE              default: policy.pt / policy.onnx in the checkpoint's run directory
  value=false           also output the critic's value
"""

SPEC: dict[str, tuple[type, Any]] = {
    "checkpoint": (str, ...),
    "format": (str, "torchscript"),
    "out": (str, None),
    "value": (bool, False),
}
FORMATS = {"torchscript": ".pt", "onnx": ".onnx"}
ONNX_HINT = "format=onnx needs onnx, onnxscript and onnxruntime: pip install 'ppo-fabric[onnx]'"
METADATA_FILE = "ppo_fabric.json"  # TorchScript extra file (ONNX: metadata_props) describing the policy


class ExportError(ValueError):
    """Input the export cannot run with; `str()` is one line for the user."""


class DeterministicPolicy(nn.Module):
    """The checkpoint's ActorCritic reduced to obs -> deterministic action (-> value), the one graph an
    exported file needs: no sampling, no log-probs, and the env-side clipping of Box actions built in."""

    def __init__(
        self,
        agent: nn.Module,
        action_space: gym.Space,
        with_value: bool = False,
        obs_norm: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        # A run trained on normalised observations: the exported file takes raw ones and normalises them
        # with the run's final statistics, exactly as the rollout did.
        self.normalize = obs_norm is not None
        if obs_norm is not None:
            std = np.sqrt(np.asarray(obs_norm["var"]) + NORM_EPS)
            self.register_buffer("obs_mean", torch.as_tensor(obs_norm["mean"], dtype=torch.float32))
            self.register_buffer("obs_std", torch.as_tensor(std, dtype=torch.float32))
        # Frozen: a traced graph of parameters that require grad hands consumers outputs that do too
        # (so `.numpy()` fails); an exported policy is for inference only.
        self.agent = agent.requires_grad_(False)
        self.with_value = with_value
        self.clip = isinstance(action_space, gym.spaces.Box)
        if self.clip:
            self.register_buffer("low", torch.as_tensor(action_space.low, dtype=torch.float32))
            self.register_buffer("high", torch.as_tensor(action_space.high, dtype=torch.float32))

    def forward(self, obs: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        obs = obs.to(torch.float32)
        if self.normalize:
            obs = torch.clamp((obs - self.obs_mean) / self.obs_std, -NORM_CLIP, NORM_CLIP)
        action, _, value = self.agent.act(obs, deterministic=True)
        if self.clip:  # minimum/maximum rather than clamp(tensor, tensor): every ONNX opset has them
            action = torch.maximum(torch.minimum(action, self.high), self.low)
        return (action, value) if self.with_value else action


def _metadata(
    state: dict[str, Any], obs_space: gym.Space, action_space: gym.Space, with_value: bool
) -> dict[str, Any]:
    return {
        "env_id": state["config"]["env"]["id"],
        "env_step": state.get("env_step"),
        "observation_shape": list(obs_space.shape),
        "action_space": str(action_space),
        "inputs": ["obs"],
        "outputs": ["action", "value"] if with_value else ["action"],
    }


def _example_obs(space: gym.Space, batch: int, seed: int = 0) -> Tensor:
    """Observations drawn from the space (batch > 1, so no size-1 dimension gets specialised)."""
    space.seed(seed)
    return torch.as_tensor(np.stack([space.sample() for _ in range(batch)]), dtype=torch.float32)


def export_torchscript(
    policy: DeterministicPolicy, example: Tensor, path: Path, meta: dict[str, Any]
) -> None:
    """Trace (not script) the policy: the model's Python-side dispatch (activation table, head type) is
    fixed per checkpoint, so tracing records exactly the ops that run. TorchScript is deprecated in
    recent PyTorch but still the format a bare `torch.jit.load` runs; its warning is silenced here."""
    with warnings.catch_warnings(), torch.no_grad():
        warnings.filterwarnings("ignore", message=".*torch.jit.*deprecated.*")
        traced = torch.jit.trace(policy, example)
        torch.jit.save(traced, str(path), _extra_files={METADATA_FILE: json.dumps(meta)})


def _check_onnx_installed() -> None:
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as exc:
        raise ExportError(ONNX_HINT) from exc


def export_onnx(policy: DeterministicPolicy, example: Tensor, path: Path, meta: dict[str, Any]) -> None:
    """torch.export-based ONNX export (PyTorch's default since 2.9) with a dynamic batch dimension, saved
    as one self-contained file (the weights of an MLP policy are far below protobuf's 2 GB limit)."""
    quiet = logging.getLogger("torch.onnx")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # "torchvision is not installed" notes are irrelevant to an MLP
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                policy,
                (example,),
                input_names=["obs"],
                output_names=meta["outputs"],
                dynamic_shapes={"obs": {0: torch.export.Dim("batch")}},
                dynamo=True,
                verbose=False,
            )
    finally:
        quiet.setLevel(level)
    program.model.metadata_props[METADATA_FILE] = json.dumps(meta)
    program.save(str(path), external_data=False)


def run_exported(path: Path, fmt: str, obs: Tensor) -> list[np.ndarray]:
    """Outputs of an exported file on `obs`, loaded the way a consumer without this package would."""
    if fmt == "torchscript":
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.jit.*deprecated.*")
            out = torch.jit.load(str(path))(obs)
        return [t.numpy() for t in (out if isinstance(out, tuple) else (out,))]
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return list(session.run(None, {"obs": obs.numpy()}))


def export(
    checkpoint: str | Path, format: str = "torchscript", out: str | Path | None = None, value: bool = False
) -> Path:
    """Write the policy file and verify it reproduces the checkpoint's deterministic actions; returns its
    path. Raises ExportError with a one-line message for input that cannot be exported."""
    from ppo_fabric import checkpoint as ckpt

    if format not in FORMATS:
        raise ExportError(f"format={format} is unknown; choose one of {', '.join(FORMATS)}")
    if format == "onnx":
        _check_onnx_installed()
    try:
        state, agent = ckpt.load_policy(checkpoint)
    except ValueError as exc:
        raise ExportError(str(exc)) from exc
    obs_space, action_space = ckpt.saved_spaces(state)
    if not isinstance(obs_space, gym.spaces.Box):  # one input tensor named "obs"
        raise ExportError(f"export supports Box observations; this policy reads {type(obs_space).__name__}")
    if state.get("action_mask") is not None:  # a file without the mask input would pick illegal actions
        raise ExportError(
            "export of policies trained with action masks comes later (the file would need the mask as an "
            "input); run it with ppo_fabric.evaluate, or train with algo.action_mask=off"
        )
    if agent.recurrent:  # a stateless file would silently act without memory
        raise ExportError(
            "export supports feed-forward policies; this one is recurrent (model=lstm), whose state the "
            "exported file would have to take and return: run it with ppo_fabric.evaluate instead"
        )
    path = Path(out) if out is not None else ckpt.run_dir_of(checkpoint) / f"policy{FORMATS[format]}"
    path.parent.mkdir(parents=True, exist_ok=True)
    norm = ckpt.observation_normalization(state)
    policy = DeterministicPolicy(agent, action_space, value, norm).eval()
    meta = _metadata(state, obs_space, action_space, value)
    example = _example_obs(obs_space, batch=2)
    (export_torchscript if format == "torchscript" else export_onnx)(policy, example, path, meta)

    check = _example_obs(obs_space, batch=7, seed=1)
    with torch.no_grad():
        expected = policy(check)
    expected_np = [t.numpy() for t in (expected if isinstance(expected, tuple) else (expected,))]
    got = run_exported(path, format, check) if format == "torchscript" or _has_onnxruntime() else expected_np
    for name, want, have in zip(meta["outputs"], expected_np, got, strict=True):
        if want.shape != have.shape or not np.allclose(want, have, rtol=1e-4, atol=1e-5):
            raise ExportError(f"the exported {format} policy's {name} differs from the checkpoint's model")
    return path


def _has_onnxruntime() -> bool:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> Path | None:
    """Entry point; exits with status 2 and one line on stderr for bad input."""
    from ppo_fabric.arguments import ArgError, fail, parse_key_values

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(USAGE)
        return None
    try:
        kwargs = parse_key_values(args, SPEC)
        path = export(**kwargs)
    except (ArgError, ExportError) as exc:
        fail(str(exc))
        return None  # unreachable: _fail exits
    print(f"ppo-fabric: exported the {kwargs['format']} policy to {path}", flush=True)
    return path


if __name__ == "__main__":
    main()
