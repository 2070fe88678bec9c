"""Gymnasium spaces as plain data (dicts, lists, numbers, strings, tensors) and back.

Checkpoints describe a policy's inputs and outputs with its spaces, and must load with
`torch.load(weights_only=True)`: a pickled space would make the unpickler import and build arbitrary
classes, which is exactly what lets a crafted file run code. `space_from_data(space_to_data(s)) == s`.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces

SUPPORTED = ("Box", "Discrete", "MultiDiscrete", "MultiBinary", "Dict", "Tuple")


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(array))  # a copy: the space keeps its own arrays


def space_to_data(space: gym.Space) -> dict[str, Any]:
    """A dict of plain values describing `space`; raises ValueError for types a checkpoint cannot hold."""
    if isinstance(space, spaces.Box):
        low, high = _tensor(space.low), _tensor(space.high)
        return {
            "type": "Box",
            "low": low,
            "high": high,
            "shape": list(space.shape),
            "dtype": space.dtype.name,
        }
    if isinstance(space, spaces.Discrete):
        return {"type": "Discrete", "n": int(space.n), "start": int(space.start), "dtype": space.dtype.name}
    if isinstance(space, spaces.MultiDiscrete):
        nvec, start = _tensor(space.nvec), _tensor(space.start)
        return {"type": "MultiDiscrete", "nvec": nvec, "start": start, "dtype": space.dtype.name}
    if isinstance(space, spaces.MultiBinary):
        return {"type": "MultiBinary", "n": space.n if isinstance(space.n, int) else list(space.n)}
    if isinstance(space, spaces.Dict):
        return {"type": "Dict", "spaces": {key: space_to_data(sub) for key, sub in space.spaces.items()}}
    if isinstance(space, spaces.Tuple):
        return {"type": "Tuple", "spaces": [space_to_data(sub) for sub in space.spaces]}
    raise ValueError(
        f"a {type(space).__name__} space cannot be stored in a checkpoint; supported: {', '.join(SUPPORTED)}"
    )


def space_from_data(data: dict[str, Any]) -> gym.Space:
    """The space `space_to_data` described; raises ValueError (one line) for anything else."""
    kind = data.get("type") if isinstance(data, dict) else None
    if kind not in SUPPORTED:
        raise ValueError(f"not a stored gymnasium space (type {kind!r}; supported: {', '.join(SUPPORTED)})")
    try:
        return _build(kind, data)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"a stored {kind} space is malformed ({type(exc).__name__}: {exc})") from exc


def _build(kind: str, data: dict[str, Any]) -> gym.Space:
    if kind == "Box":
        dtype = np.dtype(data["dtype"])
        low, high = (np.asarray(data[k].numpy(), dtype) for k in ("low", "high"))
        return spaces.Box(low=low, high=high, shape=tuple(data["shape"]), dtype=dtype)
    if kind == "Discrete":
        return spaces.Discrete(data["n"], start=data["start"], dtype=np.dtype(data["dtype"]))
    if kind == "MultiDiscrete":
        return spaces.MultiDiscrete(
            data["nvec"].numpy(), dtype=np.dtype(data["dtype"]), start=data["start"].numpy()
        )
    if kind == "MultiBinary":
        return spaces.MultiBinary(data["n"])
    if kind == "Dict":  # (key, space) pairs keep the stored order (a plain dict would be sorted)
        return spaces.Dict([(key, space_from_data(sub)) for key, sub in data["spaces"].items()])
    return spaces.Tuple([space_from_data(sub) for sub in data["spaces"]])
