"""The stall watchdog: a rank that makes no progress for `stall_timeout` seconds ends the job, naming
itself, its role and where it is stuck, with every process's Python stacks in the run directory.

A stuck simulator (an env whose `step` never returns) used to hang a 1-process run for ever and end a
decoupled job with gloo's "Timed out waiting 30000ms for send operation" naming nobody. Here every
process runs a daemon thread that reads `wire.progress.PROGRESS` once a second:

- when this process has been *busy* (not waiting on a peer) without a mark for longer than the timeout,
  it claims the job's end (a file created exclusively, so one process speaks), writes its stacks, gives
  the others a moment to write theirs, prints one line (`player rank 1: no progress for 600 s, in
  env.step (my_env.py:42, in step)`) and leaves with `FAULT_EXIT`, which the supervisor's `restarts=N`
  relaunches from the last checkpoint;
- when another process claimed the end (a stall, or a collective that timed out), it writes its own
  stacks and leaves too, so that nothing of the job is left running.

Under Fabric's launcher a child's non-zero exit gets its node's first process (rank 0) SIGKILLed at the
launcher's next look (every 5 s): a child that left first could cut rank 0 short of its line (exit -9,
nothing said). So an answering process leaves once the claiming one has printed its line (`spoke()`, a
mark in the stall directory), and a launcher child ending the job this way leaves after its parent.

A collective that times out goes through `collective_timeout`: the waiting rank asks every process for
its stacks and names the busy rank that has gone longest without progress, instead of gloo's message.
The thread cannot run while C code holds the GIL for ever: `runs/deadman.py`'s timer, in a C thread it
re-arms every second, then ends the process with its stacks once the thread has not run for
`stall_timeout` plus a grace.
An in-process run (`ppo_fabric.run()`, `interrupting`) raises its stall in its main thread instead of
ending the process its caller owns.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from ppo_fabric.config.faults import FAULT_EXIT, fault_status, launcher_child
from ppo_fabric.envs.make import end_env_workers
from ppo_fabric.runs import deadman
from ppo_fabric.wire.progress import PROGRESS, STACK_HOOKS

CLAIM = ".stall-claim"  # in the run directory: which stall directory this job's end writes its stacks to
POLL_S = 1.0
SETTLE_S = 3.0  # how long the claiming process waits for the others' stacks before it leaves
# A busy process whose last progress is this recent when a peer's wait times out is not stuck: its work (a
# long in-place evaluation) outlasted the wait ("rank 0: no progress for 0.1 s" contradicted itself).
MOVING_S = 5.0
SAID = ".said"  # in the stall directory: the claiming process has printed the job's line
CAUSE_SAID = ".cause-said"  # in the run directory: a process of this attempt has printed the job's cause
LOSS_SAID = ".loss-said"  # in the run directory: a process of this attempt has said it lost a peer
# Raises the stall into an in-process run's main thread: ignored by default, so one that arrives after the
# run has put its handler back does nothing, and used by nothing else a Python program normally runs.
STALL_SIGNAL = signal.SIGURG


class Stalled(BaseException):
    """Raised in the main thread of an in-process run (`ppo_fabric.run()`) that stalled: a BaseException,
    so that no env's failure handler (`env.on_error=restart`) takes it for the env's own error. The run
    raises it to its caller as a `RunFault` with the watchdog's line."""


def seconds_text(seconds: float) -> str:
    """Whole seconds, or one decimal below 10 s (a stall_timeout of 0.2 s read "no progress for 0 s")."""
    return f"{seconds:.0f}" if seconds >= 10 else f"{seconds:.1f}"


def where_stuck() -> str:
    """`env.step (my_env.py:42, in step)`: what the main thread was marked doing, and its innermost frame."""
    return f"{PROGRESS.doing}{main_thread_place()}"


def main_thread_place() -> str:
    """` (my_env.py:42, in step)`: the main thread's innermost frame ("" when it has none)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return ""
    last = traceback.extract_stack(frame)[-1]
    return f" ({Path(last.filename).name}:{last.lineno}, in {last.name})"


class Watchdog:
    """One per process, for the run in `run_dir`; `start()` once the run directory is known, `stop()` at
    the end (also on the way out of a failure)."""

    def __init__(self, run_dir: Path, timeout_s: float, world_size: int) -> None:
        self.run_dir, self.timeout_s, self.world_size = run_dir, timeout_s, world_size
        self.started = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.answered: str | None = None  # the stall directory this process wrote its stacks into
        self.claimed: Path | None = None  # the stall directory this process claimed, when it did
        self._stalled: str | None = None  # the line an in-process run's main thread raises (`interrupting`)
        self._handler: object = None  # STALL_SIGNAL's handler before `interrupting`, put back by `stop`

    # ------------------------------------------------------------------------------------------- life
    def start(self) -> Watchdog:
        PROGRESS.mark("start-up")
        self._arm()  # now: the main thread may enter C code that holds the GIL before this thread first runs
        if self.timeout_s > 0 or self.world_size > 1:  # with several processes: answer the others' claims
            self._thread = threading.Thread(target=self._watch, name="ppo-fabric-watchdog", daemon=True)
            self._thread.start()
        return self

    def interrupting(self) -> Watchdog:
        """An in-process run's (its caller owns the process, a notebook's kernel): a stall is raised in the
        main thread as `Stalled` instead of ending the process. Call from the main thread."""
        self._handler = signal.signal(STALL_SIGNAL, self._raise_stall)
        return self

    def _raise_stall(self, _signum: int, _frame: object) -> None:
        if self._stalled is not None and not self._stop.is_set():
            raise Stalled(self._stalled)

    def stop(self) -> None:
        """End the watchdog's thread (waiting up to a second for it: a caller that goes on, a notebook's
        kernel or the next run, finds it gone) and put back the stall signal's handler."""
        self._stop.set()
        deadman.disarm()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=1.0)  # bounded: a thread answering another process's claim ends that process
        if self._handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(STALL_SIGNAL, self._handler)  # type: ignore[arg-type]
            self._handler = None

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            self._arm()
            claimed = self._claimed()
            if claimed is not None:
                self._ending()
                self._answer(claimed)
                self.wait_for_line(claimed)
                self.leave(FAULT_EXIT)  # the job is ending: leave nothing running
            idle = time.monotonic() - PROGRESS.at
            if self.timeout_s > 0 and not PROGRESS.waiting and idle > self.timeout_s:
                line = f"{PROGRESS.label}: no progress for {seconds_text(idle)} s, in {where_stuck()}"
                self.end_job(line + f" (stall_timeout={self.timeout_s:g})")

    # ------------------------------------------------------------------------------------ the job's end
    def _claimed(self) -> Path | None:
        """The stall directory another process of this job claimed (after this one started), if any."""
        claim = self.run_dir / CLAIM
        try:
            if claim.stat().st_mtime < self.started - 1:
                return None  # an earlier attempt's (a relaunch goes on in the same directory)
            name = claim.read_text().strip()
        except (OSError, ValueError):
            return None
        return self.run_dir / name if name else None

    def _claim(self) -> Path | None:
        """Claim the job's end: the stall directory to write stacks into, or None when another process
        claimed it first."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target = self.run_dir / f"stall-{stamp}"
        claim = self.run_dir / CLAIM
        with contextlib.suppress(FileNotFoundError):
            if claim.stat().st_mtime < self.started - 1:
                claim.unlink()  # an earlier attempt's
        try:
            fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return None
        with os.fdopen(fd, "w") as fh:
            fh.write(target.name)
        self.claimed = target
        return target

    def spoke(self, cause: bool = True) -> None:
        """This process printed the job's line: the processes that answered its claim may leave now, and
        those that fail only because this one ends keep quiet (`cause_said`). `cause=False`: a line saying
        only that a peer was lost, after which the others that lost it keep quiet (`loss_said`)."""
        with contextlib.suppress(OSError):
            (self.run_dir / (CAUSE_SAID if cause else LOSS_SAID)).touch()
            if self.claimed is not None:
                (self.claimed / SAID).touch()

    def cause_said(self) -> bool:
        """Whether another process of this attempt has printed the job's cause: a rank that then loses its
        collective's peer (the process that spoke, leaving) has nothing to add. Its gloo error printed a
        second line after the cause, ending in "Check the logs of the remote worker ... GLHF!"."""
        return self._said(CAUSE_SAID)

    def loss_said(self) -> bool:
        """Whether another process of this attempt has said it lost a peer (`spoke(cause=False)`)."""
        return self._said(LOSS_SAID)

    def _said(self, name: str) -> bool:
        try:
            return (self.run_dir / name).stat().st_mtime >= self.started - 1
        except OSError:
            return False

    def leave(self, status: int) -> None:
        """End this process with `status` once the watchdog has a hand in the job's end (it claimed it or
        answered a claim): a launcher child first waits for its parent, its node's first process, to go
        (at most SETTLE_S + 5 s), so that its exit cannot get that process SIGKILLed before it leaves."""
        if launcher_child() and (self.claimed is not None or self.answered is not None):
            parent, deadline = os.getppid(), time.monotonic() + SETTLE_S + 5.0
            while os.getppid() == parent and time.monotonic() < deadline:
                time.sleep(0.05)
        end_env_workers()  # os._exit skips multiprocessing's cleanup: an async env's workers would stay
        self._stop.set()  # this thread re-arms the timer no more
        deadman.disarm()
        os._exit(status)

    def _arm(self) -> None:
        """The timer that ends this process should this thread stop running (`runs/deadman.py`); not in a
        caller's process (`interrupting`: a notebook's kernel is not ended)."""
        if self.timeout_s > 0 and self._handler is None:
            seconds = self.timeout_s + deadman.grace(self.timeout_s)
            deadman.arm(self.run_dir, PROGRESS.label, seconds, live=lambda: not self._stop.is_set())

    def _ending(self) -> None:
        """This thread ends the job now (its stacks, the others', its line: ~15 s at most): the timer that
        stands in for it gives it that long, whatever stall_timeout is."""
        if deadman.armed():
            deadman.arm(self.run_dir, PROGRESS.label, deadman.GRACE_S, live=lambda: not self._stop.is_set())

    def wait_for_line(self, target: Path) -> bool:
        """Before an answering process leaves: wait until the claiming one has printed its line (it waits
        up to SETTLE_S for the stacks first), at most SETTLE_S + 5 s; whether it did."""
        deadline = time.monotonic() + SETTLE_S + 5.0
        while not (target / SAID).exists():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def _answer(self, target: Path, note: str = "") -> None:
        """This process's stacks (every thread) and its progress, once, into `target`."""
        if self.answered == target.name:
            return
        self.answered = target.name
        with contextlib.suppress(OSError):  # a full disk: the job's line is said without these stacks
            self._write_stacks(target, note)

    def _write_stacks(self, target: Path, note: str) -> None:
        target.mkdir(parents=True, exist_ok=True)
        idle = time.monotonic() - PROGRESS.at
        status = {
            "label": PROGRESS.label,
            "doing": PROGRESS.doing,
            "waiting": PROGRESS.waiting,
            "idle_s": round(idle, 1),
            "where": where_stuck(),
            "pid": os.getpid(),
        }
        path = target / f"{PROGRESS.label.replace(' ', '-')}.txt"
        part = path.with_name(path.name + ".part")  # named .txt once whole: `_others` reads its first line
        with open(part, "w") as fh:
            fh.write(json.dumps(status) + "\n" + (note + "\n" if note else "") + "\n")
            fh.flush()
            faulthandler.dump_traceback(fh, all_threads=True)
        os.replace(part, path)
        for hook in list(STACK_HOOKS):  # this process's own helpers (an evaluator), stuck with it or not
            with contextlib.suppress(Exception):
                hook(target)

    def _others(self, target: Path) -> list[dict]:
        """The statuses the processes wrote into `target` (waiting up to SETTLE_S for all of them)."""
        deadline = time.monotonic() + (SETTLE_S if self.world_size > 1 else 0.0)
        while True:
            files = sorted(target.glob("*.txt"))
            if len(files) >= self.world_size or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        out = []
        for path in files:
            with contextlib.suppress(OSError, ValueError):
                out.append(json.loads(path.read_text().splitlines()[0]))
        return out

    def end_job(self, line: str) -> None:
        """Claim the end, write the stacks, print `line` and leave (from the watchdog thread)."""
        self._ending()
        try:
            target = self._claim()
        except OSError as exc:  # a full disk, a read-only run directory: the line all the same, no stacks
            line = f"{line} (its stacks could not be written: {exc.strerror or type(exc).__name__})"
            if self._handler is not None and self._interrupt_main(line):
                return
            os.write(2, f"ppo-fabric: error: {line}\n".encode())
            self.spoke()
            self.leave(fault_status(self.run_dir, line))
            return
        if target is None:  # another process is ending the job: answer it instead
            claimed = self._claimed()
            if claimed is not None:
                self._answer(claimed)
                self.wait_for_line(claimed)
            self.leave(FAULT_EXIT)
        self._answer(target, note=line)
        self._others(target)
        line += f"; stacks in {target}" if target.is_dir() else " (its stacks could not be written)"
        if self._handler is not None and self._interrupt_main(line):
            return  # the run raised it to its caller, whose process goes on
        os.write(2, f"ppo-fabric: error: {line}\n".encode())
        self.spoke()
        self.leave(fault_status(self.run_dir, line))

    def _interrupt_main(self, line: str) -> bool:
        """Raise `line` in the main thread (`interrupting`): a signal's handler runs there at its next
        Python instruction, and a wait in a system call (a sleep, a pipe) ends for it. Whether the run
        ended within SETTLE_S + 5 s (C code holding the GIL never lets the handler run: the process then
        ends as a command-line run's would)."""
        self._stalled = line
        with contextlib.suppress(OSError, ValueError):
            signal.pthread_kill(threading.main_thread().ident or 0, STALL_SIGNAL)
        return self._stop.wait(SETTLE_S + 5.0)

    def collective_timeout(self, cause: str) -> str | None:
        """A collective of this rank timed out: ask every process for its stacks and name the one stuck
        (the busy one longest without progress); returns the line to end with (the caller prints it, then
        calls `spoke()`), None when another process claimed the job's end first (it reports; this one
        returns once it has)."""
        try:
            target = self._claim()
        except OSError as exc:  # a full disk: no stacks to ask for, this rank's wait all the same
            return f"{PROGRESS.label}: {cause} (no stacks: {exc.strerror or type(exc).__name__})"
        if target is None:
            claimed = self._claimed()
            if claimed is not None:
                self._answer(claimed)
                self.wait_for_line(claimed)
            return None
        self._answer(target, note=cause)
        statuses = [s for s in self._others(target) if s.get("label") != PROGRESS.label]
        busy = sorted((s for s in statuses if not s.get("waiting")), key=lambda s: -float(s["idle_s"]))
        head = f"{PROGRESS.label}: {cause}"
        if busy:
            stuck = busy[0]
            seen = f"{PROGRESS.label}'s {cause.removeprefix('its ')}"
            if float(stuck["idle_s"]) < MOVING_S:  # not stuck: still busy with work that outlasted the wait
                head = (
                    f"{seen}, while {stuck['label']} was still making progress, in {stuck['where']} (a long "
                    "evaluation or a slow step: raise collectives.timeout)"
                )
            else:
                head = f"{stuck['label']}: no progress for {seconds_text(stuck['idle_s'])} s, in {stuck['where']} ({seen})"
        return f"{head}; stacks in {target}"
