"""app/prestart.py: the job's first process starts before the supervisor's checks, runs the command line
it is handed (not the one it was started with), and a refused command leaves none behind. (That a
supervised run's job is such a process: tests/app/test_supervisor.py's SIGTERM test.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ppo_fabric.app import prestart
from ppo_fabric.app.supervisor import job_environment
from ppo_fabric.config.values import OWN_RUN_DIR_ENV
from ppo_fabric.runs import lock
from tests.conftest import assert_cli_failure, job_env, job_processes


@pytest.fixture(autouse=True)
def _nothing_left_waiting() -> Iterator[None]:
    """A test that fails between `start` and `take` leaves no process, and no stale `_waiting` for the
    worker's next test."""
    yield
    prestart.discard()


RUN = ["logger=none", "env.num_envs=2", "algo.rollout_steps=64", "algo.minibatch_size=64", "algo.total_steps=128",
       "eval.every=0"]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "runs"),
    [
        (["algo.lr=1e-3", "hydra.run.dir=x"], True),
        (["-m", "seed=1,2"], False),
        (["--multirun", "seed=1,2"], False),
        (["--cfg", "job"], False),
        (["--cfg=job"], False),
        (["--help"], False),
        (["--info", "config"], False),
        (["-c", "job"], False),
        (["--config-dir", "/tmp/conf", "algo.lr=1e-3"], True),
        (["--multi", "seed=1,2"], False),  # Hydra's parser takes abbreviations
        (["--hel"], False),
        (["-cjob"], False),
        (["--inf"], False),
        (["hydra.mode=MULTIRUN", "seed=1,2"], False),
        (["--no-such-flag"], False),  # refused by the checks: nothing to start
    ],
)
def test_only_a_command_that_runs_a_job_starts_one_early(argv: list[str], runs: bool) -> None:
    assert prestart.runs_a_job(argv) is runs


@pytest.mark.multiprocess
def test_the_waiting_process_runs_the_command_line_it_is_handed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Started with a command line that cannot run, it runs the one handed over, in the environment
    handed over (the run directory it owns)."""
    monkeypatch.setattr(os, "environ", dict(job_env()))
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    prestart.start(["not_a_key=1"], job_environment())
    # before the handover it runs the supervisor's checks for it, in the environment the request carries
    # (with the waiting process's own it would take itself for a supervised job and skip the lock)
    ask = {"config_path": None, "config_name": "config", "env": dict(os.environ)}
    refused = prestart.ask({**ask, "overrides": ["env.id=CartPol-v1"]})
    assert refused is not None and "did you mean CartPole-v1" in refused["error"], refused
    with lock.acquire(run_dir):  # a live run's directory (this process holds it)
        held = prestart.ask({**ask, "overrides": [*RUN, f"hydra.run.dir={run_dir}"]})
    assert held is not None and str(os.getpid()) in held["error"], held
    answer = prestart.ask({**ask, "overrides": [*RUN, f"hydra.run.dir={run_dir}"]})
    assert answer is not None and answer["config"]["algo"]["total_steps"] == 128, answer
    env = job_environment() | {OWN_RUN_DIR_ENV: str(run_dir)}
    proc = prestart.take([*RUN, f"hydra.run.dir={run_dir}"], env)
    assert proc is not None and prestart.take([], env) is None, "handed over once"
    assert proc.wait(timeout=120) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["total_env_steps"] == 128


def _supervised(argv: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess[str], list[str], list[str]]:
    """`python -m ppo_fabric argv` with `-X importtime`: (the process, the modules the supervising process
    imported, the other lines of its stderr). The job's processes are started without the flag."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ppo_fabric", *argv],
        cwd=cwd, env=job_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = proc.stderr.splitlines()
    imports = [line.rsplit("|", 1)[-1].strip() for line in lines if line.startswith("import time:")]
    return proc, imports, [line for line in lines if not line.startswith("import time:")]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("algo.gamma=1.5", "algo.gamma"),  # a value: refused before the job's process is asked
        ("env.id=CartPol-v1", "did you mean CartPole-v1"),  # the env: the job's process finds it
    ],
)
def test_a_refused_command_leaves_no_waiting_process(tmp_path: Path, override: str, fragment: str) -> None:
    """`python -m ppo_fabric` with a value the checks refuse: one line, status 2, and the job's first
    process, started before the checks, is gone when the command returns. The supervising process never
    imports torch (`-X importtime` lists its imports alone: the job's processes are started without it):
    the checks that need it ran in the job's first process, which has it imported anyway."""
    run_dir = tmp_path / "run"
    proc, imports, said = _supervised([*RUN, override, f"hydra.run.dir={run_dir}"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(said) == 1 and said[0].startswith("ppo-fabric: error: ") and fragment in said[0], said
    assert "hydra" in imports and "torch" not in imports and "gymnasium" not in imports, (
        "the supervisor imported them"
    )
    assert not job_processes(run_dir), "the waiting process outlived the refused command"
    assert not run_dir.exists()


@pytest.mark.multiprocess
def test_an_env_stuck_in_the_checks_ends_the_command_in_one_line(tmp_path: Path) -> None:
    """The job's first process builds the env for its supervisor's checks; a constructor that never returns
    ends the command after `stall_timeout` with the one line of the checks' watchdog (said in that process;
    the supervisor adds none), status 1, no run directory and no process left."""
    run_dir = tmp_path / "run"
    argv = ["env.id=tests.faulty_env:FaultyCartPole-v0", "+env.kwargs.fault=hang_init", "stall_timeout=2"]
    proc = subprocess.run(
        [sys.executable, "-m", "ppo_fabric", *RUN, *argv, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=job_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "for the checks: no progress for 2 s" in lines[0], lines
    assert lines[0].startswith("ppo-fabric: error: building env.id="), lines
    assert not job_processes(run_dir) and not run_dir.exists()


@pytest.mark.multiprocess
def test_a_resume_is_supervised_without_torch(tmp_path: Path, tiny_run: Path) -> None:
    """A resume's supervisor keeps the restarts and timeouts of the run's own config, continued from its
    checkpoint: the job's first process read it for the checks and hands it back with its answer, so this
    supervisor does not import torch to read it again."""
    run_dir = tmp_path / "run"
    resume = tiny_run / "checkpoints" / "last.ckpt"
    argv = [f"resume={resume}", "algo.total_steps=1024", "logger.plot=false", f"hydra.run.dir={run_dir}"]
    proc, imports, _ = _supervised(argv, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "hydra" in imports and "torch" not in imports, "the supervisor imported torch"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["total_env_steps"], summary["resumed_from"]) == (1024, str(resume))


def test_checks_fall_back_to_this_process_when_the_waiting_one_cannot_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A waiting process that ended without answering (a failed import: status 1; killed; out of memory)
    is forgotten and the checks run here; one that answered it could not check, too. One that a check's
    stall timeout ended says so first (it printed why): the command ends with its status, said once."""
    from ppo_fabric.app import hydra_app
    from ppo_fabric.config.faults import FAULT_EXIT

    cases = [
        ("import os; os._exit(1)", None),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", None),
        ("import os, sys; os.write(int(sys.argv[1]), b'{\"unanswered\": true}\\n')", None),
        ("import os, sys; os.write(int(sys.argv[1]), b'{\"said\": true}\\n'); os._exit(1)", FAULT_EXIT),
    ]
    for code, ended in cases:
        gate_read, gate = os.pipe()
        answer, answer_write = os.pipe()
        proc = subprocess.Popen([sys.executable, "-c", code, str(answer_write)], pass_fds=(answer_write,))
        os.close(answer_write)  # the child's alone: gone with it
        monkeypatch.setattr(prestart, "_waiting", prestart.Waiting(proc, gate, answer))
        if ended is None:
            assert hydra_app._checked_by_the_job(["seed=1"], None, "config") is None, code
        else:
            with pytest.raises(SystemExit) as stopped:
                hydra_app._checked_by_the_job(["seed=1"], None, "config")
            assert stopped.value.code == ended
        prestart.discard()
        assert prestart._waiting is None and proc.poll() is not None, "forgotten and reaped"
        os.close(gate_read)


def test_a_mistaken_value_is_refused_before_the_job_is_asked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Values need no torch: the supervisor refuses them itself, at once, without waiting for the job's
    first process to import it (~3 s here, more on a GPU node)."""
    from ppo_fabric import cli

    def ask(request: dict[str, object]) -> None:
        raise AssertionError("asked the job's first process")

    monkeypatch.setattr(prestart, "ask", ask)
    monkeypatch.chdir(tmp_path)
    assert_cli_failure(capsys, cli.main, ["algo.gamma=1.5"], "algo.gamma")


@pytest.mark.multiprocess
def test_a_discarded_process_is_gone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "environ", dict(job_env()))
    prestart.start([*RUN, f"hydra.run.dir={tmp_path / 'run'}"], job_environment())
    assert job_processes(tmp_path / "run"), "started"
    prestart.discard()
    assert not job_processes(tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_the_handover_keeps_what_the_process_set_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """The handed environment replaces the one the process started with, but what its imports set for
    themselves stays (Lightning's NVML switch), as in a job started after the checks."""
    inherited = {"KEPT": "old", "GONE": "1", "PATH": "/bin"}
    environ = {**inherited, "SET_BY_AN_IMPORT": "1"}
    monkeypatch.setattr(os, "environ", environ)
    monkeypatch.setattr(sys, "argv", ["ppo_fabric", "not_a_key=1"])
    read, write = os.pipe()
    os.write(write, json.dumps({"argv": ["seed=3"], "env": {"KEPT": "new", "PATH": "/usr/bin"}}).encode())
    os.close(write)
    prestart.await_handover(read, inherited)
    assert environ == {"KEPT": "new", "PATH": "/usr/bin", "SET_BY_AN_IMPORT": "1"}
    assert sys.argv == ["ppo_fabric", "seed=3"]


def test_the_run_s_imports_wait_for_checks_that_let_it_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """The waiting process imports Lightning and the strategies (`accepted`) only once its answer lets
    the run start, and after sending it: a refused command never pays for them, and an accepted one's
    supervisor goes on while they import."""
    monkeypatch.setattr(os, "environ", {"PATH": "/bin"})
    monkeypatch.setattr(sys, "argv", ["ppo_fabric"])
    read, write = os.pipe()
    answer_read, answer_write = os.pipe()
    for overrides in (["env.id=CartPol-v1"], ["seed=3"]):
        os.write(write, json.dumps({"check": {"overrides": overrides}}).encode() + b"\n")
    os.write(write, json.dumps({"argv": ["seed=3"], "env": {"PATH": "/bin"}}).encode() + b"\n")
    os.close(write)
    sent: list[list[str]] = []

    def check(request: dict) -> dict:
        return {"error": "no such env"} if request["overrides"] == ["env.id=CartPol-v1"] else {"config": {}}

    def accepted() -> None:
        sent.append(os.read(answer_read, 65536).decode().splitlines())

    prestart.await_handover(read, {"PATH": "/bin"}, answer_write, check, accepted)
    os.close(answer_read)
    assert sent == [['{"error": "no such env"}', '{"config": {}}']], "called once, after the accepting answer"
    assert sys.argv == ["ppo_fabric", "seed=3"]


def test_a_handover_larger_than_the_pipe_grows_it_or_starts_the_job_the_usual_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The handover is written while the process may still be importing: a message the pipe cannot hold
    would block the supervisor (and the signals it forwards) until the reader comes."""
    read, write = os.pipe()
    try:
        assert prestart._fits(write, 200_000), "grown past Linux's 64 KiB default"
        assert not prestart._fits(write, 1 << 40)
    finally:
        os.close(read)
        os.close(write)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    read, write = os.pipe()
    os.close(read)
    prestart._waiting = prestart.Waiting(proc, write)
    monkeypatch.setattr(prestart, "_fits", lambda fd, size: False)  # a pipe that cannot grow enough
    assert prestart.take([], {}) is None
    assert proc.poll() is not None, "the waiting process is killed, the job starts the usual way"
