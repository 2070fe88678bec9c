"""The `key=value` arguments of the evaluate and export tools, and the one-line failure every entry point
ends with on bad input."""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn


def fail(message: str, code: int = 2) -> NoReturn:
    """The one line every entry point ends with on bad input (status 2 by default). Under `fabric run`
    every rank checks the same command line and finds the same mistake: each node's first rank says it
    (another node may lack what this one has: a package, a device, the resumed file)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0) if os.environ.get("LT_CLI_USED") else 0
    if local_rank == 0:
        print(f"ppo-fabric: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


class ArgError(ValueError):
    """A bad `key=value` argument of the evaluate/export tools; `str()` is one line for the user."""


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def parse_key_values(argv: list[str], spec: dict[str, tuple[type, Any]]) -> dict[str, Any]:
    """Parse `key=value` arguments (the training CLI's syntax, without Hydra's composition machinery:
    these tools take a handful of flat keys) into typed values.

    `spec` maps each key to (type, default); a default of `...` makes the key required. Types are
    str, int and bool (true/false/1/0/yes/no). Raises ArgError naming the argument and the fix.
    """
    values: dict[str, Any] = {}
    for arg in argv:
        key, sep, raw = arg.partition("=")
        key = key.strip().lstrip("+")
        if not sep or not key:
            raise ArgError(f"cannot parse argument {arg!r}; write arguments as key=value")
        if key not in spec:
            raise ArgError(f"{key}: unknown argument; known: {', '.join(spec)}")
        kind = spec[key][0]
        if kind is bool:
            if raw.strip().lower() not in (*_TRUE, *_FALSE):
                raise ArgError(f"{key}={raw} must be true or false")
            values[key] = raw.strip().lower() in _TRUE
        elif kind is int:
            try:
                values[key] = int(float(raw)) if float(raw).is_integer() else int(raw)
            except ValueError:
                raise ArgError(f"{key}={raw} must be a whole number") from None
        else:
            values[key] = raw
    for key, (_, default) in spec.items():
        if key not in values:
            if default is ...:
                raise ArgError(f"{key} is required; set {key}=VALUE")
            values[key] = default
    return values
