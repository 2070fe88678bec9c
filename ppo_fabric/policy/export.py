"""Export a checkpoint's policy: `python -m ppo_fabric.export checkpoint=PATH format=torchscript|onnx`.

The file maps a float32 observation batch [B, *obs_shape] to the deterministic action [B, *action_shape]
(and, with `value=true`, the critic's value [B]), and runs without this package: `torch.jit.load(f)(obs)`
in plain PyTorch, or `onnxruntime.InferenceSession(f).run(None, {"obs": obs})`. Box actions come out
clipped to the action space, as the training rollout clips them before `env.step`, so the output is what
the env receives. Every export is loaded back and checked against the checkpoint's model before returning.

Inputs and outputs follow the policy, in this order: `obs`, then `action_mask` (bool [B, sum(nvec)], True
where legal) for a policy trained with action masks, then `state` ([B, *state_shape], zeros at an
episode's start) for a recurrent (LSTM) one; outputs `action`, `value` (with `value=true`), then
`next_state` (the `state` to feed with the next step). A multi-agent checkpoint gives one file per policy,
`policy_<name>.pt` / `.onnx`, in `out` (a directory there).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import Tensor, nn

from ppo_fabric.envs.normalize import CLIP as NORM_CLIP
from ppo_fabric.envs.normalize import EPS as NORM_EPS

USAGE = """usage: python -m ppo_fabric.export checkpoint=PATH [key=value ...]

  checkpoint=PATH       a .ckpt file, or a run directory (its checkpoints/last.ckpt)   (required)
  format=torchscript    torchscript (torch.jit.load) or onnx (needs: pip install 'ppo-fabric[onnx]')
  out=FILE              default: policy.pt / policy.onnx in the checkpoint's run directory (policy-best.pt
                        for best.ckpt, policy-<stem> for any checkpoint but last.ckpt); multi-agent
                        checkpoints: a directory for policy_<name>.pt / .onnx, one file per policy
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
    exported file needs: no sampling, no log-probs, and the env-side clipping of Box actions built in.
    `MaskedPolicy`, `RecurrentPolicy` and `MaskedRecurrentPolicy` add the mask and state inputs: each
    has its own `forward` signature, since both exporters name a graph's inputs after its arguments."""

    masked = False
    recurrent = False

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

    @property
    def input_names(self) -> list[str]:
        return ["obs", *(["action_mask"] if self.masked else []), *(["state"] if self.recurrent else [])]

    @property
    def output_names(self) -> list[str]:
        # not "state" again: ONNX names every graph value once
        return [
            "action",
            *(["value"] if self.with_value else []),
            *(["next_state"] if self.recurrent else []),
        ]

    def _act(self, obs: Tensor, mask: Tensor | None, state: Tensor | None) -> Tensor | tuple[Tensor, ...]:
        obs = obs.to(torch.float32)
        if self.normalize:
            obs = torch.clamp((obs - self.obs_mean) / self.obs_std, -NORM_CLIP, NORM_CLIP)
        masks = () if mask is None else (mask.to(torch.bool),)
        action, _, value, state = self.agent.act_with_state(obs, state, True, *masks)
        if self.clip:  # minimum/maximum rather than clamp(tensor, tensor): every ONNX opset has them
            action = torch.maximum(torch.minimum(action, self.high), self.low)
        outputs = (action, *((value,) if self.with_value else ()), *((state,) if self.recurrent else ()))
        return outputs if len(outputs) > 1 else action

    def forward(self, obs: Tensor) -> Tensor | tuple[Tensor, ...]:
        return self._act(obs, None, None)


class MaskedPolicy(DeterministicPolicy):
    masked = True

    def forward(self, obs: Tensor, action_mask: Tensor) -> Tensor | tuple[Tensor, ...]:  # type: ignore[override]
        return self._act(obs, action_mask, None)


class RecurrentPolicy(DeterministicPolicy):
    recurrent = True

    def forward(self, obs: Tensor, state: Tensor) -> Tensor | tuple[Tensor, ...]:  # type: ignore[override]
        return self._act(obs, None, state)


class MaskedRecurrentPolicy(DeterministicPolicy):
    masked = True
    recurrent = True

    def forward(  # type: ignore[override]
        self, obs: Tensor, action_mask: Tensor, state: Tensor
    ) -> Tensor | tuple[Tensor, ...]:
        return self._act(obs, action_mask, state)


def policy_module(
    agent: nn.Module,
    action_space: gym.Space,
    with_value: bool = False,
    obs_norm: dict[str, Any] | None = None,
    masked: bool = False,
) -> DeterministicPolicy:
    """The exportable module for `agent`: with the mask input when it was trained with masks, and the
    state in and out when it is recurrent."""
    kinds = {
        (False, False): DeterministicPolicy,
        (True, False): MaskedPolicy,
        (False, True): RecurrentPolicy,
        (True, True): MaskedRecurrentPolicy,
    }
    return kinds[(masked, bool(agent.recurrent))](agent, action_space, with_value, obs_norm).eval()


def _metadata(
    state: dict[str, Any],
    obs_space: gym.Space,
    action_space: gym.Space,
    policy: DeterministicPolicy,
    name: str | None = None,
) -> dict[str, Any]:
    return {
        "env_id": state["config"]["env"]["id"],
        "env_step": state.get("env_step"),
        "policy": name,
        "observation_shape": list(obs_space.shape),
        "action_space": str(action_space),
        "inputs": policy.input_names,
        "outputs": policy.output_names,
        "state_shape": list(policy.agent.state_shape) if policy.recurrent else None,
    }


def _example_obs(space: gym.Space, batch: int, seed: int = 0) -> Tensor:
    """Observations drawn from the space (batch > 1, so no size-1 dimension gets specialised)."""
    space.seed(seed)
    return torch.as_tensor(np.stack([space.sample() for _ in range(batch)]), dtype=torch.float32)


def example_inputs(
    policy: DeterministicPolicy, obs_space: gym.Space, batch: int, seed: int = 0
) -> tuple[Tensor, ...]:
    """Inputs of `policy` for tracing and checking: sampled observations, random masks with at least one
    legal action per action dimension, and a random (not zero) recurrent state, so the check covers the
    state's path through the graph."""
    inputs = [_example_obs(obs_space, batch, seed)]
    gen = torch.Generator().manual_seed(seed)
    if policy.masked:
        nvec = policy.agent.head.nvec
        mask = torch.rand(batch, sum(nvec), generator=gen) < 0.5
        offset = 0
        for n in nvec:
            mask[torch.arange(batch), offset + torch.randint(n, (batch,), generator=gen)] = True
            offset += n
        inputs.append(mask)
    if policy.recurrent:
        inputs.append(0.5 * torch.randn(batch, *policy.agent.state_shape, generator=gen))
    return tuple(inputs)


def export_torchscript(
    policy: DeterministicPolicy, example: Tensor | tuple[Tensor, ...], path: Path, meta: dict[str, Any]
) -> None:
    """Trace (not script) the policy: the model's Python-side dispatch (activation table, head type) is
    fixed per checkpoint, so tracing records exactly the ops that run. TorchScript is deprecated in
    recent PyTorch but still the format a bare `torch.jit.load` runs; its warning is silenced here."""
    with warnings.catch_warnings(), torch.no_grad():
        warnings.filterwarnings("ignore", message=".*torch.jit.*deprecated.*")
        # nn.LSTM's own shape checks read sizes as Python values: harmless here (they only raise)
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        traced = torch.jit.trace(policy, example if isinstance(example, tuple) else (example,))
        # into memory, then written by Python: torch.jit.save into a file on a full disk aborted the
        # process (a C++ exception, exit 134) and left a truncated file
        buffer = io.BytesIO()
        torch.jit.save(traced, buffer, _extra_files={METADATA_FILE: json.dumps(meta)})
    path.write_bytes(buffer.getvalue())


def _check_onnx_installed() -> None:
    """onnxruntime too: without it the exported file could not be checked against the model."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as exc:
        raise ExportError(ONNX_HINT) from exc


def export_onnx(
    policy: DeterministicPolicy, example: Tensor | tuple[Tensor, ...], path: Path, meta: dict[str, Any]
) -> None:
    """torch.export-based ONNX export (PyTorch's default since 2.9) with a dynamic batch dimension, saved
    as one self-contained file (the weights of an MLP policy are far below protobuf's 2 GB limit)."""
    quiet = logging.getLogger("torch.onnx")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # "torchvision is not installed" notes are irrelevant to an MLP
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            inputs = example if isinstance(example, tuple) else (example,)
            batch = torch.export.Dim("batch")
            program = torch.onnx.export(
                policy,
                inputs,
                input_names=policy.input_names,
                output_names=policy.output_names,
                dynamic_shapes={name: {0: batch} for name in policy.input_names},
                dynamo=True,
                verbose=False,
            )
    finally:
        quiet.setLevel(level)
    program.model.metadata_props[METADATA_FILE] = json.dumps(meta)
    program.save(str(path), external_data=False)


def run_exported(path: Path, fmt: str, *inputs: Tensor) -> list[np.ndarray]:
    """Outputs of an exported file on `inputs` (obs[, action_mask][, state]), loaded the way a consumer
    without this package would."""
    if fmt == "torchscript":
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.jit.*deprecated.*")
            out = torch.jit.load(str(path))(*inputs)
        return [t.numpy() for t in (out if isinstance(out, tuple) else (out,))]
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return list(session.run(None, {n: t.numpy() for n, t in zip(names, inputs, strict=True)}))


def export(
    checkpoint: str | Path, format: str = "torchscript", out: str | Path | None = None, value: bool = False
) -> Path | dict[str, Path]:
    """Write the policy file and verify it reproduces the checkpoint's deterministic actions; returns its
    path, or for a multi-agent checkpoint {policy: path} of its `policy_<name>` files in the directory
    `out`. Raises ExportError with a one-line message for input that cannot be exported."""
    from ppo_fabric.runs import checkpoint as ckpt

    if format not in FORMATS:
        raise ExportError(f"format={format} is unknown; choose one of {', '.join(FORMATS)}")
    if format == "onnx":
        _check_onnx_installed()
    try:
        state, policies = ckpt.load_policies(checkpoint)
    except ValueError as exc:
        raise ExportError(str(exc)) from exc
    obs_spaces, action_spaces = ckpt.saved_spaces(state)
    suffix = FORMATS[format]
    other = {s: f for f, s in FORMATS.items() if f != format}
    if out is not None and Path(out).suffix in other:  # a .pt file that holds ONNX is read by nothing
        raise ExportError(
            f"out={out} names a {other[Path(out).suffix]} file for format={format}; name it "
            f"{Path(out).with_suffix(suffix)} or give format={other[Path(out).suffix]}"
        )
    stem = ckpt.resolve(checkpoint).stem  # best.ckpt's policy beside last.ckpt's, not over it
    own = "policy" if stem == "last" else f"policy-{stem}"
    if not state.get("multiagent"):
        path = Path(out) if out is not None else ckpt.run_dir_of(checkpoint) / f"{own}{suffix}"
        norm = ckpt.observation_normalization(state)
        masked = ckpt.mask_width(state) is not None
        agent = policies["main"]
        return _export_one(state, agent, obs_spaces, action_spaces, format, path, value, norm, masked, None)
    directory = Path(out) if out is not None else ckpt.run_dir_of(checkpoint)
    paths = {}
    for name, agent in policies.items():
        masked = ckpt.mask_width(state, name) is not None
        path = directory / f"{own if out is None else 'policy'}_{name}{suffix}"  # a directory of the user's
        paths[name] = _export_one(
            state, agent, obs_spaces[name], action_spaces[name], format, path, value, None, masked, name
        )
    return paths


def _export_one(
    state: dict[str, Any],
    agent: nn.Module,
    obs_space: gym.Space,
    action_space: gym.Space,
    format: str,
    path: Path,
    value: bool,
    norm: dict[str, Any] | None,
    masked: bool,
    name: str | None,
) -> Path:
    """Export one policy to `path` and check the file against the model on fresh inputs."""
    which = "" if name is None else f"policy {name!r}: "
    if not isinstance(obs_space, gym.spaces.Box):  # one input tensor named "obs"
        raise ExportError(
            f"{which}export supports Box observations; this policy reads {type(obs_space).__name__}"
        )
    policy = policy_module(agent, action_space, value, norm, masked)
    meta = _metadata(state, obs_space, action_space, policy, name)
    if path.is_dir():
        raise ExportError(
            f"out={path} is a directory; name the file (e.g. out={path / ('policy' + FORMATS[format])})"
        )
    # Written and checked as a temp file beside `path`, which it then replaces: a failed write (a full
    # disk) or check leaves no partial file, and an earlier export at `path` as it was.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            (export_torchscript if format == "torchscript" else export_onnx)(
                policy, example_inputs(policy, obs_space, batch=2), tmp, meta
            )
        except OSError as exc:
            raise ExportError(
                f"out={path}: cannot write there ({exc.strerror or type(exc).__name__})"
            ) from exc
        check = example_inputs(policy, obs_space, batch=7, seed=1)
        with torch.no_grad():
            expected = policy(*check)
        expected_np = [t.numpy() for t in (expected if isinstance(expected, tuple) else (expected,))]
        got = run_exported(tmp, format, *check)
        for output, want, have in zip(meta["outputs"], expected_np, got, strict=True):
            if want.shape != have.shape or not np.allclose(want, have, rtol=1e-4, atol=1e-5):
                raise ExportError(
                    f"{which}the exported {format} policy's {output} differs from the checkpoint's model"
                )
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    return path


def main(argv: list[str] | None = None) -> Path | dict[str, Path] | None:
    """Entry point; exits with status 2 and one line on stderr for bad input."""
    from ppo_fabric.config.arguments import ArgError, fail, parse_key_values

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
    if isinstance(path, dict):
        files = ", ".join(f"{name}: {p}" for name, p in path.items())
        print(f"ppo-fabric: exported the {kwargs['format']} policies ({files})", flush=True)
    else:
        print(f"ppo-fabric: exported the {kwargs['format']} policy to {path}", flush=True)
    return path


if __name__ == "__main__":
    main()
