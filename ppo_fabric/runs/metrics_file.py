"""Reading a run's `metrics.csv` and `evaluations.csv`: the supervisor, the learning-curve plot, the tuner,
the tests and the benchmarks all read them through these functions, so what the files look like (one row
per logged update, or per evaluation during training; a `step` column, empty cells where a row has no
value of a key, a header that widens when a resumed run logs new keys) is known in one place. Only the
standard library: the supervising process reads it too."""

from __future__ import annotations

import contextlib
import csv
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

METRICS_CSV = "metrics.csv"  # one row per logged update
EVALUATIONS_CSV = "evaluations.csv"  # one row per evaluation during training (`eval.every`)


def read_rows(path: str | Path) -> list[dict[str, str]]:
    """Every row of a metrics.csv (or evaluations.csv) as a dict of strings; [] when the file is missing or is being rewritten
    (a reader polling a live run reads it again at its next poll)."""
    try:
        with Path(path).open(newline="") as fh:
            return list(csv.DictReader(fh))
    except (OSError, csv.Error):
        return []


def series(rows: Iterable[dict[str, str]], key: str, x: str = "step") -> list[tuple[float, float]]:
    """(x, value) of the rows where both `x` and `key` hold a finite number, in file order (rows without
    finished episodes, say, have no return and are left out)."""
    out = []
    for row in rows:
        try:
            point = (float(row[x]), float(row[key]))
        except (KeyError, TypeError, ValueError):
            continue
        if math.isfinite(point[0]) and math.isfinite(point[1]):
            out.append(point)
    return out


@contextmanager
def writing(path: Path, tmp: Path | None = None) -> Iterator[None]:
    """A write of `path` (through `tmp`, which a failure removes) whose OSError names `path`: a full disk
    ended a run with "OSError: [Errno 28] No space left on device", no file named, and left a 0-byte
    temp file beside summary.json."""
    try:
        yield
    except OSError as exc:
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        if exc.filename is not None and tmp is None:
            raise
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """`data` as `path` (a summary, an evaluation), replaced whole: a reader never sees half of it."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with writing(path, tmp):
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        tmp.replace(path)
