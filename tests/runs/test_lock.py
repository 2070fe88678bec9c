"""One run per run directory: the lock file taken, refused while its owner lives, taken over when it is
stale or garbled, released only by its owner; and two `python -m ppo_fabric` into one directory."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import ppo_fabric
from ppo_fabric.config.values import ConfigError
from ppo_fabric.runs import lock
from tests.conftest import job_env, job_processes

SMALL = ["env.num_envs=4", "algo.rollout_steps=64", "collectives.timeout=20"]  # 256 samples: one minibatch


NOW = lock.Owner.this_process().started  # a live owner's lock is younger than its process


def _write_owner(
    run_dir: Path, pid: int, host: str | None = None, age_s: float = 0.0, started: str = NOW
) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / lock.LOCK_NAME
    owner = lock.Owner(pid, host or socket.gethostname(), started, "python -m ppo_fabric")
    path.write_text(owner.to_json())
    if age_s:
        os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def _dead_pid() -> int:
    """A pid no process can have: Linux hands out pids below pid_max."""
    return int(Path("/proc/sys/kernel/pid_max").read_text())


def _err_lines(capfd: pytest.CaptureFixture[str]) -> list[str]:
    return capfd.readouterr().err.splitlines()


@pytest.mark.unit
def test_lock_is_taken_and_released(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    held = lock.acquire(run_dir)
    data = json.loads((run_dir / lock.LOCK_NAME).read_text())
    assert data["pid"] == os.getpid() and data["host"] == socket.gethostname()
    assert data["started"][:4].isdigit() and "T" in data["started"] and data["command"]
    held.release()
    assert not (run_dir / lock.LOCK_NAME).exists()
    with lock.acquire(run_dir):  # free again; a `with` block releases it too
        assert (run_dir / lock.LOCK_NAME).exists()
    assert not (run_dir / lock.LOCK_NAME).exists()


@pytest.mark.unit
def test_a_live_owner_is_refused_in_one_line_naming_it(tmp_path: Path) -> None:
    path = _write_owner(tmp_path, os.getppid(), age_s=60)
    with pytest.raises(ConfigError) as refused:
        lock.acquire(tmp_path)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"hydra.run.dir={tmp_path.resolve()} is in use by a live run "), message
    assert f"(pid {os.getppid()} on {socket.gethostname()}, started {NOW})" in message
    assert f"delete {path}" in message
    assert lock.Owner.parse(path.read_text()).pid == os.getppid(), "the owner's file is left alone"


@pytest.mark.unit
def test_an_owner_on_another_host_is_refused(tmp_path: Path) -> None:
    """Its pid cannot be checked from here, even when no process here has it."""
    _write_owner(tmp_path, _dead_pid(), host="elsewhere.example")
    with pytest.raises(ConfigError, match=rf"a run on another host \(pid {_dead_pid()} on elsewhere.example"):
        lock.acquire(tmp_path)


@pytest.mark.unit
def test_a_dead_owners_lock_is_taken_over_with_one_line(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    dead = _dead_pid()
    path = _write_owner(tmp_path, dead, age_s=60)
    held = lock.acquire(tmp_path)
    assert json.loads(path.read_text())["pid"] == os.getpid()
    assert _err_lines(capfd) == [
        f"ppo-fabric: took over the lock of {tmp_path.resolve()} from pid {dead} on {socket.gethostname()} "
        "(no longer running)"
    ]
    held.release()
    assert not path.exists() and not list(tmp_path.glob("*.stale")), "nothing left beside it"


@pytest.mark.unit
@pytest.mark.parametrize("whose", ["a process younger than the lock", "this process's own"])
def test_a_pid_handed_out_again_is_no_owner(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], whose: str
) -> None:
    """A container restarted after an OOM kill, or a rebooted node, hands the dead owner's pid out again:
    to a process that started after the lock was taken, or to the run that now wants it. Either way the
    lock is stale (every retry of a requeued job was refused as "in use by a live run")."""
    if whose == "this process's own":
        pid, started = os.getpid(), NOW
    else:
        pid, started = os.getppid(), "2024-01-02T03:04:05+00:00"
        assert lock.process_start(pid) is not None, "Linux's /proc tells when a process started"
    path = _write_owner(tmp_path, pid, age_s=60, started=started)
    with lock.acquire(tmp_path):
        assert json.loads(path.read_text())["started"] != "2024-01-02T03:04:05+00:00"
        assert lock.Owner.parse(path.read_text()).alive() is True  # the lock this process holds: live
    assert _err_lines(capfd) == [
        f"ppo-fabric: took over the lock of {tmp_path.resolve()} from pid {pid} on {socket.gethostname()} "
        "(no longer running)"
    ]


@pytest.mark.unit
def test_a_lock_names_its_process_by_boot_and_start_not_by_the_wall_clock(tmp_path: Path) -> None:
    """A lock records the host's boot id and its process's start in ticks since boot: a live process with
    that pid is its owner only if both match (the wall clock being set since does not matter); another
    process with the pid, or the pid after a reboot, is not."""
    me = lock.Owner.this_process()
    assert me.boot and me.ticks == lock.start_ticks(os.getpid())
    parent = lock.Owner(os.getppid(), socket.gethostname(), "2024-01-02T03:04:05+00:00", "x",
                        me.boot, lock.start_ticks(os.getppid()))  # fmt: skip
    assert parent.alive() is True  # its start ticks hold, however old its wall-clock time reads
    assert replace(parent, ticks=parent.ticks + 1).alive() is False
    assert replace(parent, boot="another-boot").alive() is False
    assert lock.Owner.parse(me.to_json()) == me


@pytest.mark.unit
@pytest.mark.parametrize("content", [b"", b"{not json", b'{"pid": "x"}', b"\xff\xfe\x00"])
def test_a_garbled_lock_file_is_taken_over(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], content: bytes
) -> None:
    path = tmp_path / lock.LOCK_NAME
    path.write_bytes(content)
    os.utime(path, (time.time() - 60, time.time() - 60))
    with lock.acquire(tmp_path):
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert _err_lines(capfd) == [
        f"ppo-fabric: took over the lock of {tmp_path.resolve()} (its lock file {path} was unreadable)"
    ]


@pytest.mark.unit
def test_a_lock_file_being_written_is_not_taken_over(tmp_path: Path) -> None:
    """Between its owner's O_EXCL create and its write the file is empty: a run starting in that instant
    waits for the content instead of taking it for garbage."""
    path = tmp_path / lock.LOCK_NAME
    path.write_bytes(b"")
    writer = threading.Timer(0.2, lambda: _write_owner(tmp_path, os.getppid()))
    writer.start()
    try:
        with pytest.raises(ConfigError, match=f"in use by a live run \\(pid {os.getppid()} "):
            lock.acquire(tmp_path)
    finally:
        writer.join()


@pytest.mark.unit
@pytest.mark.parametrize("content", ["", "owner"])
def test_a_takeover_never_removes_a_lock_that_replaced_the_stale_one(tmp_path: Path, content: str) -> None:
    """Run B judged the lock stale; run A took it over first and holds a fresh one. A lock whose owner was
    killed between its create and its write is empty, and so is A's fresh one until A writes it: judged by
    its text, B removed A's lock and both held the directory. B removes only the very file it judged."""
    path = tmp_path / lock.LOCK_NAME
    if content:
        _write_owner(tmp_path, _dead_pid(), age_s=60)
    else:
        path.write_text("")
        os.utime(path, (time.time() - 60, time.time() - 60))
    judged = lock._stale(path, tmp_path)  # run B's look
    assert judged is not None
    assert lock._move_aside(path, judged.file) is True  # run A's takeover, first
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)  # A's lock, not yet written
    os.close(fd)
    if content:  # even the very text of the stale one (identity, not text, tells them apart)
        path.write_text(judged.file.text or "")
    assert lock._move_aside(path, judged.file) is False, "run A still holds it"
    assert path.exists() and sorted(p.name for p in tmp_path.iterdir()) == [lock.LOCK_NAME]


@pytest.mark.unit
def test_takeovers_take_turns_and_an_abandoned_turn_is_cleared(tmp_path: Path) -> None:
    """While another run takes the lock over (its `.takeover` file), a run does not touch the lock; a turn
    left by a run killed inside it (older than a takeover ever lasts) does not block takeovers for ever."""
    path = _write_owner(tmp_path, _dead_pid(), age_s=60)
    stale = lock.LockFile.read(path)[0]
    guard = path.with_name(lock.LOCK_NAME + lock.TAKEOVER)
    guard.touch()
    assert lock._move_aside(path, stale) is False and lock.LockFile.read(path)[0] == stale and guard.exists()
    old = time.time() - lock.TAKEOVER_ABANDONED_S - 1
    os.utime(guard, (old, old))
    assert lock._move_aside(path, stale) is False and not guard.exists()  # cleared; the next look takes it
    assert lock._move_aside(path, stale) is True and not path.exists() and not guard.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.unit
def test_clearing_an_abandoned_turn_puts_back_a_live_one_taken_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs B and C both saw an abandoned turn; B cleared it and took a turn of its own. C, clearing by
    name, removed B's live turn and both took the lock over at once. C moves the file aside, sees it is not
    the one it judged abandoned, and puts it back."""
    guard = tmp_path / (lock.LOCK_NAME + lock.TAKEOVER)
    guard.touch()
    old = time.time() - lock.TAKEOVER_ABANDONED_S - 1
    os.utime(guard, (old, old))
    real_rename = os.rename

    def b_clears_and_takes_a_turn_first(src: Any, dst: Any) -> None:
        os.unlink(src)  # B's clearing
        os.close(os.open(src, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))  # B's live turn
        real_rename(src, dst)

    monkeypatch.setattr(lock.os, "rename", b_clears_and_takes_a_turn_first)
    lock._clear_abandoned(guard)  # run C
    assert guard.exists() and time.time() - guard.stat().st_mtime < 5, "B's turn is back"
    assert sorted(p.name for p in tmp_path.iterdir()) == [guard.name], "nothing left beside it"


@pytest.mark.unit
def test_release_deletes_only_its_own_lock(tmp_path: Path) -> None:
    held = lock.acquire(tmp_path)
    path = _write_owner(tmp_path, os.getppid())  # e.g. another run took it over meanwhile
    held.release()
    assert lock.Owner.parse(path.read_text()).pid == os.getppid()
    held.release()  # twice: still nothing
    assert path.exists()


@pytest.mark.unit
def test_a_directory_that_cannot_hold_the_lock_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"cannot create its lock file .* \(Not a directory\)"):
        lock.acquire(tmp_path / "file" / "run")


@pytest.mark.unit
def test_a_forked_child_never_releases_its_parents_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An env worker forked from rank 0 inherits the held lock (and its exit hook): not its to release."""
    held = lock.acquire(tmp_path)
    with monkeypatch.context() as patch:
        patch.setattr(os, "getpid", lambda: held.owner.pid + 1)  # as seen from a forked child
        held.release()
    assert (tmp_path / lock.LOCK_NAME).exists()
    held.release()
    assert not (tmp_path / lock.LOCK_NAME).exists()


class _Rank:
    """The two calls `hold_for_ranks` makes of Fabric, for rank `global_rank` of a job whose rank 0 said
    `said` (None: this is rank 0, or a job of one process)."""

    def __init__(self, global_rank: int, said: Any = None) -> None:
        self.global_rank, self.said = global_rank, said

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj if self.global_rank == src else self.said


@pytest.mark.unit
def test_every_rank_raises_rank_0s_refusal(tmp_path: Path) -> None:
    _write_owner(tmp_path, os.getppid())
    with pytest.raises(ConfigError) as on_rank_0:
        lock.hold_for_ranks(_Rank(0), tmp_path)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as on_rank_1:
        lock.hold_for_ranks(_Rank(1, said=str(on_rank_0.value)), tmp_path)  # type: ignore[arg-type]
    assert str(on_rank_1.value) == str(on_rank_0.value)
    (tmp_path / lock.LOCK_NAME).unlink()
    with lock.hold_for_ranks(_Rank(1), tmp_path):  # type: ignore[arg-type]
        assert not (tmp_path / lock.LOCK_NAME).exists(), "only rank 0 takes it"
    with lock.hold_for_ranks(_Rank(0), tmp_path, take=False):  # type: ignore[arg-type]
        assert not (tmp_path / lock.LOCK_NAME).exists(), "a supervised job's supervisor holds it"


@pytest.mark.unit
def test_an_in_process_run_is_refused_by_a_live_owner(tmp_path: Path) -> None:
    """`ppo_fabric.run()` (no supervisor): rank 0 locks in `launch`; a live owner refuses it in one line."""
    _write_owner(tmp_path, os.getppid())
    with pytest.raises(ConfigError, match=f"is in use by a live run \\(pid {os.getppid()} on "):
        ppo_fabric.run(["algo.total_steps=256", "logger=none", f"hydra.run.dir={tmp_path}"])
    assert not (tmp_path / "config.yaml").exists(), "refused before the run wrote anything"


@pytest.mark.unit
def test_a_finished_run_leaves_no_lock(tiny_run: Path) -> None:
    assert (tiny_run / "summary.json").exists() and not (tiny_run / lock.LOCK_NAME).exists()


@pytest.mark.multiprocess
def test_the_interpreters_exit_releases_the_lock(tmp_path: Path) -> None:
    code = f"from ppo_fabric.runs.lock import acquire; held = acquire({str(tmp_path)!r}); print(held.path)"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=job_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout.strip() == str(tmp_path / lock.LOCK_NAME), proc.stderr
    assert not (tmp_path / lock.LOCK_NAME).exists()


@pytest.mark.multiprocess
def test_a_second_run_into_a_live_runs_directory_is_refused(tmp_path: Path) -> None:
    """The supervisor of a running `python -m ppo_fabric` holds the lock; a second one into the same
    directory (here with resume=auto, which accepts a used directory) exits 2 within seconds with one line
    naming the first's pid. SIGTERM then stops the first as always, and its lock goes with it."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "ppo_fabric", *SMALL, "algo.total_steps=10000000", "logger=none"]
    first = subprocess.Popen(
        [*cmd, f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=job_env(), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (run_dir / lock.LOCK_NAME).exists():
            assert first.poll() is None, first.communicate()[1]
            assert time.monotonic() < deadline, "the first run never took the lock"
            time.sleep(0.1)
        assert json.loads((run_dir / lock.LOCK_NAME).read_text())["pid"] == first.pid, (
            "the supervisor holds it"
        )
        started = time.monotonic()
        second = subprocess.run(
            [*cmd, "resume=auto", f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=job_env(),
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        took = time.monotonic() - started
        assert second.returncode == 2, second.stderr[-3000:]
        assert second.stderr.count("\n") == 1, second.stderr[-3000:]
        assert second.stderr.startswith(
            f"ppo-fabric: error: hydra.run.dir={run_dir} is in use by a live run (pid {first.pid} on "
        ), second.stderr
        # ~8 s on 2 busy cores (the check, then the lock), 32 s at load 6: the bound tells a refusal from a
        # second run that waits for the first (which runs for 10M steps), not a fast machine from a slow one
        assert took < 50, f"refused after {took:.1f} s"
        assert first.poll() is None, "the first run goes on"
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 143, err[-3000:]
    assert not (run_dir / lock.LOCK_NAME).exists(), "the supervisor released it"
    deadline = time.monotonic() + 10
    while job_processes(run_dir):
        assert time.monotonic() < deadline, f"processes outlived the run: {job_processes(run_dir)}"
        time.sleep(0.1)


RACER = """
import sys, time
from ppo_fabric.config.values import ConfigError
from ppo_fabric.runs import lock
start, run_dir = float(sys.argv[1]), sys.argv[2]
while time.time() < start:
    time.sleep(0.001)
try:
    held = lock.acquire(run_dir)
except ConfigError:
    print("refused")
else:
    begin = time.time()
    time.sleep(0.3)
    print(f"held {begin} {time.time()}")
    held.release()
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("content", ["", "owner"])
def test_runs_taking_over_one_stale_lock_at_once_never_hold_it_together(tmp_path: Path, content: str) -> None:
    """Five processes meet one stale lock (a dead owner's, or an empty one) at the same instant: one takes it
    over and says so, the others wait for it or are refused; never two holders at once."""
    path = _write_owner(tmp_path, _dead_pid(), age_s=60)
    if not content:
        path.write_text("")
        os.utime(path, (time.time() - 60, time.time() - 60))
    start = time.time() + 3.0  # every interpreter started and imported by then
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(start), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(5)
    ]
    outs = [r.communicate(timeout=60) for r in racers]
    held = [tuple(map(float, out.split()[1:])) for out, _ in outs if out.startswith(b"held")]
    assert held, outs
    assert max(sum(b <= t < e for b, e in held) for t, _ in held) == 1, held
    said = [line for _, err in outs for line in err.decode().splitlines() if "took over" in line]
    assert len(said) == 1, said
    assert not path.exists() and sorted(p.name for p in tmp_path.iterdir()) == []
