"""`resume=auto` and the supervisor's relaunches: which checkpoint of a run directory a run continues from.

A requeued cluster job runs the same command again; `resume=auto` lets that command continue where the
previous attempt stopped instead of starting over, and the supervisor relaunches a failed job by the same
rule. Nothing writes a checkpoint before a run starts (and the run directory's lock keeps other runs out),
so every rank composing its config resolves `auto` to the same file. Each checkpoint passed over on the way
is named with its reason, by one process, so that continuing from an older file, or starting afresh, is
never a surprise.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

from omegaconf import DictConfig

from ppo_fabric.config.values import OWN_RUN_DIR_ENV
from ppo_fabric.runs import checkpoint as ckpt

AUTO = "auto"
AUTO_SETTING = f"resume={AUTO}"
OnSkip = Callable[[Path, str], None]
_reported: set[tuple[Path, int, int, str]] = set()  # (file, mtime, size, reason) this process reported


def newest_checkpoint(run_dir: Path, on_skip: OnSkip | None = None) -> tuple[Path, int] | None:
    """(path, env step) of `checkpoints/last.ckpt` when it loads, else of the newest other `*.ckpt` there that
    loads; None when there is none. Every file passed over goes to `on_skip(path, reason)`, by default
    `report_skipped` (one line on stderr), so that a run continuing from an older checkpoint than the user
    expects, or starting afresh, says why.

    Passed over: files that do not load (truncated by a crash or a full disk, not a checkpoint, an older
    format) and checkpoints holding a NaN or inf tensor (a diverged update: resuming it trains on NaNs).
    Env snapshots are dropped while looking, and nothing else decides: a checkpoint that loads but cannot
    continue this config (another env or model, or an env snapshot signed elsewhere with resume_env=restore)
    is then refused by `preflight.check_resume` in one line, rather than skipped for an older one or a fresh
    start over a run the user wanted continued.
    """
    report = on_skip if on_skip is not None else partial(report_skipped, run_dir)
    ckpt_dir = run_dir / "checkpoints"
    last = ckpt_dir / "last.ckpt"
    others = sorted(
        (p for p in ckpt_dir.glob("*.ckpt") if p.name not in (last.name, ckpt.DROPPED_BEST) and p.is_file()),
        key=lambda p: p.stat().st_mtime,  # by age, whatever the numbered files are named after
        reverse=True,
    )
    for path in [last, *others]:
        if not path.is_file():
            continue
        try:
            state = ckpt.load(path, env_state="fresh")
        except ValueError as exc:
            report(path, unreadable_reason(path, exc))
            continue
        nonfinite = ckpt.nonfinite_reason(state)
        if nonfinite is not None:
            report(path, nonfinite)
            continue
        return path, int(state["env_step"])
    return None


def unreadable_reason(path: Path, exc: ValueError) -> str:
    """Why `ckpt.load` refused `path`, short: its message without the `resume='<path>'` it starts with and
    without the advice after `;` (the advice is for a file the user named; this one is only passed over)."""
    with_path = f"resume={str(path)!r}"
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    text = text.removeprefix(with_path).removeprefix(":").strip()
    text = text.split(";")[0].strip()
    if "not a readable checkpoint" in text:
        size = path.stat().st_size if path.exists() else 0
        if size == 0:
            return "empty file"
        if not zipfile.is_zipfile(path):  # a torch file is a zip: its directory, at the end, is missing
            return f"truncated or corrupt ({size} bytes, no zip directory at its end)"
    return text


def speaks(run_dir: Path) -> bool:
    """Whether this process reports for `run_dir`: global rank 0 only (every rank of a `fabric run`/torchrun
    job resolves `resume=auto`, and rank 0 even twice: its command-line check and its run), and never the
    job of a supervisor that owns the directory (the supervisor resolved the same command line and reported)."""
    ranks = (os.environ.get(name, "0") or "0" for name in ("RANK", "LOCAL_RANK", "NODE_RANK"))
    if any(rank != "0" for rank in ranks):
        return False
    owner = os.environ.get(OWN_RUN_DIR_ENV)
    return not (owner and Path(owner).resolve() == Path(run_dir).resolve())


def report_skipped(run_dir: Path, path: Path, reason: str, by: str = AUTO_SETTING) -> None:
    """One line on stderr for a checkpoint passed over by `by` (`resume=auto`, or a supervisor's restart),
    once per process and file version, from the one process that speaks for the run (`speaks`)."""
    if not speaks(run_dir):
        return
    try:
        stat = path.stat()
        key = (path.resolve(), stat.st_mtime_ns, stat.st_size, reason)
    except OSError:
        key = (path.resolve(), 0, 0, reason)
    if key in _reported:
        return
    _reported.add(key)
    os.write(2, f"ppo-fabric: {by} skipped {path}: {reason}\n".encode())  # one write: no interleaving


def resolve_auto(cfg: DictConfig, run_dir: str) -> bool:
    """Replace `resume=auto` by the run directory's newest valid checkpoint (or None: a fresh start);
    returns whether the config asked for `auto`."""
    if cfg.get("resume") != AUTO:
        return False
    found = newest_checkpoint(Path(run_dir).resolve())
    cfg.resume = str(found[0]) if found is not None else None
    return True
