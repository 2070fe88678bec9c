"""A run that goes wrong ends with its cause in one line and its checkpoints intact: bad env data (NaN
observations, inf rewards), an update that diverges, a checkpoint that holds NaN or cannot be written; or,
with `env.on_error=restart`, it goes on and counts the restarts. In-process single-rank runs (~1 s each);
the multi-process cases are in tests/strategies/test_faults_distributed.py."""

from __future__ import annotations

import glob
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import ppo_fabric
from ppo_fabric.config.faults import RunFault
from ppo_fabric.config.values import compose
from ppo_fabric.envs.guard import EnvFault
from ppo_fabric.learn.update import UpdateDiverged
from ppo_fabric.runs import checkpoint as ckpt
from ppo_fabric.runs.metrics_file import read_rows, series
from ppo_fabric.runs.session import CheckpointFault, RunSession
from ppo_fabric.runs.watchdog import STALL_SIGNAL

# 4 envs x 32 steps: 128 env steps an update, each env's 32nd, 64th, 96th... step ends one
SMALL = [
    "logger.tensorboard=false",
    "env.num_envs=4",
    "algo.rollout_steps=32",
    "algo.minibatch_size=64",
    "algo.update_epochs=2",
    "algo.total_steps=1024",
]
FAULTY = "env.id=tests.faulty_env:FaultyCartPole-v0"


def _run(tmp_path: Path, *overrides: str) -> dict:
    return ppo_fabric.run([*SMALL, f"hydra.run.dir={tmp_path}", *overrides])


def _finite(path: Path) -> None:
    state = ckpt.load(path, env_state="fresh")
    assert ckpt.nonfinite_tensor(state) is None, path


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "what"), [("nan_obs", "observation holds NaN"), ("inf_reward", "reward holds +inf")]
)
def test_bad_env_data_ends_the_run_and_keeps_the_last_checkpoint(
    tmp_path: Path, fault: str, what: str
) -> None:
    """Each env's 70th step is bad: update 3's rollout (env steps 256-384) stops at env step 4 x 70. (The
    evaluation envs would meet it first; their guard is tests/policy/test_periodic.py's.)"""
    with pytest.raises(EnvFault) as raised:
        _run(tmp_path, FAULTY, f"+env.kwargs.fault={fault}", "+env.kwargs.after=70", "checkpoint.every=1",
             "eval.every=0")  # fmt: skip
    assert str(raised.value) == f"rank 0, env 0: {what} at env step 280"
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert ckpt.load(last, env_state="fresh")["env_step"] == 256  # update 2's, untouched
    _finite(last)


@pytest.mark.slow
def test_restart_mode_rebuilds_failing_envs_and_counts_them(tmp_path: Path) -> None:
    """Every env raises at its 100th step and at every 100th step of each rebuilt env: the run finishes,
    counts the restarts in metrics.csv and summary.json, and never learns from a bad value."""
    summary = _run(
        tmp_path, FAULTY, "+env.kwargs.fault=raise", "+env.kwargs.after=100", "env.on_error=restart"
    )
    assert summary["total_env_steps"] == 1024 and summary["env_restarts"] == 8  # 256 steps: 2 per env
    restarts = [v for _, v in series(read_rows(tmp_path / "metrics.csv"), "env/restarts")]
    assert restarts[-1] == 8 and restarts == sorted(restarts)
    _finite(tmp_path / "checkpoints" / "last.ckpt")


@pytest.mark.slow
@pytest.mark.parametrize("vector", ["sync", "async"])
def test_a_stall_in_process_is_raised_to_the_caller(tmp_path: Path, vector: str) -> None:
    """`ppo_fabric.run()` in a notebook: an env step that never returns (in this process, or in an async
    env's worker, the main thread waiting on its pipe) ends the run as a RunFault naming where it stood,
    with the stacks written, and the caller's process goes on. It ended the process, a notebook's kernel
    with it (its one line on the kernel's own stderr, not the notebook's), even with env.on_error=restart."""
    threads = set(threading.enumerate())
    with pytest.raises(
        RunFault, match=r"^rank 0: no progress for .* s, in env\.step \(.* \(stall_timeout=2\); "
    ):
        _run(tmp_path, FAULTY, "+env.kwargs.fault=hang", "+env.kwargs.after=20", "stall_timeout=2",
             f"env.vector={vector}", "env.on_error=restart", "eval.every=0")  # fmt: skip
    assert len(list(tmp_path.glob("stall-*/rank-0.txt"))) == 1
    assert set(threading.enumerate()) == threads  # the watchdog ended (and the async env's workers)
    assert signal.getsignal(STALL_SIGNAL) == signal.SIG_DFL  # as before the run
    assert _run(tmp_path / "next", "eval.every=0")["total_env_steps"] == 1024


@pytest.mark.slow
def test_a_diverging_update_ends_the_run_before_any_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(UpdateDiverged, match=r"beyond algo.max_param_abs=1e\+06: the update diverged"):
        _run(tmp_path, "algo.lr=1e9", "checkpoint.every=1")
    assert not (tmp_path / "checkpoints").exists()


def _session(tmp_path: Path) -> RunSession:
    cfg, _ = compose([*SMALL, f"hydra.run.dir={tmp_path}"])
    return RunSession(cfg, tmp_path, True, 128, None)


@pytest.mark.slow
def test_finite_data_float32_cannot_hold_ends_the_run_in_one_line(tmp_path: Path) -> None:
    """A reward of 1e200 is finite, but the rollout stores float32: the guard names it where it arrives
    (it became inf in the rollout, and the update's NaN losses were blamed), before it is normalised,
    learned from or reaches a checkpoint. The fault strikes at each env's 134th step: the 70th after the
    normaliser's 64 warm-up steps, in update 3."""
    with pytest.raises(EnvFault) as raised:
        _run(tmp_path, FAULTY, "+env.kwargs.fault=huge_reward", "+env.kwargs.after=134", "checkpoint.every=1",
             "env.normalize_reward=true", "eval.every=0")  # fmt: skip
    assert "reward holds 1e+200, beyond float32's range" in str(raised.value), raised.value
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert ckpt.load(last, env_state="fresh")["env_step"] == 256  # update 2's: 280 is in update 3
    _finite(last)


def test_nonfinite_normaliser_statistics_are_found_before_they_are_made_plain() -> None:
    """A state about to be written still holds numpy arrays and scalars (the normalisers' statistics)."""
    assert ckpt.nonfinite_reason({"ranks": [{"var": np.array([1.0, np.inf])}]}) == "ranks.0.var holds inf"
    assert ckpt.nonfinite_reason({"var": np.float64("nan")}) == "var holds NaN"
    assert ckpt.nonfinite_reason({"count": np.array([3], np.int64), "best_return": -math.inf}) is None


def _state(value: float) -> dict:
    return {"agent": {"w": torch.full((2, 2), value)}, "optimizer": {}}


def _only_the_good_save(good: Path) -> bool:
    """The folder holds the good save, `last.ckpt`, and its numbered copy (the default 10-minute clock
    numbers every save), and nothing else: no temp file, no later copy, no best.ckpt."""
    names = sorted(p.name for p in good.parent.iterdir())
    numbered = [n for n in names if n.startswith("step_000000000128_")]
    if len(names) != 2 or names[0] != "last.ckpt" or len(numbered) != 1:
        return False
    copy, last = (torch.load(good.parent / name, weights_only=True) for name in (numbered[0], "last.ckpt"))
    return bool(torch.equal(copy["agent"]["w"], last["agent"]["w"]))


def test_a_nonfinite_checkpoint_is_never_written(tmp_path: Path) -> None:
    session = _session(tmp_path)
    good = session.write_checkpoint(_state(1.0), [{}], 1)
    before = good.read_bytes()
    with pytest.raises(CheckpointFault, match=r"at env step 256 was not written: agent.w holds NaN; "):
        session.write_checkpoint(_state(math.nan), [{}], 2)
    assert good.read_bytes() == before
    assert _only_the_good_save(good)  # no temp file, no best.ckpt
    session.logger.close()


def test_a_failed_write_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = _session(tmp_path)
    good = session.write_checkpoint(_state(1.0), [{}], 1)
    before = good.read_bytes()
    real_replace = ckpt.os.replace

    def full_disk(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt.os, "replace", full_disk)
    with pytest.raises(CheckpointFault) as raised:
        session.write_checkpoint(_state(2.0), [{}], 2)
    monkeypatch.setattr(ckpt.os, "replace", real_replace)
    assert str(raised.value) == (
        "could not write last.ckpt at env step 256 (OSError: [Errno 28] No space left on device); "
        f"the last good checkpoint is {good}"
    )
    assert good.read_bytes() == before
    assert _only_the_good_save(good)
    session.logger.close()


def test_a_stops_checkpoint_that_cannot_be_written_names_the_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM on a full disk: the run ends with exit 1 (the stop lost what it was to save), and its line
    said only that a checkpoint could not be written."""
    from ppo_fabric.runs.session import STOP

    session = _session(tmp_path)
    _full_disk_for("last", monkeypatch)
    monkeypatch.setattr(STOP, "signum", int(signal.SIGTERM))
    with pytest.raises(
        CheckpointFault, match=r"^stopping on SIGTERM: could not write last\.ckpt at env step 128 "
    ):
        session.write_checkpoint(_state(1.0), [{}], 1)
    session.logger.close()


def test_a_decoupled_runs_best_policy_is_written_before_the_last_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decoupled run's best.ckpt holds the parameters its evaluator scored (`best_policy`), which no
    checkpoint holds: written after last.ckpt, a failed write of it lost them for good (last.ckpt was past
    the best). It comes first, and a failed one leaves the previous last.ckpt for a resume to replay from."""
    session = _session(tmp_path)
    good = session.write_checkpoint(_state(1.0), [{}], 1, best=False)

    def policy(state: dict) -> dict:
        return {"agent": {"w": torch.zeros(2, 2)}, "env_step": int(state["env_step"]) - 64}

    session.write_checkpoint(_state(2.0), [{}], 2, best=False, best_policy=policy)
    assert torch.load(good.parent / "best.ckpt", weights_only=True)["env_step"] == 192
    _full_disk_for("best", monkeypatch)
    with pytest.raises(CheckpointFault, match=r"^could not write best\.ckpt at env step 384 "):
        session.write_checkpoint(_state(3.0), [{}], 3, best=False, best_policy=policy)
    assert torch.load(good, weights_only=True)["env_step"] == 256
    session.logger.close()


def _full_disk_for(name_starts: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Writes into files whose names start with `name_starts` fail as on a full disk; others succeed."""
    real_replace = ckpt.os.replace

    def replace(src: str, dst: str) -> None:
        if Path(dst).name.startswith(name_starts):
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", replace)


def test_a_numbered_copy_that_fails_leaves_that_updates_last_checkpoint_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`last.ckpt` is written before the numbered copy: the copy written first, then a failing
    `last.ckpt`, left the run's newest state in a file the line did not name ("no checkpoint was written
    before"), and a decoupled `resume=auto` went back to the older `last.ckpt`."""
    session = _session(tmp_path)
    _full_disk_for("step_", monkeypatch)
    with pytest.raises(CheckpointFault) as raised:
        session.write_checkpoint(_state(1.0), [{}], 1)
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert str(raised.value) == (
        "could not write step_000000000128_" + session.run_id + ".ckpt at env step 128 (OSError: [Errno 28] "
        f"No space left on device); {last} holds this env step"
    )
    assert torch.load(last, weights_only=True)["env_step"] == 128
    session.logger.close()


def test_a_new_best_is_written_before_the_last_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run whose final checkpoint was a new best and whose best.ckpt then failed (a full disk) was
    complete with no best.ckpt: `resume=auto` found nothing to do, and no run wrote that best again. Now
    best.ckpt comes first: when it fails, the previous `last.ckpt` stays, and a resume replays to it."""
    session = _session(tmp_path)
    window = {"episodes": [(100, 10.0, 10)]}  # (env step, return, length) of the recent episodes
    good = session.write_checkpoint(_state(1.0), [window], 1)
    assert (good.parent / "best.ckpt").read_bytes() == good.read_bytes()
    _full_disk_for("best", monkeypatch)
    better = {"episodes": [(200, 20.0, 20)]}
    with pytest.raises(CheckpointFault, match=r"^could not write best\.ckpt at env step 256 "):
        session.write_checkpoint(_state(2.0), [better], 2)
    assert torch.load(good, weights_only=True)["env_step"] == 128  # the new best's update left no last.ckpt
    session.logger.close()


def test_a_nan_final_observation_of_a_cut_agent_ends_the_run(tmp_path: Path) -> None:
    """The observation a truncated agent's episode ends on is bootstrapped from: a NaN there (only in
    `final_obs`, the next episode's first observation being finite) made every advantage NaN unchecked."""
    with pytest.raises(
        EnvFault, match=r"rank 0, env 0, agent 'agent_0': final observation holds NaN at env step 16"
    ):
        _run(tmp_path, "env=pettingzoo", "env.id=tests.faulty_env:nan_final_matching_v0", "eval.every=0")


@pytest.mark.slow
def test_a_nan_observation_of_one_agent_names_the_agent(tmp_path: Path) -> None:
    """PettingZoo parallel envs: the policy's rows are checked together; the line names the env copy and
    the agent (every copy's agent_1 sees NaN at its 10th step: the first vector step that returns it)."""
    with pytest.raises(EnvFault) as raised:
        _run(tmp_path, "env=pettingzoo", "env.id=tests.faulty_env:nan_matching_v0")
    assert str(raised.value) == "rank 0, env 0, agent 'agent_1': observation holds NaN at env step 40"


def test_a_nan_in_a_multiagent_envs_first_observations_ends_the_run(tmp_path: Path) -> None:
    """The collector checks the PettingZoo vector envs' steps; their first reset went unchecked: a NaN
    there was learned from (the update's minibatch steps skipped) and the run ended with exit 0."""
    with pytest.raises(EnvFault) as raised:
        _run(tmp_path, "env=pettingzoo", "env.id=tests.faulty_env:nan_matching_v0", "+env.kwargs.after=0")
    assert str(raised.value) == "rank 0, env 0: agent 'agent_1': observation holds NaN at its first reset"


def test_an_env_that_fails_in_its_constructor_or_close_is_one_line(tmp_path: Path) -> None:
    """The env's own failure while the checks build it is one line naming it (a RuntimeError of its
    constructor printed a 45-line traceback); a `close` that raises at the end of a run that trained to the
    end is a warning line, and the run keeps its summary (Hydra printed a traceback and it was lost)."""
    with pytest.raises(ppo_fabric.ConfigError) as raised:
        _run(tmp_path / "a", FAULTY, "+env.kwargs.fault=raise_init")
    assert str(raised.value).startswith(
        "env.id='tests.faulty_env:FaultyCartPole-v0' raised RuntimeError: no licence for the simulator"
    ), raised.value
    with pytest.warns(UserWarning) as warned:  # the evaluation's envs too (evaluation on, as by default)
        summary = _run(
            tmp_path / "b", FAULTY, "+env.kwargs.fault=raise_close", "eval.every=512", "eval.episodes=1"
        )
    said = {str(w.message).split(" raised")[0] for w in warned if "closing" in str(w.message)}
    assert said == {"ppo-fabric: closing the envs", "ppo-fabric: closing the evaluation envs"}, said
    assert summary["total_env_steps"] == 1024 and (tmp_path / "b" / "summary.json").is_file()


def test_a_check_that_never_returns_ends_the_command_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """No watchdog runs before the run: an env whose constructor or `close` never returns hung the checks
    (and the command) for ever. After `stall_timeout` the command ends with a line naming where."""
    import threading
    import time

    from ppo_fabric.app import preflight

    left = threading.Event()
    monkeypatch.setattr(preflight.os, "_exit", lambda code: left.set())
    with preflight.bounded(0.3, "building env.id='X' for the checks"):
        deadline = time.monotonic() + 5
        while not left.is_set() and time.monotonic() < deadline:  # stuck here, in this file
            time.sleep(0.01)
        assert left.is_set(), "the check was never ended"
    assert capfd.readouterr().err.startswith(
        "ppo-fabric: error: building env.id='X' for the checks: no progress for 0.3 s (test_faults.py:"
    )
    with preflight.bounded(0.3, "quick"):
        pass
    time.sleep(0.5)
    assert capfd.readouterr().err == ""


def test_a_planned_clock_checkpoint_restarts_the_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decoupled player decides a clock checkpoint for the update after the rollout it sends, and the
    clock ran on until that checkpoint was written: the next boundary, before the write, decided another
    (clock checkpoints came in pairs on consecutive updates, halving what checkpoint.keep kept)."""
    import time

    session = _session(tmp_path)
    session.every_seconds = 60.0
    now = [time.monotonic() + 61.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    assert session.agreed(session.boundary_flags()).clock_due
    session.clock_checkpoint_planned()
    now[0] += 1.0  # the next boundary, the planned checkpoint not written yet
    assert not session.agreed(session.boundary_flags()).clock_due


@pytest.mark.slow  # two runs in process
@pytest.mark.parametrize("resume_env", ["restore", "fresh"])
def test_env_on_error_restart_given_to_a_resume_rebuilds_failing_envs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, resume_env: str
) -> None:
    """A run started with `env.on_error=raise` fails on bad env data; its resume with `env.on_error=restart`
    said it changed the setting, but the envs restored from the checkpoint kept their wrappers: nothing was
    rebuilt and the resume failed as the run had. Now such a resume starts fresh envs, saying why."""
    import ppo_fabric
    from tests.faulty_env import FAULT_ENV

    run = ["env.id=tests.faulty_env:FaultyCartPole-v0", "env.num_envs=2", "algo.rollout_steps=32",
           "algo.minibatch_size=32", "logger.tensorboard=false", "logger.plot=false", "eval.every=0"]  # fmt: skip
    ppo_fabric.run([*run, "algo.total_steps=128", f"hydra.run.dir={tmp_path}"])
    monkeypatch.setenv(FAULT_ENV, "nan_obs")  # from now on every env step after the 50th of an env
    last = tmp_path / "checkpoints" / "last.ckpt"
    with pytest.raises(ppo_fabric.RunFault, match="observation holds NaN"):
        ppo_fabric.run([run[0], f"resume={last}", "algo.total_steps=256", f"resume_env={resume_env}"])
    summary = ppo_fabric.run(
        [run[0], f"resume={last}", "algo.total_steps=256", "env.on_error=restart", f"resume_env={resume_env}"]
    )
    assert summary["total_env_steps"] == 256 and summary["env_restarts"] > 0, summary


@pytest.mark.slow  # three runs in process
def test_a_finished_run_whose_longer_resume_failed_still_returns_its_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failed session moved `summary.json` aside before it failed; `resume=auto` then found the run complete
    at its own budget and `ppo_fabric.run` returned {} (the README's `summary["final_mean_return"]` raised)."""
    import ppo_fabric
    from tests.faulty_env import FAULT_ENV

    run = ["env.id=tests.faulty_env:FaultyCartPole-v0", "env.num_envs=2", "algo.rollout_steps=32",
           "algo.minibatch_size=32", "logger.tensorboard=false", "logger.plot=false", "eval.every=0",
           f"hydra.run.dir={tmp_path}"]  # fmt: skip
    finished = ppo_fabric.run([*run, "algo.total_steps=128"])
    with monkeypatch.context() as faulty:
        faulty.setenv(FAULT_ENV, "raise")
        with pytest.raises(ppo_fabric.RunFault, match="simulator crashed"):
            ppo_fabric.run([*run, "resume=auto", "algo.total_steps=256"])
    assert not (tmp_path / "summary.json").exists()  # the failed session's is not the finished run's
    again = ppo_fabric.run([*run, "resume=auto"])
    assert again == finished and again["total_env_steps"] == 128


@pytest.mark.slow  # starts an interpreter (~0.2 s): the unit tier starts no process
def test_a_value_whose_square_overflows_is_named_without_numpys_warning() -> None:
    """1e200 overflowed the quick test's dot product, and NumPy's "overflow encountered in matmul" warning
    was printed above the run's one line. A fresh interpreter (~0.2 s, no torch): warnings are errors there,
    as no test process's own warning filters can be."""
    code = (
        "import numpy as np\n"
        "from ppo_fabric.envs.guard import find_nonfinite\n"
        "print(find_nonfinite(np.zeros((2, 4), np.float32), np.array([1e200, 0.0]))[1])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.strip() == "reward holds 1e+200, beyond float32's range (the rollout stores float32)"


@pytest.mark.slow  # a run with async env workers
def test_an_async_workers_error_is_the_runs_one_line_without_gymnasiums_report(tmp_path: Path) -> None:
    """gymnasium reported a worker's error in ~25 lines of warnings (its traceback, each worker's shutdown)
    before the run's one line; `PPO_FABRIC_TRACEBACK=1` keeps them for a user who wants the traceback."""
    import warnings

    import ppo_fabric

    run = ["env.id=tests.faulty_env:FaultyCartPole-v0", "+env.kwargs.fault=raise", "+env.kwargs.after=20",
           "env.vector=async", "env.num_envs=2", "algo.rollout_steps=32", "algo.minibatch_size=32",
           "logger.tensorboard=false", "logger.plot=false", "eval.every=0", "algo.total_steps=256"]  # fmt: skip
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(ppo_fabric.RunFault, match=r"env.step raised RuntimeError: simulator crashed"):
            ppo_fabric.run([*run, f"hydra.run.dir={tmp_path}"])
    reports = [str(w.message) for w in seen if "async_vector_env" in w.filename]
    assert reports == [], reports


@pytest.mark.slow
def test_a_keyboard_interrupt_from_an_env_is_its_fault_not_a_ctrl_c(tmp_path: Path) -> None:
    """A run's Ctrl+C never raises in an env (its handler asks for a stop at the next update): one raised
    by an env's code ended the run as "interrupted", exit 130, no stop checkpoint, never restarted."""
    with pytest.raises(EnvFault) as raised:
        _run(tmp_path, FAULTY, "+env.kwargs.fault=keyboard_interrupt", "+env.kwargs.after=70", "eval.every=0")
    assert str(raised.value) == (
        "rank 0: env.step raised KeyboardInterrupt (raised by the env's own code: a Ctrl+C stops a run at its "
        "next update) at env step 280"
    )


@pytest.mark.slow
@pytest.mark.parametrize("on_error", ["raise", "restart"])
def test_an_env_that_calls_sys_exit_is_a_fault_not_a_finished_run(tmp_path: Path, on_error: str) -> None:
    """`sys.exit(0)` in an env's step raises SystemExit, which passed every `except Exception`: the run
    ended with exit 0 and no line, no summary, as if it had finished (a supervisor's `restarts=N` never
    relaunched it). It is the env's fault, named; `env.on_error=restart` rebuilds the env."""
    overrides = [FAULTY, "+env.kwargs.fault=exit", "+env.kwargs.after=70", "checkpoint.every=1", "eval.every=0",
                 f"env.on_error={on_error}"]  # fmt: skip
    if on_error == "restart":
        assert _run(tmp_path, *overrides)["env_restarts"] >= 4
        return
    with pytest.raises(EnvFault) as raised:
        _run(tmp_path, *overrides)
    assert str(raised.value) == (
        "rank 0: env.step raised SystemExit(0) (the env called sys.exit) at env step 280"
    )
    _finite(tmp_path / "checkpoints" / "last.ckpt")


@pytest.mark.slow
def test_an_async_worker_that_dies_is_named_with_its_exit(tmp_path: Path) -> None:
    """An async env's worker process that ends (a crash in C code, `os._exit`, `sys.exit` in the env): the
    line said only `env.step raised EOFError`; it names the worker and how it ended, and that
    `env.on_error=restart` cannot rebuild a process."""
    with pytest.raises(EnvFault) as raised:
        _run(tmp_path, FAULTY, "+env.kwargs.fault=os_exit", "+env.kwargs.after=70", "+env.kwargs.rank=-1",
             "env.vector=async", "env.on_error=restart", "eval.every=0")  # fmt: skip
    assert re.fullmatch(
        r"rank 0: env\.step raised EOFError \(env \d's worker process ended, exit status 3[;,].* "
        r"env\.on_error=restart rebuilds an env whose code raises, not a process that ended: restarts=N "
        r"relaunches the run from its last checkpoint\) at env step 280",
        str(raised.value),
    ), raised.value


@pytest.mark.slow
def test_an_env_built_in_the_run_but_not_in_its_async_workers_is_named_in_one_line(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """An env whose constructor fails only in an async env's worker process (a licence, a display the
    workers lack): each worker printed a ~25-line traceback and the run's line named the closed pipe
    (`ConnectionResetError ... at its first reset`); it names the constructor's error and where it was
    raised, once, and leaves no worker's file behind."""
    with pytest.raises(EnvFault) as raised:
        _run(tmp_path, FAULTY, "+env.kwargs.fault=raise_init_worker", "env.vector=async", "env.num_envs=2",
             "eval.every=0")  # fmt: skip
    assert re.fullmatch(
        r"rank 0: env\.vector=async: the env could not be built in 2 of its 2 worker processes \(it was in "
        r"the run's own\): RuntimeError: no display in a worker process \(injected by the test env\) "
        r"\(faulty_env\.py:\d+, in __init__\); env\.vector=sync builds every env in the run's process",
        str(raised.value),
    ), raised.value
    assert "Traceback" not in capfd.readouterr().err
    assert not glob.glob(os.path.join(tempfile.gettempdir(), f"ppo-fabric-{os.getpid()}-env-worker-*"))


@pytest.mark.slow
def test_an_env_close_that_never_returns_keeps_the_runs_outputs(tmp_path: Path) -> None:
    """The run's outputs come before the envs' close(): one that hung held back summary.json and the
    learning curve until the watchdog ended the run without them, and `resume=auto` then found the run
    complete, with no summary."""
    with pytest.raises(RunFault, match=r"no progress for .* in closing the envs"):
        _run(tmp_path, FAULTY, "+env.kwargs.fault=hang_close", "stall_timeout=2", "eval.every=0")
    assert json.loads((tmp_path / "summary.json").read_text())["total_env_steps"] == 1024


def test_a_silent_exit_during_a_run_is_a_fault() -> None:
    """`sys.exit()` or `sys.exit(0)` from code a run calls (outside the envs' guarded calls too) is a
    RunFault naming where it was called; the package's own non-zero exits pass as they are."""
    from ppo_fabric.app.launch import no_silent_exit

    for code in (None, 0):
        with (
            pytest.raises(
                RunFault, match=r"^sys\.exit\(0?\) was called during the run, at test_faults\.py:\d+ "
            ),
            no_silent_exit(),
        ):
            sys.exit(code)
    with pytest.raises(SystemExit) as raised, no_silent_exit():
        sys.exit(2)
    assert raised.value.code == 2


@pytest.mark.slow
def test_a_rebuild_that_fails_is_named_after_the_failure_that_asked_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`env.on_error=restart`: an env whose step raised, then whose rebuild raised too (a licence server
    gone): the line named only the rebuild's error, as if `env.step` had raised it."""
    from tests.faulty_env import FaultyCartPole

    monkeypatch.setattr(FaultyCartPole, "struck", False)
    with pytest.raises(EnvFault) as raised:
        _run(tmp_path, FAULTY, "+env.kwargs.fault=raise_then_noinit", "+env.kwargs.after=70", "eval.every=0",
             "env.on_error=restart")  # fmt: skip
    assert str(raised.value) == (
        "rank 0: step raised RuntimeError: simulator crashed (injected by the test env); rebuilding the env "
        "then raised RuntimeError: no licence for the simulator (injected by the test env) (env step 280)"
    )


@pytest.mark.slow
def test_an_async_envs_reward_that_is_not_one_number_is_named_so(tmp_path: Path) -> None:
    """A reward of shape (1,) from an async env's worker fails as NumPy's "non-broadcastable output
    operand", which names neither the reward nor the env; the line says what it means."""
    with pytest.raises(EnvFault) as raised:
        _run(tmp_path, FAULTY, "+env.kwargs.fault=array_reward", "+env.kwargs.after=70", "env.vector=async",
             "eval.every=0")  # fmt: skip
    assert str(raised.value) == (
        "rank 0: env.step raised ValueError: non-broadcastable output operand with shape (4,) doesn't match the "
        "broadcast shape (4,4) (a step's reward, terminated or truncated is not one number: a reward of shape "
        "(1,)?) at env step 280"
    )


def test_a_one_process_runs_fault_prints_its_traceback_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """`PPO_FABRIC_TRACEBACK=1` added the traceback to a multi-process job's ranks only: a one-process run
    (every run on a laptop) printed its one line alone. Run as a supervised job does, in this process."""
    from ppo_fabric import cli
    from ppo_fabric.app.supervisor import SUPERVISED_ENV

    monkeypatch.setenv(SUPERVISED_ENV, "1")
    monkeypatch.setenv("PPO_FABRIC_TRACEBACK", "1")
    status = cli.main(["env=pettingzoo", "env.id=tests.envs.factory_envs:faulty_matching", "env.num_envs=1",
                       "+env.kwargs.fault=vanish", "algo.rollout_steps=16", "algo.minibatch_size=16",
                       "algo.total_steps=64", "eval.every=0", "logger=none", f"hydra.run.dir={tmp_path}"])  # fmt: skip
    err = capfd.readouterr().err
    assert status == 1
    assert "Traceback (most recent call last)" in err and 'multiagent.py", line' in err, err
    assert err.splitlines()[-1].startswith(
        "ppo-fabric: error: rank 0: env.step raised ValueError: env 0, agent"
    )
