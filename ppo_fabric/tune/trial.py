"""One trial of a study: its seeds as runs of their own, watched until they end, then scored.

Each seed is `python -m ppo_fabric <overrides> seed=<s> hydra.run.dir=<trial dir>/seed_<s>` started
through `jobs.RunProcess`, so a trial is a normal run directory a user can inspect, evaluate or resume.
While the runs train, their `metrics.csv` (column `rollout/return_mean20`, one row per update at the
env step in column `step`) is read back and the mean over seeds reported to Optuna on a fixed grid of env
steps: the median pruner compares trials at equal steps, so the grid keeps trials with different batch
sizes comparable. A pruned or interrupted trial is stopped with SIGTERM (the runs write their checkpoint
and exit 143); a second interrupt kills their process groups.
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppo_fabric.app.jobs import RunProcess
from ppo_fabric.runs.metrics_file import read_rows, series

RETURN_COLUMN = "rollout/return_mean20"


@dataclass
class StopFlags:
    """Set by the tuner's signal handler: `stop` ends running trials cleanly, `kill` at once."""

    stop: threading.Event = field(default_factory=threading.Event)
    kill: threading.Event = field(default_factory=threading.Event)


@dataclass
class Outcome:
    """How a trial ended: `state` is complete, pruned, failed or interrupted."""

    state: str
    value: float | None = None
    reason: str = ""
    seed_values: list[float] = field(default_factory=list)


def read_returns(path: Path) -> list[tuple[int, float]]:
    """(env step, recent mean return) of every row of a metrics.csv that has both; a row being written
    (or a file being rewritten with a wider header) is skipped and read at the next poll."""
    return [(int(step), value) for step, value in series(read_rows(path), RETURN_COLUMN)]


class Reporter:
    """Turns the seeds' learning curves into intermediate values on a grid of `every` env steps.

    A grid step is reported once every seed has logged past it; its value is the mean over seeds of each
    seed's latest return at or before it (a seed with no finished episode yet leaves that step out)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.next_step = every

    def due(self, curves: list[list[tuple[int, float]]]) -> list[tuple[int, float]]:
        if not curves or any(not c for c in curves):
            return []
        reached = min(c[-1][0] for c in curves)
        values = []
        while self.next_step <= reached:
            at = [[v for s, v in c if s <= self.next_step] for c in curves]
            if all(at):
                values.append((self.next_step, sum(a[-1] for a in at) / len(at)))
            self.next_step += self.every
        return values


def run_error(log: Path) -> str | None:
    """The one-line cause a failed run printed last (`ppo-fabric: error: ...`), without its prefix; None when
    it printed none (killed, or a crash outside the package). The trial's reason said only its exit status."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    prefix = "ppo-fabric: error: "
    return next((line[len(prefix) :].strip() for line in reversed(lines) if line.startswith(prefix)), None)


def objective_value(run_dir: Path, objective: str, seed: int, eval_episodes: int) -> float:
    """The score of one finished run: its summary's mean return (`return`), the mean return of
    deterministic evaluation episodes on its last checkpoint (`eval`), or a summary.json metric.
    Raises ValueError with one line when the run has no such value."""
    summary = json.loads((run_dir / "summary.json").read_text())
    if objective == "eval":
        from ppo_fabric.policy.evaluate import evaluate
        from ppo_fabric.policy.scorers import evaluation_seed

        # the trial this study just trained from the user's own config: its env is the user's to build
        result = evaluate(  # on the evaluation seeds, never the training envs'
            run_dir / "checkpoints" / "last.ckpt",
            episodes=eval_episodes,
            seed=evaluation_seed(seed),
            trust_env=True,
        )
        return float(result["mean_return"])
    value: Any = summary
    for part in ("final_mean_return" if objective == "return" else objective).split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        shown = "final_mean_return" if objective == "return" else objective
        raise ValueError(f"summary.json of {run_dir} has no number for {shown} (got {value!r})")
    return float(value)


@dataclass
class TrialRun:
    """The seeds of one trial and what the tuner needs to watch them."""

    overrides: list[str]
    seeds: list[int]
    directory: Path
    objective: str
    eval_episodes: int
    report_every: int | None
    poll_seconds: float
    flags: StopFlags

    def run_dirs(self) -> list[Path]:
        return [self.directory / f"seed_{s}" for s in self.seeds]

    def execute(
        self, report: Callable[[float, int], bool] | None, env: dict[str, str] | None = None
    ) -> Outcome:
        """Run the seeds to their end. `report(value, step)` records an intermediate value and says
        whether the trial should be pruned (None: nothing is reported)."""
        procs = [
            RunProcess.start([*self.overrides, f"seed={s}"], d, env=env, log_path=d / "output.log")
            for s, d in zip(self.seeds, self.run_dirs(), strict=True)
        ]
        reporter = Reporter(self.report_every) if report is not None and self.report_every else None
        codes: list[int | None] = [None] * len(procs)
        stopped: set[int] = set()
        ending: Outcome | None = None
        while any(c is None for c in codes):
            time.sleep(self.poll_seconds)
            codes = [c if c is not None else p.poll() for c, p in zip(codes, procs, strict=True)]
            if ending is None and self.flags.stop.is_set():
                ending = Outcome("interrupted", reason="the study was interrupted")
            if ending is None and reporter is not None:
                assert report is not None
                curves = [read_returns(d / "metrics.csv") for d in self.run_dirs()]
                for step, value in reporter.due(curves):
                    if report(value, step):
                        ending = Outcome("pruned", value, reason=f"pruned at env step {step}")
                        break
            failed = [(s, c) for s, c in zip(self.seeds, codes, strict=True) if c not in (None, 0)]
            if ending is None and failed:
                seed, code = failed[0]
                log = self.directory / f"seed_{seed}" / "output.log"
                cause = run_error(log)
                ending = Outcome(
                    "failed",
                    reason=f"seed {seed} exited with status {code}"
                    + (f": {cause}" if cause else "")
                    + f" (see {log})",
                )
            if ending is not None:
                self._stop(procs, codes, stopped)
        if ending is not None and not all(c == 0 for c in codes):
            return ending  # a prune or an interrupt in the poll where every seed had finished scores them
        return self._score()

    def _stop(self, procs: list[RunProcess], codes: list[int | None], stopped: set[int]) -> None:
        """SIGTERM once to every run still going; their process groups are killed on a second interrupt."""
        for i, (proc, code) in enumerate(zip(procs, codes, strict=True)):
            if code is not None:
                continue
            if self.flags.kill.is_set():
                proc.kill()  # through its supervisor: the job runs in a session of its own
            elif i not in stopped:
                proc.stop(signal.SIGTERM)
                stopped.add(i)

    def _score(self) -> Outcome:
        values = []
        for seed, run_dir in zip(self.seeds, self.run_dirs(), strict=True):
            try:
                values.append(objective_value(run_dir, self.objective, seed, self.eval_episodes))
            except (OSError, ValueError) as exc:
                return Outcome("failed", reason=str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return Outcome("complete", sum(values) / len(values), seed_values=values)
