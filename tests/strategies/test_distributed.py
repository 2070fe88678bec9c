"""Real multi-process runs on CPU (gloo): both launch paths, one run directory, identical parameters,
and a failing or killed rank ending the whole job quickly instead of hanging."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import ppo_fabric
from ppo_fabric.config.values import compose
from ppo_fabric.runs.metrics_file import read_rows
from tests.conftest import end_group, fabric_run_port, job_env, job_processes, signal_when_ready

REPO = Path(__file__).resolve().parents[2]
FABRIC = Path(sys.executable).parent / "fabric"
SMALL = [
    "algo.total_steps=4096",
    "logger.tensorboard=false",
    "logger.plot=false",
    "eval.every=0",
    "env.num_envs=4",
    "algo.rollout_steps=64",
]


def _env() -> dict[str, str]:
    return job_env()


def _run(
    cmd: list[str], cwd: Path, timeout: float = 120, supervisor: bool = True
) -> subprocess.CompletedProcess[str]:
    env = job_env(supervisor=supervisor)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _single_run_dir(cwd: Path) -> Path:
    """The default run dir is timestamped per process; rank 0's choice must be the only one used."""
    dirs = [p for p in (cwd / "runs").glob("*/*") if p.is_dir()]
    assert len(dirs) == 1, f"ranks wrote to several run directories: {dirs}"
    return dirs[0]


def _check_summary(run_dir: Path, world_size: int) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == world_size
    assert summary["strategy"] == "coupled"
    assert summary["total_env_steps"] == 4096
    assert summary["ranks_in_sync"] is True, "DDP ranks ended with different parameters"
    assert summary["episodes"] > 0 and summary["final_mean_return"] is not None
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert (run_dir / "metrics.csv").is_file() and (run_dir / "config.yaml").is_file()
    # the logged mean of the last 20 episodes is every rank's, as the summary's (it was rank 0's alone)
    last = [row for row in read_rows(run_dir / "metrics.csv") if row.get("rollout/return_mean20")][-1]
    assert float(last["rollout/return_mean20"]) == pytest.approx(summary["final_mean_return"], rel=1e-9)
    return summary


@pytest.mark.multiprocess
def test_python_m_launches_two_processes(tmp_path: Path) -> None:
    """The job launches its second rank (without the supervisor, whose part tests/app covers: then rank 0
    chooses the run directory, and rank 1 must use the same)."""
    proc = _run([sys.executable, "-m", "ppo_fabric", "fabric.devices=2", *SMALL], tmp_path, supervisor=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    _check_summary(_single_run_dir(tmp_path), 2)
    assert proc.stdout.count("ppo-fabric: coupled") == 1, "only rank 0 prints the summary line"


@pytest.mark.multiprocess
def test_the_python_api_runs_a_job_of_two_processes_without_running_the_script_again(tmp_path: Path) -> None:
    """`ppo_fabric.run([... "fabric.devices=2"])` from a script: Lightning started the second rank by running
    the script again (every `run()` before that call trained again; a notebook's kernel cannot be run
    again at all). The job runs as `python -m ppo_fabric` in a child process, its output this process's: a
    failure is raised as `RunFault` naming the rank's cause, the job imports the env factory's module
    beside the script, and a SIGTERM to the caller stops the job with its checkpoint (143, as a
    one-process run)."""
    (tmp_path / "scripts").mkdir()  # the env factory's module beside the script, not in the working directory
    (tmp_path / "scripts" / "my_envs.py").write_text(
        "import gymnasium as gym\n\ndef make():\n    return gym.make('CartPole-v1')\n"
    )
    script = tmp_path / "scripts" / "train.py"
    script.write_text(
        "import ppo_fabric\n"
        "import my_envs\n"
        "open('started.txt', 'a').write('x')\n"
        "try:\n"
        "    ppo_fabric.run(['fabric.devices=2', 'env.id=tests.faulty_env:FaultyCartPole-v0', "
        "'+env.kwargs.fault=raise', 'hydra.run.dir=bad', 'eval.every=0'])\n"
        "except ppo_fabric.RunFault as fault:\n"
        "    print('FAULT', fault, flush=True)\n"
        "ppo_fabric.run(['fabric.devices=2', 'algo.total_steps=10000000', 'hydra.run.dir=long', 'eval.every=0'], "
        "env=my_envs.make)\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    out, err = signal_when_ready(
        proc, lambda: bool(read_rows(tmp_path / "long" / "metrics.csv")), signal.SIGTERM
    )
    assert proc.returncode == 143, err[-2000:]
    assert (tmp_path / "started.txt").read_text() == "x", "the script ran again"
    (fault,) = [line for line in out.splitlines() if line.startswith("FAULT")]
    assert fault.startswith("FAULT rank ") and "env.step raised RuntimeError: simulator crashed" in fault, (
        fault
    )
    summary = json.loads((tmp_path / "long" / "summary.json").read_text())
    assert (summary["stop_signal"], summary["world_size"], summary["env_id"]) == (
        "SIGTERM",
        2,
        "my_envs:make",
    )
    assert (tmp_path / "long" / "checkpoints" / "last.ckpt").is_file() and not job_processes(
        tmp_path / "long"
    )


def test_the_python_api_returns_the_summary_of_the_job_it_ran(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the job of several processes ended with, as the in-process run gives it: its summary, or
    the exceptions a one-process run raises."""
    from ppo_fabric import cli
    from ppo_fabric.app import jobs

    ended: list[tuple[int, list[str]]] = []
    monkeypatch.setattr(jobs, "run_attached", lambda overrides, run_dir, out: ended.pop())
    (tmp_path / "summary.json").write_text('{"total_env_steps": 4096}')
    cfg = compose(["fabric.devices=2"])[0]
    ended.append((0, ["ppo-fabric: coupled CartPole-v1: 4096 steps"]))
    assert cli._run_processes(cfg, [], tmp_path) == {"total_env_steps": 4096}
    ended.append((2, ["ppo-fabric: error: algo.lr=0 must be > 0"]))
    with pytest.raises(ppo_fabric.ConfigError, match=r"^algo.lr=0 must be > 0$"):
        cli._run_processes(cfg, [], tmp_path)
    ended.append((1, ["ppo-fabric: error: rank 1: env.step raised X", "ppo-fabric: rank failure (exit 1)"]))
    with pytest.raises(ppo_fabric.RunFault, match=r"^rank 1: env.step raised X$"):
        cli._run_processes(cfg, [], tmp_path)
    ended.append((130, ["ppo-fabric: stopped by SIGINT"]))
    with pytest.raises(KeyboardInterrupt):
        cli._run_processes(cfg, [], tmp_path)


def test_the_python_api_runs_a_resume_of_several_processes_as_a_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """A resume's process count is the checkpoint's, known only once its checks restored the run's config:
    the run in this process stops there and the job runs as a child, with the caller's overrides."""
    from ppo_fabric import cli
    from ppo_fabric.app import launch

    def prepare(cfg: object, *_: object) -> dict:
        return {"world_size": 2}

    started: list[list[str]] = []
    monkeypatch.setattr(launch, "prepare", prepare)
    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("launched in this process"))
    monkeypatch.setattr(
        cli, "_run_processes", lambda cfg, overrides, run_dir: started.append(overrides) or {}
    )
    assert cli.run(["seed=5", "hydra.run.dir=unused"]) == {}
    assert len(started) == 1 and "seed=5" in started[0]


def test_the_python_api_is_not_the_hydra_apps_job_while_hydras_config_is_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ppo_fabric.run()` after a Hydra app ran in the process, whose global config Hydra leaves set: the
    run is still the Python API's, with its own run directory and
    overrides (it took the app's, and a resume of several processes trained in the calling process)."""
    from hydra.core.hydra_config import HydraConfig

    from ppo_fabric import cli
    from ppo_fabric.app import launch

    theirs = OmegaConf.create({"hydra": {"runtime": {"output_dir": str(tmp_path / "theirs")},
                                         "overrides": {"task": ["their=1"]}, "job": {"config_name": "app"}}})  # fmt: skip
    monkeypatch.setattr(HydraConfig.instance(), "cfg", theirs)
    seen: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(launch, "prepare", lambda cfg, run_dir, overrides, *_: seen.append((run_dir, overrides))
                        or {"world_size": 2})  # fmt: skip
    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("launched in this process"))
    monkeypatch.setattr(cli, "_run_processes", lambda cfg, overrides, run_dir: {"child": True})
    ours = str(tmp_path / "ours")
    assert cli.run(["seed=5", f"hydra.run.dir={ours}"]) == {"child": True}
    assert seen[0][0] == ours and "seed=5" in seen[0][1] and "their=1" not in seen[0][1]


def test_the_python_api_trains_inside_a_users_own_hydra_app(tmp_path: Path) -> None:
    """`ppo_fabric.run()` called inside a user's `@hydra.main` function, where Hydra is initialised with the
    app's own config: it raised "GlobalHydra is already initialized". It trains, and the app's Hydra is
    the app's again afterwards (its config still composes)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    (tmp_path / "app.yaml").write_text("lr_of_my_model: 0.5\n")
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        theirs = GlobalHydra.instance().hydra
        summary = ppo_fabric.run(
            ["env.num_envs=2", "algo.rollout_steps=64", "algo.minibatch_size=64", "algo.total_steps=256",
             "eval.every=0", "logger=none", f"hydra.run.dir={tmp_path / 'run'}"]
        )  # fmt: skip
        assert summary["total_env_steps"] == 256
        assert GlobalHydra.instance().hydra is theirs
        assert hydra_compose("app").lr_of_my_model == 0.5


@pytest.mark.multiprocess
def test_fabric_run_joins_existing_processes(tmp_path: Path) -> None:
    cmd = [
        str(FABRIC),
        "run",
        "--accelerator=cpu",
        "--devices=2",
        fabric_run_port(),
        str(REPO / "ppo_fabric" / "ppo.py"),
        *SMALL,
    ]
    proc = _run(cmd, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    _check_summary(_single_run_dir(tmp_path), 2)


@pytest.mark.multiprocess
def test_fabric_run_file_refuses_other_strategy(tmp_path: Path) -> None:
    cmd = [sys.executable, str(REPO / "ppo_fabric" / "ppo.py"), "strategy=decoupled", *SMALL]
    proc = _run(cmd, tmp_path, timeout=60)
    assert proc.returncode == 2
    assert "conflicts with the launched file" in proc.stderr


def test_a_strategy_file_resuming_the_other_strategys_run_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`fabric run ppo_fabric/ppo.py resume=<a decoupled run's checkpoint>`: the file's strategy was added
    as an override, and the refusal read as a change to the run's experiment (drop an override the user
    never typed). A resume is not given the file's strategy; the run's own, once restored, is checked."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from ppo_fabric.app import hydra_app, launch

    seen: dict = {}
    monkeypatch.setattr(
        hydra_app,
        "run_app",
        lambda args, task: seen.update(args=args, task=task) or SimpleNamespace(status=0),
    )
    monkeypatch.setattr(launch, "end_process", lambda code: None)
    for given, added in ((["seed=1"], True), (["resume=r/last.ckpt"], False), (["resume=auto"], True)):
        monkeypatch.setattr(sys, "argv", ["ppo.py", *given])
        launch.run_script("coupled", lambda *a: {})
        assert ("strategy=coupled" in seen["args"]) is added, seen["args"]
    monkeypatch.setattr(launch, "train", lambda cfg, strategy: strategy(cfg))
    with pytest.raises(SystemExit) as ended:
        seen["task"](OmegaConf.create({"strategy": "decoupled", "resume": "r/last.ckpt"}), None)
    assert ended.value.code == 2
    assert capsys.readouterr().err == (
        "ppo-fabric: error: resume=r/last.ckpt continues a strategy=decoupled run; launch "
        "ppo_fabric/ppo_decoupled.py\n"
    )


@pytest.mark.multiprocess
def test_failing_rank_ends_the_job(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "ppo_fabric", "fabric.devices=2", "env.id=tests.failing_env:FailingCartPole-v0",
        "algo.total_steps=100000", "logger=none", f"hydra.run.dir={tmp_path / 'run'}",
    ]  # fmt: skip
    start = time.monotonic()
    proc = _run(cmd, tmp_path, timeout=120, supervisor=False)  # the job's own error line
    assert proc.returncode != 0
    assert time.monotonic() - start < 60
    assert "error: rank 1: env.step raised RuntimeError: probe failure injected" in proc.stderr


@pytest.mark.multiprocess
def test_killed_launcher_leaves_no_orphans(tmp_path: Path) -> None:
    """SIGKILL on the command-line process (the supervisor): the job's first process dies with it, and the
    rank that one spawned must notice and exit, not wait forever."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "ppo_fabric", "fabric.devices=2", "algo.total_steps=10000000", "logger=none",
           f"hydra.run.dir={run_dir}"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while not (run_dir / "config.yaml").exists():  # training has started on rank 0
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the run never started"
            time.sleep(0.2)
        time.sleep(1.0)
        assert len(job_processes(run_dir)) == 3, "the supervisor and two ranks"
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 60
        while job_processes(run_dir):  # any process of the job still alive?
            if time.monotonic() > deadline:
                pytest.fail("a rank outlived the killed launcher by more than 60 s")
            time.sleep(0.2)
    finally:
        end_group(proc)
        for pid in job_processes(run_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.multiprocess
def test_cli_process_ends_without_waiting_for_exit_hooks(tmp_path: Path) -> None:
    """A finished run leaves its process at once, whatever exit hooks libraries registered (one of pygame's,
    imported by gymnasium's Box2D envs, once hung a finished rank at interpreter shutdown for good). The
    hook here would sleep for 10 minutes; the run must end well within the timeout, with its output."""
    hook = (
        "import atexit, runpy, time; atexit.register(time.sleep, 600); "
        "runpy.run_module('ppo_fabric', run_name='__main__')"
    )
    started = time.monotonic()
    proc = _run([sys.executable, "-c", hook, *SMALL], tmp_path, timeout=90)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ppo-fabric: coupled" in proc.stdout, "the summary line was flushed before the process ended"
    assert time.monotonic() - started < 90
    _check_summary(_single_run_dir(tmp_path), 1)
