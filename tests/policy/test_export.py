"""`python -m ppo_fabric.export`: a policy file that plain PyTorch or ONNX Runtime runs without this package.

The file must give exactly the actions of the checkpoint's ActorCritic in deterministic mode on any batch
size (the batch dimension stays dynamic), optionally with the value, and ONNX must either work end to end
or fail with one line naming the extra to install.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from ppo_fabric.models.agent import ActorCritic
from ppo_fabric.policy import export
from ppo_fabric.runs import checkpoint as ckpt
from tests.conftest import assert_cli_failure

# TorchScript is deprecated in recent PyTorch, but it is the format a bare `torch.jit.load` reads.
pytestmark = pytest.mark.filterwarnings("ignore:.*torch.jit.*deprecated:DeprecationWarning")
HAS_ONNX = all(importlib.util.find_spec(m) is not None for m in ("onnx", "onnxscript", "onnxruntime"))


def _ckpt(run_dir: Path) -> str:
    return str(run_dir / "checkpoints" / "last.ckpt")


def _observations(run_dir: Path, n: int = 64) -> torch.Tensor:
    """Observations the policy meets (a random-action CartPole trajectory) plus off-distribution ones."""
    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=0)
    seen = []
    for _ in range(n // 2):
        seen.append(obs)
        obs, _, terminated, truncated, _ = env.step(env.action_space.sample())
        if terminated or truncated:
            obs, _ = env.reset()
    wide = np.random.default_rng(0).normal(scale=2.0, size=(n - len(seen), 4))
    return torch.as_tensor(np.concatenate([np.stack(seen), wide]), dtype=torch.float32)


def _reference(run_dir: Path, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the checkpoint's ActorCritic does, rebuilt by hand rather than through the export code."""
    state = ckpt.load(_ckpt(run_dir))
    agent = ActorCritic(*ckpt.saved_spaces(state), OmegaConf.create(state["config"]["model"]))
    agent.load_state_dict(state["agent"])
    with torch.no_grad():
        action, _, value = agent.act(obs, deterministic=True)
    return action, value


def test_torchscript_matches_the_agent(tiny_run: Path, tmp_path: Path) -> None:
    path = export.main([f"checkpoint={_ckpt(tiny_run)}", f"out={tmp_path / 'policy.pt'}"])
    assert path == tmp_path / "policy.pt" and path.is_file()
    obs = _observations(tiny_run)
    want, _ = _reference(tiny_run, obs)
    assert want.unique().numel() == 2, "the batch should exercise both actions"
    policy = torch.jit.load(str(path))
    assert torch.equal(policy(obs), want)
    assert torch.equal(policy(obs[:1]), want[:1])  # batch size is not baked in
    extra = {export.METADATA_FILE: ""}
    torch.jit.load(str(path), _extra_files=extra)
    meta = json.loads(extra[export.METADATA_FILE])
    assert meta["env_id"] == "CartPole-v1" and meta["outputs"] == ["action"]


def test_torchscript_with_value_default_path(tiny_run: Path) -> None:
    path = export.export(tiny_run, value=True)  # a run directory stands for its last.ckpt
    assert path == tiny_run / "policy.pt"
    obs = _observations(tiny_run, 16)
    action, value = torch.jit.load(str(path))(obs)
    want_action, want_value = _reference(tiny_run, obs)
    assert torch.equal(action, want_action)
    torch.testing.assert_close(value, want_value)


def test_a_checkpoint_other_than_last_is_exported_beside_it(tiny_run: Path, tmp_path: Path) -> None:
    """Exporting best.ckpt and then the run directory both wrote <run>/policy.pt: the best policy's file
    was overwritten without a word."""
    (tmp_path / "checkpoints").mkdir()
    for name in ("last.ckpt", "best.ckpt"):
        shutil.copy(_ckpt(tiny_run), tmp_path / "checkpoints" / name)
    best = export.export(tmp_path / "checkpoints" / "best.ckpt")
    last = export.export(tmp_path)
    assert (best, last) == (tmp_path / "policy-best.pt", tmp_path / "policy.pt") and best.is_file()


def test_an_export_that_cannot_be_written_leaves_the_earlier_file_as_it_was(
    tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a full disk `torch.jit.save` aborted the process (a C++ exception: exit 134, a 16-line dump)
    and left a truncated policy.pt that `torch.jit.load` refused. The file is written by Python into a
    temp file and checked before it replaces the earlier export: one line, nothing partial left."""
    out = tmp_path / "policy.pt"
    out.write_bytes(b"an earlier export")
    real = Path.write_bytes

    def full_disk(self: Path, data: bytes) -> int:
        if self.name.endswith(".tmp"):
            real(self, data[: len(data) // 2])  # a partial file, as a full disk leaves
            raise OSError(28, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", full_disk)
    with pytest.raises(export.ExportError, match=r"^out=.*policy\.pt: cannot write there \(No space left"):
        export.export(_ckpt(tiny_run), out=out)
    assert out.read_bytes() == b"an earlier export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy.pt"]


def test_box_actions_are_clipped_like_the_rollout(tmp_path: Path) -> None:
    """Gaussian head: the export gives the mean clipped to the bounds, which is what the env receives."""
    obs_space = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
    action_space = gym.spaces.Box(-0.01, 0.02, (2,), np.float32)
    cfg = OmegaConf.create(
        {"encoder": "auto", "actor_hidden": [8], "critic_hidden": [8], "activation": "tanh"}
    )
    agent = ActorCritic(obs_space, action_space, cfg).eval()
    with torch.no_grad():
        agent.head.mean.weight.mul_(100)  # push means well outside the bounds
    policy = export.DeterministicPolicy(agent, action_space).eval()
    obs = torch.randn(32, 3)
    export.export_torchscript(policy, obs[:2], tmp_path / "p.pt", {"outputs": ["action"]})
    with torch.no_grad():
        mean = agent.act(obs, deterministic=True)[0].numpy()
    got = torch.jit.load(str(tmp_path / "p.pt"))(obs).numpy()
    np.testing.assert_allclose(got, np.clip(mean, action_space.low, action_space.high), rtol=1e-6)
    assert (got == action_space.low).any() and (got == action_space.high).any()


@pytest.mark.slow
@pytest.mark.skipif(not HAS_ONNX, reason="onnx extra not installed: pip install 'ppo-fabric[onnx]'")
def test_onnx_matches_the_agent(tiny_run: Path, tmp_path: Path) -> None:
    import onnxruntime as ort

    path = export.main(
        [f"checkpoint={_ckpt(tiny_run)}", "format=onnx", "value=true", f"out={tmp_path / 'p.onnx'}"]
    )
    assert path is not None and path.is_file()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == ["action", "value"]
    obs = _observations(tiny_run)
    want_action, want_value = _reference(tiny_run, obs)
    for batch in (obs, obs[:1]):
        action, value = session.run(None, {"obs": batch.numpy()})
        np.testing.assert_array_equal(action, want_action[: len(batch)].numpy())
        np.testing.assert_allclose(value, want_value[: len(batch)].numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("missing", ["onnxscript", "onnxruntime"])
def test_onnx_without_the_extra_names_it(
    tiny_run: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, missing: str
) -> None:
    """Without onnxruntime the exported file could not be checked against the model: refused like the rest
    of the extra, not exported unchecked."""
    monkeypatch.setitem(sys.modules, missing, None)  # makes `import <missing>` fail
    with pytest.raises(SystemExit) as exc:
        export.main([f"checkpoint={_ckpt(tiny_run)}", "format=onnx"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'ppo-fabric[onnx]'" in err, err


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        pytest.param(["checkpoint={missing}"], "no such checkpoint file", id="missing-checkpoint"),
        pytest.param(["checkpoint={ckpt}", "format=tflite"], "format=tflite is unknown", id="bad-format"),
        pytest.param(["checkpoint={ckpt}", "fromat=onnx"], "fromat: unknown argument", id="unknown-key"),
        pytest.param(["format=onnx"], "checkpoint is required", id="no-checkpoint"),
        pytest.param(
            ["checkpoint={ckpt}", "out={tmp}"], "is a directory; name the file", id="out-a-directory"
        ),
        pytest.param(
            ["checkpoint={ckpt}", "out=/proc/nowhere/p.pt"], "cannot write there", id="out-unwritable"
        ),
        pytest.param(["checkpoint={misfit}"], "the weights do not fit the model its config", id="misfit"),
        pytest.param(  # it wrote TorchScript into x.onnx
            ["checkpoint={ckpt}", "out={tmp}/x.onnx"], "names a onnx file for format=torchscript", id="suffix"
        ),
    ],
)
def test_bad_input(
    tiny_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], fragment: str
) -> None:
    state = ckpt.load(_ckpt(tiny_run), env_state="fresh")
    state["agent"].pop(next(iter(state["agent"])))  # weights that no longer fit the model
    (tmp_path / "misfit.ckpt").write_bytes(ckpt.encode(state))
    paths = {"missing": tmp_path / "nope.ckpt", "ckpt": _ckpt(tiny_run), "tmp": tmp_path,
             "misfit": tmp_path / "misfit.ckpt"}  # fmt: skip
    assert_cli_failure(capsys, export.main, [a.format(**paths) for a in args], fragment)
