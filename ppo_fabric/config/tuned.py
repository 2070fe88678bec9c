"""Tuned values by env id: which config-group options a run that names only `env.id` composes.

The default env option is `cartpole`, whose file holds CartPole's tuned values (20 epochs, lr 1e-3, gamma
0.98, no entropy bonus). A run of `env.id=Acrobot-v1`, or of a user's own env, would inherit them without a
word and learn worse for it. `conf/tuned.yaml` maps env ids (fnmatch patterns, as RL Zoo's per-env files)
to the options that hold their tuned values; an id no pattern matches gets `env=gym`, the generic
defaults. The options go first on the command line, so every override the user gives still wins, and a
`tuning=...` override records the choice: the run's first line says it and `config.yaml` keeps it.
"""

from __future__ import annotations

import fnmatch
import re
from functools import cache

import yaml

from ppo_fabric.config.values import ConfigError, config_dir

# The env packages ppo-fabric builds envs from by name; an env.id naming another module runs that module's code
# (`envs.make.foreign_module`). Their `module:id` ids are the id's own envs, tuned values included.
KNOWN_ENV_PACKAGES = ("gymnasium", "pettingzoo", "mpe2", "ale_py", "minatar", "envpool", "shimmy")
TABLE = "tuned.yaml"
CHOOSERS = ("env", "exp")  # groups whose option decides an env's values
GENERIC = "env=gym"


@cache
def table() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """conf/tuned.yaml as (pattern, options) pairs, in file order (the first match wins)."""
    path = config_dir() / TABLE
    entries = yaml.safe_load(path.read_text()) or {}
    return tuple((str(pattern), tuple(str(o) for o in options)) for pattern, options in entries.items())


def tuned_options(env_id: str) -> tuple[str, ...] | None:
    """The options holding `env_id`'s tuned values, or None when the project has none for it. A known env
    package's `module:id` (`ale_py:ALE/Pong-v5`, which imports the package that registers the id) is its
    id; another module's is its own env, whatever id follows the colon."""
    module, sep, name = env_id.partition(":")
    if sep and module.split(".")[0] in KNOWN_ENV_PACKAGES:
        env_id = name
    elif sep:
        return None
    for pattern, options in table():
        if fnmatch.fnmatchcase(env_id, pattern):
            return options
    return None


def _parsed(overrides: list[str]) -> list | None:
    """Hydra's parse of the overrides; None for one its grammar rejects (composing names it, one line)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_overrides(overrides)
    except Exception:  # Hydra's grammar errors have no common base
        return None


def with_tuned_values(
    overrides: list[str], config_path: str | None = None, config_name: str | None = None
) -> list[str]:
    """`overrides` with the tuned options of the env id they name put first and a `tuning=` override
    saying where the values come from; unchanged when they already say (`tuning=` present).

    - `env=` or `exp=` given: the user chose; `tuning` says which option.
    - `env.id=ID` alone: conf/tuned.yaml's options for ID, or `env=gym` when it has none.
    - neither: the config's default env option (CartPole's tuned values in ours). A user's own primary
      config (`config_path`/`config_name`) decides as a command line would: its own `env`/`exp` choice,
      or the id it sets with ours left at `env=cartpole` (`_own_config`).
    A sweep over `env.id` (`env.id=A,B`) is left to each job, which expands its own id. A run resumed
    from a checkpoint (`resume=PATH`) continues its saved config, tuned values included: nothing is added,
    so an `env.id` named again with its saved value changes nothing (`resume=auto` may start a new run,
    which gets them)."""
    parsed = _parsed(overrides)
    if parsed is None:
        return list(overrides)
    notes = [o for o in parsed if o.key_or_group == "tuning" and not o.is_sweep_override()]
    if notes:
        _check_note(str(notes[-1].value()))
        return list(overrides)
    resumed = [o for o in parsed if o.key_or_group == "resume" and not o.is_sweep_override()]
    if resumed and isinstance(resumed[-1].value(), str) and resumed[-1].value() not in ("auto", "null"):
        return list(overrides)
    chosen = [o.input_line for o in parsed if o.key_or_group in CHOOSERS and o.input_line is not None]
    ids = [o for o in parsed if o.key_or_group == "env.id"]
    if chosen:
        note = f"{' '.join(chosen)} (chosen on the command line)"
        return [*overrides, f"tuning={quoted(note)}"]
    if ids and ids[-1].is_sweep_override():
        return list(overrides)
    if ids:
        return _for_id(str(ids[-1].value()), overrides, "")
    own = _own_config(parsed, config_path, config_name)
    if own is not None:
        name, chosen_by_it, env_id = own
        if chosen_by_it:
            return [*overrides, f"tuning={quoted(f'{chosen_by_it} (chosen by the config {name})')}"]
        if env_id != DEFAULT_ID:
            return _for_id(env_id, overrides, f"{OWN_MARK} {name})")
    elif config_path is not None or config_name not in (None, "config"):  # not composed here (--config-dir)
        return [*overrides, f"tuning={quoted(f'the env option the config {config_name} picks')}"]
    note = f"{DEFAULT_OPTION}, the default env option (tuned values for {DEFAULT_ID})"
    return [*overrides, f"tuning={quoted(note)}"]


DEFAULT_OPTION, DEFAULT_ID = "env=cartpole", "CartPole-v1"  # conf/config.yaml's default env option
OWN_MARK = "(env.id set by the config"  # the note of an id a user's own config sets
# What every note `with_tuned_values` writes holds one of: a `tuning=` without any is a user's own
NOTE_MARKS = (
    "(chosen on the command line)",
    "(conf/tuned.yaml)",
    "conf/tuned.yaml has no tuned values for",
    "(chosen by the config ",
    "the env option the config ",
    ", the default env option (tuned values for",
    "the default env option, in ours",  # the note's earlier words, on a relaunch of an older command line
    OWN_MARK,
)


def options_of_note(note: object) -> list[str]:
    """The `env=`/`exp=` options a run was composed with, read back from the `tuning` note
    `with_tuned_values` wrote for it: every note begins with them (`exp=mujoco (chosen on the command
    line)`, `env=lunarlander, tuned values for ...`). An option named again on a resume that is one of
    these is the run's own and changes nothing. [] for a note without any (a user's own config's)."""
    options: list[str] = []
    for word in str(note or "").split():
        group, sep, value = word.rstrip(",").lstrip("+").partition("=")
        if not (sep and group in CHOOSERS and value):
            break
        options.append(f"{group}={value}")
    return options


def _check_note(note: str) -> None:
    """A `tuning=` this module wrote (a relaunch's or a sweep job's command line passes it on), never one
    typed by hand: that one turned the choice of tuned values off, so `env.id=Acrobot-v1 tuning=mine`
    trained Acrobot with CartPole's values under the note `mine`."""
    if not any(mark in note for mark in NOTE_MARKS):
        raise ConfigError(
            f"tuning={note!r} is not for the command line: ppo-fabric sets it at launch to record where the "
            "run's values come from; drop it (choose the values with env=, exp= or env.id=)"
        )


def _for_id(env_id: str, overrides: list[str], source: str) -> list[str]:
    """The tuned options of `env_id` first, then `overrides`, then the note (`source`: who set the id)."""
    options = tuned_options(env_id)
    if options is None:
        note = f"{GENERIC}, the generic defaults: conf/tuned.yaml has no tuned values for {env_id}"
        options = (GENERIC,)
    else:
        note = f"{' '.join(options)}, tuned values for {env_id} (conf/tuned.yaml)"
    return [*options, *overrides, f"tuning={quoted(f'{note} {source}'.strip())}"]


def _own_config(
    parsed: list, config_path: str | None, config_name: str | None
) -> tuple[str, str, str] | None:
    """For a user's own primary config: (its name, the `env=`/`exp=` option it chose over ours or "",
    the env id it composes to); None for ours, or for one that does not compose here (composing the run
    says why; its options may come from `--config-dir`, which this compose cannot add)."""
    if config_path is None and config_name in (None, "config"):
        return None
    from hydra import compose as hydra_compose
    from hydra.core.global_hydra import GlobalHydra

    from ppo_fabric.config.values import compose

    name = config_name or "config"
    fixed = [o.input_line for o in parsed if not o.is_sweep_override() and o.input_line is not None]
    try:
        if GlobalHydra.instance().is_initialized():  # inside a running app (a sweep's launcher)
            cfg = hydra_compose(name, overrides=fixed, return_hydra_config=True)
        else:
            cfg = compose(fixed, config_path, name, keep_hydra=True)[0]
        choices = cfg.hydra.runtime.choices
        env_option, exp_option, env_id = choices.get("env"), choices.get("exp"), str(cfg.env.id)
    except Exception:  # ConfigError, or Hydra's many types: the run's own compose names the mistake
        return None
    if exp_option not in (None, "null"):
        return name, f"exp={exp_option}", env_id
    if f"env={env_option}" != DEFAULT_OPTION:
        return name, f"env={env_option}", env_id
    return name, "", env_id


def without_tuned_values(overrides: list[str]) -> list[str]:
    """The command line as the user typed it, from `with_tuned_values`'s: the options and the `tuning=` note
    it added taken out (unchanged when it added none). A `resume=auto` that finds a checkpoint continues
    the run's own config, and the options added in case it started afresh are not the user's overrides:
    taken for them, they reset every key of their files to its tuned value (`env=lunarlander` cut a
    3M-step run back to its recipe's 1M)."""
    notes = [i for i, o in enumerate(overrides) if o.startswith("tuning=")]
    if not notes:
        return list(overrides)
    # what with_tuned_values made ends at its note; overrides put after it (a relaunch's hydra.run.dir and
    # resume=auto) are the caller's and stay
    head, tail = list(overrides[: notes[-1] + 1]), list(overrides[notes[-1] + 1 :])
    parsed = _parsed(head)
    if parsed is None:
        return list(overrides)
    ids = [str(o.value()) for o in parsed if o.key_or_group == "env.id" and not o.is_sweep_override()]
    added = list(tuned_options(ids[-1]) or (GENERIC,)) if ids else []
    note = str(parsed[-1].value())
    if not ids and OWN_MARK in note:  # an id the user's own config sets: the note names its options
        added = note.split(",", 1)[0].split()
        if head[: len(added)] == added:
            return [*head[len(added) : -1], *tail]
    candidates = [head[:-1]]  # the note alone (the user chose the option, or named no id)
    if added and head[: len(added)] == added:
        candidates.insert(0, head[len(added) : -1])
    for candidate in candidates:  # what with_tuned_values made this command line from
        if with_tuned_values(candidate) == head:
            return [*candidate, *tail]
    return list(overrides)


def quoted(text: str) -> str:
    """`text` as a Hydra override value: single-quoted, its quotes and backslashes escaped."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def override_value(text: str) -> str:
    """`text` (a path, a name) as an override value: as it is where Hydra's grammar reads it so (ASCII
    letters, digits and `_ . / : + -`), else quoted (a space, a parenthesis, `=`, `,`, a non-ASCII letter)."""
    return text if re.fullmatch(r"[\w./:+-]+", text, re.ASCII) else quoted(text)
