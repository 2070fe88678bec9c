"""Atomic checkpoints and exact resume.

A checkpoint holds the shared learner state (model, optimizer, counters) once, and per rank what makes
its next rollout identical to an uninterrupted run: RNG states, the vector env (pickled when it can be,
e.g. sync envs), the observation it acts on next, and its recent episodes.
"""

from __future__ import annotations

import io
import os
import pickle
import random
import tempfile
import warnings
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from omegaconf import OmegaConf

FORMAT_VERSION = 1


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def pickle_envs(envs: gym.vector.VectorEnv) -> bytes | None:
    """The vector env's full state, or None where it cannot be pickled (async workers, some simulators)."""
    try:
        return pickle.dumps(envs)
    except Exception:  # any env may refuse; resume then starts fresh episodes
        return None


def atomic_write(data: bytes, path: Path) -> None:
    """Write to a temp file in the same directory, fsync, then rename: readers never see a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save(state: dict[str, Any], ckpt_dir: Path, iteration: int, numbered: bool, keep: int) -> Path:
    """Write `last.ckpt` and, when asked, `iter_NNNNNN.ckpt` (the update number), pruning numbered ones beyond `keep`."""
    buffer = io.BytesIO()
    torch.save({"format": FORMAT_VERSION, **state}, buffer)
    data = buffer.getvalue()
    if numbered:
        atomic_write(data, ckpt_dir / f"iter_{iteration:06d}.ckpt")
        if keep > 0:
            for old in sorted(ckpt_dir.glob("iter_*.ckpt"))[:-keep]:
                old.unlink(missing_ok=True)
    last = ckpt_dir / "last.ckpt"
    atomic_write(data, last)
    return last


def load(path: str | Path, key: str = "resume") -> dict[str, Any]:
    """Load a checkpoint written by `save`; raises ValueError with a one-line reason.

    `key` is the argument the user gave the path as (`resume` for training, `checkpoint` for the
    evaluate/export tools), so the message names what they typed.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(
            f"{key}={str(path)!r} is a directory; point {key} at a .ckpt file such as "
            f"{path / 'checkpoints' / 'last.ckpt'}"
        )
    if not path.is_file():
        raise ValueError(f"{key}={str(path)!r}: no such checkpoint file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise ValueError(f"{key}={str(path)!r}: not a readable checkpoint ({type(exc).__name__})") from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise ValueError(f"{key}={str(path)!r}: not a ppo-fabric checkpoint (format {FORMAT_VERSION})")
    return state


def restore_envs(blob: bytes | None, fallback: Any) -> Any:
    """Unpickle a saved vector env, or keep the freshly built one when there is none."""
    if blob is None:
        warnings.warn(
            "the checkpoint holds no env state (async or unpicklable envs): episodes restart on resume",
            stacklevel=2,
        )
        return fallback
    fallback.close()
    return pickle.loads(blob)


def resolve(path: str | Path) -> Path:
    """A checkpoint file, or a run directory standing for its `checkpoints/last.ckpt` (what users type)."""
    path = Path(path)
    last = path / "checkpoints" / "last.ckpt"
    return last if path.is_dir() and last.is_file() else path


def load_policy(path: str | Path, key: str = "checkpoint") -> tuple[dict[str, Any], Any]:
    """(checkpoint, ActorCritic in eval mode on the CPU) rebuilt from the checkpoint's own model config,
    so evaluation and export need nothing from the run that wrote it; raises ValueError (one line)."""
    from ppo_fabric.agent import ActorCritic

    state = load(resolve(path), key=key)
    if state.get("multiagent"):
        raise ValueError(
            f"{key}={path} holds the policies of a multi-agent run ({', '.join(state['agent'])}); evaluate and "
            "export take single-agent checkpoints"
        )
    model_cfg = OmegaConf.create(state["config"]["model"])
    agent = ActorCritic(state["observation_space"], state["action_space"], model_cfg)
    agent.load_state_dict(state["agent"])
    return state, agent.eval()


def observation_normalization(state: dict[str, Any]) -> dict[str, Any] | None:
    """The observation statistics a run normalised with (identical on every collecting rank), or None."""
    ranks = state.get("ranks") or [{}]
    return (ranks[0].get("normalizers") or {}).get("NormalizeObservation")


def run_dir_of(checkpoint: str | Path) -> Path:
    """The run directory a checkpoint belongs to: `<run>/checkpoints/x.ckpt` -> `<run>`; a checkpoint kept
    anywhere else counts its own directory as the run directory."""
    path = resolve(checkpoint).resolve()
    return path.parent.parent if path.parent.name == "checkpoints" else path.parent
