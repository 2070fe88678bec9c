"""The supervisor of `python -m ppo_fabric`: a killed rank relaunched from the last checkpoint (coupled and
decoupled), a failure without restarts ending the whole job, SIGTERM forwarded to the job, and `resume=auto`.

Every process start costs seconds of imports on a small machine, so the runs are tiny CartPoles and the
failure runs use `collectives.timeout=20`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import ppo_fabric
from ppo_fabric import cli
from ppo_fabric.app import prestart, supervisor
from ppo_fabric.app.supervisor import last_logged_step, with_override
from ppo_fabric.config.faults import STOP_SIGNALS
from ppo_fabric.config.values import ConfigError
from ppo_fabric.runs.metrics_file import read_rows
from tests.conftest import assert_cli_failure, job_env, job_processes

SMALL = [
    "logger.tensorboard=false",
    "logger.plot=false",
    "eval.every=0",
    "env.num_envs=4",
    "algo.rollout_steps=32",
    "collectives.timeout=20",
]


def _python_m(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "ppo_fabric", *SMALL, *overrides, f"hydra.run.dir={run_dir}"]


def _killed_once(rank: int, after: int, marker: Path) -> list[str]:
    """Rank `rank` SIGKILLs itself after `after` steps of each env copy, on the first attempt only."""
    return [
        "env.id=tests.killing_env:KilledOnceCartPole-v0",
        f"+env.kwargs.kill_rank={rank}",
        f"+env.kwargs.kill_after={after}",
        f"+env.kwargs.marker={marker}",
    ]


def _run(cmd: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=job_env(), capture_output=True, text=True, timeout=timeout)


def _assert_nothing_left(run_dir: Path, within: float = 10) -> None:
    deadline = time.monotonic() + within
    while job_processes(run_dir):
        assert time.monotonic() < deadline, f"processes of the job outlived it: {job_processes(run_dir)}"
        time.sleep(0.1)


def _check_restarted_run(
    proc: subprocess.CompletedProcess[str], run_dir: Path, steps: int, interval: int
) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    restarts = [line for line in proc.stderr.splitlines() if "restart 1/1" in line]
    assert len(restarts) == 1 and "rank failure (exit" in restarts[0], proc.stderr[-3000:]
    assert "last.ckpt at " in restarts[0], restarts[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["total_env_steps"] == steps, (
        "the relaunched run ends by the same rule as an uninterrupted one"
    )
    assert summary["restarts"] == 1
    assert 0 < summary["env_steps_redone"] <= interval, summary["env_steps_redone"]
    _assert_nothing_left(run_dir)


@pytest.mark.multiprocess
def test_coupled_rank_killed_is_restarted_from_last_checkpoint(tmp_path: Path) -> None:
    """2 ranks x 4 envs x 32 steps = 256 env steps per update; a checkpoint every 2 updates (512 steps);
    rank 1 dies during the 6th update of 16."""
    run_dir = tmp_path / "run"
    cmd = _python_m(
        run_dir, "fabric.devices=2", "restarts=1", "checkpoint.every=2", "algo.total_steps=4096",
        *_killed_once(1, 5 * 32 + 5, tmp_path / "killed"),
    )  # fmt: skip
    proc = _run(cmd, tmp_path)
    assert (tmp_path / "killed").exists(), "rank 1 was never killed"
    _check_restarted_run(proc, run_dir, 4096, 512)


@pytest.mark.multiprocess
def test_decoupled_player_killed_is_restarted(tmp_path: Path) -> None:
    """The player is rank 0, the job's first process: the trainer is left behind and must be ended.
    4 envs x 32 steps = 128 env steps per update, a checkpoint every 256; `algo.pipeline=false` makes the
    player log update k before it collects rollout k+1, so the kill (in the 6th rollout) follows the row of
    update 5 and the checkpoint of update 4: 128 steps redone."""
    run_dir = tmp_path / "run"
    cmd = _python_m(
        run_dir, "strategy=decoupled", "fabric.devices=2", "algo.minibatch_size=64", "algo.update_epochs=2",
        "algo.pipeline=false", "restarts=1", "checkpoint.every=2", "algo.total_steps=2048",
        *_killed_once(0, 5 * 32 + 5, tmp_path / "killed"),
    )  # fmt: skip
    proc = _run(cmd, tmp_path)
    assert (tmp_path / "killed").exists(), "the player was never killed"
    _check_restarted_run(proc, run_dir, 2048, 2 * 128)


@pytest.mark.multiprocess
def test_a_branch_that_fails_before_its_first_checkpoint_restarts_on_its_branch(tmp_path: Path) -> None:
    """Resumed from an earlier checkpoint of its directory (a branch at 128 of a run that went on to 256),
    the job dies before it writes one: the restart takes the job's own `resume=`, not the directory's
    newest file, which is the other branch's."""
    run_dir, marker = tmp_path / "run", tmp_path / "killed"
    env = _killed_once(0, 40, marker)  # each env copy is at step 32 at 128 env steps: it dies in update 2
    marker.touch()  # disarmed for the first run
    ppo_fabric.run([*SMALL, *env, "checkpoint.every=1", "algo.total_steps=256", "eval.every=0",
                    f"hydra.run.dir={run_dir}"])  # fmt: skip
    (branch,) = [p for p in (run_dir / "checkpoints").glob("step_*.ckpt") if "_000000000128_" in p.name]
    marker.unlink()
    proc = _run(_python_m(run_dir, *env, "checkpoint.every=1", "algo.total_steps=512", "eval.every=0",
                          "restarts=1", f"resume={branch}"), tmp_path)  # fmt: skip
    assert proc.returncode == 0 and marker.exists(), proc.stderr[-3000:]
    restarts = [line for line in proc.stderr.splitlines() if "restart 1/1" in line]
    assert restarts == [
        "ppo-fabric: rank failure (exit 137); restart 1/1 as it started (it wrote no checkpoint yet)"
    ]
    steps = [int(float(row["step"])) for row in read_rows(run_dir / "metrics.csv")]
    assert steps == [128, 256, 384, 512], steps  # the branch's rows; the other one's 256 is gone
    # nothing past the branch's 128 was trained twice (counted from 0, the whole history was "redone")
    assert json.loads((run_dir / "summary.json").read_text())["env_steps_redone"] == 0


@pytest.mark.multiprocess
def test_a_restart_before_any_checkpoint_replaces_the_dead_attempts_records(tmp_path: Path) -> None:
    """Killed in its 4th update with no checkpoint written (checkpoint.every=0), the job restarts as it
    started in the same directory: metrics.csv must hold the new attempt's rows only, not the dead
    attempt's 128..384 followed by 128..1024 again."""
    run_dir = tmp_path / "run"
    cmd = _python_m(
        run_dir, "restarts=1", "checkpoint.every=0", "eval.every=0", "algo.total_steps=1024",
        *_killed_once(0, 3 * 32 + 5, tmp_path / "killed"),
    )  # fmt: skip
    proc = _run(cmd, tmp_path)
    assert proc.returncode == 0 and (tmp_path / "killed").exists(), proc.stderr[-3000:]
    assert "restart 1/1 as it started (it wrote no checkpoint yet)" in proc.stderr
    assert f"ppo-fabric: {run_dir} holds the records of an attempt that wrote no checkpoint" in proc.stderr
    steps = [int(float(row["step"])) for row in read_rows(run_dir / "metrics.csv")]
    assert steps == [128 * k for k in range(1, 9)], steps
    assert json.loads((run_dir / "summary.json").read_text())["env_steps_redone"] == 3 * 128


@pytest.mark.multiprocess
@pytest.mark.parametrize("rank", [0, 1])
def test_without_restarts_a_killed_rank_ends_the_job(tmp_path: Path, rank: int) -> None:
    """Rank 0 (the job's first process) dies: its orphaned rank 1 must not wait out the collectives. Rank 1
    dies: rank 0, its parent, names it and ends 137 as it did (it said "rank 0: lost contact with another
    rank", as if the fault were its own, and the job ended 1)."""
    run_dir = tmp_path / "run"
    cmd = _python_m(
        run_dir, "fabric.devices=2", "algo.total_steps=100000", *_killed_once(rank, 40, tmp_path / "killed")
    )
    started = time.monotonic()
    proc = _run(cmd, tmp_path, timeout=90)
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "not restarting" in line]
    assert lines == ["ppo-fabric: rank failure (exit 137); not restarting (restarts=0)"], proc.stderr[-3000:]
    if rank == 1:
        errors = [line for line in proc.stderr.splitlines() if "error:" in line]
        named = (
            "rank 1 was killed by SIGKILL (the out-of-memory killer, or kill -9); rank 0 lost contact with it"
        )
        assert errors == [f"ppo-fabric: error: {named}"], proc.stderr[-3000:]
    assert time.monotonic() - started < 60, "the orphaned rank was left to time out"
    _assert_nothing_left(run_dir, within=1)


@pytest.mark.multiprocess
def test_sigterm_is_forwarded_to_the_job(tmp_path: Path) -> None:
    """SIGTERM to the supervisor alone reaches the job's processes; no restart follows a signal stop and
    nothing is left. (Which status the ranks end with is theirs to decide.)"""
    run_dir = tmp_path / "run"
    cmd = _python_m(run_dir, "fabric.devices=2", "algo.total_steps=10000000", "restarts=1", "logger=none")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=job_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (run_dir / "config.yaml").exists() or len(job_processes(run_dir)) < 3:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the run never started"
            time.sleep(0.2)
        first = _first_job_process(proc.pid, run_dir)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "restart" not in err, err
    # the job's first process was started before the checks (app/prestart.py) and handed the command line
    assert f"{prestart.GATE_ENV}=".encode() in first, "the job was started after the checks"
    _assert_nothing_left(run_dir, within=1)


# The command under a pseudo-terminal that closes once training has begun, as a closed terminal window or a
# dropped ssh session ends it: the kernel sends SIGHUP, and every later write to the terminal fails (EIO).
HANGUP = """
import os, pty, select, sys, time
run_dir, cmd = sys.argv[1], sys.argv[2:]
pid, fd = pty.fork()
if pid == 0:
    os.execv(cmd[0], cmd)
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(run_dir, "metrics.csv")) and time.monotonic() < deadline:
    if select.select([fd], [], [], 0.2)[0]:
        try:
            os.read(fd, 65536)
        except OSError:
            break
os.close(fd)
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


@pytest.mark.multiprocess
def test_a_closed_terminal_stops_the_run_with_its_checkpoint(tmp_path: Path) -> None:
    """The terminal a run was started in closes (SIGHUP): the run stops at its next update boundary with
    its checkpoint and ends with 129, its lock released. SIGHUP's default action ended the command at once
    (no checkpoint, a stale lock); handled but left writing to the dead terminal, the stop failed (exit 1)
    on its first line."""
    run_dir = tmp_path / "run"
    cmd = _python_m(
        run_dir, "algo.minibatch_size=64", "algo.total_steps=10000000", "logger=none", "logger.csv=true"
    )
    proc = subprocess.run([sys.executable, "-c", HANGUP, str(run_dir), *cmd], cwd=tmp_path, env=job_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.stdout.strip() == str(128 + signal.SIGHUP), proc.stdout + proc.stderr
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert json.loads((run_dir / "summary.json").read_text())["interrupted"] is True
    assert not (run_dir / "ppo-fabric.lock").exists()
    _assert_nothing_left(run_dir, within=1)


@pytest.mark.multiprocess
@pytest.mark.parametrize("signum", [signal.SIGUSR1])
def test_a_schedulers_warning_signal_stops_the_job_with_its_checkpoint(tmp_path: Path, signum: int) -> None:
    """SLURM's `--signal=USR1@90` (or USR2) to the command: the job stops at its next update boundary with
    its checkpoint, says how to continue, ends with 128 + N and is not restarted. The signal's default
    action killed the command, whose job died with it: no line, no checkpoint, a stale lock."""
    run_dir = tmp_path / "run"
    cmd = _python_m(
        run_dir,
        "algo.minibatch_size=64",
        "algo.total_steps=10000000",
        "restarts=1",
        "logger=none",
        "logger.csv=true",
    )
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=job_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (run_dir / "metrics.csv").exists():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the run never started"
            time.sleep(0.2)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signum, err
    name = signal.Signals(signum).name
    last = run_dir / "checkpoints" / "last.ckpt"
    assert f"ppo-fabric: stopped by {name} at " in err and f"continue with resume={last}" in err, err
    assert "restart" not in err.replace("resume=", ""), err
    assert last.is_file() and not (run_dir / "ppo-fabric.lock").exists()
    _assert_nothing_left(run_dir, within=1)


@pytest.mark.multiprocess
def test_a_signal_during_start_up_ends_the_command_in_one_line(tmp_path: Path) -> None:
    """SIGTERM while the command is still starting (its checks import torch and build the env): one line
    and 143, where it ended without a word (and Ctrl+C printed a KeyboardInterrupt traceback)."""
    proc = subprocess.Popen(_python_m(tmp_path / "run", "algo.total_steps=100000", "algo.minibatch_size=64"),
                            cwd=tmp_path, env=job_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not _catches(proc.pid, signal.SIGTERM):  # the start-up handler is in place
            assert proc.poll() is None and time.monotonic() < deadline, "it never caught SIGTERM"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    assert err.strip().splitlines() == [
        "ppo-fabric: stopped by SIGTERM during start-up, before training began"
    ]
    assert not (tmp_path / "run" / "checkpoints").exists()


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler of its own for `signum` (SigCgt in /proc/<pid>/status)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def test_the_same_stop_signal_twice_is_one_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """A cluster signals every process and a sweep (or the tuner) forwards the same signal to each job's
    supervisor: one request arriving twice within seconds must reach the job once, not SIGKILL it and lose
    its stop checkpoint. Another signal still kills it at once, with a line."""
    from ppo_fabric.app import supervisor

    monkeypatch.setattr(supervisor.signal, "signal", lambda *_args: None)  # not this test process's handlers
    monkeypatch.setattr(supervisor, "prctl", lambda *_args: None)
    job = supervisor.Job(tmp_path, 10.0)
    sent: list[int] = []
    monkeypatch.setattr(job, "_kill_group", sent.append)
    job.proc = object()  # type: ignore[assignment]  # stands for the running job
    job._on_signal(signal.SIGTERM, None)  # noqa: SLF001
    job._on_signal(signal.SIGTERM, None)  # noqa: SLF001
    assert sent == [signal.SIGTERM]
    job._on_signal(signal.SIGINT, None)  # noqa: SLF001
    assert sent == [signal.SIGTERM, signal.SIGKILL]
    # with no checkpoint written yet it said the checkpoints "stay as it last wrote them": there were none
    assert capfd.readouterr().err.endswith(
        "a second stop signal: killed the job at once; it had written no checkpoint\n"
    )
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"")
    job._on_signal(signal.SIGINT, None)  # noqa: SLF001
    assert capfd.readouterr().err.endswith(
        "killed the job at once; its checkpoints stay as it last wrote them\n"
    )


def test_a_sweep_or_tuner_stopping_a_job_twice_kills_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep forwards each Ctrl+C to its jobs (`RunProcess.stop`) and the tuner kills a trial on a second
    interrupt (`RunProcess.kill`): their signals go to a supervisor that takes the same signal twice within
    seconds for one request, so the second must be another signal, or a double Ctrl+C would not kill."""
    from ppo_fabric.app import supervisor
    from ppo_fabric.app.jobs import RunProcess

    monkeypatch.setattr(supervisor.signal, "signal", lambda *_args: None)
    monkeypatch.setattr(supervisor, "prctl", lambda *_args: None)
    for first, action in ((signal.SIGINT, "stop"), (signal.SIGTERM, "stop"), (None, "kill")):
        job = supervisor.Job(tmp_path, 10.0)
        sent: list[int] = []
        monkeypatch.setattr(job, "_kill_group", sent.append)
        job.proc = object()  # type: ignore[assignment]  # stands for the running job

        class Supervisor:  # the supervisor's process, as RunProcess signals it
            @staticmethod
            def send_signal(signum: int, job: supervisor.Job = job) -> None:
                job._on_signal(signum, None)  # noqa: SLF001

        run = RunProcess([], tmp_path, Supervisor())  # type: ignore[arg-type]
        if first is not None:
            run.stop(first)
            assert sent == [first]
        getattr(run, action)()
        assert sent[-1] == signal.SIGKILL, (first, action, sent)
    # kill again (the tuner polls): nothing more at once; past the grace, SIGKILL to the supervisor itself
    from ppo_fabric.app import jobs

    signals: list[int] = []
    run = RunProcess([], tmp_path, Supervisor())  # type: ignore[arg-type]
    monkeypatch.setattr(Supervisor, "send_signal", staticmethod(signals.append))
    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(jobs.os, "killpg", lambda pid, sig: killed.append((pid, sig)))
    run.proc.pid, run.proc.returncode = 4321, None  # type: ignore[attr-defined,misc]
    run.kill()
    run.kill()
    assert signals == [signal.SIGTERM, signal.SIGINT] and killed == []
    run.killed_at -= jobs.KILL_GRACE_S + 1  # type: ignore[operator]
    run.kill()
    assert signals == [signal.SIGTERM, signal.SIGINT] and killed == [(4321, signal.SIGKILL)]
    run.proc.returncode = 0  # type: ignore[misc]  # reaped: its pid may be another session's by now
    run.kill()
    assert killed == [(4321, signal.SIGKILL)]


def test_the_supervisor_finds_what_is_left_of_its_job_by_descent(tmp_path: Path) -> None:
    """The job's group as the supervisor sees it once the job's first process is reaped: its processes that
    descend from the supervisor, not whatever holds the group id (the kernel may reuse a reaped leader's
    pid for another session, which `killpg` then killed)."""
    code = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    leader = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(supervisor.group_descendants(leader.pid) or []) < 2:
            assert time.monotonic() < deadline, supervisor.group_descendants(leader.pid)
            time.sleep(0.05)
        (child,) = [pid for pid in supervisor.group_descendants(leader.pid) or [] if pid != leader.pid]
        assert supervisor.group_descendants(leader.pid) == sorted([leader.pid, child])
        assert supervisor.group_descendants(os.getpgid(0)) is not None  # another group: not the job's
        assert leader.pid not in (supervisor.group_descendants(os.getpgid(0)) or [])
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()
    deadline = time.monotonic() + 10
    while supervisor.group_descendants(leader.pid):  # the sleep, killed, waits for init to reap it
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.multiprocess
def test_a_job_that_cannot_stop_is_killed_with_a_line(tmp_path: Path) -> None:
    """A signalled job whose rank cannot reach its stop (an env stuck in `step`, the watchdog off) is killed
    `collectives.timeout + stall_timeout` + 5 s after the signal, and the supervisor says so."""
    run_dir = tmp_path / "run"
    cmd = _python_m(run_dir, "env.id=tests.faulty_env:FaultyCartPole-v0", "+env.kwargs.fault=hang",
                    "+env.kwargs.after=200", "env.normalize_warmup=0", "stall_timeout=0", "collectives.timeout=1",
                    "logger=none")  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=job_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (run_dir / "config.yaml").exists() or not job_processes(run_dir):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the run never started"
            time.sleep(0.2)
        time.sleep(1.0)  # every env is at its 200th step by now: stuck
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=40)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGKILL, err
    assert (
        "ppo-fabric: the job had not stopped 6 s after the signal (collectives.timeout + stall_timeout): "
        "killed" in err
    ), err
    assert 5 < took < 30, took
    _assert_nothing_left(run_dir, within=1)


def _first_job_process(supervisor: int, run_dir: Path) -> bytes:
    """The environment the job's first process (the supervisor's child) was started with."""
    for pid in job_processes(run_dir):
        with contextlib.suppress(OSError):
            if int(Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[1]) == supervisor:
                return Path(f"/proc/{pid}/environ").read_bytes()
    pytest.fail("no process of the job is the supervisor's child")


def test_resume_auto_needs_a_fixed_run_dir(capsys: pytest.CaptureFixture[str]) -> None:
    assert_cli_failure(capsys, cli.main, ["resume=auto"], "resume=auto needs a stable run directory")


def test_resume_auto_starts_fresh_then_continues(tmp_path: Path) -> None:
    """The same command twice (a requeued job): the first starts, the second continues from last.ckpt."""
    run_dir = tmp_path / "run"
    args = ["resume=auto", f"hydra.run.dir={run_dir}", "logger.tensorboard=false", "algo.rollout_steps=32"]
    assert ppo_fabric.run([*args, "algo.total_steps=512"])["total_env_steps"] == 512
    assert last_logged_step(run_dir / "metrics.csv") == 512
    assert ppo_fabric.run([*args, "algo.total_steps=1024"])["total_env_steps"] == 1024
    steps = [int(line.split(",")[0]) for line in (run_dir / "metrics.csv").read_text().splitlines()[1:]]
    assert steps == [256, 512, 768, 1024], "the second run continued where the first stopped"


def test_a_resume_keeps_the_runs_own_threads_restarts_and_timeouts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`torch_threads`, `restarts`, `collectives.timeout` and `stall_timeout` are the run's own on resume,
    as every other key: the supervisor and the process's threads once took the command line's defaults
    (a run started with restarts=3 and resumed without repeating it had no restarts left)."""
    import torch

    from ppo_fabric.app.supervisor import run_config
    from ppo_fabric.config.values import compose
    from ppo_fabric.runs import checkpoint as ckpt

    first = tmp_path / "first"
    args = ["logger.tensorboard=false", "logger.plot=false", "algo.rollout_steps=32", "eval.every=0"]
    ppo_fabric.run([*args, "algo.total_steps=256", "torch_threads=2", f"hydra.run.dir={first}"])
    last = first / "checkpoints" / "last.ckpt"
    state = ckpt.load(last, env_state="fresh")
    state["config"] |= {"restarts": 3, "stall_timeout": 123.0}
    state["config"]["collectives"]["timeout"] = 77.0
    last.write_bytes(ckpt.encode(state))
    given = [f"resume={last}", "algo.total_steps=512"]
    cfg, _ = compose(given)
    run = run_config(cfg, tmp_path / "second", given)
    assert (run.restarts, run.stall_timeout, run.collectives.timeout) == (3, 123.0, 77.0)
    assert cfg.restarts == 0, "the command line's config is left as it was"
    # as the job's first process answers the supervisor's checks (app/prestart.py): the same config
    from ppo_fabric.app.hydra_app import answer_check

    answered = answer_check({"overrides": given, "config_path": None, "config_name": "config"})
    answered = json.loads(json.dumps(answered))  # through the pipe
    run = run_config(cfg, tmp_path / "second", given, answered["config"])
    assert (run.restarts, run.stall_timeout, run.collectives.timeout) == (3, 123.0, 77.0)
    again, _ = compose([*given, "restarts=1"])
    assert (
        run_config(again, tmp_path / "second", [*given, "restarts=1"]).restarts == 1
    )  # what a resume may change, it changes
    from ppo_fabric.app import launch

    seen: list[int] = []
    launch_run = launch.launch

    def launching(*a: Any, **kw: Any) -> dict[str, Any]:
        seen.append(torch.get_num_threads())  # the threads the run trains with
        return launch_run(*a, **kw)

    monkeypatch.setattr(launch, "launch", launching)
    torch.set_num_threads(1)
    try:
        ppo_fabric.run(
            [*args, f"resume={last}", "algo.total_steps=512", f"hydra.run.dir={tmp_path / 'second'}"]
        )
        assert seen == [2] and torch.get_num_threads() == 1, "the run's own threads, then the caller's"
    finally:
        torch.set_num_threads(1)


def test_restarts_need_the_supervisor(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="restarts=1 needs the supervisor"):
        ppo_fabric.run(["restarts=1", "algo.total_steps=512", f"hydra.run.dir={tmp_path}"])
    with pytest.raises(ConfigError, match="restarts=-1 is out of range"):
        ppo_fabric.run(["restarts=-1", f"hydra.run.dir={tmp_path}"])


def test_overrides_name_the_resolved_paths(tmp_path: Path) -> None:
    """The job gets exactly one run directory and one resume, quoted when Hydra would misread the path."""
    odd = tmp_path / "a b,c"
    args = with_override(["hydra.run.dir=x", "seed=1", "++hydra.run.dir=y"], "hydra.run.dir", odd)
    assert args == ["seed=1", f"hydra.run.dir='{odd}'"]
    from ppo_fabric.config.values import compose

    assert compose(args)[1] == str(odd)
    assert os.fspath(tmp_path) in with_override(args, "resume", tmp_path)[-1]


@pytest.mark.parametrize(
    ("env", "status"),
    [
        ({}, 143),  # one process, or the first process of Fabric's launcher: it carries the job's status
        ({"LOCAL_RANK": "0"}, 143),
        ({"LOCAL_RANK": "1"}, 0),  # Fabric's launcher's child: 143 would get the first process SIGKILLed
        ({"LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "x"}, 143),  # torchrun's agent reads every rank's
    ],
)
def test_the_exit_status_of_a_stopped_rank(
    env: dict[str, str], status: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ppo_fabric.app.process import stop_status

    for name in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert stop_status(signal.SIGTERM) == status


@pytest.mark.parametrize(
    ("env", "recorded"),
    [
        ({"LOCAL_RANK": "1", "PPO_FABRIC_SUPERVISED": "1"}, True),  # its exit gets rank 0 SIGKILLed
        ({"LOCAL_RANK": "0", "PPO_FABRIC_SUPERVISED": "1"}, False),  # the first process says it itself
        ({"LOCAL_RANK": "1"}, False),  # no supervisor to read it
        ({"LOCAL_RANK": "1", "PPO_FABRIC_SUPERVISED": "1", "TORCHELASTIC_RUN_ID": "x"}, False),
    ],
)
def test_a_failed_launcher_child_leaves_its_cause_for_the_supervisor(
    env: dict[str, str], recorded: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ppo_fabric.config.faults import failed_child, fault_status, forget_failed_child

    for name in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID", "PPO_FABRIC_SUPERVISED"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert fault_status(tmp_path, "rank 1: env.step raised") == 1
    assert failed_child(tmp_path) is recorded
    forget_failed_child(tmp_path)
    assert not failed_child(tmp_path)


@pytest.mark.slow
def test_the_checks_before_a_run_leave_tensordict_unimported(tmp_path: Path, tiny_run: Path) -> None:
    """The supervisor checks a run (env, model, the checkpoint it resumes) before its job imports everything
    again: tensordict (with torch._dynamo, ~1.5 s a process) is not needed for that and stays unimported.
    In a fresh process, as the supervisor is."""
    overrides = [f"resume={tiny_run / 'checkpoints' / 'last.ckpt'}", "algo.total_steps=1024"]
    code = (
        "import sys\n"
        "from ppo_fabric.app import preflight, supervisor\n"
        f"preflight.load({overrides!r} + ['hydra.run.dir=' + sys.argv[1]])\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'tensordict', 'lightning_fabric', 'torch'}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], env=job_env(), cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "['torch']", proc.stdout


@pytest.mark.multiprocess
def test_a_restarted_resume_auto_keeps_the_runs_own_values(tmp_path: Path) -> None:
    """A requeued `resume=auto` job that names only its env id (the generic `env=gym` is added in case it
    starts afresh) loses a rank after its first checkpoint: the relaunch resumes that checkpoint with the
    command line as typed. With the added option taken for the user's, it reset env.num_envs to 4 (was 2),
    was refused and not restarted."""
    run_dir, marker = tmp_path / "run", tmp_path / "killed"
    base = [sys.executable, "-m", "ppo_fabric", "logger.tensorboard=false", "logger.plot=false", "algo.rollout_steps=32",
            "collectives.timeout=20", "eval.every=0", "checkpoint.every=1", f"hydra.run.dir={run_dir}"]  # fmt: skip
    marker.touch()  # disarmed for the first run
    killed = _killed_once(0, 128 + 32 + 5, marker)  # each env copy is at step 128 when the first run ends
    ppo_fabric.run([*base[3:], *killed, "env.num_envs=2", "algo.minibatch_size=32", "algo.total_steps=256"])
    marker.unlink()  # armed: killed in the requeue's second update, after its first checkpoint
    proc = _run([*base, *killed, "algo.total_steps=768", "resume=auto",
                 "restarts=1"], tmp_path)  # fmt: skip
    assert proc.returncode == 0 and marker.exists(), proc.stderr[-3000:]
    assert "restart 1/1 from" in proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["total_env_steps"] == 768 and summary["restarts"] == 1
    from ppo_fabric.runs import checkpoint as ckpt

    saved = ckpt.load(run_dir / "checkpoints" / "last.ckpt", env_state="fresh")["config"]
    assert saved["env"]["num_envs"] == 2


def test_the_runs_own_warnings_print_as_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's process prints ppo-fabric's warnings (a resume without env state, a tracker that failed) as
    the one line they are, as its errors; a library's warning keeps Python's file, line and category."""
    import warnings

    from ppo_fabric.app import process

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
    monkeypatch.setattr(warnings, "filters", list(warnings.filters))
    process.quiet_libraries()
    ours = warnings.formatwarning(
        UserWarning("ppo-fabric: episodes restart"), UserWarning, "/x/ckpt.py", 9, "src"
    )
    theirs = warnings.formatwarning(UserWarning("deprecated"), DeprecationWarning, "/y/lib.py", 3, "src")
    assert ours == "ppo-fabric: episodes restart\n"
    assert theirs.startswith("/y/lib.py:3: DeprecationWarning: deprecated"), theirs


def test_a_signal_during_start_up_ends_a_launcher_child_quietly_with_0(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """A job stopped while its processes start: a child Fabric's launcher started exited 128+N, and its
    node's first process SIGKILLed itself on seeing it (the job ended 137, which a requeue script reads as
    a kill). The child leaves with 0 and no line; the first process says it and carries 128+N."""
    import signal as signals

    from ppo_fabric.app import process

    codes: list[int] = []
    monkeypatch.setattr(process.os, "_exit", codes.append)
    saved = {s: signals.getsignal(s) for s in STOP_SIGNALS}
    try:
        process.stop_quietly_during_startup()
        handler = signals.getsignal(signals.SIGTERM)
        passed: list[tuple[int, int]] = []
        monkeypatch.setattr(process.os, "kill", lambda pid, signum: passed.append((pid, signum)))
        for child, code, said in (
            (True, 0, ""),
            (False, 143, "ppo-fabric: stopped by SIGTERM during start-up"),
        ):
            monkeypatch.setattr(process, "launcher_child", lambda child=child: child)
            handler(signals.SIGTERM, None)
            err = capfd.readouterr().err
            assert codes.pop() == code and (err == "" if child else err.startswith(said)), err
        assert passed == [(os.getppid(), signals.SIGTERM)]  # the child passed it to its node's first process
    finally:
        for s, h in saved.items():
            signals.signal(s, h)


@pytest.fixture
def kept_handlers() -> Any:
    """A supervisor's `Job` made in this process takes the stop signals: given back after the test."""
    from ppo_fabric.config.faults import STOP_SIGNALS

    saved = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.mark.usefixtures("kept_handlers")
@pytest.mark.parametrize("csv", [True, False])
def test_steps_trained_twice_are_not_known_without_metrics_csv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], csv: bool
) -> None:
    """A restart's `env_steps_redone` is read from metrics.csv's last row: with `logger=none` (no file)
    the summary said 0, as if nothing had been trained twice; it is null, not known. The job's end says
    what the command did over its attempts: the last attempt's final line counts that attempt alone."""
    from omegaconf import OmegaConf

    from ppo_fabric.app.hydra_app import Invocation
    from ppo_fabric.config.faults import FAULT_EXIT
    from ppo_fabric.runs import resume

    summary = tmp_path / "summary.json"
    statuses = iter([FAULT_EXIT, 0])

    def run(self: object, args: list[str]) -> int:  # the job's attempts: the first fails at env step 384
        if csv and not (tmp_path / "metrics.csv").exists():
            (tmp_path / "metrics.csv").write_text("step,loss\n128,1.0\n384,1.0\n")
        summary.write_text(json.dumps({"total_env_steps": 512}))
        return next(statuses)

    monkeypatch.setattr(supervisor.Job, "run", run)
    monkeypatch.setattr(resume, "newest_checkpoint", lambda *_: None)  # it wrote none: a restart from 0
    cfg = OmegaConf.create({"restarts": 1, "resume": None, "collectives": {"timeout": 1}, "stall_timeout": 1})
    assert supervisor._attempts(cfg, tmp_path, Invocation(overrides=[])) == 0
    assert json.loads(summary.read_text())["env_steps_redone"] == (384 if csv else None)
    twice = "384" if csv else "not known"
    assert capfd.readouterr().err.splitlines()[-1] == (
        f"ppo-fabric: the run reached 512 env steps after 1 restart ({twice} env steps trained twice); the line "
        "above counts its last attempt alone"
    )


@pytest.mark.usefixtures("kept_handlers")
@pytest.mark.parametrize(("saved", "env_id"), [(True, "CartPole-v1"), (False, "CartPole-v1"),
                                               (True, "tests.faulty_env:FaultyCartPole-v0")])  # fmt: skip
def test_a_killed_job_that_is_not_restarted_says_how_to_continue(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    saved: bool,
    env_id: str,
) -> None:
    """A rank killed outright (the OOM killer: exit 137) says nothing of its own, and the supervisor's line
    named only the exit: with a checkpoint written it now says how to continue from it, with a module env's
    id, which that resume must name (the command it suggested was refused)."""
    from omegaconf import OmegaConf

    from ppo_fabric.app.hydra_app import Invocation

    if saved:
        (tmp_path / "checkpoints").mkdir()
        (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"")
    monkeypatch.setattr(supervisor.Job, "run", lambda self, args: 128 + signal.SIGKILL)
    cfg = OmegaConf.create({"restarts": 0, "resume": None, "collectives": {"timeout": 1}, "stall_timeout": 1,
                            "env": {"id": env_id}})  # fmt: skip
    assert supervisor._attempts(cfg, tmp_path, Invocation(overrides=[])) == 137
    named = f" env.id={env_id}" if ":" in env_id else ""
    hint = (
        f"; continue from its last checkpoint with resume=auto hydra.run.dir={tmp_path}{named}"
        if saved
        else ""
    )
    assert (
        capfd.readouterr().err == f"ppo-fabric: rank failure (exit 137); not restarting (restarts=0){hint}\n"
    )


@pytest.mark.parametrize("nodes", [2, 1])
def test_another_nodes_command_leaves_the_lock_to_node_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], nodes: int
) -> None:
    """Node 1's command of a multi-node run (NODE_RANK=1) shares node 0's run directory and leaves its lock
    to node 0's supervisor, also where `resume=auto` leaves fabric.num_nodes to the checkpoint (the command
    line says 1): it was refused as "in use", while node 0 waited for it until `collectives.timeout`. A
    one-node run with NODE_RANK set still locks, and is refused by a live run."""
    from omegaconf import OmegaConf

    from ppo_fabric.app.hydra_app import Invocation
    from ppo_fabric.runs import lock

    monkeypatch.setenv("NODE_RANK", "1")
    command_line = OmegaConf.create({"resume": "auto", "fabric": {"num_nodes": 1}})
    monkeypatch.setattr(
        supervisor, "run_config", lambda *_: OmegaConf.create({"fabric": {"num_nodes": nodes}})
    )
    monkeypatch.setattr(supervisor, "_attempts", lambda *_: 0)
    with lock.acquire(tmp_path):  # node 0's supervisor holds it
        status = supervisor.supervise(command_line, tmp_path, Invocation(overrides=[]))
    assert status == (0 if nodes == 2 else supervisor.CONFIG_REFUSED)
    assert ("is in use by a live run" in capfd.readouterr().err) is (nodes == 1)


@pytest.mark.usefixtures("kept_handlers")
def test_a_relaunch_its_checks_refuse_is_not_called_a_config_mistake(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """A relaunch whose checks fail (the env cannot be built any more) exits 2, as a config mistake does;
    the line said "the job's config was refused", a config that had passed and was not changed."""
    from omegaconf import OmegaConf

    from ppo_fabric.app.hydra_app import Invocation
    from ppo_fabric.config.faults import FAULT_EXIT
    from ppo_fabric.runs import resume

    statuses = iter([FAULT_EXIT, supervisor.CONFIG_REFUSED])
    monkeypatch.setattr(supervisor.Job, "run", lambda self, args: next(statuses))
    monkeypatch.setattr(resume, "newest_checkpoint", lambda *_: None)
    cfg = OmegaConf.create({"restarts": 2, "resume": None, "collectives": {"timeout": 1}, "stall_timeout": 1})
    assert supervisor._attempts(cfg, tmp_path, Invocation(overrides=[])) == 2
    assert capfd.readouterr().err.splitlines()[-1] == (
        "ppo-fabric: the relaunched job's checks refused it (exit 2; its line above says why); not restarting"
    )


@pytest.mark.usefixtures("kept_handlers")
@pytest.mark.parametrize(("resume", "redone"), [("auto", 904), (None, 5000)])
def test_a_resume_auto_jobs_restart_counts_from_the_checkpoint_it_found(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    resume: str | None,
    redone: int,
) -> None:
    """`resume=auto` found a checkpoint at 4,096 env steps; the attempt died at 5,000 before writing one of
    its own and was relaunched as it started: 904 env steps were trained twice, not 5,000 (the start step of
    a `resume=auto` command was read as 0)."""
    from omegaconf import OmegaConf

    from ppo_fabric.app.hydra_app import Invocation
    from ppo_fabric.runs import resume as resume_module

    found = tmp_path / "checkpoints" / "last.ckpt"
    found.parent.mkdir()
    found.write_bytes(b"")
    os.utime(found, (time.time() - 60, time.time() - 60))  # before the job started
    monkeypatch.setattr(resume_module, "newest_checkpoint", lambda *_: (found, 4096))
    statuses = iter([1, 0])

    def run(self: object, args: list[str]) -> int:
        status = next(statuses)
        if status:  # the attempt logged up to 5,000 and died
            (tmp_path / "metrics.csv").write_text("step,x\n4500,1\n5000,1\n")
        else:
            (tmp_path / "summary.json").write_text('{"total_env_steps": 8192}')
        return status

    monkeypatch.setattr(supervisor.Job, "run", run)
    cfg = OmegaConf.create({"restarts": 1, "resume": resume, "collectives": {"timeout": 1}, "stall_timeout": 1,
                            "env": {"id": "CartPole-v1"}})  # fmt: skip
    assert supervisor._attempts(cfg, tmp_path, Invocation(overrides=[])) == 0
    assert json.loads((tmp_path / "summary.json").read_text())["env_steps_redone"] == redone
    assert f"({redone:,} env steps trained twice)" in capfd.readouterr().err
