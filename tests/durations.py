"""Write `tests/durations.json` from a pytest run's `--durations` report, read on stdin:

    .venv/bin/python -m pytest -n 3 --dist worksteal -q --durations=0 | .venv/bin/python tests/durations.py

The conftest starts the long tiers' tests longest first with these figures (longest-processing-time
order): the workers then end on short tests together, not one of them on a 35-second study while the
other cores have nothing left. Only tests of 3 s or more are kept; a test not in the file (a new one) runs
after the listed ones of its tier. Stale figures only make the order worse, never a test fail."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "durations.json"
LINE = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(\S.*?)\s*$")


def main() -> None:
    seconds: dict[str, float] = {}
    for line in sys.stdin:
        if match := LINE.match(line):
            seconds[match[3]] = seconds.get(match[3], 0.0) + float(match[1])
    kept = {test: round(s, 1) for test, s in sorted(seconds.items(), key=lambda kv: -kv[1]) if s >= 3.0}
    if not kept:
        sys.exit("no --durations report on stdin")
    part = OUT.with_suffix(".part")
    part.write_text(json.dumps(kept, indent=0) + "\n")
    part.replace(OUT)  # whole or not at all: the conftest reads it at every collection
    print(f"{OUT}: {len(kept)} tests")


if __name__ == "__main__":
    main()
