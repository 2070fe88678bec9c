"""Hydra's own command line for `python -m ppo_fabric`: multirun through our launcher (each job a process of
its own: 2-process jobs, a failing job, Ctrl+C on a 1-process job), the sweep table, `--cfg`, `--help`, a user's own
primary config, `-m` refused under `fabric run`, and relative `resume=` paths (the working directory stays).

Every job is a process of its own and costs seconds of imports, so sweeps are few and tiny; the checks that
need no job run in this process.
"""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ppo_fabric import cli
from ppo_fabric.app.supervisor import SUPERVISED_ENV
from tests.conftest import assert_cli_failure, job_env, signal_when_ready

TINY = ["algo.total_steps=512", "logger.tensorboard=false", "logger.plot=false"]


def _python_m(args: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ppo_fabric", *args],
        cwd=cwd,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _table(sweep_dir: Path) -> list[dict[str, str]]:
    with (sweep_dir / "sweep.csv").open(newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.mark.multiprocess
def test_multirun_jobs_are_processes_of_their_own_and_a_failure_is_recorded(tmp_path: Path) -> None:
    """Two 2-process jobs, two at a time (a 2-process job inside the sweep's process would have every rank
    re-run the whole sweep). The first trains; in the second rank 1's env raises after 300 steps of each
    copy (update 10 of 16): the table says which failed, the other still has its summary, the sweep's status
    says one failed, and each job's output is in its job.log. Each job belongs to the sweep's group. The
    sweep's directory has a space and parentheses (`proj (1)`), which the jobs' overrides must quote."""
    sweep_dir = tmp_path / "sweep (1)"
    args = [
        "-m", "env.id=CartPole-v1,tests.failing_env:FailingCartPole-v0", "fabric.devices=2",
        "hydra.launcher.n_jobs=2", "algo.total_steps=8192", "algo.update_epochs=1", "logger.tensorboard=false",
        "logger.plot=false",
        f"hydra.sweep.dir='{sweep_dir}'",
    ]  # fmt: skip
    proc = _python_m(args, tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    summary = json.loads((sweep_dir / "0" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["total_env_steps"] == 8192, summary
    saved = yaml.safe_load((sweep_dir / "0" / "config.yaml").read_text())
    assert saved["group"] == "sweep (1)", "each job belongs to the sweep named by its directory"
    rows = _table(sweep_dir)
    assert [(r["job"], r["status"]) for r in rows] == [("0", "ok"), ("1", "failed (exit 1)")], rows
    assert rows[0]["overrides"].startswith("env.id=CartPole-v1 fabric.devices=2")
    assert "FailingCartPole-v0" in rows[1]["overrides"]
    assert float(rows[0]["final_mean_return"]) == pytest.approx(summary["final_mean_return"], abs=0.01)
    assert float(rows[0]["sps"]) == pytest.approx(summary["sps"], abs=1)
    assert float(rows[0]["wall_s"]) > 0 and rows[1]["final_mean_return"] == ""
    assert "probe failure injected" in (sweep_dir / "1" / "job.log").read_text()
    assert "job 1 (" in proc.stderr and "failed (exit 1)" in proc.stderr
    markdown = (sweep_dir / "sweep.md").read_text()
    assert markdown.count("| ok |") == 1 and "| failed (exit 1) |" in markdown
    assert proc.stdout.count("| 0 | env.id=CartPole-v1") == 1, "the table is printed once"
    assert not (tmp_path / "runs").exists() and not (tmp_path / "multirun").exists()


@pytest.mark.multiprocess
def test_sigint_stops_the_running_job_and_ends_the_sweep_with_130(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    args = [
        "-m",
        "seed=1,2",
        "algo.total_steps=10000000",
        "logger.tensorboard=false",
        "logger.plot=false",
        "logger.log_every=1",
    ]
    sweep = subprocess.Popen(
        [sys.executable, "-m", "ppo_fabric", *args, f"hydra.sweep.dir={sweep_dir}"],
        cwd=tmp_path,
        env=job_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, err = signal_when_ready(sweep, (sweep_dir / "0" / "metrics.csv").exists, signal.SIGINT)
    assert sweep.returncode == 130, err[-3000:]
    assert err.splitlines()[-1] == (
        f"ppo-fabric: the sweep stopped on SIGINT; the same command with resume=auto hydra.sweep.dir={sweep_dir} "
        "continues it"
    ), err[-3000:]
    rows = _table(sweep_dir)
    assert [r["status"] for r in rows] == ["stopped (exit 130)", "not started"], rows
    assert (sweep_dir / "0" / "checkpoints" / "last.ckpt").is_file(), "the stopped job saved its checkpoint"
    assert not (sweep_dir / "1").exists()


def test_cfg_job_prints_the_composed_config_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--cfg", "job", "seed=5", "env=pendulum"]) == 0
    out = capsys.readouterr().out
    cfg = yaml.safe_load(out)
    assert cfg["seed"] == 5 and cfg["env"]["id"] == "Pendulum-v1" and "hydra" not in cfg
    assert out.count("\nseed: 5\n") == 1


def test_cfg_job_of_a_resume_prints_the_config_the_run_continues(
    tiny_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A resume continues its checkpoint's config with what the command line changes: `--cfg job` shows
    that one (it printed the command line's defaults, another experiment than the one that would run)."""
    from ppo_fabric.runs import checkpoint as ckpt

    state = ckpt.load(tiny_run / "checkpoints" / "last.ckpt", env_state="fresh")
    state["config"]["algo"]["lr"] = 0.00123  # the run's own, not conf/'s default
    path = tmp_path / "run" / "checkpoints" / "last.ckpt"
    path.parent.mkdir(parents=True)
    path.write_bytes(ckpt.encode(state))
    assert cli.main(["--cfg", "job", f"resume={path}", "algo.total_steps=2048"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["algo"]["lr"] == 0.00123 and cfg["algo"]["total_steps"] == 2048
    assert cfg["resume"] == str(path)
    # --package shows that node of it; --cfg all or hydra would show the command line's: refused
    assert cli.main(["--cfg", "job", "-p", "algo", f"resume={path}"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# @package algo\n") and yaml.safe_load(out)["lr"] == 0.00123
    with pytest.raises(SystemExit) as exc:
        cli.main(["--cfg", "all", f"resume={path}"])
    assert (
        exc.value.code == 2
        and "--cfg job shows the config the resumed run continues" in capsys.readouterr().err
    )


def test_cfg_prints_on_rank_0_only_under_fabric_run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LT_CLI_USED", "1")
    monkeypatch.setenv("RANK", "1")
    assert cli.main(["--cfg", "job"]) == 0
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    assert cli.main(["--cfg", "job"]) == 0
    assert capsys.readouterr().out.count("\nseed: 42\n") == 1


@pytest.mark.multiprocess
def test_help_lists_our_groups_and_common_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for text in (
        "env: atari, cartpole",
        "model: cnn, grid, lstm, mlp",
        "fabric.devices=2",
        "resume=auto",
        "-m seed=",
        "my.module:MyEnv-v0, or\n",  # env.id's three forms, the callable's on the next line
        "my_pkg.my_module:make_env",
    ):
        assert text in out, out
    assert "--multirun,-m" in out, "Hydra's own flags are listed"


def test_multirun_under_fabric_run_is_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LT_CLI_USED", "1")
    assert_cli_failure(capsys, cli.main, ["-m", "seed=1,2"], "-m/--multirun cannot run under fabric run")


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        pytest.param(["-m", "env=nosuch", "seed=1,2"], "env=nosuch: unknown option", id="shared-override"),
        pytest.param(
            ["-m", "env.id=CartPole-v1,Nope-v1"], "job 1 (env.id=Nope-v1): env.id='Nope-v1'", id="job"
        ),
        pytest.param(["--cfg", "job", "algo.nosuch=1"], "algo.nosuch: unknown config key", id="cfg"),
        pytest.param(["--nosuch"], "unrecognized arguments: --nosuch", id="flag"),
        pytest.param(  # Hydra's own check raised a traceback, exit 1
            ["-m", "--cfg", "job", "seed=1,2"],
            "--multirun and --cfg cannot be given together",
            id="two-modes",
        ),
        pytest.param(["-m", "hydra.launcher.n_jobs=0", "seed=1,2"], "n_jobs=0 must be >= 1", id="n_jobs"),
        pytest.param(  # a value Hydra's sweeper cannot compose: its own many-line error and exit 1 before
            ["-m", "seed=1,2", "model=mlp,nosuch"],
            "job 1 (seed=1 model=nosuch): model=nosuch: unknown option",
            id="sweep-value",
        ),
        pytest.param(
            ["-m", "algo.nosuch=1,2"],
            "job 0 (algo.nosuch=1): algo.nosuch: unknown config key",
            id="sweep-key",
        ),
    ],
)
def test_mistakes_are_one_line_before_any_job_starts(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """No job starts, and no directory is left (a job's refusal left the sweep's, with Hydra's
    multirun.yaml in it)."""
    sweep_dir = tmp_path / "sweep"
    assert_cli_failure(capsys, cli.main, [*argv, f"hydra.sweep.dir={sweep_dir}"], fragment)
    assert not sweep_dir.exists(), list(sweep_dir.iterdir())


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["env=mine", "algo.lrr=1"], "algo.lrr: unknown config key"),
        (
            ["env=lunarlandr"],
            "env=lunarlandr: unknown option for config group 'env'; available: atari, cartpole",
        ),
        (["env=mine", "algo.lr=abc"], "algo.lr='abc' must be a finite number"),
        (["env=broken"], "broken.yaml, line 4, column 1: YAML syntax"),
    ],
    ids=["unknown-key", "unknown-option", "bad-value", "yaml-syntax"],
)
def test_a_config_dir_runs_mistakes_are_one_line_before_any_directory(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`--config-dir DIR` (an env option of the user's own): Hydra's multi-line errors with exit 1, a YAML
    traceback, or an empty run directory came instead of the one line the other paths give."""
    (tmp_path / "conf" / "env").mkdir(parents=True)
    (tmp_path / "conf" / "env" / "mine.yaml").write_text("defaults:\n  - gym\n  - _self_\nid: Acrobot-v1\n")
    (tmp_path / "conf" / "env" / "broken.yaml").write_text("defaults:\n  - gym\nid: [Acrobot-v1\n")
    run_dir = tmp_path / "run"
    argv = ["--config-dir", str(tmp_path / "conf"), *argv, f"hydra.run.dir={run_dir}"]
    assert_cli_failure(capsys, cli.main, argv, fragment)
    assert not run_dir.exists()


@pytest.mark.slow  # seconds in process (a run, or every option composed): not the unit tier
def test_user_config_dir_and_relative_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A user's own primary config (`--config-path` relative to the working directory) that extends ours
    and picks options of our groups; then a relative `resume=` path: the working directory never changes.
    Run as a supervised job would (in this process), which is what every path's train(cfg) does."""
    (tmp_path / "myconf").mkdir()
    (tmp_path / "myconf" / "mine.yaml").write_text(
        "defaults:\n  - config\n  - override env: cartpole\n  - _self_\n"
        "algo:\n  total_steps: 512\nlogger:\n  tensorboard: false\n"
        "seed: 7\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(SUPERVISED_ENV, "1")
    flags = ["--config-path", "myconf", "--config-name", "mine"]
    assert cli.main([*flags, "hydra.run.dir=first"]) == 0
    first = json.loads((tmp_path / "first" / "summary.json").read_text())
    assert first["seed"] == 7 and first["total_env_steps"] == 512
    assert Path.cwd() == tmp_path
    assert (
        cli.main(
            [*flags, "hydra.run.dir=second", "algo.total_steps=1024", "resume=first/checkpoints/last.ckpt"]
        )
        == 0
    )
    second = json.loads((tmp_path / "second" / "summary.json").read_text())
    assert second["total_env_steps"] == 1024 and second["resumed_from"] == "first/checkpoints/last.ckpt"
    capsys.readouterr()


@pytest.mark.slow  # seconds in process (a run, or every option composed): not the unit tier
def test_other_launchers_stay_selectable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`hydra/launcher=basic` runs each job's task in the sweep's process (here as a supervised job would,
    training in-process): two job directories with their own seeds, and no table (that is our launcher's)."""
    monkeypatch.setenv(SUPERVISED_ENV, "1")
    argv = ["-m", "hydra/launcher=basic", "seed=3,4", *TINY, f"hydra.sweep.dir={tmp_path}"]
    assert cli.main(argv) == 0
    seeds = [json.loads((tmp_path / str(n) / "summary.json").read_text())["seed"] for n in (0, 1)]
    assert seeds == [3, 4]
    assert not (tmp_path / "sweep.csv").exists()
    # a failed job followed by one that finishes: the sweep's status is the failure's, not the last job's
    failing = ["-m", "hydra/launcher=basic", "env.id=tests.faulty_env:FaultyCartPole-v0",
               "+env.kwargs.fault=raise,none", *TINY, f"hydra.sweep.dir={tmp_path / 'failing'}"]  # fmt: skip
    assert cli.main(failing) == 1
    assert (tmp_path / "failing" / "1" / "summary.json").is_file(), "the job after the failure still ran"


@pytest.mark.multiprocess
def test_a_failed_job_leaves_the_later_batches_to_run(tmp_path: Path) -> None:
    """`hydra.sweeper.max_batch_size=1`: Hydra's sweeper runs a batch at a time, and a failed job used to
    end the sweep after its batch, the later jobs never started. They run; the sweep's status says one
    failed, in one line."""
    sweep_dir = tmp_path / "sweep"
    args = ["-m", "env.id=tests.faulty_env:FaultyCartPole-v0", "+env.kwargs.fault=raise,none",
            "hydra.sweeper.max_batch_size=1", *TINY, f"hydra.sweep.dir={sweep_dir}"]  # fmt: skip
    proc = _python_m(args, tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert [(r["job"], r["status"]) for r in _table(sweep_dir)] == [("0", "failed (exit 1)"), ("1", "ok")]
    assert "Traceback" not in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr
    (line,) = [
        ln for ln in proc.stderr.splitlines() if ln.endswith(f"failed (exit 1); see {sweep_dir / '0'}")
    ]
    assert line.startswith("ppo-fabric: job 0 (") and "+env.kwargs.fault=raise" in line


def test_a_finished_job_of_a_resumed_sweep_is_not_started_again(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """`-m ... resume=auto` whose job's run is complete: its row is its finished run's summary, and no process
    starts for it (one started, said "complete" a second time, and spent a process start on nothing)."""
    from omegaconf import OmegaConf

    from ppo_fabric.app.sweep import Job, Sweep

    (tmp_path / "summary.json").write_text('{"final_mean_return": 200.5, "sps": 4000}')
    job = Job(
        0, ["seed=1", "resume=auto"], ["seed=1"], tmp_path, OmegaConf.create({}), OmegaConf.create({}),
        complete="resume=auto: the run in R is complete (512 env steps >= algo.total_steps=512); nothing to do",
    )  # fmt: skip
    assert Sweep(n_jobs=1)._run([job]) is None
    assert capfd.readouterr().err == (
        "ppo-fabric: job 0 (seed=1 resume=auto): resume=auto: the run in R is complete (512 env steps >= "
        "algo.total_steps=512); nothing to do\n"
    )
    assert job.row()["final_mean_return"] == "200.50" and job.exit_code == 0
