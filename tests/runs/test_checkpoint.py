"""Checkpoints: exact resume, atomic writes, pruning, and never overwriting another run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ppo_fabric
from ppo_fabric.config.values import ConfigError
from ppo_fabric.runs import checkpoint as ckpt
from ppo_fabric.runs.metrics_file import read_rows, series
from tests.conftest import numbered_checkpoint

BASE = [
    "logger.tensorboard=false",
    "algo.total_steps=6144",
    "seed=3",
    "env.num_envs=4",
    "algo.rollout_steps=64",
]


def _params(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["agent"]


@pytest.mark.slow
def test_resume_matches_uninterrupted_run(tmp_path: Path) -> None:
    """Resumed at update 10 of 24, the run ends with bit-identical parameters (model, optimizer, LR
    schedule, RNG and env state all restored). The uninterrupted run does not evaluate and the other two
    do (eval.every=auto, in the training process): evaluation must leave training as it was."""
    ppo_fabric.run([*BASE, "eval.every=0", f"hydra.run.dir={tmp_path / 'full'}"])
    assert not read_rows(tmp_path / "full" / "evaluations.csv")
    ppo_fabric.run([*BASE, f"hydra.run.dir={tmp_path / 'part'}", "checkpoint.every=10", "checkpoint.keep=0"])
    middle = numbered_checkpoint(tmp_path / "part", 10)
    assert ckpt.load(middle)["env_step"] == 10 * 256
    summary = ppo_fabric.run([*BASE, f"hydra.run.dir={tmp_path / 'resumed'}", f"resume={middle}"])
    assert read_rows(tmp_path / "resumed" / "evaluations.csv"), "the resumed run evaluated"
    assert summary["total_env_steps"] == 6144 and summary["steps_this_run"] == 6144 - 2560
    full, resumed = _params(tmp_path / "full"), _params(tmp_path / "resumed")
    assert full.keys() == resumed.keys()
    for key in full:
        assert torch.equal(full[key], resumed[key]), key
    # time/wall_s counts from the run's start: the resumed part continues from the checkpoint's clock
    before = float(ckpt.load(middle)["wall_s"])
    walls = [wall for _, wall in series(read_rows(tmp_path / "resumed" / "metrics.csv"), "time/wall_s")]
    assert before > 0 and walls and walls[0] > before and walls == sorted(walls)


@pytest.mark.slow
def test_resume_changes_the_result_without_env_state(tmp_path: Path) -> None:
    """Guard for the test above: dropping the saved env state must break equality, so the test can fail."""
    ppo_fabric.run([*BASE, f"hydra.run.dir={tmp_path / 'full'}"])
    ppo_fabric.run([*BASE, f"hydra.run.dir={tmp_path / 'part'}", "checkpoint.every=10"])
    middle = numbered_checkpoint(tmp_path / "part", 10)
    state = ckpt.load(middle)
    state["ranks"][0]["envs"] = None
    torch.save(state, tmp_path / "no_env.ckpt")
    with pytest.warns(UserWarning, match="no env state"):
        ppo_fabric.run([*BASE, f"hydra.run.dir={tmp_path / 'resumed'}", f"resume={tmp_path / 'no_env.ckpt'}"])
    full, resumed = _params(tmp_path / "full"), _params(tmp_path / "resumed")
    assert any(not torch.equal(full[k], resumed[k]) for k in full)


@pytest.mark.slow  # seconds in process (a run, or every option composed): not the unit tier
def test_numbered_checkpoints_are_pruned(tmp_path: Path) -> None:
    ppo_fabric.run([*BASE, f"hydra.run.dir={tmp_path}", "checkpoint.every=5", "checkpoint.keep=2"])
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert [n.split("_")[:2] for n in names] == [
        ["best.ckpt"],
        ["last.ckpt"],
        ["step", f"{20 * 256:012d}"],
        ["step", f"{24 * 256:012d}"],
    ]


def test_atomic_write_keeps_the_old_file_when_interrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash between writing and renaming leaves the previous checkpoint intact and no temp file."""
    target = tmp_path / "last.ckpt"
    ckpt.atomic_write(b"old", target)

    def crash(*_: object) -> None:
        raise KeyboardInterrupt  # e.g. Ctrl-C or a kill during the rename

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        ckpt.atomic_write(b"new" * 1000, target)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_atomic_write_syncs_the_file_then_the_renamed_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file's bytes were synced, the rename's directory entry was not: after a power loss `last.ckpt`
    could be the previous checkpoint again."""
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append("dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    ckpt.atomic_write(b"data", tmp_path / "last.ckpt")
    assert synced == ["file", "dir"]


def test_checkpoints_take_the_umask_and_a_dead_writers_temp_files_go(tmp_path: Path) -> None:
    """A checkpoint is readable by whoever the user's umask lets read (tempfile's 0600 kept a teammate's
    `evaluate` out of a shared directory); the temp files a killed writer left (SIGKILL mid-write: no
    Python left to remove them) are removed at the next writer's first write there, not another write's
    in progress in this process."""
    old = os.umask(0o022)
    try:
        ckpt.atomic_write(b"x", tmp_path / "a" / "last.ckpt")
        assert (tmp_path / "a" / "last.ckpt").stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(old)
    run = tmp_path / "b"
    run.mkdir()
    dead = [run / ".last.ckpt.0a1b2c3d4e5f.tmp", run / ".step_000000000512_abcd.ckpt.x1y2.tmp"]
    ours = run / ".best.ckpt.00000000.tmp"  # another thread's write in progress
    for path in (*dead, ours):
        path.write_bytes(b"partial")
    ckpt._WRITING.add(ours)
    try:
        ckpt.atomic_write(b"y", run / "last.ckpt")
    finally:
        ckpt._WRITING.discard(ours)
    assert sorted(p.name for p in run.iterdir()) == sorted([ours.name, "last.ckpt"])


def test_used_run_dir_is_refused_but_can_be_continued(tmp_path: Path) -> None:
    run = ["logger.tensorboard=false", "algo.total_steps=512", f"hydra.run.dir={tmp_path}"]
    ppo_fabric.run(run)
    with pytest.raises(ConfigError, match="already holds a run"):
        ppo_fabric.run(run)
    last = tmp_path / "checkpoints" / "last.ckpt"
    ppo_fabric.run([*run[:1], "algo.total_steps=1024", f"hydra.run.dir={tmp_path}", f"resume={last}"])
    steps = [int(row["step"]) for row in read_rows(tmp_path / "metrics.csv")]
    assert steps == [256, 512, 768, 1024], "the continued run must append to the metrics, not replace them"


@pytest.mark.slow  # seconds in process (a run, or every option composed): not the unit tier
def test_async_envs_resume_with_fresh_episodes(tmp_path: Path) -> None:
    """Async workers cannot be pickled: the checkpoint says so and resume restarts episodes, with a warning."""
    run = [*BASE[:1], "env.vector=async", "env.num_envs=2", "algo.rollout_steps=64", "algo.minibatch_size=64"]
    ppo_fabric.run([*run, "algo.total_steps=256", f"hydra.run.dir={tmp_path / 'a'}"])
    last = tmp_path / "a" / "checkpoints" / "last.ckpt"
    assert ckpt.load(last)["ranks"][0]["envs"] is None
    with pytest.warns(UserWarning, match="no env state"):
        summary = ppo_fabric.run(
            [*run, "algo.total_steps=512", f"hydra.run.dir={tmp_path / 'b'}", f"resume={last}"]
        )
    assert summary["total_env_steps"] == 512


def test_the_no_env_state_warning_is_one_ranks() -> None:
    """Every rank of a resumed job said "the checkpoint holds no env state"; the docs promise one warning."""
    import warnings

    fallback = object()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert ckpt.restore_envs(None, fallback, say=False) is fallback
        assert seen == []
        assert ckpt.restore_envs(None, fallback) is fallback
    assert len(seen) == 1 and "holds no env state" in str(seen[0].message)
