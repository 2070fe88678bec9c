"""Search spaces of `python -m ppo_fabric.tune`, written in Hydra's override grammar and parsed by Hydra.

Users already write `algo.lr=choice(1e-4, 3e-4)` or `seed=1,2,3` for a Hydra multirun; the tuner reads
the same expressions with Hydra's own parser (never a look-alike), so quoting, escaping and the sweep
functions behave exactly as in Hydra. Each sweep becomes one Optuna distribution:

- `choice(a, b, ...)` and `a,b,...`   -> categorical
- `range(start, stop[, step])`        -> int (or float with a float bound) from start up to stop,
  exclusive as in Hydra (`range(1, 5)` is 1..4)
- `interval(low, high)`               -> float in [low, high]
- `tag(log, ...)` samples on a log scale; `tag(int, interval(...))` samples whole numbers

Every other override is fixed: it is passed unchanged to every trial.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from ppo_fabric.compat.private import hydra_override_value, hydra_value_as_str

_TAGS = {"log", "int"}


class SpaceError(ValueError):
    """A search expression the tuner cannot turn into a distribution; `str()` is one line."""


@dataclass(frozen=True)
class Param:
    """One searched key: `prefix` is `+`/`++` when the override adds the key, as the user wrote it."""

    key: str
    prefix: str
    distribution: BaseDistribution
    expression: str

    def override(self, value: Any) -> str:
        """The training override for one sampled value, in Hydra's own escaping."""

        if (
            isinstance(value, float)
            and value.is_integer()
            and isinstance(self.distribution, FloatDistribution)
        ):
            text = repr(value)  # keep 1.0 a float: 1 would compose as an int
        else:
            text = hydra_value_as_str(value)
        return f"{self.prefix}{self.key}={text}"


@dataclass(frozen=True)
class Space:
    """The overrides every trial shares and the parameters Optuna samples, in command-line order."""

    fixed: list[str]
    params: list[Param]

    def suggest(self, trial: optuna.Trial) -> list[str]:
        """Sample every parameter for `trial`; returns the overrides that set them."""
        return [p.override(_suggest(trial, p.key, p.distribution)) for p in self.params]

    def overrides_for(self, values: dict[str, Any]) -> list[str]:
        """The overrides of parameter values already sampled (a finished trial's `params`)."""
        return [p.override(values[p.key]) for p in self.params if p.key in values]

    def corners(self) -> list[list[str]]:
        """The lowest and the highest value of every parameter, as two override lists: the configs the
        check before a study composes (a bound the training config refuses fails there, not in trial 7)."""
        low = [p.override(_bound(p.distribution, 0)) for p in self.params]
        high = [p.override(_bound(p.distribution, -1)) for p in self.params]
        return [low] if low == high else [low, high]


def _suggest(trial: optuna.Trial, key: str, dist: BaseDistribution) -> Any:
    if isinstance(dist, CategoricalDistribution):
        return trial.suggest_categorical(key, dist.choices)
    if isinstance(dist, IntDistribution):
        return trial.suggest_int(key, dist.low, dist.high, step=dist.step, log=dist.log)
    assert isinstance(dist, FloatDistribution)
    return trial.suggest_float(key, dist.low, dist.high, step=dist.step, log=dist.log)


def _bound(dist: BaseDistribution, end: int) -> Any:
    if isinstance(dist, CategoricalDistribution):
        return dist.choices[end]
    assert isinstance(dist, FloatDistribution | IntDistribution)
    return dist.low if end == 0 else dist.high


def parse(overrides: list[str]) -> Space:
    """Split `overrides` into fixed ones and searched parameters; raises SpaceError naming the override."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType

    parser = OverridesParser.create()
    fixed: list[str] = []
    params: list[Param] = []
    for text in overrides:
        try:
            (override,) = parser.parse_overrides([text])
        except Exception as exc:  # Hydra's grammar errors have no common base
            reason = str(exc).strip().splitlines()
            detail = reason[1] if len(reason) > 1 else (reason[0] if reason else type(exc).__name__)
            raise SpaceError(f"cannot parse override {text!r}: {detail}") from None
        if not override.is_sweep_override():
            fixed.append(text)
            continue
        key = override.get_key_element()
        prefix = key[: len(key) - len(key.lstrip("+"))]
        if override.type == OverrideType.DEL:
            raise SpaceError(f"{text}: a deletion cannot be searched")
        name = override.key_or_group if override.package is None else key.lstrip("+")
        if any(p.key == name for p in params):
            raise SpaceError(f"{text}: {name} is searched twice; give one expression per key")
        params.append(Param(name, prefix, distribution(text, hydra_override_value(override)), text))
    keys = {p.key for p in params}
    for text in fixed:
        if text.split("=", 1)[0].lstrip("+~") in keys:
            raise SpaceError(f"{text}: this key is also searched; drop one of the two")
    return Space(fixed, params)


def distribution(text: str, sweep: Any) -> BaseDistribution:
    """The Optuna distribution of one parsed Hydra sweep (`text` names it in errors)."""
    from hydra.core.override_parser.types import ChoiceSweep, Glob, IntervalSweep, RangeSweep

    tags = set(getattr(sweep, "tags", set()) or set())
    unknown = tags - _TAGS
    if unknown:
        raise SpaceError(
            f"{text}: unknown tag {sorted(unknown)[0]!r}; the tuner knows tag(log, ...) and tag(int, ...)"
        )
    log = "log" in tags
    if isinstance(sweep, Glob):
        raise SpaceError(f"{text}: glob() cannot be searched; list the options with choice(...)")
    if isinstance(sweep, ChoiceSweep):
        if tags:
            raise SpaceError(f"{text}: tags apply to range() and interval(), not to a choice")
        return _categorical(text, list(sweep.list))
    if isinstance(sweep, RangeSweep):
        return _range(text, sweep, log)
    if isinstance(sweep, IntervalSweep):
        low, high = float(sweep.start), float(sweep.end)
        if not low < high:
            raise SpaceError(f"{text}: interval needs low < high")
        if log and low <= 0:
            raise SpaceError(f"{text}: a log scale needs low > 0")
        if "int" in tags:
            if not (low.is_integer() and high.is_integer()):
                raise SpaceError(f"{text}: tag(int, ...) needs whole-number bounds")
            return IntDistribution(int(low), int(high), log=log)
        return FloatDistribution(low, high, log=log)
    raise SpaceError(f"{text}: {type(sweep).__name__} cannot be searched")


def _categorical(text: str, choices: list[Any]) -> CategoricalDistribution:
    if len(choices) < 2:
        raise SpaceError(f"{text}: a choice needs at least two values")
    for value in choices:
        if not isinstance(value, str | int | float | bool):
            raise SpaceError(f"{text}: choices must be numbers, strings or booleans, not {value!r}")
    if len(set(map(repr, choices))) != len(choices):
        raise SpaceError(f"{text}: a value is listed twice")
    return CategoricalDistribution(choices)


def _range(text: str, sweep: Any, log: bool) -> BaseDistribution:
    start, stop, step = sweep.start, sweep.stop, sweep.step
    if "int" in (getattr(sweep, "tags", None) or set()):
        raise SpaceError(f"{text}: range() of whole numbers is already an int; drop tag(int, ...)")
    if step is None or step <= 0:
        raise SpaceError(f"{text}: range() needs a positive step")
    count = math.ceil((stop - start) / step)
    if count < 2:
        raise SpaceError(f"{text}: the range holds fewer than two values (stop is exclusive, as in Hydra)")
    last = start + (count - 1) * step
    if log and step != 1:
        raise SpaceError(f"{text}: a log scale needs a range with step 1 (or use tag(log, interval(...)))")
    if log and start <= 0:
        raise SpaceError(f"{text}: a log scale needs start > 0")
    if all(isinstance(v, int) for v in (start, stop, step)):
        return IntDistribution(int(start), int(last), step=int(step), log=log)
    if log:
        return FloatDistribution(float(start), float(last), log=True)
    return FloatDistribution(float(start), float(round(last, 12)), step=float(step))
