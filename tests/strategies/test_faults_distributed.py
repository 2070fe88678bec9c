"""Faults in real jobs (`python -m ppo_fabric`, gloo on CPU): bad env data on a player, a stuck env in a
1-process and in a 2-process job (the watchdog, and a collective that times out), and restarts counted
over the ranks. Each job ends with one line naming the rank, its role and the cause, exit 1, every
process's stacks in the run directory for a stall, and nothing left running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ppo_fabric.policy.scorers import evaluation_seed
from ppo_fabric.runs import checkpoint as ckpt
from ppo_fabric.runs.metrics_file import read_rows
from tests.conftest import end_group, job_env, job_processes

pytestmark = pytest.mark.multiprocess

SMALL = ["logger.tensorboard=false", "logger.plot=false", "eval.every=0", "env.num_envs=4", "algo.rollout_steps=32", "algo.minibatch_size=64",
         "algo.update_epochs=2", "env.id=tests.faulty_env:FaultyCartPole-v0"]  # fmt: skip
DECOUPLED = ["strategy=decoupled", "fabric.devices=2"]


def _job(
    tmp_path: Path, *overrides: str, supervisor: bool = False
) -> tuple[subprocess.CompletedProcess, float]:
    """The job, by default without the supervising parent (a process start fewer; the supervisor only
    relays the exit status, which tests/app/test_supervisor.py covers)."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "ppo_fabric", *SMALL, *overrides, f"hydra.run.dir={run_dir}"]
    started = time.monotonic()
    env = job_env(supervisor=supervisor)
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    deadline = time.monotonic() + 10
    while job_processes(run_dir):
        assert time.monotonic() < deadline, f"processes of the job outlived it: {job_processes(run_dir)}"
        time.sleep(0.1)
    return proc, took


def _errors(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("ppo-fabric: error: ")]


def test_nan_observation_on_a_player_ends_the_job(tmp_path: Path) -> None:
    """Its envs in worker processes (env.vector=async): the workers are ended with the job, not left to
    print an EOFError and a BrokenPipeError traceback each under its line."""
    proc, _ = _job(
        tmp_path, *DECOUPLED, "+env.kwargs.fault=nan_obs", "+env.kwargs.after=20", "env.vector=async"
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    # the cause alone: the trainer that lost its player printed gloo's "Connection closed by peer" after it
    assert _errors(proc) == [
        "ppo-fabric: error: player rank 0, env 0: observation holds NaN at env step 80"
    ], proc.stderr[-3000:]
    assert not (tmp_path / "run" / "summary.json").exists()
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_an_output_that_cannot_be_written_ends_a_one_process_job_in_one_line(tmp_path: Path) -> None:
    """metrics.csv cannot be replaced (a folder stands there, as a full disk or a lost permission would
    refuse it): one line naming the OS error, exit 1, no traceback."""
    (tmp_path / "run" / "metrics.csv").mkdir(parents=True)
    proc, _ = _job(tmp_path, "env.id=CartPole-v1", "algo.total_steps=256", "eval.every=0")
    assert proc.returncode == 1, proc.stderr[-3000:]
    (line,) = _errors(proc)
    assert line.startswith("ppo-fabric: error: IsADirectoryError: [Errno 21] Is a directory: "), line
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def _stacks(run_dir: Path) -> dict[str, str]:
    (stall,) = run_dir.glob("stall-*")
    return {path.stem: path.read_text() for path in stall.glob("*.txt")}


def test_a_stuck_env_ends_a_one_process_job_within_the_stall_timeout(tmp_path: Path) -> None:
    proc, took = _job(tmp_path, "+env.kwargs.fault=hang", "+env.kwargs.after=20", "stall_timeout=2")
    assert proc.returncode == 1, proc.stderr[-3000:]
    (line,) = _errors(proc)
    assert line.startswith("ppo-fabric: error: rank 0: no progress for "), line
    assert "s, in env.step (faulty_env.py:" in line and ", in step) (stall_timeout=2); stacks in " in line
    stacks = _stacks(tmp_path / "run")
    assert list(stacks) == ["rank-0"] and "faulty_env.py" in stacks["rank-0"]
    assert took < 60, took


def test_a_stuck_async_env_ends_the_job_and_its_workers(tmp_path: Path) -> None:
    """The envs in worker processes (env.vector=async), one stuck in `step`: the watchdog ends the job
    and its workers with it (`_job` waits for every process of the job to be gone); they were left, one
    of them sleeping for ever."""
    proc, _ = _job(tmp_path, "+env.kwargs.fault=hang", "+env.kwargs.after=20", "stall_timeout=2",
                   "env.vector=async", "env.num_envs=2")  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert _errors(proc)[0].startswith("ppo-fabric: error: rank 0: no progress for "), proc.stderr[-3000:]


def test_a_rank_that_ends_without_a_line_is_named_by_the_process_that_launched_it(tmp_path: Path) -> None:
    """Rank 1's env ends its process at once (status 3, as a C library's `exit()` would): it says nothing,
    and rank 0 saw only a closed connection. It names rank 1 and its status; the job ended 137 (Lightning's
    launcher SIGKILLed rank 0 while it looked), as if killed for memory, with no cause."""
    proc, _ = _job(
        tmp_path, "fabric.devices=2", "+env.kwargs.fault=os_exit", "+env.kwargs.after=70", "+env.kwargs.rank=1",
        "algo.total_steps=100000",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert _errors(proc) == [
        "ppo-fabric: error: rank 1 ended with exit status 3 and no line of its own; rank 0 lost contact with it"
    ], proc.stderr[-3000:]


@pytest.mark.parametrize("devices", [1, 2])
def test_a_process_stuck_in_c_code_holding_the_interpreter_lock_is_ended_by_its_watchdogs_timer(
    tmp_path: Path, devices: int
) -> None:
    """Rank 0's env never returns from C code that holds the GIL: its watchdog thread cannot run, and in a
    job of two neither can Lightning's launcher thread, which rank 0 runs. Both hung for ever (rank 1 timed
    out and left). faulthandler's timer, which the watchdog re-arms every second, ends rank 0 with its
    stacks, and the supervisor names it in one line."""
    proc, took = _job(
        tmp_path, f"fabric.devices={devices}", "+env.kwargs.fault=gil_hang", "+env.kwargs.after=30",
        "+env.kwargs.rank=0", "stall_timeout=2", "collectives.timeout=60", "algo.total_steps=100000",
        supervisor=True,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = _errors(proc)
    assert errors[-1].startswith(
        "ppo-fabric: error: rank 0: no progress for 12 s, and its watchdog could not run: C code held the "
        "interpreter lock (a simulator stuck in its C step?); stacks in "
    ), proc.stderr[-3000:]
    (stall,) = (tmp_path / "run").glob("stall-*")
    assert "faulty_env.py" in (stall / "rank-0.txt").read_text()
    assert not list((tmp_path / "run").glob(".hang-*")) and took < 60, took


@pytest.mark.parametrize("how", ["watchdog", "collective timeout"])
def test_a_stuck_player_is_named_with_every_rank_stacks(tmp_path: Path, how: str) -> None:
    """With the watchdog the player names itself; with it off, the trainer's wait times out first and it
    names the player from the stacks every process wrote. collectives.timeout also bounds the ranks'
    rendezvous: 15 s, because a rank still importing on a loaded 2-core machine missed an 8-s one."""
    timing = ["stall_timeout=2"] if how == "watchdog" else ["stall_timeout=0", "collectives.timeout=15"]
    proc, _ = _job(tmp_path, *DECOUPLED, "+env.kwargs.fault=hang", "+env.kwargs.after=20", *timing)
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = _errors(proc)[0]
    assert line.startswith("ppo-fabric: error: player rank 0: no progress for "), proc.stderr[-3000:]
    assert "in env.step (faulty_env.py:" in line, line
    if how == "collective timeout":
        assert "(trainer rank 1's wait outlasted collectives.timeout=15 s)" in line, line
    stacks = _stacks(tmp_path / "run")
    assert sorted(stacks) == ["player-rank-0", "trainer-rank-1"], stacks
    assert "faulty_env.py" in stacks["player-rank-0"]
    if how == "watchdog":  # the trainer answered the player's claim while it waited for the batch
        assert '"waiting": true' in stacks["trainer-rank-1"]


def test_a_stuck_evaluation_env_ends_a_decoupled_job(tmp_path: Path) -> None:
    """An evaluation env that hangs in the first player's evaluator process: the player goes on training,
    waits for it at the end, and its watchdog ends the job in one line naming where it waits; the stall
    directory holds the evaluator's stacks beside the ranks'."""
    seeds = [evaluation_seed(42) + k for k in range(3)]  # the evaluation envs' only (seed 42, 3 episodes)
    proc, took = _job(
        tmp_path, *DECOUPLED, "+env.kwargs.fault=hang", "+env.kwargs.after=5", f"+env.kwargs.seeds={seeds}",
        "eval.every=auto", "eval.episodes=3", "algo.total_steps=1024", "stall_timeout=3",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = _errors(proc)[0]
    assert line.startswith("ppo-fabric: error: player rank 0: no progress for "), proc.stderr[-3000:]
    assert "evaluat" in line, line
    assert not (tmp_path / "run" / "summary.json").exists() and took < 90, took
    (stall,) = (tmp_path / "run").glob("stall-*")  # and where the evaluator is stuck: its own stacks
    assert "faulty_env.py" in (stall / "player-rank-0-evaluator.stacks").read_text()


@pytest.mark.parametrize("strategy", ["decoupled", "coupled"])
def test_a_final_evaluation_longer_than_the_collectives_timeout_ends_the_run_with_it(
    tmp_path: Path, strategy: str
) -> None:
    """A final evaluation of 12-13.5 s (each of its env's first 9 steps takes 1.5 s; an episode lasts 8 or
    more) against a `collectives.timeout` of 10 s (less would cut the processes' start on a loaded machine)
    fails no rank: the first player waits for it only after the trainers' last collectives; a coupled job's
    other rank waits for rank 0's in a group of its own that allows `stall_timeout` more. The run ends 0,
    its last checkpoint and its summary holding the evaluation."""
    seeds = [evaluation_seed(42)]  # the evaluation env's only (seed 42, 1 episode)
    proc, _ = _job(
        tmp_path, f"strategy={strategy}", "fabric.devices=2", "+env.kwargs.fault=slow", "+env.kwargs.pause=1.5",
        "+env.kwargs.after=1", "+env.kwargs.times=9", f"+env.kwargs.seeds={seeds}", "eval.episodes=1",
        "eval.every=1000000", "algo.total_steps=512", "collectives.timeout=10",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["evaluation"]["last"]["env_step"] == 512
    state = ckpt.load(tmp_path / "run" / "checkpoints" / "last.ckpt", env_state="fresh")
    assert state["env_step"] == 512 and state["evaluation"]["last"]["env_step"] == 512
    (row,) = read_rows(tmp_path / "run" / "evaluations.csv")
    assert float(row.get("time/eval_background_s") or row["time/eval_s"]) > 10  # the evaluator's own time


def test_a_stop_during_a_decoupled_final_evaluation_is_a_stop_the_resume_finishes(tmp_path: Path) -> None:
    """SIGINT to the first player while it waits for the final evaluation (its evaluator's env sends it,
    then takes 3 s a step): the job stops at once with its checkpoint owing that evaluation, and
    `resume=auto` plays it and completes the run, with nothing left to train. The player used to wait for
    its episodes, however long they took (past a cluster's grace period), then call the run complete."""
    slow = ["+env.kwargs.fault=signal_parent_slow", "+env.kwargs.pause=3", "+env.kwargs.after=1",
            f"+env.kwargs.seeds=[{evaluation_seed(42)}]", "eval.episodes=1", "eval.every=1000000"]  # fmt: skip
    proc, _ = _job(tmp_path, *DECOUPLED, *slow, "algo.total_steps=256")
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr[-3000:]
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    state = ckpt.load(last, env_state="fresh")
    assert state["env_step"] == 256 and state["evaluation"]["in_flight"] == 256
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["interrupted"] is True
    resume = [*DECOUPLED, *slow[-2:], "+env.kwargs.fault=none", "resume_overrides=allow", "resume=auto"]
    proc, _ = _job(tmp_path, *resume)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["interrupted"] is False and summary["evaluation"]["last"]["env_step"] == 256
    assert [int(r["step"]) for r in read_rows(tmp_path / "run" / "evaluations.csv")] == [256]
    assert ckpt.load(last, env_state="fresh")["evaluation"]["last"]["env_step"] == 256  # no longer owed
    assert ckpt.load_policy(tmp_path / "run" / "checkpoints" / "best.ckpt")[0]["env_step"] == 256
    # the run is complete: a later resume=auto has nothing to do
    proc, _ = _job(tmp_path, *resume)
    assert proc.returncode == 0 and "is complete" in proc.stdout + proc.stderr, proc.stderr[-3000:]


def test_an_earlier_updates_evaluation_in_flight_at_a_stop_is_played_by_the_resume(tmp_path: Path) -> None:
    """The evaluation of update 1 (env step 128) plays in the first player's evaluator, whose env sends
    the player SIGINT and then takes 3 s a step, when the stop's checkpoint is written at a later update.
    That checkpoint keeps the parameters it scores, and `resume=auto` plays it first: the uninterrupted
    run's row at 128 is in evaluations.csv. The resumed run used to go on without it (a gap in the record,
    and a best.ckpt that never had those parameters scored)."""
    slow = ["+env.kwargs.fault=signal_parent_slow", "+env.kwargs.pause=3", "+env.kwargs.after=1",
            f"+env.kwargs.seeds=[{evaluation_seed(42)}]", "eval.episodes=1", "eval.every=128"]  # fmt: skip
    proc, _ = _job(tmp_path, *DECOUPLED, *slow, "algo.total_steps=1000000")  # the stop comes first
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr[-3000:]
    state = ckpt.load(tmp_path / "run" / "checkpoints" / "last.ckpt", env_state="fresh")
    assert state["env_step"] > 128 and state["evaluation"]["in_flight"] == 128, state["evaluation"]
    assert state["evaluation_policy"]["env_step"] == 128
    assert not (tmp_path / "run" / "evaluations.csv").is_file() or not read_rows(
        tmp_path / "run" / "evaluations.csv"
    )
    end = state["env_step"] + 256
    resume = [*DECOUPLED, *slow[-3:], "+env.kwargs.fault=none", "resume_overrides=allow", "resume=auto"]
    proc, _ = _job(tmp_path, *resume, f"algo.total_steps={end}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [int(r["step"]) for r in read_rows(tmp_path / "run" / "evaluations.csv")]
    assert steps[0] == 128 and steps[-1] == end and steps == sorted(set(steps)), steps
    last = ckpt.load(tmp_path / "run" / "checkpoints" / "last.ckpt", env_state="fresh")
    assert last["evaluation"]["in_flight"] is None and last.get("evaluation_policy") is None


def test_a_rank_slow_to_stop_is_not_killed_by_the_launcher(tmp_path: Path) -> None:
    """SIGTERM to a coupled 2-rank job whose rank 0 takes 7 s to close its envs after the stop checkpoint:
    Lightning's launcher, in rank 0, looks at its child every 5 s and SIGKILLs itself once the child has
    exited non-zero. Rank 1 must not end rank 0 that way (exit 137, no summary): the job ends 143 with
    its summary marked interrupted."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "ppo_fabric", *SMALL, "fabric.devices=2", "algo.total_steps=1000000",
           "+env.kwargs.fault=slow_close", "+env.kwargs.rank=0", "eval.every=0", f"hydra.run.dir={run_dir}"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=job_env(supervisor=False), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while len(read_rows(run_dir / "metrics.csv")) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        end_group(proc)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["interrupted"] is True


def test_a_rank_failing_while_rank_0_is_busy_ends_the_job_as_a_failure(tmp_path: Path) -> None:
    """Supervised, coupled, 2 ranks: rank 1's envs raise at their 50th step while rank 0's hang in theirs.
    Lightning's launcher, in rank 0, SIGKILLs rank 0 within 5 s of rank 1's exit: the job must still end
    as the failure it was (exit 1, rank 1's line, no restart offered for a kill), not 137 as if the
    machine had run out of memory."""
    proc, _ = _job(
        tmp_path, "fabric.devices=2", "algo.total_steps=1000000", "+env.kwargs.fault=raise",
        "+env.kwargs.rank=1", "+env.kwargs.others=hang", "eval.every=0", supervisor=True,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert any("rank 1" in line and "simulator crashed" in line for line in _errors(proc)), proc.stderr[
        -3000:
    ]
    assert "rank failure" not in proc.stderr, proc.stderr[-3000:]  # the rank's line is the one line


def test_restarts_are_summed_over_the_ranks(tmp_path: Path) -> None:
    """Coupled, 2 ranks: every env of rank 1 raises at its 50th step and is rebuilt."""
    proc, _ = _job(
        tmp_path, "fabric.devices=2", "algo.total_steps=1024", "+env.kwargs.fault=raise",
        "+env.kwargs.after=50", "+env.kwargs.rank=1", "env.on_error=restart",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["env_restarts"] == 8  # rank 1's 4 envs x 128 steps: 2 each
    assert proc.stderr.count("env rebuilt (restart") == 8
