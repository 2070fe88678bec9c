"""Multirun (`python -m ppo_fabric -m ...`): each job a process of its own, and the sweep table.

Lightning relaunches ranks from `sys.argv`, so a job run inside the sweep's process with fabric.devices>1
would start ranks that each run the whole sweep, and a rank variable left behind would stall the next job.
Each job is therefore `python -m ppo_fabric <job overrides> hydra.run.dir=<job dir>` (`jobs.RunProcess`:
the command a user types, supervisor and all), `n_jobs` at a time. Every job's config is checked before
the first one starts; a failed job is recorded and the others still run; a stop signal (SIGINT, SIGTERM,
SIGHUP, SIGUSR1/2) stops the running jobs cleanly (they write their checkpoints) and ends the sweep with
128 + N. The table (`sweep.csv`,
`sweep.md`, printed) holds each job's overrides, status, final mean return, steps/s and wall time.

Used by the Hydra launcher plugin `hydra_plugins/ppo_fabric/launcher.py` (`hydra/launcher=ppo_fabric`).
"""

from __future__ import annotations

import contextlib
import copy
import csv
import json
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import DictConfig, OmegaConf, open_dict

from ppo_fabric.app.jobs import RunProcess
from ppo_fabric.app.supervisor import say
from ppo_fabric.compat.linux import drop_hung_up_terminal
from ppo_fabric.config.arguments import fail
from ppo_fabric.config.faults import SIGNAL_STOPS, STOP_SIGNALS, RunComplete
from ppo_fabric.config.tuned import quoted, with_tuned_values
from ppo_fabric.config.values import ConfigError, composer, config_dir, translate_hydra_error

# Overrides that configure the sweep itself; a job is a plain run and gets its own hydra.run.dir.
_SWEEP_KEYS = (
    "hydra.mode",
    "hydra.sweep",
    "hydra.launcher",
    "hydra/launcher",
    "hydra.sweeper",
    "hydra/sweeper",
    "hydra.run.dir",
    "hydra.job.id",
    "hydra.job.num",
)
COLUMNS = ("job", "overrides", "status", "final_mean_return", "sps", "wall_s", "run_dir")


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def job_overrides(overrides: Sequence[str]) -> list[str]:
    """A job's own overrides: the sweep's combination without the keys that configure the sweep."""
    return [o for o in overrides if not _key(o).startswith(_SWEEP_KEYS)]


def config_flags(config: DictConfig) -> list[str]:
    """`--config-path/--config-name/--config-dir` that make a job compose the sweep's primary config."""
    flags, name = [], str(config.hydra.job.config_name)
    ours = f"file://{config_dir()}"
    for source in config.hydra.runtime.config_sources:
        path = str(source.path)
        shown = path[len("file://") :] if path.startswith("file://") else path
        if source.provider == "main" and (path != ours or name != "config"):
            flags += [f"--config-path={shown}", f"--config-name={name}"]
        elif source.provider == "command-line":
            flags.append(f"--config-dir={shown}")
    return flags


@dataclass
class Job:
    """One job of the sweep: what it runs, where, and how it ended."""

    num: int
    overrides: list[str]  # as Hydra's sweeper gave them
    command: list[str]  # the job's own command-line arguments (flags, overrides, group)
    run_dir: Path
    cfg: DictConfig
    hydra_cfg: DictConfig
    status: str = "not started"
    complete: str | None = None  # a `resume=auto` job whose run is finished: why, and nothing to start
    exit_code: int | None = None
    wall_s: float | None = None
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def shown(self) -> str:
        return " ".join(job_overrides(self.overrides))

    def finish(self, code: int, wall_s: float) -> None:
        self.exit_code, self.wall_s = code, wall_s
        path = self.run_dir / "summary.json"
        if path.is_file():
            self.summary = json.loads(path.read_text())
        if code == 0:
            self.status = "ok"
        elif code in SIGNAL_STOPS:
            self.status = f"stopped (exit {code})"
        else:
            self.status = f"failed (exit {code})"

    def row(self) -> dict[str, Any]:
        ret, sps = self.summary.get("final_mean_return"), self.summary.get("sps")
        return {
            "job": self.num,
            "overrides": self.shown,
            "status": self.status,
            "final_mean_return": "" if ret is None else f"{ret:.2f}",
            "sps": "" if sps is None else f"{sps:.0f}",
            "wall_s": "" if self.wall_s is None else f"{self.wall_s:.1f}",
            "run_dir": str(self.run_dir),
        }

    def job_return(self) -> JobReturn:
        """COMPLETED whatever the job's status (a failed one's value is None): a FAILED return makes Hydra's
        sweeper raise after its batch, so with `hydra.sweeper.max_batch_size` the later batches never ran.
        The sweep's own status says what failed, once every job has run (`failed_jobs`)."""
        if self.exit_code != 0:
            FAILED.append(f"job {self.num} ({self.shown}) {self.status}; see {self.run_dir}")
        ret = JobReturn(
            overrides=list(self.overrides),
            cfg=self.cfg,
            hydra_cfg=self.hydra_cfg,
            working_dir=os.getcwd(),
            task_name=str(self.hydra_cfg.hydra.job.name),
            status=JobStatus.COMPLETED,
        )
        ret.return_value = self.summary if self.exit_code == 0 else None
        return ret


FAILED: list[str] = []  # this process's sweep: a line for each job that did not finish


def failed_jobs() -> list[str]:
    """What failed in the sweep this process ran (its lines), read once the sweeper has run every batch."""
    return list(FAILED)


def _unmake(sweep_dir: Path) -> None:
    """A sweep refused before its first job: the directory Hydra made for it (holding only its
    multirun.yaml) goes, and its parent if that is left empty (`multirun/`), as a refused run leaves none."""
    with contextlib.suppress(OSError):
        if sorted(p.name for p in sweep_dir.iterdir()) == ["multirun.yaml"]:
            (sweep_dir / "multirun.yaml").unlink()
            sweep_dir.rmdir()
            if sweep_dir.parent.name == "multirun":  # the default sweep directory's parent, when empty
                sweep_dir.parent.rmdir()


class Sweep:
    """The state of one multirun: its jobs so far (a sweeper may launch several batches) and its table."""

    def __init__(self, n_jobs: int = 1) -> None:
        if int(n_jobs) < 1:
            fail(f"hydra.launcher.n_jobs={n_jobs} must be >= 1")
        FAILED.clear()
        self.n_jobs = int(n_jobs)
        self.jobs: list[Job] = []
        self.context: Any = None
        self.config: DictConfig | None = None

    def setup(self, hydra_context: Any, config: DictConfig) -> None:
        self.context, self.config = hydra_context, config

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[JobReturn]:
        """Check every job's config, run the jobs, write the table; returns Hydra's JobReturns."""
        assert self.config is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        try:
            batch = [self._plan(initial_job_idx + i, list(o), sweep_dir) for i, o in enumerate(job_overrides)]
        except SystemExit:
            if initial_job_idx == 0:
                _unmake(sweep_dir)
            raise
        sweep_dir.mkdir(parents=True, exist_ok=True)
        self.jobs += batch
        stopped_by = self._run(batch)
        self.write_table(sweep_dir)
        if stopped_by is not None:
            say(f"the sweep stopped on {signal.Signals(stopped_by).name}; the same command with resume=auto "
                f"hydra.sweep.dir={sweep_dir} continues it")  # fmt: skip
            raise SystemExit(128 + stopped_by)
        return [job.job_return() for job in batch]

    def _plan(self, num: int, overrides: list[str], sweep_dir: Path) -> Job:
        """Compose and check one job's config as its run will; a mistake ends the sweep (one line, exit 2)
        before any job starts."""
        from ppo_fabric.app.preflight import prepare  # torch and gymnasium: only once a sweep runs

        assert self.config is not None
        shown = " ".join(job_overrides(overrides))
        # as the job's own command line will (hydra_app), with the sweep's primary config
        flags = config_flags(self.config)  # the primary config each job is started with: ours, or the user's
        own = (
            str(self.config.hydra.job.config_name)
            if any(f.startswith("--config-name") for f in flags)
            else None
        )
        try:
            settled = with_tuned_values(overrides, None if own is None else "", own)
            sweep_config = self.context.config_loader.load_sweep_config(self.config, settled)
        except Exception as exc:  # Hydra raises many types; each becomes one line
            fail(f"job {num} ({shown}): {translate_hydra_error(exc, overrides)}")
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = num
            sweep_config.hydra.job.num = num
        HydraConfig.instance().set_config(sweep_config)
        run_dir = (Path(str(sweep_config.hydra.sweep.dir)) / str(sweep_config.hydra.sweep.subdir)).resolve()
        cfg = copy.deepcopy(sweep_config)
        with open_dict(cfg):
            del cfg["hydra"]
        command = [*config_flags(self.config), *job_overrides(overrides)]
        if cfg.get("group") is None:  # runs of one sweep are grouped by the sweep directory's name
            with open_dict(cfg):
                cfg.group = sweep_dir.name
            command.append(f"group={quoted(sweep_dir.name)}")
        try:
            prepare(
                cfg,
                str(run_dir),
                job_overrides(settled),
                composer(None, str(self.config.hydra.job.config_name)),
            )
        except ConfigError as exc:
            if "already holds a run" in str(exc):  # one job's resume= would resume every job from its file
                fail(
                    f"job {num} ({shown}): {run_dir} already holds a run; choose another hydra.sweep.dir, or add "
                    "resume=auto to continue each job of the sweep in its own directory"
                )
            fail(f"job {num} ({shown}): {exc}")
        except RunComplete as done:  # said when its turn comes, instead of starting it (it said so too)
            complete = str(done)
        else:
            complete = None
        hydra_cfg = OmegaConf.create({"hydra": OmegaConf.to_container(sweep_config.hydra, resolve=False)})
        return Job(num, overrides, command, run_dir, cfg, hydra_cfg, complete=complete)

    def _run(self, batch: list[Job]) -> int | None:
        """Run the jobs, `n_jobs` at a time; returns the signal that stopped the sweep, if one did."""
        stop: list[int] = []
        running: list[tuple[Job, RunProcess]] = []

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            if signum == signal.SIGHUP:
                drop_hung_up_terminal()
            stop.append(signum)
            for _, proc in running:  # the first asks each job to stop; a second kills it (its supervisor)
                proc.stop(signum)

        previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
        try:
            pending = list(batch)
            while pending or running:
                while pending and not stop and len(running) < self.n_jobs:
                    job = pending.pop(0)
                    if job.complete is not None:  # nothing to run: its finished run's summary is its row
                        say(f"job {job.num} ({job.shown}): {job.complete}")
                        job.finish(0, 0.0)
                        continue
                    log = job.run_dir / "job.log" if self.n_jobs > 1 else None
                    say(f"job {job.num} ({job.shown}) starting in {job.run_dir}")
                    running.append((job, RunProcess.start(job.command, job.run_dir, log_path=log)))
                    if stop and running[-1][1].stop_signal is None:  # a signal that came while it was
                        running[-1][1].stop(stop[0])  # being started, which `on_signal` missed
                if stop:
                    pending.clear()  # never started: "not started" in the table
                for pair in list(running):
                    code = pair[1].poll()
                    if code is not None:
                        running.remove(pair)
                        pair[0].finish(code, pair[1].elapsed_s)
                        say(f"job {pair[0].num} ({pair[0].shown}) {pair[0].status}")
                time.sleep(0.1)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return stop[0] if stop else None

    def write_table(self, sweep_dir: Path) -> None:
        """sweep.csv and sweep.md in the sweep directory; the Markdown is printed too."""
        rows = [job.row() for job in self.jobs]
        with (sweep_dir / "sweep.csv").open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
        lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(str(r[c]).replace("|", "\\|") for c in COLUMNS) + " |" for r in rows]
        text = "\n".join(lines) + "\n"
        (sweep_dir / "sweep.md").write_text(text)
        print(f"\nsweep {sweep_dir}:\n{text}", flush=True)
