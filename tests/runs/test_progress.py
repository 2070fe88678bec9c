"""What a run says while and after it trains: progress lines off a terminal (every `logger.progress_every`
seconds, paced by an injected clock), the bar on one, summary.json and the learning curve of a run stopped
by a signal, and the final line of a resumed session (issue 44, items 3 and 6)."""

from __future__ import annotations

import io
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import DictConfig, OmegaConf

import ppo_fabric
from ppo_fabric import ppo
from ppo_fabric.app.launch import build_fabric
from ppo_fabric.app.preflight import check
from ppo_fabric.config.values import ConfigError, compose
from ppo_fabric.policy.scorers import evaluation_seed
from ppo_fabric.runs import checkpoint as ckpt
from ppo_fabric.runs.metrics import RunLogger, duration, progress_every, progress_line
from ppo_fabric.runs.metrics_file import read_rows
from ppo_fabric.runs.session import STOP, RunSession, Stopped
from tests.signal_env import SignalledCartPole


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Stream(io.StringIO):
    """A pipe or a log file: no terminal; counts writes and flushes."""

    tty = False

    def __init__(self) -> None:
        super().__init__()
        self.writes = self.flushes = 0

    def isatty(self) -> bool:
        return self.tty

    def write(self, text: str) -> int:
        self.writes += 1
        return super().write(text)

    def flush(self) -> None:
        self.flushes += 1
        super().flush()


class Terminal(Stream):
    tty = True


def _cfg(**logger: Any) -> DictConfig:
    return OmegaConf.create({"logger": {"tensorboard": False, "csv": False, "tracker": None, **logger}})


def _logger(tmp_path: Path, stream: Stream, clock: Clock, **logger: Any) -> RunLogger:
    return RunLogger(tmp_path, _cfg(**logger), 50_000, enabled=True, stream=stream, clock=clock)


def test_progress_lines_come_at_the_cadence_off_a_terminal(tmp_path: Path) -> None:
    """No line before `progress_every` seconds; then one at the first progress call after each period (a
    long gap gives one line, not a burst); each line one flushed write."""
    stream, clock = Stream(), Clock()
    run = _logger(tmp_path, stream, clock, progress_every=30)
    said: list[float] = []
    for now in (10, 29.9, 30, 45, 59.9, 60.5, 200, 229, 230):
        clock.now = now
        before = stream.writes
        run.progress(12_288, 1_234.0, 87.3)
        if stream.writes > before:
            said.append(now)
    assert said == [30, 60.5, 200, 230]
    lines = stream.getvalue().splitlines()
    assert lines == ["ppo-fabric: 12,288/50,000 steps (25%), 1,234 steps/s, return 87.3, ETA 31s"] * 4
    assert stream.writes == 4 and stream.flushes == 4
    run.close()
    clock.now = 1000
    run.progress(50_000, 1_234.0, 87.3)
    assert len(stream.getvalue().splitlines()) == 4, "no line after close"


def test_progress_every_zero_prints_nothing_and_a_missing_key_means_30(tmp_path: Path) -> None:
    stream, clock = Stream(), Clock()
    run = _logger(tmp_path, stream, clock, progress_every=0)
    for now in (30, 100, 10_000):
        clock.now = now
        run.progress(1_000, 100.0, None)
    assert stream.getvalue() == ""
    assert progress_every(_cfg()) == 30.0 and progress_every(_cfg(progress_every=None)) == 0.0
    quiet = RunLogger(tmp_path, _cfg(), 50_000, enabled=False, stream=stream, clock=clock)
    clock.now = 10_000
    quiet.progress(1_000, 100.0, None)  # a rank that does not log
    assert stream.getvalue() == ""


@pytest.mark.parametrize("value", [-1, "soon", True, float("nan")])
def test_a_bad_progress_every_is_one_line_on_every_rank(tmp_path: Path, value: Any) -> None:
    with pytest.raises(ConfigError, match=r"^logger.progress_every=.* must be a number of seconds >= 0"):
        RunLogger(tmp_path, _cfg(progress_every=value), 1, enabled=False)


def test_a_terminal_gets_the_bar_and_no_lines(tmp_path: Path) -> None:
    stream, clock = Terminal(), Clock()
    run = _logger(tmp_path, stream, clock, progress_every=30)
    assert run.bar is not None
    for now in (30, 60, 90):
        clock.now = now
        run.progress(12_288, 1_234.0, 87.3)
    run.close()
    out = stream.getvalue()
    assert "ppo-fabric:" not in out and "return=87.3" in out and "step" in out


def test_a_resumed_runs_bar_counts_this_sessions_rate(tmp_path: Path) -> None:
    """Resumed at 900k of 1M, 20k steps in 10 s: 2k steps/s and 40 s left. The bar started at 0 took the
    checkpoint's steps for this session's (92k steps/s, nothing left)."""
    stream = Terminal()
    run = RunLogger(tmp_path, _cfg(), 1_000_000, enabled=True, stream=stream, resumed_at=900_000)
    assert run.bar is not None
    run.bar.start_t -= 10
    run.progress(920_000, 2_000.0, 1.0)
    line = stream.getvalue().replace("\r", "\n").splitlines()[-1]
    assert "<00:40" in line or "<00:39" in line, line
    run.close()


def test_the_progress_line_before_any_episode_and_long_etas() -> None:
    assert (
        progress_line(0, 1_000_000, 0.0, None)
        == "ppo-fabric: 0/1,000,000 steps (0%), 0 steps/s, return -, ETA -"
    )
    assert (
        progress_line(500, 500, 10.0, -3.25)
        == "ppo-fabric: 500/500 steps (100%), 10 steps/s, return -3.2, ETA 0s"
    )
    assert [duration(s) for s in (0.4, 59.6, 185, 3599, 7620)] == ["0s", "1m00s", "3m05s", "59m59s", "2h07m"]


# ------------------------------------------------------------------------------------- the final line
def _session(tmp_path: Path, resume: dict[str, Any] | None) -> RunSession:
    cfg = OmegaConf.create(
        {
            "algo": {"total_steps": 30_208, "anneal_lr": True},
            "checkpoint": {"every": 0, "keep": 0, "every_minutes": 0},
            "logger": {"tensorboard": False, "csv": False, "tracker": None, "log_every": 1},
            "resume": None,
            "env": {"id": "CartPole-v1"},
        }
    )
    return RunSession(cfg, tmp_path, False, 256, resume)


def test_the_final_line_of_a_resumed_session_counts_its_own_steps_and_the_runs_total(tmp_path: Path) -> None:
    summary = {"strategy": "coupled", "env_id": "CartPole-v1", "total_env_steps": 30_208, "wall_seconds": 1.44,
               "sps": 6_905.2, "final_mean_return": 187.3}  # fmt: skip
    fresh = _session(tmp_path, None)
    assert fresh.final_line(summary | {"steps_this_run": 30_208}) == (
        f"ppo-fabric: coupled CartPole-v1: 30,208 steps in 1.4s (6,905 steps/s), final mean return 187.3; "
        f"outputs in {tmp_path}"
    )
    resumed = _session(tmp_path, {"env_step": 20_224, "update": 79})
    assert resumed.final_step == 30_208
    assert resumed.final_line(summary | {"steps_this_run": 9_984}) == (
        "ppo-fabric: coupled CartPole-v1: 9,984 steps this session in 1.4s (6,905 steps/s), 30,208 in all, "
        f"final mean return 187.3; outputs in {tmp_path}"
    )


def test_a_run_stopped_before_its_first_checkpoint_names_the_one_that_holds_it(tmp_path: Path) -> None:
    """A decoupled session stopped before its first update writes no checkpoint: its line names the
    checkpoint it resumed from (this directory's last.ckpt may be another branch's), with `resume=auto` only
    when that file is this directory's last.ckpt; a fresh run has none to name. Once it wrote its own, that."""
    source = tmp_path / "elsewhere" / "step_000079.ckpt"
    resumed = _session(tmp_path, {"env_step": 20_224, "update": 79})
    resumed.cfg.resume = str(source)
    stop = Stopped(15, 20_224, resumed.stop_checkpoint())
    assert stop.continuation(tmp_path) == f"continue with resume={source}"
    resumed.last_checkpoint = 80  # what `checkpoint(80)` records on every rank
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert resumed.stop_checkpoint() == last
    assert Stopped(15, 20_480, last).continuation(tmp_path) == (
        f"continue with resume={last} (or resume=auto hydra.run.dir={tmp_path})"
    )
    fresh = Stopped(2, 0, _session(tmp_path, None).stop_checkpoint())
    assert fresh.continuation(tmp_path).startswith("no checkpoint was written before it")
    # a module env's id, which its resume must name (the command suggested was refused without it)
    own = "tests.faulty_env:FaultyCartPole-v0"
    assert Stopped(15, 20_480, last).continuation(tmp_path, own) == (
        f"continue with resume={last} env.id={own} (or resume=auto hydra.run.dir={tmp_path} env.id={own})"
    )
    assert Stopped(15, 20_480, last).continuation(tmp_path, "CartPole-v1").endswith(f"dir={tmp_path})")


# ------------------------------------------------------------------------------------ a stopped run
RUN = [
    "env=gym",
    "env.id=tests.signal_env:SignalledCartPole-v0",
    "env.num_envs=4",
    "env.vector=sync",
    "algo.rollout_steps=64",
    "algo.minibatch_size=64",
    "algo.update_epochs=1",
    "logger.tensorboard=false",
    "eval.every=0",
]  # evaluation off: the env counts the steps of all its instances, and evaluation's would move the signal


@pytest.mark.parametrize(
    ("signum", "raised"),
    [
        (signal.SIGINT, KeyboardInterrupt),
        (signal.SIGTERM, SystemExit),
        (signal.SIGHUP, SystemExit),  # the terminal closed
        (signal.SIGUSR1, SystemExit),  # a scheduler's warning ahead of its kill
    ],
)
def test_a_signal_stops_an_api_run_into_its_caller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signum: int, raised: type[BaseException]
) -> None:
    """`ppo_fabric.run()` in a notebook or script: a signal stops the run with its checkpoint, then raises
    into the caller (KeyboardInterrupt, or SystemExit(128 + N)), whose `finally` runs; it ended the interpreter
    before (os._exit), the caller's own handlers with it."""
    monkeypatch.setattr(SignalledCartPole, "signum", signum)
    SignalledCartPole.steps, SignalledCartPole.sent = 0, False
    run_dir = tmp_path / "run"
    with pytest.raises(raised) as info:
        ppo_fabric.run([*RUN, "algo.total_steps=4096", f"hydra.run.dir={run_dir}"])
    assert SignalledCartPole.sent
    assert raised is KeyboardInterrupt or info.value.code == 128 + signum
    assert ckpt.load(run_dir / "checkpoints" / "last.ckpt")["env_step"] == 768
    assert json.loads((run_dir / "summary.json").read_text())["interrupted"] is True
    assert (
        signal.getsignal(signum) is not None
        and getattr(signal.getsignal(signum), "__self__", None) is not STOP
    )


def test_a_stop_during_an_evaluation_leaves_it_unfinished(tmp_path: Path) -> None:
    """SIGINT while the evaluation plays a slow env (the evaluation env sends it, then takes 3 s a step: an
    episode of 8 or more steps lasts 24 s or more): the run stops within seconds, with its checkpoint at
    that update boundary and no record of the evaluation, which a resume owes and plays first. It waited for the episodes
    before: minutes on a slow simulator, past a cluster's grace period, whose SIGKILL lost the stop's
    checkpoint."""
    run_dir = tmp_path / "run"
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        ppo_fabric.run(
            [*(o for o in RUN if not o.startswith(("env.id=", "eval.every="))),
             "env.id=tests.faulty_env:FaultyCartPole-v0", "+env.kwargs.fault=signal_slow",
             "+env.kwargs.pause=3", "+env.kwargs.after=1", f"+env.kwargs.seeds=[{evaluation_seed(42)}]",
             "eval.every=256", "eval.episodes=1", "algo.total_steps=4096", f"hydra.run.dir={run_dir}"]
        )  # fmt: skip
    assert time.monotonic() - started < 15
    last = run_dir / "checkpoints" / "last.ckpt"
    assert ckpt.load(last)["env_step"] == 256 and ckpt.load(last)["evaluation"]["in_flight"] == 256
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["evaluation"]["last"] is None
    assert not (run_dir / "evaluations.csv").exists()
    # resumed (on envs that behave), it plays that evaluation first, on the checkpoint's parameters, and
    # best.ckpt holds them: the coupled resume went on at its cadence, the record and best.ckpt unlike the
    # uninterrupted run's
    resumed = ppo_fabric.run(["env.id=tests.faulty_env:FaultyCartPole-v0", "+env.kwargs.fault=none",
                              "resume_overrides=allow", "algo.total_steps=512", f"resume={last}",
                              f"hydra.run.dir={run_dir}"])  # fmt: skip
    assert [int(r["step"]) for r in read_rows(run_dir / "evaluations.csv")] == [256, 512]
    assert resumed["evaluation"]["last"]["env_step"] == 512
    best, _ = ckpt.load_policy(run_dir / "checkpoints" / "best.ckpt")
    assert best["env_step"] == resumed["evaluation"]["best"]["env_step"]


def test_a_stopped_run_writes_an_interrupted_summary_and_the_curve_then_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGTERM mid-rollout (the env sends it after 600 env steps): the coupled run stops at the next update
    boundary (768 env steps) with its checkpoint, summary.json marked interrupted and learning_curve.png.
    Resumed in its directory, it ends with `interrupted: false` and a final line counting the session."""
    SignalledCartPole.steps, SignalledCartPole.sent = 0, False
    run_dir = tmp_path / "run"
    cfg, _ = compose([*RUN, "algo.total_steps=4096"])
    check(cfg)
    with STOP.installed(), pytest.raises(Stopped) as stopped:
        ppo.main(build_fabric(cfg, 1), cfg, run_dir)
    assert SignalledCartPole.sent and stopped.value.signum == signal.SIGTERM
    assert stopped.value.env_step == 768 == ckpt.load(run_dir / "checkpoints" / "last.ckpt")["env_step"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["stop_signal"] == "SIGTERM"
    assert summary["total_env_steps"] == summary["steps_this_run"] == 768 and summary["updates"] == 3
    assert summary["episodes"] > 0 and summary["ranks_in_sync"] is True
    assert (run_dir / "learning_curve.png").stat().st_size > 0

    capsys.readouterr()
    last = run_dir / "checkpoints" / "last.ckpt"
    resumed = ppo_fabric.run([*RUN, "algo.total_steps=1280", f"hydra.run.dir={run_dir}", f"resume={last}"])
    assert resumed["interrupted"] is False and resumed["stop_signal"] is None
    assert resumed["total_env_steps"] == 1280 and resumed["steps_this_run"] == 512
    assert resumed["total_wall_seconds"] > resumed["wall_seconds"]
    assert json.loads((run_dir / "summary.json").read_text()) == resumed
    # the stopped session's summary is kept beside: a resumed session that failed would otherwise leave it
    # to be read as its own ("interrupted" at 768, while metrics.csv went further)
    assert json.loads((run_dir / "summary.previous.json").read_text())["total_env_steps"] == 768
    final = [line for line in capsys.readouterr().out.splitlines() if "final mean return" in line]
    assert len(final) == 1 and ": 512 steps this session in " in final[0] and ", 1,280 in all, " in final[0]


def test_a_resumed_csv_keeps_the_rows_through_its_checkpoint(tmp_path: Path) -> None:
    """Rows after the resumed checkpoint's step leave, a torn last line (a crash mid-write) with them; a file
    with nothing to drop is left as it is."""
    from ppo_fabric.runs.metrics import CsvMetrics
    from ppo_fabric.runs.metrics_file import read_rows

    path = tmp_path / "metrics.csv"
    path.write_text("step,a\n100,1\n200,2\n300,3\n40")
    CsvMetrics(path, resumed_at=200).log({"a": 9.0}, 300)
    assert [(r["step"], r["a"]) for r in read_rows(path)] == [("100", "1"), ("200", "2"), ("300", "9.0")]
    before = path.stat().st_mtime_ns
    CsvMetrics(path, resumed_at=300)
    assert path.stat().st_mtime_ns == before
    path.write_text("")  # cut before its header
    CsvMetrics(path, resumed_at=300).log({"a": 1.0}, 400)
    assert [(r["step"], r["a"]) for r in read_rows(path)] == [("400", "1.0")]
    assert [r["step"] for r in read_rows(tmp_path / "metrics.dropped.csv")] == ["300"]  # kept aside


def test_a_fresh_run_without_csv_still_clears_a_dead_attempts_rows(tmp_path: Path) -> None:
    """`logger.csv=false` writes no rows, but the plot, the supervisor and the tuner read metrics.csv: a
    fresh run in a directory where an attempt without a checkpoint logged moves that attempt's rows aside,
    as it says it does, instead of drawing its curve from them."""
    from ppo_fabric.runs.metrics_file import read_rows

    (tmp_path / "metrics.csv").write_text("step,a\n100,1\n200,2\n")
    run = RunLogger(
        tmp_path, _cfg(csv=False), 1_000, enabled=True, stream=Stream(), session=("new", [["new", 0]])
    )
    run.close()
    assert read_rows(tmp_path / "metrics.csv") == []
    assert [r["step"] for r in read_rows(tmp_path / "metrics.dropped.csv")] == ["100", "200"]


def test_a_resumed_csv_holds_the_timeline_of_its_checkpoints_lineage(tmp_path: Path) -> None:
    """Session A logs 100-1000; B resumes from A's checkpoint at 500 (same directory) and logs 600-800; C
    resumes from A's checkpoint at 1000. C's file is A's timeline, 100-1000: B's rows leave (they were kept
    below 1000, between A's), and A's rows 600-1000 that B's start took out come back."""
    from ppo_fabric.runs.metrics import CsvMetrics
    from ppo_fabric.runs.metrics_file import read_rows

    path = tmp_path / "metrics.csv"
    a = CsvMetrics(path, None, "A", [["A", 0]])
    for step in range(100, 1001, 100):
        a.log({"x": 1.0}, step)
    b = CsvMetrics(path, 500, "B", [["A", 0], ["B", 500]])
    for step in (600, 700, 800):
        b.log({"x": 2.0}, step)
    assert [(r["step"], r["run_id"]) for r in read_rows(path)][4:] == [
        ("500", "A"),
        ("600", "B"),
        ("700", "B"),
        ("800", "B"),
    ]
    CsvMetrics(path, 1000, "C", [["A", 0], ["C", 1000]])
    rows = read_rows(path)
    assert [int(r["step"]) for r in rows] == list(range(100, 1001, 100)) and {r["run_id"] for r in rows} == {
        "A"
    }
    assert [r["run_id"] for r in read_rows(tmp_path / "metrics.dropped.csv")] == ["B", "B", "B"]


def test_a_terminal_without_width_gets_the_plain_lines() -> None:
    """A pseudo-terminal that reports 0 columns (`script -c ...`, some CI runners) is a tty, so the plain
    lines were left out, and tqdm drew a bar of nothing there: a run showed no progress at all."""
    import fcntl
    import struct
    import termios

    from ppo_fabric.runs.metrics import is_terminal

    leader, follower = os.openpty()
    with open(follower, "w") as stream, open(leader, "rb", buffering=0):
        fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
        assert stream.isatty() and not is_terminal(stream)
        fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        assert is_terminal(stream)
    assert not is_terminal(io.StringIO())


def test_the_final_mean_return_takes_whole_env_steps() -> None:
    """A multi-agent rollout records its agents' episodes policy by policy: the last 20 of a zero-sum game's
    (8 envs, one adversary at -2 and one agent at +2 each) held 4 more of the agents' (0.4, where the mean
    over every agent is 0). Those that ended at the env step of the earliest of the 20 count too."""
    from ppo_fabric.runs.metrics import final_mean_return

    window = [(step, ret, 5) for step in (90, 100) for ret in [-2.0] * 8 + [2.0] * 8]
    assert final_mean_return([window]) == 0.0
    plain = [(step, float(step), 5) for step in range(1, 31)]  # one episode an env step: the last 20
    assert final_mean_return([plain]) == sum(range(11, 31)) / 20
    assert final_mean_return([[]]) is None


def test_a_tracker_that_fails_is_dropped_with_one_line() -> None:
    """A database error's SQL and links made the warning many lines."""

    class FakeTracker:
        pass

    logger = RunLogger.__new__(RunLogger)
    logger.tracker = FakeTracker()  # type: ignore[assignment]
    with pytest.warns(UserWarning) as caught:
        logger._drop_tracker(
            RuntimeError("file is not a database\n[SQL: SELECT runs.run_uuid]\nhttps://sqlalche.me")
        )
    assert str(caught[0].message) == (
        "ppo-fabric: FakeTracker failed (RuntimeError: file is not a database); the run goes on without it "
        "(metrics.csv and summary.json hold everything)"
    )
    assert logger.tracker is None


def test_the_ranks_recent_episodes_carry_their_ties() -> None:
    """Over several collecting ranks each sent its last 20 alone, so the log's `rollout/return_mean20` kept
    the order-picked part of a multi-agent env step that `final_mean_return` of the whole windows counts."""
    from ppo_fabric.runs.metrics import final_mean_return
    from ppo_fabric.runs.session import recent_windows

    a = [(step, ret, 5) for step in (90, 100) for ret in [-2.0] * 8 + [2.0] * 8]
    b = [(95, 1.0, 5)] * 3
    sent: list[torch.Tensor] = []
    for slot, window in enumerate((a, b)):
        recent_windows(window, slot, 2, lambda rows: sent.append(rows) or rows)
    gathered = recent_windows(a, 0, 2, lambda _rows: sent[0] + sent[1])
    assert final_mean_return(gathered) == final_mean_return([a, b]) == 3.0 / 35


def test_a_stop_during_the_final_evaluation_is_a_stop_the_resume_finishes(tmp_path: Path) -> None:
    """SIGINT while the final evaluation plays (the evaluation at the last update): the run stops as at any
    other update, its checkpoint owing that evaluation, and `resume=auto` plays it and completes the run.
    The run used to go on to its end: summary.json without the final evaluation, called complete, so the
    table's figure was missing and `resume=auto` said there was nothing to do; and a stop while the resumed
    run played it ended that run as complete too."""
    run_dir = tmp_path / "run"
    slow = [*(o for o in RUN if not o.startswith(("env.id=", "eval.every="))),
            "env.id=tests.faulty_env:FaultyCartPole-v0", "+env.kwargs.fault=signal_slow", "+env.kwargs.pause=3",
            "+env.kwargs.after=1", f"+env.kwargs.seeds=[{evaluation_seed(42)}]", "eval.every=256",
            "eval.episodes=1", "algo.total_steps=256", f"hydra.run.dir={run_dir}"]  # fmt: skip
    last = run_dir / "checkpoints" / "last.ckpt"
    for resume in ([], ["resume=auto"]):  # stopped again while the resumed run plays it: it stays owed
        with pytest.raises(KeyboardInterrupt):
            ppo_fabric.run([*slow, *resume])
        assert ckpt.load(last)["env_step"] == 256 and ckpt.load(last)["evaluation"]["in_flight"] == 256
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["interrupted"] is True and summary["evaluation"]["last"] is None
    resumed = ppo_fabric.run(["env.id=tests.faulty_env:FaultyCartPole-v0", "+env.kwargs.fault=none",
                              "resume_overrides=allow", "resume=auto", f"hydra.run.dir={run_dir}"])  # fmt: skip
    assert [int(r["step"]) for r in read_rows(run_dir / "evaluations.csv")] == [256]
    assert resumed["interrupted"] is False and resumed["evaluation"]["last"]["env_step"] == 256
    assert ckpt.load(last)["evaluation"]["in_flight"] is None  # nothing owed any more
