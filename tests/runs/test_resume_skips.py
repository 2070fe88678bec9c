"""`resume=auto` (and a supervisor's restart) names each checkpoint it passes over and why: truncated or
unreadable files, and checkpoints holding NaN or inf tensors; only the process that speaks for the run
prints. The checkpoints are hand-made plain states: loading needs no model or env."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import gymnasium as gym
import pytest
import torch
from omegaconf import OmegaConf

from ppo_fabric.config.values import OWN_RUN_DIR_ENV
from ppo_fabric.envs.spaces import space_to_data
from ppo_fabric.runs import checkpoint as ckpt
from ppo_fabric.runs import resume

pytestmark = pytest.mark.unit


def _state(env_step: int, weight: torch.Tensor | None = None) -> dict[str, Any]:
    """The least a checkpoint must hold for `ckpt.load`, with an unbounded Box (CartPole's velocities)."""
    box = space_to_data(gym.spaces.Box(-math.inf, math.inf, (4,)))
    return {
        "config": {}, "observation_space": box, "action_space": {}, "update": env_step // 128,
        "env_step": env_step, "run_id": "abc", "lineage": [["abc", 0]], "best_return": -math.inf,
        "agent": {"actor.0.weight": torch.zeros(2, 3) if weight is None else weight, "steps": torch.tensor(3)},
        "ranks": [{"obs": torch.ones(4), "episodes": [1.0, 2.0]}],
    }  # fmt: skip


def _write(ckpt_dir: Path, name: str, state: dict[str, Any], age_s: float) -> Path:
    path = ckpt_dir / name
    ckpt.atomic_write(ckpt.encode(state), path)
    os.utime(path, (path.stat().st_atime - age_s, path.stat().st_mtime - age_s))
    return path


@pytest.fixture(autouse=True)
def _speaking(monkeypatch: pytest.MonkeyPatch) -> None:
    """This test process speaks for its runs (no rank or supervisor variables inherited), and every test
    starts with nothing reported yet."""
    for name in ("RANK", "LOCAL_RANK", "NODE_RANK", OWN_RUN_DIR_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(resume, "_reported", set())


def _skipped(capfd: pytest.CaptureFixture[str]) -> list[str]:
    return [line for line in capfd.readouterr().err.splitlines() if " skipped " in line]


def test_a_truncated_newest_checkpoint_is_passed_over_and_named(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    ckpt_dir = tmp_path / "checkpoints"
    older = _write(ckpt_dir, "step_000000000256_abc.ckpt", _state(256), age_s=60)
    last = _write(ckpt_dir, "last.ckpt", _state(512), age_s=0)
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])  # a crash or a full disk mid-write
    cfg = OmegaConf.create({"resume": "auto"})
    assert resume.resolve_auto(cfg, str(tmp_path))
    assert cfg.resume == str(older.resolve()), "continued from the intact older checkpoint"
    (line,) = _skipped(capfd)
    assert line.startswith(f"ppo-fabric: resume=auto skipped {last.resolve()}: truncated or corrupt ("), line


def test_a_checkpoint_holding_nan_is_passed_over_with_its_key(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    ckpt_dir = tmp_path / "checkpoints"
    older = _write(ckpt_dir, "step_000000000256_abc.ckpt", _state(256), age_s=120)
    inf = _write(ckpt_dir, "step_000000000384_abc.ckpt", _state(384, torch.full((2, 3), math.inf)), age_s=60)
    nan = torch.zeros(2, 3)
    nan[1, 2] = math.nan
    last = _write(ckpt_dir, "last.ckpt", _state(512, nan), age_s=0)
    assert resume.newest_checkpoint(tmp_path) == (older, 256)
    assert _skipped(capfd) == [
        f"ppo-fabric: resume=auto skipped {last}: agent.actor.0.weight holds NaN",
        f"ppo-fabric: resume=auto skipped {inf}: agent.actor.0.weight holds inf",
    ]


def test_other_unreadable_files_are_named_with_loads_reason(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "checkpoints"
    ckpt_dir.mkdir()
    (ckpt_dir / "last.ckpt").write_bytes(b"")
    torch.save({"format": ckpt.FORMAT_VERSION, "env_step": 3}, ckpt_dir / "partial.ckpt")
    torch.save({"weights": torch.zeros(1)}, ckpt_dir / "foreign.ckpt")
    os.utime(ckpt_dir / "foreign.ckpt", (0, 0))
    seen: list[tuple[str, str]] = []
    assert resume.newest_checkpoint(tmp_path, lambda path, why: seen.append((path.name, why))) is None
    assert seen == [
        ("last.ckpt", "empty file"),
        ("partial.ckpt", "an incomplete ppo-fabric checkpoint (missing config, observation_space, action_space, "
         "agent, update, ranks)"),
        ("foreign.ckpt", "not a ppo-fabric checkpoint (format 2)"),
    ]  # fmt: skip


def test_only_the_process_speaking_for_the_run_reports(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Other ranks, and the job of a supervisor owning the directory (which reported already), stay
    silent; a file is reported once per process however often it is looked at; a restart says so."""
    ckpt_dir = tmp_path / "checkpoints"
    ckpt_dir.mkdir()
    bad = ckpt_dir / "last.ckpt"
    bad.write_bytes(b"PK\x03\x04 truncated")
    with monkeypatch.context() as patch:
        patch.setenv("LOCAL_RANK", "1")
        resume.newest_checkpoint(tmp_path)
        patch.setenv("LOCAL_RANK", "0")
        patch.setenv("NODE_RANK", "1")
        resume.newest_checkpoint(tmp_path)
    with monkeypatch.context() as patch:
        patch.setenv(OWN_RUN_DIR_ENV, str(tmp_path))
        resume.newest_checkpoint(tmp_path)
    assert _skipped(capfd) == []
    resume.newest_checkpoint(tmp_path)
    resume.newest_checkpoint(tmp_path)
    assert len(_skipped(capfd)) == 1
    resume.report_skipped(tmp_path, ckpt_dir / "step_1_x.ckpt", "empty file", by="restart")
    assert _skipped(capfd) == [f"ppo-fabric: restart skipped {ckpt_dir / 'step_1_x.ckpt'}: empty file"]


def test_nonfinite_tensor_names_the_first_key_path() -> None:
    state = _state(256)
    assert ckpt.nonfinite_tensor(state) is None, "a -inf float (not a tensor) is a value, not a broken model"
    state["ranks"][0]["obs"][2] = -math.inf
    assert ckpt.nonfinite_tensor(state) == "ranks.0.obs"
    assert ckpt.nonfinite_reason(state) == "ranks.0.obs holds inf"
    state["agent"]["actor.0.weight"][0, 0] = math.nan
    assert ckpt.nonfinite_tensor(state) == "agent.actor.0.weight"
    assert (
        ckpt.nonfinite_tensor({"a": (torch.zeros(1), [torch.tensor([1, 2]), torch.tensor([math.nan])])})
        == "a.1.1"
    )
    half = torch.tensor([math.inf], dtype=torch.float16)
    assert ckpt.nonfinite_reason({"x": half, "i": torch.tensor([2**62])}) == "x holds inf"


def test_a_real_checkpoint_is_finite(tiny_run: Path) -> None:
    """CartPole's observation space is unbounded (-inf/inf bounds): a stored space is not a diverged model."""
    state = ckpt.load(tiny_run / "checkpoints" / "last.ckpt", env_state="fresh")
    assert not bool(torch.isfinite(state["observation_space"]["high"]).all())
    assert ckpt.nonfinite_tensor(state) is None
    assert resume.newest_checkpoint(tiny_run) == (tiny_run / "checkpoints" / "last.ckpt", 512)
