"""What a resumed run continues with: the run's own config, and the overrides that may change on the way.

A checkpoint carries the run's resolved config. Rebuilding a resumed run from the command line instead
trained another experiment whenever the user did not repeat every original override (the default
`total_steps`, another env's tuned values), so a resume starts from the saved config and the command line
only changes what it names:

- keys that leave the experiment as it is (`MUTABLE`: the budget, checkpoints, logging, devices, launch,
  fault handling) change freely;
- any other change (algo, env, model, strategy, seed, ...) is refused in one line naming the keys, unless
  `resume_overrides=allow`, when every changed key is logged;
- keys the saved config lacks (added to the package since) take today's defaults: `checkpoint.load` fills
  them from conf/ (`config.defaults`), and keys only some options have from the command line's config.

The user's overrides decide what counts as named: a key override names its key and everything under it;
a group option (`env=gym`) names the keys it changes, found by composing with and without it. Every
process of a job computes the same result from the same command line and checkpoint.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from ppo_fabric.config.defaults import NEVER_FILLED, Path_, leaves, overlaps, set_leaf
from ppo_fabric.config.tuned import options_of_note
from ppo_fabric.config.values import ConfigError, group_options

# Keys a resumed run may change: its budget, where and how it writes, where it runs, how faults end it.
MUTABLE: tuple[Path_, ...] = (
    ("algo", "total_steps"),
    ("algo", "trainer_device"),
    ("algo", "player_device"),
    ("algo", "compile"),
    ("algo", "numpy_rollout"),
    ("algo", "max_skipped_updates"),
    ("algo", "max_param_abs"),
    ("env", "vector"),
    ("env", "on_error"),
    ("env", "max_restarts"),
    ("env", "envpool", "num_threads"),
    ("checkpoint",),
    ("logger",),
    ("fabric",),
    ("collectives",),
    ("eval",),
    ("resume",),
    ("resume_env",),
    ("resume_overrides",),
    ("restarts",),
    ("stall_timeout",),
    ("torch_threads",),
    ("group",),
)
# Keys no resume may change, resume_overrides=allow or not: the checkpoint's networks are built from the
# model and the multi-agent policies (`app.preflight.check_resume` compares them), and its env and strategy
# are what its weights and state were trained in. Naming allow for them only led to a second refusal.
FIXED: tuple[Path_, ...] = (("model",), ("multiagent",), ("env", "id"), ("strategy",))
IDENTITY: tuple[Path_, ...] = (("tuning",),)  # the run's own record: always the saved value
# What this command asks of its resume, never the run's own: always the command line's value, and no change
# of the run's. Taken from the checkpoint, one `resume_overrides=allow` allowed every later resume's changes.
PER_SESSION: tuple[Path_, ...] = (
    ("resume",),
    ("resume_overrides",),
    ("resume_env",),
)
MISSING = "???"  # OmegaConf's mandatory value not given, as a container holds it
SESSIONS_FILE = "resumes.jsonl"  # one line per resumed session: when, from where, what it changed


def _get(tree: Any, path: Path_) -> tuple[bool, Any]:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return False, None
        tree = tree[key]
    return True, tree


def _drop(tree: dict[str, Any], path: Path_) -> None:
    for key in path[:-1]:
        tree = tree.get(key)
        if not isinstance(tree, dict):
            return
    tree.pop(path[-1], None)


def _under(path: Path_, prefixes: Any) -> bool:
    return any(path[: len(p)] == p for p in prefixes)


def dotted(path: Path_) -> str:
    return ".".join(path)


def named_keys(overrides: list[str]) -> tuple[list[Path_], list[str]]:
    """(the keys the key overrides name, the group overrides) of a command line; Hydra's own keys and
    sweeps' values are not the run's."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    groups = {p.name for p in _group_dirs()}
    keys: list[Path_] = []
    options: list[str] = []
    for override in OverridesParser.create().parse_overrides(overrides):
        name = override.key_or_group
        if name.startswith("hydra") or override.input_line is None:
            continue
        if name in groups or "/" in name:
            options.append(override.input_line)
        else:
            keys.append(tuple(name.split(".")))
    return keys, options


def option_keys(option: str) -> list[Path_]:
    """The keys a group option (`env=cartpole`) sets: those of its file in conf/ and of the options its
    defaults list overrides (`exp=mujoco` -> `env=gym`). The default option counts too, which composing
    with and without it cannot see."""
    from ppo_fabric.config.values import config_dir

    group, _, name = option.lstrip("+~").partition("=")
    path = config_dir() / group / f"{name}.yaml"
    if not path.is_file():
        return []
    text = path.read_text()
    data = yaml.safe_load(text) or {}
    keys: list[Path_] = []
    for entry in data.pop("defaults", None) or []:
        for key, value in entry.items() if isinstance(entry, dict) else ():
            if str(key).startswith("override /"):
                keys += option_keys(f"{str(key)[len('override /') :]}={value}")
    prefix: Path_ = () if "@package _global_" in text else tuple(group.split("/"))
    return keys + [(*prefix, *p) for p, _ in leaves(data)]


def _group_dirs() -> list[Path]:
    from ppo_fabric.config.values import config_dir

    return [p for p in config_dir().iterdir() if p.is_dir() and group_options(p.name)]


def continued_config(
    cfg: DictConfig,
    saved: dict[str, Any],
    overrides: list[str],
    compose_without: Callable[[list[str]], DictConfig] | None = None,
) -> tuple[DictConfig, dict[str, tuple[Any, Any]]]:
    """The config a resumed run trains with, and what it changes from the saved one ({key: (before, now)}).

    `cfg` is composed from the command line (`overrides`), `saved` is the checkpoint's resolved config;
    `compose_without(overrides)` composes a command line, needed only when a group option is given.
    Raises `ConfigError` naming the changes that alter the experiment, unless `resume_overrides=allow`."""
    now = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(now, dict)
    # the run's own env/exp option named again names nothing: its keys as the run had them, overrides
    # of its first command line included (`exp=cartpole_lstm` set a 16k-step run's total_steps to 200k)
    own = options_of_note(saved.get("tuning"))
    overrides = [o for o in overrides if o.lstrip("+") not in own]
    keys, options = named_keys(overrides)
    named = [*keys, ("resume",)]
    for option in options:
        named += option_keys(option)
    if options and compose_without is not None:  # what the files do not show: a user's own config dirs
        plain = [o for o in overrides if o not in options]
        try:
            before = dict(leaves(OmegaConf.to_container(compose_without(plain), resolve=True)))
        except ConfigError:  # a key only the option has (`model=lstm model.lstm.seq_len=8`): files only
            before = None
        if before is not None:
            named += [p for p, v in leaves(now) if before.get(p, object()) != v]
    named = [k for k in named if not _under(k, IDENTITY)]
    merged = copy.deepcopy(saved)
    saved_leaves = dict(leaves(saved))
    for path, value in leaves(now):  # keys added to the package since the run started
        if path not in saved_leaves and path[0] not in NEVER_FILLED and not overlaps(saved_leaves, path):
            set_leaf(merged, path, value)
    for prefix in named:  # the named subtree as the command line has it, in place (mappings keep their order)
        found, value = _get(now, prefix)
        if found and value == MISSING:  # an option that leaves it to be given (env=gym's env.id): the run's
            continue
        if found:
            set_leaf(merged, prefix, value)
        else:
            _drop(merged, prefix)
    for path in PER_SESSION:
        set_leaf(merged, path, _get(now, path)[1])
    merged_leaves = dict(leaves(merged))
    changes = {
        dotted(p): (saved_leaves.get(p, ABSENT), v)
        for p, v in merged_leaves.items()
        if p not in PER_SESSION and (saved_leaves[p] != v if p in saved_leaves else _under(p, named))
    }
    changes |= {
        dotted(p): (v, ABSENT)
        for p, v in saved_leaves.items()
        if p not in merged_leaves and not overlaps(merged_leaves, p)
    }
    fixed = [key for key in changes if _under(tuple(key.split(".")), FIXED)]
    if fixed:
        shown = ", ".join(f"{k}={_show(changes[k][1])} (was {_show(changes[k][0])})" for k in fixed[:6])
        shown += f" and {len(fixed) - 6} more" if len(fixed) > 6 else ""
        raise ConfigError(
            f"resume={str(cfg.resume)!r}: {shown} cannot change on a resume, even with resume_overrides=allow "
            "(the checkpoint's networks, env and strategy are the run's); start a new run to change it"
        )
    refused = [key for key in changes if not _under(tuple(key.split(".")), MUTABLE)]
    if refused and merged.get("resume_overrides") != "allow":
        shown = ", ".join(f"{k}={_show(changes[k][1])} (was {_show(changes[k][0])})" for k in refused[:6])
        more = f" and {len(refused) - 6} more" if len(refused) > 6 else ""
        raise ConfigError(
            f"resume={str(cfg.resume)!r}: {shown}{more} would change the run's experiment; a resume continues the "
            "run's own config (drop these overrides), or add resume_overrides=allow to change them anyway"
        )
    out = OmegaConf.create(merged)
    OmegaConf.set_struct(out, True)
    return out, changes


class _Absent:
    """A key one side of a change lacks: shown `(absent)`, where a key set to null shows `null`."""

    def __repr__(self) -> str:
        return "(absent)"


ABSENT: Any = _Absent()


def _show(value: Any) -> str:
    if value is ABSENT:
        return "(absent)"
    if value is None:
        return "null"
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def describe(changes: dict[str, tuple[Any, Any]]) -> str:
    """`key: before -> now, ...` for the resume's line and record."""
    return ", ".join(f"{k}: {_show(b)} -> {_show(n)}" for k, (b, n) in changes.items())


def config_differences(run_dir: Path, cfg: DictConfig, shown: int = 6) -> str | None:
    """How `cfg` differs from the `config.yaml` in `run_dir` (`key: before -> now, ...`, the first `shown`),
    for a run starting afresh where an earlier attempt wrote no checkpoint (`resume=auto` found none), whose
    config it replaces: such a run trained another experiment than the directory's without a word, a user
    meaning to continue it none the wiser. None when they are the same (a requeue of the same command)."""
    try:
        before = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(before, dict):
        return None
    now = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(now, dict)
    old, new = dict(leaves(before)), dict(leaves(now))
    changes = {
        dotted(p): (old.get(p, ABSENT), new.get(p, ABSENT))
        for p in [*new, *(p for p in old if p not in new)]
        if old.get(p, ABSENT) != new.get(p, ABSENT) and not _under(p, (*PER_SESSION, *IDENTITY))
    }
    if not changes:
        return None
    more = f" and {len(changes) - shown} more" if len(changes) > shown else ""
    return describe(dict(list(changes.items())[:shown])) + more


def record_session(run_dir: Path, cfg: DictConfig, state: dict[str, Any]) -> dict[str, Any]:
    """Note a resumed session in the run directory (`resumes.jsonl`): when, from which checkpoint and env
    step, and which keys it changes from the checkpoint's config. The run's `config.yaml`, written by its
    first session, is never overwritten; a run continued in a new directory gets one there."""
    now = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(now, dict)
    saved = dict(leaves(state["config"]))
    current = dict(leaves(now))
    changes = {
        dotted(p): [saved[p], v]
        for p, v in current.items()
        if p in saved and saved[p] != v and p not in PER_SESSION
    }
    entry = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "resume": str(cfg.resume),
        "env_step": int(state["env_step"]),
        "changed": changes,
    }
    with (run_dir / SESSIONS_FILE).open("a") as fh:
        fh.write(json.dumps(entry, default=str) + "\n")
    return entry
