"""One run per run directory: a lock file that a run holds while it writes there.

Two runs writing into one directory (a requeued job whose first attempt still runs, the same command
typed twice, `resume=auto` pointed at a live run) overwrite each other's `last.ckpt`, interleave their
metrics and leave a run that neither of them trained. The first to start takes `<run dir>/ppo-fabric.lock`;
the second is refused in one line naming the owner, before it starts any process or trains a step.

The lock is a file created with O_CREAT|O_EXCL (one creator wins, on local file systems and on NFS v3+,
where cluster run directories often live and `flock` is emulated or unreliable), holding the owner's pid,
host, start time and command line as JSON, so that the refusal can say which run to wait for. A run killed
without its exit hooks (SIGKILL, the OOM killer, a node lost) leaves the file behind: on the same host a
dead pid proves it stale, as does a pid whose process started after the lock (a restarted container or a
rebooted node hands pids out again), and the next run takes it over with one line saying so. On another host liveness
cannot be checked, so such a lock is honoured until a person deletes it.

Who takes it: the supervisor of `python -m ppo_fabric`, once for all of the job's attempts (its job's
processes do not lock), else global rank 0 of the job (`fabric run`, torchrun, `ppo_fabric.run()`, see
`hold_for_ranks`). A sweep's jobs and a study's trials each run in a directory of their own.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import shlex
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from ppo_fabric.config.values import SUPERVISED_ENV, ConfigError, under_fabric_run

if TYPE_CHECKING:
    from lightning_fabric import Fabric

LOCK_NAME = "ppo-fabric.lock"
TAKEOVER = ".takeover"  # beside it while a run takes over a stale lock (`_move_aside`)
TAKEOVER_ABANDONED_S = 10.0  # a takeover lasts milliseconds: an older file's taker died inside it
# A lock file that does not parse may be one that its owner has created but not written yet (the JSON
# follows the O_EXCL create within microseconds): only one older than this counts as garbled.
WRITING_GRACE_S = 1.0


@dataclass(frozen=True)
class Owner:
    """What a lock file says about the run holding it: enough for a person to find that run."""

    pid: int
    host: str
    started: str  # ISO time, local time zone
    command: str
    boot: str = ""  # the host's boot id and the process's start in clock ticks since that boot (Linux's
    ticks: int = -1  # /proc): which process a pid is, immune to the wall clock being set

    @classmethod
    def this_process(cls) -> Owner:
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        ticks = start_ticks(os.getpid())
        return cls(
            os.getpid(),
            socket.gethostname(),
            started,
            shlex.join(sys.orig_argv),
            boot_id(),
            -1 if ticks is None else ticks,
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self)) + "\n"

    @classmethod
    def parse(cls, text: str) -> Owner | None:
        """The owner a lock file names, or None for a file that is not one of ours (garbled, truncated)."""
        try:
            data = json.loads(text)
            owner = cls(
                int(data["pid"]),
                str(data["host"]),
                str(data["started"]),
                str(data["command"]),
                str(data.get("boot", "")),
                int(data.get("ticks", -1)),
            )
        except (ValueError, TypeError, KeyError, AttributeError):
            return None
        return owner if owner.pid > 0 else None

    def alive(self) -> bool | None:
        """Whether the owner still runs: None on another host, where its pid means nothing here. A pid in
        use is the owner only if that process started before the lock did: a container restarted after an
        OOM kill, or a rebooted node, hands small pids out again (the dead owner's may even be this
        process's own, which holds no lock it has not taken)."""
        if self.host != socket.gethostname():
            return None
        if self.pid == os.getpid():
            return any(held.owner == self for held in _HELD)
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process: alive, unless it is another process
            pass
        ticks, boot = start_ticks(self.pid), boot_id()
        if self.ticks >= 0 and self.boot and ticks is not None and boot:
            return (boot, ticks) == (self.boot, self.ticks)
        # a lock of an earlier release (no boot id): a process that started well after the lock's time is
        # another one (a margin for the wall clock being set since)
        began, locked = process_start(self.pid), _timestamp(self.started)
        return began is None or locked is None or began <= locked + 60.0


def _timestamp(iso: str) -> float | None:
    try:
        return datetime.datetime.fromisoformat(iso).timestamp()
    except ValueError:
        return None


def boot_id() -> str:
    """This boot of the host (Linux), "" where unknown: the same pid after a reboot is another process."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (Linux's /proc/<pid>/stat), None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        # after the command name, which may hold spaces and parentheses: field 22 (starttime) is the 20th
        return int(stat.rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def process_start(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch, by the wall clock now), None where unknown."""
    ticks = start_ticks(pid)
    try:
        boot = next(
            float(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return None if ticks is None else boot + ticks / os.sysconf("SC_CLK_TCK")


_HELD: list[RunDirLock] = []  # the locks this process holds (not yet released)


class RunDirLock:
    """A held lock: `release()` (or leaving the `with` block) deletes the file while it is still ours;
    the interpreter's exit releases it too, for a process that ends without reaching either."""

    def __init__(self, path: Path, owner: Owner) -> None:
        self.path, self.owner = path, owner
        self.released = False
        _HELD.append(self)
        atexit.register(self.release)

    def release(self) -> None:
        """Delete the lock file if it still names this process: a run that took over a lock it thought
        stale must never lose it to the process it took it from, and a forked child (an env worker)
        inheriting this object never releases its parent's lock."""
        if self.released or os.getpid() != self.owner.pid:
            return
        self.released = True
        with contextlib.suppress(ValueError):
            _HELD.remove(self)
        atexit.unregister(self.release)
        with contextlib.suppress(OSError, UnicodeDecodeError):
            found = Owner.parse(self.path.read_text())
            if found is not None and (found.pid, found.host) == (self.owner.pid, self.owner.host):
                self.path.unlink()

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def say(text: str) -> None:
    os.write(2, f"ppo-fabric: {text}\n".encode())  # one write: never interleaved with another process's line


def acquire(run_dir: str | Path) -> RunDirLock:
    """Take the lock of `run_dir` for this process; raises ConfigError (one line naming the owner) while a
    live run, or a run on another host, holds it. A stale or garbled lock is taken over with one line."""
    run_dir = Path(run_dir).resolve()
    path = run_dir / LOCK_NAME
    with contextlib.suppress(OSError):  # one that cannot be made is named by the create below
        run_dir.mkdir(parents=True, exist_ok=True)
    me = Owner.this_process()
    took_over: str | None = None  # the line to print once the stale file is replaced by ours
    # past the age at which a takeover's turn left by a run killed inside it is cleared (`_move_aside`)
    deadline = time.monotonic() + TAKEOVER_ABANDONED_S + 4 * WRITING_GRACE_S
    while time.monotonic() < deadline:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            stale = _stale(path, run_dir)
            if stale is not None and _move_aside(path, stale.file):
                took_over = stale.line
            continue  # created, moved or removed in between by another process: look again
        except OSError as exc:  # a read-only or full file system, no permission
            raise ConfigError(
                f"hydra.run.dir={run_dir}: cannot create its lock file {path} "
                f"({exc.strerror or type(exc).__name__}); choose a directory this user can write"
            ) from exc
        with os.fdopen(fd, "w") as fh:
            fh.write(me.to_json())
            fh.flush()
            os.fsync(fh.fileno())
        if took_over is not None:
            say(took_over)
        return RunDirLock(path, me)
    raise ConfigError(
        f"hydra.run.dir={run_dir}: could not take its lock {path} (other processes kept taking it); "
        "try again, or choose another directory"
    )


def node_rank() -> int:
    """This machine's node of a multi-node job, as Lightning reads it (NODE_RANK, else GROUP_RANK; 0)."""
    return int(os.environ.get("NODE_RANK") or os.environ.get("GROUP_RANK") or 0)


def speaks_first() -> bool:
    """The process that refuses a live run's directory before anything starts: the command line's (not a
    supervised job's, whose supervisor holds the lock, nor a `fabric run` rank, whose rank 0 takes it at
    launch while the other ranks may still be checking)."""
    ranks = (os.environ.get(name, "0") or "0" for name in ("RANK", "LOCAL_RANK", "NODE_RANK"))
    return not (os.environ.get(SUPERVISED_ENV) or under_fabric_run()) and all(r == "0" for r in ranks)


def refuse_if_held(run_dir: str | Path) -> None:
    """Raise ConfigError (naming the owner) when a live run holds `run_dir`'s lock; nothing else. The
    checks before a run call it first, so a second run into a live run's directory hears that, not that
    the directory "already holds a run" or that its checkpoint is behind; `acquire` takes the lock later."""
    run_dir = Path(run_dir).resolve()
    path = run_dir / LOCK_NAME
    if path.is_file():
        _stale(path, run_dir)


@dataclass(frozen=True)
class LockFile:
    """One lock file as it was read: its identity (a file created later under the same name differs, even
    with the same text: an empty lock, its owner killed before writing it, and the next run's, not yet
    written) and its text (None: unreadable)."""

    identity: tuple[int, int, int, int]  # device, inode, mtime and ctime in ns
    text: str | None

    @staticmethod
    def read(path: Path) -> tuple[LockFile, float]:
        """The file at `path` and its age in seconds, from one open file (raises FileNotFoundError)."""
        with path.open("rb") as fh:
            st = os.fstat(fh.fileno())
            try:
                text: str | None = fh.read().decode()
            except (OSError, UnicodeDecodeError):  # unreadable (I/O, binary junk): garbled
                text = None
        return LockFile(
            (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns), text
        ), time.time() - st.st_mtime


@dataclass(frozen=True)
class Stale:
    file: LockFile
    line: str  # what the takeover says


def _stale(path: Path, run_dir: Path) -> Stale | None:
    """An existing lock file that is stale (its owner is gone, or it is garbled), with the line saying it
    is taken over. None when it vanished meanwhile or is still being written. Raises ConfigError when its
    owner may be running."""
    try:
        found, age = LockFile.read(path)
    except FileNotFoundError:
        return None
    except OSError:  # unopenable (permissions): garbled
        found, age = LockFile((0, 0, 0, 0), None), WRITING_GRACE_S
    owner = Owner.parse(found.text) if found.text is not None else None
    if owner is None:
        if age < WRITING_GRACE_S:
            time.sleep(0.05)  # its owner may be writing it
            return None
        return Stale(found, f"took over the lock of {run_dir} (its lock file {path} was unreadable)")
    alive = owner.alive()
    if alive is False:
        return Stale(
            found, f"took over the lock of {run_dir} from pid {owner.pid} on {owner.host} (no longer running)"
        )
    who = f"pid {owner.pid} on {owner.host}, started {owner.started}"
    what = "a live run" if alive else "a run on another host"
    raise ConfigError(
        f"hydra.run.dir={run_dir} is in use by {what} ({who}); wait for it, or choose another directory "
        f"(delete {path} if that run is gone)"
    )


def _move_aside(path: Path, stale: LockFile) -> bool:
    """Remove a stale lock file, unless another process replaced it meanwhile (two runs taking over the
    same stale lock). Takeovers take turns through a second file created with O_EXCL (`TAKEOVER`): the lock
    is read again inside it and removed only while it still is the very file judged stale (its identity,
    not only its text: a fresh lock not yet written reads "" as an abandoned empty one does), and nothing but
    a takeover removes a lock its owner does not release. Returns whether the stale file was removed.

    Renaming the lock aside first and putting back a fresh one moved by mistake lost a live run's lock
    when a third run created its own in between (the put-back failed): two live runs held the directory."""
    guard = path.with_name(path.name + TAKEOVER)
    try:
        os.close(os.open(guard, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:  # another run is taking it over: look again shortly
        _clear_abandoned(guard)
        time.sleep(0.01)
        return False
    try:
        try:
            now = LockFile.read(path)[0]
        except FileNotFoundError:
            return False
        except OSError:
            now = LockFile((0, 0, 0, 0), None)
        if now != stale:
            return False
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return True
    finally:
        guard.unlink(missing_ok=True)


def _clear_abandoned(guard: Path) -> None:
    """Remove a takeover's turn left by a run killed inside it (older than a takeover ever lasts), and only
    that file: it is renamed to a name of this process's first, so two runs clearing it at once cannot
    remove a turn the first of them took meanwhile; one renamed by mistake goes back."""
    try:
        before = os.stat(guard)
        if time.time() - before.st_mtime <= TAKEOVER_ABANDONED_S:
            return
        aside = guard.with_name(f"{guard.name}.{os.getpid()}.{time.monotonic_ns()}")
        os.rename(guard, aside)
    except OSError:  # gone meanwhile: another run cleared it
        return
    with contextlib.suppress(OSError):
        moved = os.stat(aside)
        if (moved.st_ino, moved.st_mtime_ns) != (before.st_ino, before.st_mtime_ns):  # a live turn: back
            os.link(aside, guard)
    with contextlib.suppress(OSError):
        aside.unlink()


def hold_for_ranks(
    fabric: Fabric, run_dir: Path, take: bool = True
) -> contextlib.AbstractContextManager[object]:
    """The lock of a job's run directory, taken by global rank 0 (`take=False`: someone else holds it,
    e.g. the job's supervisor); returns what releases it (a no-op on the other ranks). Every rank learns
    rank 0's outcome, so a refusal is the same ConfigError on all of them rather than rank 0 failing alone
    while its peers wait in a collective."""
    held: RunDirLock | None = None
    refusal: str | None = None
    if take and fabric.global_rank == 0:
        try:
            held = acquire(run_dir)
        except ConfigError as exc:
            refusal = str(exc)
    refusal = fabric.broadcast(refusal, src=0)
    if refusal is not None:
        raise ConfigError(refusal)
    return held if held is not None else contextlib.nullcontext()
