"""Every config key's default lives in one place, the YAML of `conf/`; code reads keys, never `.get(key,
default)` copies of them that drift apart.

A config the package composed has every key. One that it did not (a checkpoint written before a key existed,
or a config a test or a user built by hand) gets what it lacks from `with_defaults`: the keys of
`conf/config.yaml` and of each group's generic option (`SCHEMA`), read from the YAML files themselves.
`runs.checkpoint.load` applies it to every checkpoint's config, so resume, `load_policy`, evaluation and export
read complete configs. Groups whose keys depend on the option (`model`: an MLP has no `lstm`) or that are
the run's own record are never filled (`NEVER_FILLED`).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from typing import Any

import yaml

from ppo_fabric.config.values import config_dir

Path_ = tuple[str, ...]
# Each group's generic option: its keys are every option's keys (the other options repeat them all).
SCHEMA = {
    "algo": "algo/ppo.yaml",
    "env": "env/gym.yaml",
    "selfplay": "selfplay/default.yaml",
    "logger": "logger/default.yaml",
    "fabric": "fabric/cpu.yaml",
}
NEVER_FILLED = ("model", "multiagent", "tuning", "hydra")
_MISSING = "???"  # a value every config must set itself (`env.id`)


@functools.cache
def _schema() -> dict[str, Any]:
    root = yaml.safe_load((config_dir() / "config.yaml").read_text())
    for group, path in SCHEMA.items():
        root[group] = yaml.safe_load((config_dir() / path).read_text())
    for key in (*NEVER_FILLED, "defaults"):
        root.pop(key, None)
    return root


def schema() -> dict[str, Any]:
    """A copy of every default: `conf/config.yaml`'s own keys and the generic option of each group."""
    return copy.deepcopy(_schema())


def with_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """`config` (plain data) with every key it lacks at its default; what it has, it keeps. A key lying under
    one the config set to something else (a mapping made a scalar, `+env.kwargs.x` added) is not filled."""
    out = copy.deepcopy(config)
    have = dict(leaves(config))
    for path, value in leaves(_schema()):
        if value != _MISSING and path not in have and not overlaps(have, path):
            set_leaf(out, path, value)
    return out


def leaves(tree: Any, prefix: Path_ = ()) -> Iterator[tuple[Path_, Any]]:
    """(path, value) of every leaf of a plain config tree; an empty mapping is a leaf of its own."""
    if isinstance(tree, dict) and tree:
        for key, value in tree.items():
            yield from leaves(value, (*prefix, str(key)))
    else:
        yield prefix, tree


def set_leaf(tree: dict[str, Any], path: Path_, value: Any) -> None:
    for key in path[:-1]:
        node = tree.get(key)
        if not isinstance(node, dict):
            node = tree[key] = {}
        tree = node
    tree[path[-1]] = copy.deepcopy(value)


def overlaps(have: dict[Path_, Any], path: Path_) -> bool:
    """Whether a leaf of `have` lies above `path` (an empty mapping or a scalar the config has there) or
    below it (a key the config added to what is empty by default, e.g. `+env.kwargs.x`)."""
    return any(path[:i] in have for i in range(1, len(path))) or any(p[: len(path)] == path for p in have)
