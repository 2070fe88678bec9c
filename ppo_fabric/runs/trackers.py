"""Experiment trackers, `logger=mlflow` and `logger=wandb`: sinks beside metrics.csv (and TensorBoard) that
get the same content: the flattened config as params, every log row keyed by env step, and at the end
`config.yaml`, `learning_curve.png` and `summary.json` (plus the summary's numbers as final metrics).

Only the writing rank (global rank 0, a player in the decoupled strategy) opens one, through `RunLogger`.
Both libraries are optional extras, imported only when a run asks for one; `check` refuses a missing one
in preflight, before any process starts. The tracker's run id is kept in the run dir (`trackers.json`),
so a run continued in the same directory (resume, `resume=auto`, a supervisor's restart) keeps logging
into the same tracker run.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import netrc
import os
import shutil
import sys
import time
import uuid
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from omegaconf import DictConfig, OmegaConf

from ppo_fabric.config.values import ConfigError

TRACKERS = ("mlflow", "wandb")
# An MLflow server that hangs or is gone costs at most ~70 s a call (3 tries of 20 s, 2 s and 4 s apart),
# not MLflow's ~20 minutes: the run drops a tracker that fails mid-run, and refuses to start without it.
HTTP_BOUNDS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
WANDB_MODES = ("auto", "online", "offline", "disabled")
IDS_FILE = "trackers.json"  # in the run dir: which tracker run this directory logs into
ARTIFACTS = ("config.yaml", "learning_curve.png", "summary.json")
DEFAULT_EXPERIMENT = "ppo-fabric"
EMBEDDED_DIR = Path("runs")  # the embedded MLflow store, under the working directory like the run dirs


class Tracker(Protocol):
    """What `RunLogger` needs of a tracker."""

    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self, run_dir: Path, summary: Mapping[str, Any] | None, exit_code: int) -> None:
        """Send what is pending, the artifacts present in `run_dir` and `summary`'s numbers; end the tracker
        run as finished (`exit_code` 0) or stopped (128 + the signal)."""


def tracker_name(cfg: DictConfig) -> str | None:
    return OmegaConf.select(cfg, "logger.tracker", default=None)


def _importable(module: str) -> bool:
    """Whether `import module` would find it, without importing it (both take seconds to import)."""
    if module in sys.modules:
        return sys.modules[module] is not None  # None: imports of it are blocked
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check(cfg: DictConfig) -> None:
    """Preflight: the tracker is known, its package installed, its keys sane."""
    name = tracker_name(cfg)
    if name is None:
        return
    if name not in TRACKERS:
        raise ConfigError(f"logger.tracker={name!r} is not one of {', '.join(TRACKERS)} (or null)")
    if not _importable(name):
        raise ConfigError(
            f"logger={name} needs the {name} package, which is not installed; "
            f"pip install 'ppo-fabric[{name}]'"
        )
    if name == "mlflow":
        flush = OmegaConf.select(cfg, "logger.flush_seconds", default=0)
        if isinstance(flush, bool) or not isinstance(flush, (int, float)) or not flush >= 0:
            raise ConfigError(f"logger.flush_seconds={flush!r} must be a number >= 0")
    if name == "wandb":
        mode = OmegaConf.select(cfg, "logger.mode", default="auto")
        if mode not in WANDB_MODES:
            raise ConfigError(f"logger.mode={mode!r} is not one of {', '.join(WANDB_MODES)}")
        if (os.environ.get("WANDB_MODE") or mode) == "online" and not wandb_credentials():
            raise ConfigError(
                "logger=wandb is online but no W&B API key is configured (it would stop at a login prompt); "
                "run `wandb login` or set WANDB_API_KEY, or use logger.mode=offline"
            )
        if not OmegaConf.select(cfg, "logger.project", default=None):
            raise ConfigError("logger.project is required for logger=wandb; set logger.project=NAME")


def open_tracker(cfg: DictConfig, run_dir: Path, continued: bool = True) -> Tracker | None:
    """The tracker the config asks for, with its run started (or continued), or None. `continued=False`
    (a run starting afresh) starts a new tracker run even where the directory names one."""
    name = tracker_name(cfg)
    if name is None:
        return None
    ids = _read_ids(run_dir) if continued else {}
    tracker: Tracker = (
        MlflowTracker(cfg, run_dir, ids) if name == "mlflow" else WandbTracker(cfg, run_dir, ids)
    )
    return tracker


def flatten(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as `{"algo.lr": 0.00025, ...}`: the keys TensorBoard users grep for, one level."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        else:
            out[prefix] = node

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return out


def summary_metrics(summary: Mapping[str, Any]) -> dict[str, float]:
    """The summary's top-level numbers (final mean return, SPS, ...), to sort and compare runs by."""
    return {
        f"summary/{k}": float(v)
        for k, v in summary.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def run_name(cfg: DictConfig, run_dir: Path) -> str:
    return str(OmegaConf.select(cfg, "logger.run_name", default=None) or run_dir.name)


def _read_ids(run_dir: Path) -> dict[str, Any]:
    path = run_dir / IDS_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save_id(run_dir: Path, name: str, entry: dict[str, Any]) -> None:
    ids = _read_ids(run_dir) | {name: entry}
    tmp = run_dir / (IDS_FILE + ".tmp")
    tmp.write_text(json.dumps(ids, indent=2, sort_keys=True) + "\n")
    tmp.replace(run_dir / IDS_FILE)


# --------------------------------------------------------------------------------------------- MLflow
def mlflow_uri(cfg: DictConfig) -> tuple[str, bool]:
    """(tracking URI, whether it is the embedded default): `logger.tracking_uri`, else
    $MLFLOW_TRACKING_URI, else a SQLite store under `runs/` (MLflow 3's own default backend is SQLite;
    its file store is the legacy one)."""
    given = OmegaConf.select(cfg, "logger.tracking_uri", default=None) or os.environ.get(
        "MLFLOW_TRACKING_URI"
    )
    if given:
        return str(given), False
    return f"sqlite:///{(EMBEDDED_DIR / 'mlflow.db').resolve()}", True


@contextlib.contextmanager
def _store_lock(uri: str) -> Iterator[None]:
    """Serialise opening a local SQLite store: jobs of a sweep starting together would otherwise race to
    create its tables and their experiment."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    db = Path(uri.removeprefix("sqlite:///"))
    db.parent.mkdir(parents=True, exist_ok=True)
    import fcntl

    with open(db.parent / (db.name + ".lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def _quiet_mlflow() -> Iterator[None]:
    """MLflow's INFO lines on creating tables, and SQLAlchemy's deprecation warning from inside MLflow,
    say nothing the user can act on."""
    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*noload.*")
        warnings.filterwarnings("ignore", category=DeprecationWarning, module="sqlalchemy.*")
        yield


class MlflowTracker:
    """An MLflow run through `MlflowClient` (never the fluent API's process-wide active run, which a
    notebook calling `ppo_fabric.run` may be using itself). Metric rows are buffered and sent as one batch
    every `logger.flush_seconds`: a synchronous SQLite write costs ~25 ms, too much for every update."""

    MAX_METRICS = 1000  # per log_batch call (MLflow's limit)
    MAX_PARAMS = 100
    MAX_VALUE = 6000  # characters of a param value

    def __init__(self, cfg: DictConfig, run_dir: Path, ids: dict[str, Any]) -> None:
        with _quiet_mlflow():
            from mlflow import MlflowClient
            from mlflow.entities import Metric, Param, RunTag
            from mlflow.exceptions import MlflowException

        self._metric, self._param, self._tag = Metric, Param, RunTag
        self.uri, embedded = mlflow_uri(cfg)
        self.flush_seconds = float(OmegaConf.select(cfg, "logger.flush_seconds", default=5))
        self.pending: list[Any] = []
        group = OmegaConf.select(cfg, "group", default=None)
        experiment = str(
            OmegaConf.select(cfg, "logger.experiment", default=None) or group or DEFAULT_EXPERIMENT
        )
        saved = ids.get("mlflow") or {}
        if not embedded:  # MLflow retries a call to a server 7 times, 120 s each: bounded waits instead
            for name, value in HTTP_BOUNDS.items():
                os.environ.setdefault(name, value)  # the user's own settings win
        with _store_lock(self.uri), _quiet_mlflow():
            self.client = MlflowClient(tracking_uri=self.uri)
            self.run_id = None
            if saved.get("tracking_uri") == self.uri and saved.get("run_id"):
                with contextlib.suppress(MlflowException):  # deleted meanwhile: start a new one
                    previous = self.client.get_run(saved["run_id"])
                    self.run_id = previous.info.run_id
                    self.client.update_run(self.run_id, status="RUNNING")
                    self._log_params(flatten(cfg), previous.data.params)
            if self.run_id is None:
                experiment_id = self._experiment(experiment, embedded, MlflowException)
                tags = {"run_dir": str(run_dir)} | ({"group": str(group)} if group is not None else {})
                run = self.client.create_run(experiment_id, run_name=run_name(cfg, run_dir), tags=tags)
                self.run_id = run.info.run_id
                _save_id(run_dir, "mlflow", {"tracking_uri": self.uri, "run_id": self.run_id})
                self._log_params(flatten(cfg), {})
        self._last_flush = time.monotonic()  # the first batch a flush interval after the start

    def _experiment(self, name: str, embedded: bool, error: type[Exception]) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        # The embedded store keeps artifacts beside it, not in ./mlruns (MLflow's default).
        location = (EMBEDDED_DIR / "mlartifacts" / name).resolve().as_uri() if embedded else None
        try:
            return self.client.create_experiment(name, artifact_location=location)
        except error:  # created by another process since (a server, without our lock)
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def _log_params(self, params: dict[str, Any], existing: Mapping[str, str]) -> None:
        """New params; on a resume a param whose value changed (MLflow params never change) becomes the
        tag `resumed.<key>`."""
        fresh, changed = [], []
        for key, value in params.items():
            text = str(value)[: self.MAX_VALUE]
            if key not in existing:
                fresh.append(self._param(key, text))
            elif existing[key] != text:
                changed.append(self._tag(f"resumed.{key}", text))
        for i in range(0, len(fresh), self.MAX_PARAMS):
            self.client.log_batch(self.run_id, params=fresh[i : i + self.MAX_PARAMS])
        if changed:
            self.client.log_batch(self.run_id, tags=changed[: self.MAX_PARAMS])

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self.pending.extend(self._metric(k, float(v), now, int(step)) for k, v in metrics.items())
        if time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        with _quiet_mlflow():
            for i in range(0, len(self.pending), self.MAX_METRICS):
                self.client.log_batch(self.run_id, metrics=self.pending[i : i + self.MAX_METRICS])
        self.pending.clear()
        self._last_flush = time.monotonic()

    def close(self, run_dir: Path, summary: Mapping[str, Any] | None, exit_code: int) -> None:
        if summary is not None:
            self.log(summary_metrics(summary), int(summary.get("total_env_steps", 0)))
        self.flush()
        with _quiet_mlflow():
            for name in ARTIFACTS:
                if (run_dir / name).is_file():
                    self.client.log_artifact(self.run_id, str(run_dir / name))
            status = "FINISHED" if exit_code == 0 else "KILLED" if exit_code >= 128 else "FAILED"
            self.client.set_terminated(self.run_id, status)


# ---------------------------------------------------------------------------------------------- W&B
def wandb_credentials() -> bool:
    """Whether W&B would find an API key without asking: WANDB_API_KEY, an identity token file, or a
    netrc entry for the server (what `wandb login` writes). Checked without wandb's private modules."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://", 1)[-1].split("/")[0]
    path = Path(os.environ.get("NETRC") or Path.home() / ".netrc")
    try:
        entry = netrc.netrc(str(path)).authenticators(host.split(":")[0]) if path.is_file() else None
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


def wandb_mode(cfg: DictConfig) -> str | None:
    """The mode to pass to wandb.init: None when $WANDB_MODE is set (wandb reads it itself); `auto` is
    online with credentials, offline without (so a run never stops at a login prompt)."""
    if os.environ.get("WANDB_MODE"):
        return None
    mode = str(OmegaConf.select(cfg, "logger.mode", default="auto"))
    if mode == "auto":
        return "online" if wandb_credentials() else "offline"
    return mode


class WandbTracker:
    """A W&B run whose files live under the run dir (`<run dir>/wandb/`). Settings keep it from waiting
    on anything: no console capture, no git or code scan, a bounded init, no prompt (see `wandb_mode`).
    Offline runs are uploaded later with `wandb sync <run dir>/wandb/offline-run-*`."""

    def __init__(self, cfg: DictConfig, run_dir: Path, ids: dict[str, Any]) -> None:
        import wandb

        self.wandb = wandb
        run_id = (ids.get("wandb") or {}).get("id") or uuid.uuid4().hex[:12]
        _save_id(run_dir, "wandb", {"id": run_id})
        settings = wandb.Settings(
            console="off",
            silent=True,
            disable_git=True,
            save_code=False,
            init_timeout=float(OmegaConf.select(cfg, "logger.init_timeout", default=60)),
        )
        mode = wandb_mode(cfg)
        self.run = wandb.init(
            project=str(cfg.logger.project),
            entity=OmegaConf.select(cfg, "logger.entity", default=None),
            group=OmegaConf.select(cfg, "group", default=None),
            name=run_name(cfg, run_dir),
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            config=flatten(cfg),
            settings=settings,
            reinit="create_new",
            allow_val_change=True,  # a resumed run may change total_steps, resume, ...
            **({"mode": mode} if mode is not None else {}),
        )
        # Rows are keyed by env step, not by wandb's own call counter: a resumed run logs from its
        # checkpoint's step again, which wandb's monotonic `step` would drop.
        self.run.define_metric("env_step")
        self.run.define_metric("*", step_metric="env_step")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log({**metrics, "env_step": int(step)})

    def close(self, run_dir: Path, summary: Mapping[str, Any] | None, exit_code: int) -> None:
        if summary is not None:
            self.run.summary.update(summary_metrics(summary))
        files = Path(self.run.dir)  # copied in, not symlinked: the run's files must not change after
        for name in ARTIFACTS:
            if (run_dir / name).is_file():
                shutil.copyfile(run_dir / name, files / name)
                self.run.save(str(files / name), base_path=str(files), policy="now")
        if exit_code >= 128:  # stopped by a signal, to be resumed
            self.run.mark_preempting()
        self.run.finish(exit_code=exit_code)
        if self.wandb.run is None:  # ours was the last: end wandb's service process now, not at exit
            self.wandb.teardown()
