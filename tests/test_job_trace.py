"""benchmarks/job_trace.py: a benchmark run stopped before its first update says where its processes were.

A traced process tree (a parent and a child in a session of its own, as the supervisor starts a job) marks
each interpreter's start and the start of a marked import, and writes every process's stack on SIGUSR1 and
goes on; `common.run_once` with a timeout puts that trace in its `LoggedNothing`."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import benchmark_script

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.multiprocess


CHILD = "import sys, time; import ale_py; print('imported', file=sys.stderr, flush=True); time.sleep(60)"
PARENT = (
    "import subprocess, sys, time; "
    f"subprocess.Popen([sys.executable, '-c', {CHILD!r}], start_new_session=True); time.sleep(60)"
)


def test_a_traced_process_tree_marks_its_start_and_dumps_every_stack(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    jt = benchmark_script(monkeypatch, "job_trace")
    env = jt.traced_env(tmp_path / "trace")
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-c", PARENT], stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    trace = jt.Trace(proc, started, tmp_path / "trace")
    try:
        deadline = time.monotonic() + 30
        while not any(line == "imported" for _, line in trace.lines) and time.monotonic() < deadline:
            time.sleep(0.1)
        children = jt.descendants(proc.pid)
        assert len(children) == 1  # the child left the parent's session, and is still found
        jt.dump_stacks(proc.pid)
        assert proc.poll() is None  # SIGUSR1 wrote the stacks; it did not end the process
    finally:
        for pid in [proc.pid, *jt.descendants(proc.pid)]:
            subprocess.run(["kill", "-9", str(pid)], check=False)
        proc.wait()
        trace.join()
    digest = trace.digest()
    assert digest.startswith("2 processes up (first ")
    assert "1 importing ale_py" in digest and "importing torch" not in digest
    assert digest.endswith("stacks of 2: 2 at <string>:1 in <module>"), trace.text()
    stacks = trace.stacks()  # one file per process: fifteen processes on one pipe would interleave
    assert sorted(stacks) == sorted([proc.pid, *children]) and "<frozen" not in " ".join(stacks.values())
    assert trace.text().count("--- stacks of pid ") == 2


def test_where_a_process_stood_is_its_main_threads_innermost_project_frame(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    jt = benchmark_script(monkeypatch, "job_trace")
    dump = """Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.12/threading.py", line 355 in wait
  File "/x/ppo_fabric/app/launch.py", line 40 in watch

Current thread 0x00007f0000000002 (most recent call first):
  File "/x/site-packages/torch/distributed/distributed_c10d.py", line 2000 in recv
  File "/x/ppo_fabric/wire/protocol.py", line 120 in receive_params
  File "/x/ppo_fabric/ppo_decoupled.py", line 300 in player
  File "<string>", line 1 in <module>"""
    assert jt.where_stopped(dump) == "wire/protocol.py:120 in receive_params"
    # no project frame: the innermost frame of the main thread, as its last two path parts
    assert (
        jt.where_stopped(dump.replace("ppo_fabric", "lib")) == "distributed/distributed_c10d.py:2000 in recv"
    )
    assert (
        jt.where_stopped("Current thread 0x1 (most recent call first):\n  <no Python frame>")
        == "no Python frame"
    )


def test_a_run_stopped_before_its_first_update_says_how_far_its_processes_got(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    common = benchmark_script(monkeypatch, "common")
    # a first rollout of 102,400 steps (400 minibatches of 256): no update can be logged within the 1-s
    # timeout on any machine (exp=fast's CartPole run once logged its first within it on an idle one)
    first_rollout_long = ["env.num_envs=1", "algo.rollout_steps=102400", "algo.total_steps=100000000"]
    with pytest.raises(common.LoggedNothing) as stopped:
        common.run_once(first_rollout_long, timeout=1.0)
    message = str(stopped.value)
    assert message.startswith("benchmark run stopped after 1 s before it logged an update: ")
    assert " processes up (first " in message and "; stacks of " in message
    assert "[trace] pid" in stopped.value.trace and "--- stacks of pid " in stopped.value.trace


def test_a_traced_process_writes_its_stacks_at_the_deadline_without_a_signal(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On the H100 machine the ranks of a job wrote no stacks on SIGUSR1: the deadline needs no signal."""
    jt = benchmark_script(monkeypatch, "job_trace")
    env = jt.traced_env(tmp_path / "trace", deadline=time.time() + 1.0)
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env=env, stderr=subprocess.PIPE, text=True
    )
    trace = jt.Trace(proc, time.monotonic(), tmp_path / "trace")
    try:
        deadline = time.monotonic() + 20
        while not trace.stacks() and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()
        trace.join()
    assert list(trace.stacks()) == [proc.pid]
    assert trace.digest().endswith("stacks of 1: 1 at <string>:1 in <module>")


def test_ctrl_c_during_a_benchmark_run_stops_its_job_and_ends_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run's job is in a session of its own, so the terminal's Ctrl+C reached only the benchmark: its job
    trained on (a kept run's rerun was then refused as a live run) and two tracebacks were printed. Now the
    job gets the SIGINT (its checkpoint is written) and the benchmark ends with one line and status 130."""
    import subprocess
    from types import SimpleNamespace

    common = benchmark_script(monkeypatch, "common")
    job = tmp_path / "job"
    # stands in for `python -m ppo_fabric ...`, which takes SIGINT whatever it inherited: a suite started in
    # the background (`make test &`) passes SIGINT on ignored, and a shell's `sleep` then never got it
    ready = tmp_path / "ready"
    job.write_text(
        f"#!{sys.executable}\nimport signal, time\nsignal.signal(signal.SIGINT, signal.SIG_DFL)\n"
        f"open({str(ready)!r}, 'w').close()\ntime.sleep(60)\n"
    )
    job.chmod(0o755)
    monkeypatch.setattr(common.sys, "executable", str(job))
    started: list[subprocess.Popen[str]] = []

    class Interrupted(subprocess.Popen):  # type: ignore[type-arg]
        def wait(self, timeout: float | None = None) -> int:
            if not started:
                started.append(self)
                deadline = time.monotonic() + 30
                while not ready.exists() and time.monotonic() < deadline:  # Ctrl+C once it is running
                    time.sleep(0.01)
                raise KeyboardInterrupt
            return super().wait(timeout)

    monkeypatch.setattr(
        common,
        "subprocess",
        SimpleNamespace(
            Popen=Interrupted,
            TimeoutExpired=subprocess.TimeoutExpired,
            DEVNULL=subprocess.DEVNULL,
            PIPE=subprocess.PIPE,
        ),
    )
    with pytest.raises(SystemExit) as ended:
        try:
            common.run_once(["algo.total_steps=1000"], run_dir=tmp_path / "run")
        except KeyboardInterrupt:  # uncaught, it would end the whole pytest session
            pytest.fail("the Ctrl+C went through run_once untouched")
    assert ended.value.code == 130
    assert started[0].returncode == -2  # the job got SIGINT, and is gone
    assert capsys.readouterr().err.strip().splitlines() == [
        f"benchmarks: stopped by Ctrl+C; the run keeps its checkpoint in {tmp_path / 'run'}"
    ]
