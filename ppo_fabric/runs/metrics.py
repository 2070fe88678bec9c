"""Metrics: episode statistics, TensorBoard/CSV/tracker logging and progress (rank 0 only): a bar on a
terminal, a plain line every `logger.progress_every` seconds otherwise."""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import math
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TextIO

import torch
from omegaconf import DictConfig, OmegaConf

from ppo_fabric.config.faults import FAULT_EXIT, RunFault
from ppo_fabric.config.values import ConfigError
from ppo_fabric.runs.metrics_file import EVALUATIONS_CSV, METRICS_CSV, writing
from ppo_fabric.runs.trackers import Tracker, open_tracker, tracker_name
from ppo_fabric.wire.progress import PROGRESS

WALL = "time/wall_s"
ABORT_CLOSE_S = 30.0  # how long a failed run waits for its tracker to close before it exits
PROGRESS_EVERY_S = 30.0  # `logger.progress_every` where the config has no such key


def parameters_digest(*modules: torch.nn.Module) -> str:
    """A hash of all parameters, to prove at the end of a run that every rank holds the same models."""
    flat = torch.cat([p.detach().reshape(-1).cpu() for m in modules for p in m.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def episode_sums(returns: Iterable[float], lengths: Iterable[int]) -> torch.Tensor:
    """[sum of returns, sum of lengths, count], ready for a SUM all-reduce."""
    returns, lengths = list(returns), list(lengths)
    return torch.tensor([sum(returns), float(sum(lengths)), float(len(returns))], dtype=torch.float64)


def episode_means(sums: torch.Tensor) -> dict[str, float]:
    total_ret, total_len, count = sums.tolist()
    if count == 0:
        return {}
    return {"rollout/episode_return": total_ret / count, "rollout/episode_length": total_len / count}


def _first_line(exc: BaseException) -> str:
    """An exception's first non-empty line: a database error's SQL and links made the warning many lines."""
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


def recent_episodes(episodes: list[tuple[int, float, int]], last: int = 20) -> list[tuple[int, float, int]]:
    """The `last` episodes of `episodes` (in the order of the env step they ended at), with every other that
    ended at the same env step as the earliest of them: which of those came first is the order the rollout
    happened to record them in, policy by policy in a multi-agent env."""
    if len(episodes) <= last:
        return episodes
    cut = episodes[-last][0]
    return [ep for ep in episodes if ep[0] >= cut]


def final_mean_return(windows: list[Iterable[tuple[int, float, int]]], last: int = 20) -> float | None:
    """Mean of the recent episodes across all ranks (`recent_episodes` of them all): the last 20 of a
    zero-sum game's agents (whose mean is 0) held more of one policy's (1.2) before ties counted."""
    episodes = recent_episodes(
        sorted((ep for window in windows for ep in window), key=lambda ep: ep[0]), last
    )
    return sum(ep[1] for ep in episodes) / len(episodes) if episodes else None


def _step(row: Mapping[str, Any]) -> float | None:
    try:
        return float(row["step"])
    except (KeyError, TypeError, ValueError):
        return None


RUN_ID = "run_id"  # the column of the session that logged a row (the checkpoints' `run_id`)


def _read_strictly(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def _columns(key_lists: list[list[str]]) -> list[str]:
    """The union of `key_lists`, `step` first, the rest sorted (a metrics file's header)."""
    union = {k for keys in key_lists for k in keys if k is not None}
    return sorted(union, key=lambda k: (k != "step", k))


def _write_rows(path: Path, keys: list[str], rows: list[dict[str, str]]) -> None:
    tmp = path.with_suffix(".csv.tmp")
    with writing(path, tmp):
        with tmp.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=keys, extrasaction="ignore")  # a torn row's overflow
            writer.writeheader()
            writer.writerows(rows)
        tmp.replace(path)


class CsvMetrics:
    """metrics.csv that a resumed run appends to (Lightning's CSV logger deletes an existing file).

    Columns are the union of every key logged; a new key rewrites the file once with the wider header.
    `resumed_at`: the env step of the checkpoint a resumed run starts from. Rows logged after it (a run
    that crashed or was stopped some updates past its last checkpoint) leave the file once, so it holds
    one timeline, the one the run continues, rather than two runs of the same steps one after the other;
    -1 takes every row out (a run starting afresh where an attempt without a checkpoint logged). Each row
    records the session that logged it (`run_id`), so that with the checkpoint's `lineage` the rows of
    another branch leave too (a run resumed into its own directory from an older checkpoint, then from a
    newer one of the first timeline, kept the other branch's rows below that step), and the rows of this
    timeline that an earlier resume took out come back. What leaves goes to `dropped_path`.
    """

    def __init__(
        self,
        path: Path,
        resumed_at: int | None = None,
        run_id: str | None = None,
        lineage: list[list[Any]] | None = None,
    ) -> None:
        self.path = path
        self.run_id, self.lineage = run_id, lineage
        self.keys: list[str] = []
        if path.is_file():
            with path.open(newline="") as fh:
                self.keys = next(csv.reader(fh), [])
            if resumed_at is not None and self.keys:  # a file cut before its header has no rows to drop
                self._rewrite(self.keys, through=resumed_at)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        row: dict[str, Any] = {"step": step, **metrics}
        if self.run_id is not None:
            row[RUN_ID] = self.run_id
        new = [k for k in row if k not in self.keys]
        if new:
            self._rewrite(sorted([*self.keys, *new], key=lambda k: (k != "step", k)))
        with writing(self.path), self.path.open("a", newline="") as fh:
            csv.DictWriter(fh, fieldnames=self.keys).writerow(row)

    @property
    def dropped_path(self) -> Path:
        """Where the rows a resume leaves out of the file go (`metrics.dropped.csv`): another branch's, and
        those an attempt logged past its last checkpoint. Nothing is deleted: a later resume into that
        branch takes its rows back."""
        return self.path.with_name(f"{self.path.stem}.dropped.csv")

    def _rewrite(self, keys: list[str], through: int | None = None) -> None:
        """The file with the header `keys`; with `through`, the timeline the run continues (`_continued`),
        from the file and the rows dropped before, the others moved to `dropped_path`, and without a last
        line a crash cut short (no newline: the next row appended would run on from it)."""
        rows: list[dict[str, str]] = []
        torn = False
        if self.path.is_file():  # read strictly: a row lost here would be lost from the file
            with self.path.open(newline="") as fh:
                text = fh.read()
            torn = through is not None and not text.endswith("\n")
            if torn:
                text = text[: text.rfind("\n") + 1]
            rows = list(csv.DictReader(io.StringIO(text, newline="")))
        if through is not None:
            # a row in both files: a resume that moved it aside, then failed to rewrite the file (a full disk)
            held = {tuple(sorted(r.items())) for r in rows}
            aside = [r for r in _read_strictly(self.dropped_path) if tuple(sorted(r.items())) not in held]
            pool = rows + aside
            keep = [self._continued(r, through, aside=i >= len(rows)) for i, r in enumerate(pool)]
            if all(keep[: len(rows)]) and not any(keep[len(rows) :]) and not torn:  # nothing moves
                self.keys = keys
                return
            rows = sorted((r for r, k in zip(pool, keep, strict=True) if k), key=lambda r: _step(r) or 0.0)
            dropped = [r for r, k in zip(pool, keep, strict=True) if not k]
            keys = _columns([keys, *(list(r) for r in rows)])
            if dropped:
                _write_rows(self.dropped_path, _columns([list(r) for r in dropped]), dropped)
            else:
                self.dropped_path.unlink(missing_ok=True)
        _write_rows(self.path, keys, rows)
        self.keys = keys

    def _continued(self, row: dict[str, str], through: int, aside: bool = False) -> bool:
        """Whether a row is of the timeline the run continues: logged by then, and by a session of the
        checkpoint's lineage before the next one resumed from it. A row without a session (older files)
        stays in the file by its step alone, and a dropped one stays dropped: it cannot be placed."""
        step = _step(row)
        if step is None or step > through:
            return False
        session = row.get(RUN_ID)
        if not session or self.lineage is None:
            return not aside
        from ppo_fabric.runs.checkpoint import in_lineage

        return in_lineage(int(step), session, self.lineage)


def progress_every(cfg: DictConfig) -> float:
    """`logger.progress_every`: seconds between the progress lines printed off a terminal (0 or null: none;
    a config without the key: 30). Raises `ConfigError` in one line for anything but a number >= 0."""
    value = OmegaConf.select(cfg, "logger.progress_every", default=PROGRESS_EVERY_S)
    if value is None:
        return 0.0
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ConfigError(
            f"logger.progress_every={value!r} must be a number of seconds >= 0 (0: no progress lines)"
        )
    return float(value)


def duration(seconds: float) -> str:
    """`42s`, `3m05s`, `2h07m`: an ETA, to the second under an hour."""
    s = max(round(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def progress_line(step: int, total: int, sps: float, mean_return: float | None) -> str:
    """One progress line, as SB3's `verbose=1` says it but on one line: env steps of the run (of its
    planned total), this session's SPS, the recent mean return (`-` before any episode ended), and the
    time left at this session's SPS."""
    percent = f" ({100 * step / total:.0f}%)" if total > 0 else ""
    ret = "-" if mean_return is None else f"{mean_return:.1f}"
    eta = duration(max(total - step, 0) / sps) if sps > 0 else "-"
    return f"ppo-fabric: {step:,}/{total:,} steps{percent}, {sps:,.0f} steps/s, return {ret}, ETA {eta}"


def is_terminal(stream: Any) -> bool:
    """A terminal a bar can be drawn on: a tty of some width. A pseudo-terminal that reports 0 columns
    (`script -c ...`, some CI runners) drew a bar of nothing, and the plain lines were left out for it."""
    try:
        if not stream.isatty():
            return False
    except (AttributeError, ValueError, OSError):  # no isatty (some notebook streams), or closed
        return False
    try:
        return os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, ValueError, OSError):  # a terminal without a file descriptor to measure
        return True


class RunLogger:
    """Writes metrics on rank 0 and stays silent elsewhere, so callers never branch on the rank.

    Sinks: TensorBoard, metrics.csv and an experiment tracker (`logger=mlflow|wandb`, trackers.py), each
    as the config says; every one gets the same rows keyed by env step. Evaluations during training
    (`log_evaluation`) go to TensorBoard and the tracker alike, but to a CSV of their own,
    `evaluations.csv`: metrics.csv keeps one row per logged update, and a decoupled evaluation arrives
    after later updates were logged, at the env step it scored.

    Progress (`progress`, at each logged update): a tqdm bar when `stream` (stdout) is a terminal; otherwise
    (nohup, a pipe, a cluster's log file, a notebook) a plain line (`progress_line`) at the first logged
    update after every `logger.progress_every` seconds, one flushed write each. `clock` (seconds, monotonic)
    paces those lines; tests pass a fake one."""

    def __init__(
        self,
        run_dir: Path,
        cfg: DictConfig,
        total_steps: int,
        enabled: bool,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        resumed_at: int | None = None,
        session: tuple[str, list[list[Any]]] | None = None,
        replaced_config: str | None = None,
    ) -> None:
        """`session`: (this session's run id, its lineage), which the CSV rows record and a resume keeps;
        `replaced_config`: how a fresh run's config differs from the earlier attempt's it replaced."""
        self.enabled = enabled
        self.run_dir = run_dir
        self.total_steps = total_steps
        self.loggers: list[Any] = []
        self.csv: CsvMetrics | None = None
        self.evaluations: CsvMetrics | None = None
        self.tracker: Tracker | None = None
        self.bar = None
        self.stream = sys.stdout if stream is None else stream
        self.clock = clock
        # every rank reads it (and refuses a bad value alike), so that no rank waits for one that failed
        self.progress_every = progress_every(cfg)
        self.next_line: float | None = None  # when the next progress line is due (None: no lines)
        if not enabled:
            return
        # A run that starts afresh in a directory holding records (a supervisor's restart before the job's
        # first checkpoint, `resume=auto` that found none, the same hydra.run.dir again after such a failure)
        # replaces them: they are an attempt nothing continues, and appended to they would run the steps
        # twice. Its tracker gets a new run for the same reason.
        fresh = resumed_at is None
        records = fresh and any((run_dir / name).is_file() for name in (METRICS_CSV, EVALUATIONS_CSV))
        if records or replaced_config:
            differs = (
                f", and its config.yaml, whose values differ: {replaced_config}" if replaced_config else ""
            )
            print(
                f"ppo-fabric: {run_dir} holds the records of an attempt that wrote no checkpoint; this run "
                f"starts afresh and replaces them{differs}",
                file=sys.stderr,
                flush=True,
            )
        since = -1 if fresh else resumed_at
        try:
            with PROGRESS.waiting_for("the tracker", peer=False):  # a server: bounded by stall_timeout
                self.tracker = open_tracker(cfg, run_dir, continued=not fresh)
        except Exception as exc:  # the run was asked to track: it does not start without its tracker
            text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
            raise RunFault(f"logger.tracker={tracker_name(cfg)} could not start its run ({text})") from exc
        OPEN_LOGGERS.add(self)
        if cfg.logger.tensorboard:
            from lightning_fabric.loggers import TensorBoardLogger

            quiet_tensorboard_writer()

            # a resumed run's events after its checkpoint's step are hidden, as its CSV rows are dropped
            earlier = not fresh or (run_dir / "tensorboard").is_dir()
            purge = {"purge_step": since + 1} if earlier else {}
            self.loggers.append(TensorBoardLogger(root_dir=run_dir, name="", version="tensorboard", **purge))
        run_id, lineage = session if session is not None else (None, None)
        if cfg.logger.csv:
            self.csv = CsvMetrics(run_dir / METRICS_CSV, since, run_id, lineage)
            self.evaluations = CsvMetrics(run_dir / EVALUATIONS_CSV, since, run_id, lineage)
        else:  # not written to, but what is there is still this directory's record: the plot, the
            # supervisor and the tuner read it, so another timeline's rows leave it as they would
            for name in (METRICS_CSV, EVALUATIONS_CSV):
                if (run_dir / name).is_file():
                    CsvMetrics(run_dir / name, since, run_id, lineage)
        if is_terminal(self.stream):
            from tqdm import tqdm

            self.bar = tqdm(  # `initial`: a resumed run's rate and time left count this session's steps only
                total=total_steps, initial=0 if fresh else resumed_at, unit="step", unit_scale=True,
                dynamic_ncols=True, file=self.stream,
            )  # fmt: skip
        elif self.progress_every > 0:
            self.next_line = self.clock() + self.progress_every

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """One logged update's row."""
        self._log(metrics, step, self.csv)

    def log_evaluation(self, metrics: Mapping[str, float], step: int) -> None:
        """One evaluation during training, at the env step whose policy it scored. `time/wall_s` goes to
        evaluations.csv only: TensorBoard and trackers keep one wall-time series, the updates'."""
        self._log(metrics, step, self.evaluations, shared={k: v for k, v in metrics.items() if k != WALL})

    def _log(
        self,
        metrics: Mapping[str, float],
        step: int,
        table: CsvMetrics | None,
        shared: Mapping[str, float] | None = None,
    ) -> None:
        """`metrics` to `table`, and `shared` (default: the same) to TensorBoard and the tracker."""
        if not self.enabled:
            return
        shared = metrics if shared is None else shared
        for logger in list(self.loggers):
            try:
                logger.log_metrics(dict(shared), step=step)
            except Exception as exc:  # its event file cannot be written (a full disk, permissions)
                self._drop_tensorboard(logger, exc)
        if table is not None:
            table.log(metrics, step)
        if self.tracker is not None:
            try:
                with PROGRESS.waiting_for("the tracker", peer=False):
                    self.tracker.log(shared, step)
            except Exception as exc:  # a tracker's server or store failing mid-run
                self._drop_tracker(exc)

    def progress(self, step: int, sps: float, mean_return: float | None) -> None:
        """The bar's position, or a progress line when one is due (`step`: the run's env steps so far,
        `sps`: this session's)."""
        if self.next_line is not None:
            now = self.clock()
            if now >= self.next_line:
                self.next_line = now + self.progress_every
                self.stream.write(progress_line(step, self.total_steps, sps, mean_return) + "\n")
                self.stream.flush()
            return
        if self.bar is None:
            return
        self.bar.n = step
        ret = "-" if mean_return is None else f"{mean_return:.1f}"
        self.bar.set_postfix_str(f"sps={sps:,.0f} return={ret}", refresh=False)
        self.bar.refresh()

    def close(self, summary: Mapping[str, Any] | None = None, exit_code: int = 0) -> None:
        """End every sink. Called after summary.json and the learning curve are written (the tracker sends
        them as artifacts); `exit_code` 128+N: the run stopped on signal N, to be resumed."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self.next_line = None
        for logger in list(self.loggers):
            try:
                logger.finalize("success" if exit_code == 0 else "interrupted")
            except Exception as exc:  # its last events cannot be flushed
                self._drop_tensorboard(logger, exc)
        self.loggers = []
        OPEN_LOGGERS.discard(self)
        if self.tracker is not None:
            tracker, self.tracker = self.tracker, None
            try:
                with PROGRESS.waiting_for("the tracker", peer=False):
                    tracker.close(self.run_dir, summary, exit_code)
            except Exception as exc:
                self.tracker = tracker
                self._drop_tracker(exc)

    def _drop_tensorboard(self, logger: Any, exc: Exception) -> None:
        """TensorBoard failing to write its events is dropped with one warning, as a tracker is: every row
        is in metrics.csv (a full disk then ends the run at the next write there, in one line). Lightning
        reported the writer's OSError as "ValueError: you tried to log -0.016 which is currently not
        supported", under a traceback of each of its threads."""
        cause: BaseException = exc
        while cause.__cause__ is not None or cause.__context__ is not None:
            if isinstance(cause, OSError):
                break
            cause = cause.__cause__ or cause.__context__  # type: ignore[assignment]
        with contextlib.suppress(ValueError):
            self.loggers.remove(logger)
        warnings.warn(
            f"ppo-fabric: TensorBoard could not write its events in {self.run_dir / 'tensorboard'} "
            f"({type(cause).__name__}: {_first_line(cause)}); the run goes on without it (metrics.csv holds "
            "every row)",
            stacklevel=3,
        )

    def _drop_tracker(self, exc: Exception) -> None:
        """A tracker that fails once the run is going is dropped with a warning, not the run: every row
        is in metrics.csv, and a store or server going away says nothing about the training."""
        warnings.warn(
            f"ppo-fabric: {type(self.tracker).__name__} failed ({type(exc).__name__}: {_first_line(exc)}); "
            "the run goes on without it (metrics.csv and summary.json hold everything)",
            stacklevel=3,
        )
        self.tracker = None


def quiet_tensorboard_writer() -> None:
    """TensorBoard writes its events from a thread of its own, which keeps an error (a full disk) for the
    next write to raise, where `RunLogger` drops TensorBoard with one warning, and then also raises it,
    printing the thread's ~15-line traceback. That traceback is left out here; every other thread's
    reaches the hook that was there. Installed once per process."""
    previous = threading.excepthook
    if getattr(previous, "_quiets_tensorboard", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if type(args.thread).__module__.startswith("tensorboard.") and isinstance(args.exc_value, Exception):
            return
        previous(args)

    hook._quiets_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


OPEN_LOGGERS: set[RunLogger] = set()  # this process's loggers not yet closed: a failed run closes them


def close_after_failure(timeout_s: float = ABORT_CLOSE_S) -> None:
    """Close the loggers of a run that failed (exit 1), at most `timeout_s`: TensorBoard's and the
    tracker's pending rows written, the MLflow run ended as FAILED, W&B's finished with exit code 1 (a
    process that ends without this leaves the MLflow run RUNNING with its unflushed rows lost, and a W&B
    run with nothing to sync). Never raises: the run's own failure is what the user reads."""
    loggers = list(OPEN_LOGGERS)
    if not loggers:
        return

    def close() -> None:
        for logger in loggers:
            with contextlib.suppress(Exception):
                logger.close(exit_code=FAULT_EXIT)

    worker = threading.Thread(target=close, name="close-loggers", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        print(f"ppo-fabric: the run's tracker did not close within {timeout_s:g} s; its last rows may be lost",
              file=sys.stderr, flush=True)  # fmt: skip


def save_resolved_config(cfg: DictConfig, run_dir: Path) -> None:
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))


class Stopwatch:
    """Accumulates wall time per phase (collect, train, ...) for SPS and the time split."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self._start = time.perf_counter()

    def add(self, phase: str, seconds: float) -> None:
        self.totals[phase] = self.totals.get(phase, 0.0) + seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self._start
