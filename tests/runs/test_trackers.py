"""Experiment trackers: `logger=mlflow` read back with MLflow's own client (params, metric history by env
step equal to metrics.csv, the three artifacts, the experiment named by `group`, the embedded store under
`runs/`, `MLFLOW_TRACKING_URI`, a resumed run continuing the same tracker run, only rank 0 logging in the
decoupled strategy); `logger=wandb` offline, its run file read back with wandb's own record schema; the
`auto` mode; a missing extra refused before anything starts.

Runs are in-process (`ppo_fabric.run`) 4-update CartPoles; stores live under tmp_path.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

import ppo_fabric
from ppo_fabric import cli
from ppo_fabric.config.values import ConfigError
from ppo_fabric.runs.metrics import RunLogger
from ppo_fabric.runs.metrics_file import read_rows
from ppo_fabric.runs.trackers import IDS_FILE, flatten, open_tracker, wandb_mode
from tests.conftest import assert_cli_failure, job_env

SMALL = [
    "env.num_envs=4",
    "algo.rollout_steps=32",
    "algo.minibatch_size=64",
    "algo.update_epochs=2",
    "algo.total_steps=512",  # 4 updates of 128 env steps
]
STEPS = [128, 256, 384, 512]


@pytest.fixture(autouse=True)
def tracker_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No tracker state outside tmp_path, no credentials, no user settings."""
    for var in ("MLFLOW_TRACKING_URI", "WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.chdir(tmp_path)
    yield


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One SQLite store for the tests that do not test where the store goes: creating MLflow's tables
    takes seconds."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'shared.db'}"


def csv_rows(run_dir: Path, name: str = "metrics.csv") -> list[dict[str, str]]:
    return read_rows(run_dir / name)


def csv_series(run_dir: Path, key: str, name: str = "metrics.csv") -> list[tuple[int, float]]:
    rows = csv_rows(run_dir, name)
    return [(int(float(r["step"])), float(r[key])) for r in rows if r.get(key) not in (None, "")]


def assert_same_series(got: list[tuple[int, float]], want: list[tuple[int, float]], key: str) -> None:
    """The same env steps with the same values (CSV text and float32 metrics round differently)."""
    got = sorted(got)
    assert [s for s, _ in got] == [s for s, _ in want], key
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6), key


# --------------------------------------------------------------------------------------------- MLflow
def mlflow_run(uri: str, run_dir: Path) -> Any:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    run_id = json.loads((run_dir / IDS_FILE).read_text())["mlflow"]["run_id"]
    return client, client.get_run(run_id)


@pytest.mark.slow
def test_mlflow_embedded_store_holds_params_metrics_and_artifacts(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "sweep-job-0"
    summary = ppo_fabric.run([*SMALL, "logger=mlflow", "group=my-sweep", f"hydra.run.dir={run_dir}"])
    uri = f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"  # the embedded default, under ./runs
    assert (tmp_path / "runs" / "mlflow.db").is_file() and not (tmp_path / "mlruns").exists()
    client, run = mlflow_run(uri, run_dir)

    assert client.get_experiment(run.info.experiment_id).name == "my-sweep"  # group -> experiment
    assert run.info.run_name == "sweep-job-0" and run.info.status == "FINISHED"
    cfg = OmegaConf.load(run_dir / "config.yaml")
    flat = flatten(cfg)
    assert run.data.params["algo.lr"] == str(cfg.algo.lr) == "0.001"
    assert run.data.params["env.num_envs"] == "4" and run.data.params["group"] == "my-sweep"
    assert set(run.data.params) == set(flat)

    # every metric of metrics.csv, with the same values at the same env steps
    keys = [k for k in csv_rows(run_dir)[0] if k not in ("step", "run_id")]  # run_id: the CSV's own
    assert "loss/value" in keys and "rollout/episode_return" in keys
    for key in keys:
        history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        assert_same_series(history, csv_series(run_dir, key), key)
    assert [s for s, _ in csv_series(run_dir, "loss/value")] == STEPS
    # and the evaluations during training, as evaluations.csv holds them (time/wall_s: the updates' only)
    for key in ("eval/return_mean", "eval/length_mean"):
        history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        assert history, key
        assert_same_series(history, csv_series(run_dir, key, "evaluations.csv"), key)
    final = client.get_metric_history(run.info.run_id, "summary/final_mean_return")
    assert [(m.step, m.value) for m in final] == [(512, pytest.approx(summary["final_mean_return"]))]

    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert names == {"config.yaml", "learning_curve.png", "summary.json"}
    assert Path(run.info.artifact_uri.removeprefix("file://")).is_relative_to(
        tmp_path / "runs" / "mlartifacts"
    )
    assert json.loads(Path(client.download_artifacts(run.info.run_id, "summary.json")).read_text()) == summary

    # continued in the same run dir: the same MLflow run, its history extended
    ppo_fabric.run(
        [
            *SMALL,
            "logger=mlflow",
            "group=my-sweep",
            "resume=auto",
            "algo.total_steps=768",
            f"hydra.run.dir={run_dir}",
        ]
    )
    client, again = mlflow_run(uri, run_dir)
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "loss/value")]
    assert sorted(steps) == [*STEPS, 640, 768]
    assert again.data.params["algo.total_steps"] == "512"  # params never change in MLflow ...
    assert again.data.tags["resumed.algo.total_steps"] == "768"  # ... the new value is a tag
    assert len(client.search_runs([run.info.experiment_id])) == 1


@pytest.mark.multiprocess
def test_decoupled_only_rank0_logs_to_mlflow_tracking_uri(tmp_path: Path, shared_store: str) -> None:
    """1 player (rank 0, which writes) + 1 trainer, started as the command line does, into the store
    MLFLOW_TRACKING_URI names: one run, in the default experiment (no group), holding every update's row."""
    uri = shared_store
    run_dir = tmp_path / "decoupled"
    cmd = [sys.executable, "-m", "ppo_fabric", *SMALL, "strategy=decoupled", "fabric.devices=2"]
    cmd += ["logger=mlflow", "collectives.timeout=30", f"hydra.run.dir={run_dir}"]
    # the job without its supervisor (a process fewer to start; the supervisor has tests of its own)
    env = job_env() | {"MLFLOW_TRACKING_URI": uri, "PPO_FABRIC_SUPERVISED": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (tmp_path / "runs").exists()  # no embedded store: MLflow's own artifact default, ./mlruns
    client, run = mlflow_run(uri, run_dir)
    assert client.get_experiment(run.info.experiment_id).name == "ppo-fabric"
    assert len(client.search_runs([run.info.experiment_id])) == 1
    history = client.get_metric_history(run.info.run_id, "train/policy_lag")
    assert sorted(m.step for m in history) == STEPS
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert artifacts == {"summary.json", "config.yaml", "learning_curve.png"}


@pytest.mark.slow  # seconds in process (a run, or every option composed): not the unit tier
def test_mlflow_rows_wait_for_the_flush_and_a_stop_ends_killed(tmp_path: Path, shared_store: str) -> None:
    """Rows are buffered (one batch per `flush_seconds`), all sent at close; a stopped run (exit 128+N) is
    KILLED with the artifacts it has, and reopened from the same run dir as RUNNING."""
    uri = shared_store
    logger = {"tracker": "mlflow", "tracking_uri": uri, "flush_seconds": 3600, "experiment": "unit"}
    cfg = OmegaConf.create({"logger": logger, "group": None, "seed": 1})
    run_dir = tmp_path / "stopped"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("seed: 1\n")
    tracker = open_tracker(cfg, run_dir)
    client, run = mlflow_run(uri, run_dir)
    assert run.data.params == {"logger.tracker": "mlflow", "logger.tracking_uri": uri, "logger.flush_seconds": "3600",
                               "logger.experiment": "unit", "group": "None", "seed": "1"}  # fmt: skip
    for step in (10, 20, 30):
        tracker.log({"loss/value": step / 10}, step)
    assert client.get_metric_history(run.info.run_id, "loss/value") == []
    tracker.close(run_dir, None, exit_code=143)
    history = client.get_metric_history(run.info.run_id, "loss/value")
    assert [(m.step, m.value) for m in history] == [(10, 1.0), (20, 2.0), (30, 3.0)]
    run = client.get_run(run.info.run_id)
    assert run.info.status == "KILLED"
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["config.yaml"]
    open_tracker(cfg, run_dir)
    assert client.get_run(run.info.run_id).info.status == "RUNNING"
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_a_run_that_fails_sends_its_rows_and_ends_its_mlflow_run_failed(
    tmp_path: Path, shared_store: str
) -> None:
    """An env that raises in the 3rd update: the rows logged before it (held for the flush) reach the
    tracker and its run ends FAILED, not RUNNING with nothing in it."""
    run_dir = tmp_path / "failed"
    logger = [f"logger.tracking_uri={shared_store}", "logger.flush_seconds=3600", "logger.experiment=failed"]
    with pytest.raises(Exception, match="probe failure injected"):
        ppo_fabric.run([*SMALL, "logger=mlflow", *logger, "env.id=tests.failing_env:FailingCartPole-v0",
                        "+env.kwargs.fail_rank=0", "+env.kwargs.fail_after=70", f"hydra.run.dir={run_dir}"])  # fmt: skip
    client, run = mlflow_run(shared_store, run_dir)
    assert run.info.status == "FAILED"
    history = client.get_metric_history(run.info.run_id, "loss/value")
    steps = [s for s, _ in csv_series(run_dir, "loss/value")]
    assert [m.step for m in history] == steps and steps, steps


def test_a_tracker_that_cannot_start_ends_the_run_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that is not there: a RunFault of one line before anything trains (the command line prints
    it and exits 1), after bounded waits (MLflow's own retry a call for minutes; the user's setting, here
    no retries at all, wins over the run's bounds)."""
    from ppo_fabric.config.faults import RunFault
    from ppo_fabric.runs.trackers import MlflowTracker

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    run_dir = tmp_path / "r"
    with pytest.raises(
        RunFault, match=r"^logger.tracker=mlflow could not start its run \(MlflowException"
    ) as info:
        ppo_fabric.run(
            [*SMALL, "logger=mlflow", "logger.tracking_uri=http://127.0.0.1:9", f"hydra.run.dir={run_dir}"]
        )
    assert "\n" not in str(info.value) and "Connection refused" in str(info.value)
    assert not (run_dir / "metrics.csv").exists()
    cfg = OmegaConf.create({"logger": {"tracker": "mlflow", "tracking_uri": "http://127.0.0.1:9"}})
    with pytest.raises(Exception, match="Connection refused"):
        MlflowTracker(cfg, tmp_path, {})
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0"  # the user's
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "20"  # the run's bound


class FailingTracker:
    def __init__(self) -> None:
        self.rows = 0

    def log(self, metrics: Any, step: int) -> None:
        self.rows += 1
        if self.rows == 2:
            raise ConnectionError("server gone")

    def close(self, run_dir: Path, summary: Any, exit_code: int) -> None:
        raise AssertionError("a dropped tracker is not closed")


def test_a_failing_tracker_is_dropped_with_a_warning_and_the_run_goes_on(tmp_path: Path) -> None:
    cfg = OmegaConf.create({"logger": {"tensorboard": False, "csv": True, "tracker": None}})
    logger = RunLogger(tmp_path, cfg, total_steps=30, enabled=True)
    logger.tracker = tracker = FailingTracker()
    logger.log({"loss/value": 1.0}, 10)
    with pytest.warns(UserWarning, match=r"FailingTracker failed \(ConnectionError: server gone\)"):
        logger.log({"loss/value": 2.0}, 20)
    logger.log({"loss/value": 3.0}, 30)
    logger.close({"total_env_steps": 30})
    assert tracker.rows == 2 and logger.tracker is None
    assert csv_series(tmp_path, "loss/value") == [(10, 1.0), (20, 2.0), (30, 3.0)]


# ---------------------------------------------------------------------------------------------- W&B
def wandb_records(path: Path) -> Iterator[Any]:
    """The records of a `.wandb` run file: W&B's header, then LevelDB-log blocks of 32 KiB whose chunks
    (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) hold `wandb_internal_pb2.Record`s."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, _magic, _version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B"
    pos, block, chunks = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:  # zero padding at a block's end
            pos += left
            continue
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def history(records: Iterable[Any]) -> list[dict[str, Any]]:
    """The logged rows of a run file's history records."""
    return [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]


@pytest.mark.slow
def test_wandb_offline_run_holds_config_metrics_and_files(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "w0"
    summary = ppo_fabric.run([*SMALL, "logger=wandb", "group=study-1", f"hydra.run.dir={run_dir}"])
    run_id = json.loads((run_dir / IDS_FILE).read_text())["wandb"]["id"]
    (offline,) = (run_dir / "wandb").glob(f"offline-run-*-{run_id}")  # auto without credentials: offline
    records = list(wandb_records(offline / f"run-{run_id}.wandb"))
    kinds = [r.WhichOneof("record_type") for r in records]

    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.run_group == "study-1" and run.display_name == "w0" and run.project == "ppo-fabric"
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["algo.lr"] == 0.001 and config["env.id"] == "CartPole-v1" and config["group"] == "study-1"

    rows = history(records)
    assert [row["env_step"] for row in rows if "loss/value" in row] == STEPS
    for key in ("loss/value", "rollout/episode_return", "time/sps"):
        logged = [(row["env_step"], row[key]) for row in rows if key in row]
        assert_same_series(logged, csv_series(run_dir, key), key)
    # the evaluations during training, rows of their own at the env step they scored, as evaluations.csv
    evaluations = read_rows(run_dir / "evaluations.csv")
    logged = [(row["env_step"], row["eval/return_mean"]) for row in rows if "eval/return_mean" in row]
    assert logged and len(logged) == len(evaluations)
    assert_same_series(logged, csv_series(run_dir, "eval/return_mean", "evaluations.csv"), "eval")

    saved = {f.path for r in records if r.WhichOneof("record_type") == "files" for f in r.files.files}
    assert saved >= {"config.yaml", "learning_curve.png", "summary.json"}
    assert json.loads((offline / "files" / "summary.json").read_text()) == summary
    final = {
        u.key or "/".join(u.nested_key): u.value_json
        for r in records
        if r.WhichOneof("record_type") == "summary"
        for u in r.summary.update
    }
    assert json.loads(final["summary/final_mean_return"]) == pytest.approx(summary["final_mean_return"])
    assert "exit" in kinds

    # continued in the same run dir: the same W&B run id (a second offline file that `wandb sync` adds
    # to it), logging from the checkpoint's env step on
    ppo_fabric.run(
        [*SMALL, "logger=wandb", "resume=auto", "algo.total_steps=768", f"hydra.run.dir={run_dir}"]
    )
    assert json.loads((run_dir / IDS_FILE).read_text())["wandb"]["id"] == run_id
    second = [p for p in (run_dir / "wandb").glob(f"offline-run-*-{run_id}") if p != offline]
    assert len(second) == 1
    rows = history(wandb_records(second[0] / f"run-{run_id}.wandb"))
    steps = [row["env_step"] for row in rows if "loss/value" in row]
    assert steps == [640, 768]


def test_wandb_mode_auto_is_online_only_with_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = OmegaConf.create({"logger": {"tracker": "wandb", "mode": "auto"}})
    assert wandb_mode(cfg) == "offline"
    netrc_file = tmp_path / "netrc"
    netrc_file.write_text("machine api.wandb.ai\n  login user\n  password abc123\n")
    monkeypatch.setenv("NETRC", str(netrc_file))
    assert wandb_mode(cfg) == "online"  # what `wandb login` leaves
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    assert wandb_mode(cfg) == "offline"  # a key for another server
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode(cfg) == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode(cfg) is None  # wandb reads WANDB_MODE itself
    monkeypatch.delenv("WANDB_MODE")
    assert wandb_mode(OmegaConf.create({"logger": {"mode": "offline"}})) == "offline"


# --------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("tracker", ["mlflow", "wandb"])
def test_missing_extra_is_one_line_before_anything_starts(
    tracker: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, tracker, None)  # `import mlflow` now raises ImportError
    run_dir = tmp_path / "never"
    assert_cli_failure(
        capsys,
        cli.main,
        [f"logger={tracker}", f"hydra.run.dir={run_dir}"],
        f"pip install 'ppo-fabric[{tracker}]'",
    )
    assert not run_dir.exists()
    with pytest.raises(ConfigError, match=rf"logger={tracker} needs the {tracker} package"):
        ppo_fabric.run([f"logger={tracker}", f"hydra.run.dir={run_dir}"])


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("logger.tracker=comet", "logger.tracker='comet' is not one of mlflow, wandb"),
        ("logger.mode=sometimes", "logger.mode='sometimes' is not one of auto, online, offline, disabled"),
        ("logger.mode=online", "logger=wandb is online but no W&B API key is configured"),
    ],
)
def test_bad_tracker_keys(override: str, fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    base = "logger=wandb" if "mode" in override else "logger=default"
    assert_cli_failure(capsys, cli.main, [base, override], fragment)
