"""Runs started as processes of their own: the jobs of a multirun sweep and the trials of a study.

Each is `python -m ppo_fabric <overrides> hydra.run.dir=<dir>`, the command a user would type, so every
job has the config check, the supervisor (restarts, signals, no leftover ranks) and the run directory of
any run. Lightning relaunches ranks from `sys.argv`: started this way they see the job's argv, never the
sweep's, and no rank variable of the sweep's own process leaks into the next job.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ppo_fabric.app.supervisor import CALLER_PID_ENV, SUPERVISED_ENV, SUPERVISOR_PID_ENV, exit_status
from ppo_fabric.config.faults import STOP_SIGNALS
from ppo_fabric.config.tuned import override_value
from ppo_fabric.config.values import OWN_RUN_DIR_ENV

# After `RunProcess.kill`, how long its supervisor has to kill the job before it is SIGKILLed itself.
KILL_GRACE_S = 5.0

# Variables of a launcher or of a rank: a job that inherited them would take itself for a rank of a job
# that is not there (a leaked LOCAL_RANK makes Lightning wait for peers that never come).
_RANK_VARIABLES = (
    "LOCAL_RANK",
    "RANK",
    "WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "LT_CLI_USED",
    "LT_ACCELERATOR",
    "LT_DEVICES",
    "LT_NUM_NODES",
    "LT_PRECISION",
    "LT_STRATEGY",
    SUPERVISED_ENV,
    SUPERVISOR_PID_ENV,
    OWN_RUN_DIR_ENV,
)


def job_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without launcher and rank variables, plus `extra`."""
    env = {
        k: v for k, v in os.environ.items() if k not in _RANK_VARIABLES and not k.startswith("TORCHELASTIC_")
    }
    env.update(extra or {})
    return env


def job_command(overrides: list[str], run_dir: Path) -> list[str]:
    """The command line of one job: the user's overrides, the run directory last (it wins)."""
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != "hydra.run.dir"]
    return [sys.executable, "-m", "ppo_fabric", *kept, f"hydra.run.dir={override_value(str(run_dir))}"]


@dataclass
class RunProcess:
    """One job as a process (its supervisor), in a session of its own: a terminal's Ctrl+C reaches only
    the sweep, which ends the running job with `stop` so that it writes its checkpoint and summary."""

    overrides: list[str]
    run_dir: Path
    proc: subprocess.Popen[bytes]
    started: float = field(default_factory=time.monotonic)
    log: IO[bytes] | None = None
    stop_signal: int | None = None  # the first stop signal sent, if any
    killed_at: float | None = None  # when `kill` asked the supervisor to kill the job

    @classmethod
    def start(
        cls,
        overrides: list[str],
        run_dir: Path,
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
        piped: bool = False,
    ) -> RunProcess:
        """Start the job; its output goes to `log_path` when given, to a pipe (`proc.stdout`, both streams)
        with `piped`, else to this process's stdout/stderr."""
        run_dir = Path(run_dir).resolve()
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        log = None
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log = log_path.open("ab")
        proc = subprocess.Popen(
            job_command(overrides, run_dir),
            env=job_environment(env),
            stdout=subprocess.PIPE if piped else log,
            stderr=subprocess.STDOUT if log is not None or piped else None,
            start_new_session=True,
        )
        return cls(list(overrides), run_dir, proc, log=log)

    def poll(self) -> int | None:
        """The exit status once the job has ended (a signal N as 128 + N), else None."""
        code = self.proc.poll()
        return None if code is None else self._finish(code)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the job; raises `subprocess.TimeoutExpired` after `timeout` seconds."""
        return self._finish(self.proc.wait(timeout=timeout))

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Ask the job to stop at its next update boundary (its supervisor forwards the signal to every
        rank; they write last.ckpt and summary.json); a second call kills it (`kill`)."""
        if self.stop_signal is not None:
            self.kill()
            return
        self.stop_signal = signum
        self._send(signum)

    def kill(self) -> None:
        """End the job at once, through its supervisor (which kills the job's own process group and says
        so): the other stop signal than the first. The same signal again within a second or two the
        supervisor takes for one request delivered twice, so a repeated Ctrl+C would not kill. Called
        again (a poll loop, a third Ctrl+C): nothing more for `KILL_GRACE_S`, then SIGKILL to the
        supervisor, whose job dies with it (`die_with_parent`)."""
        now = time.monotonic()
        if self.killed_at is not None:
            # only while the supervisor is not reaped: a reaped one's pid may be another session's by now
            if now - self.killed_at > KILL_GRACE_S and self.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
            return
        self.killed_at = now
        if self.stop_signal is None:
            self.stop_signal = signal.SIGTERM
            self._send(signal.SIGTERM)
        self._send(signal.SIGINT if self.stop_signal == signal.SIGTERM else signal.SIGTERM)

    def _send(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signum)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def _finish(self, code: int) -> int:
        if self.log is not None and not self.log.closed:
            self.log.close()
        return exit_status(code)


def run_attached(overrides: list[str], run_dir: Path, out: IO[str]) -> tuple[int, list[str]]:
    """Run one job to its end, its output copied line by line to `out` (a notebook's cell shows what is
    written to `sys.stdout`, not what the job's processes write to their file descriptors); returns its
    exit status and its `ppo-fabric:` lines. A KeyboardInterrupt stops the job as a terminal's Ctrl+C
    would (its ranks write their stop checkpoint), a second one kills it; the interrupt is raised once
    the job has ended. Another stop signal to this process (SIGTERM, SIGHUP, SIGUSR1/2: `STOP_SIGNALS`) stops
    the job too, then raises SystemExit(128 + N); a caller
    that dies takes the job with it (`supervisor.bind_to_caller`). The job imports what the caller can
    (its `sys.path`: an env factory's module beside the calling script)."""
    path = os.pathsep.join([p for p in sys.path if p] + [os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)
    extra = {CALLER_PID_ENV: str(os.getpid()), "PYTHONPATH": path}
    job = RunProcess.start(overrides, run_dir, env=extra, piped=True)
    said: list[str] = []
    terminated: list[int] = []

    def on_stop(signum: int, _frame: Any) -> None:
        terminated.append(signum)
        job.stop(signum)

    previous: dict[int, Any] = {}
    with contextlib.suppress(ValueError):  # not the main thread: the caller handles its signals
        for signum in STOP_SIGNALS:
            if signum != signal.SIGINT:  # KeyboardInterrupt, below
                previous[signum] = signal.signal(signum, on_stop)

    def copy() -> None:
        assert job.proc.stdout is not None
        for raw in iter(job.proc.stdout.readline, b""):
            line = raw.decode(errors="replace")
            if line.startswith("ppo-fabric:"):
                said.append(line.strip())
            out.write(line)
            out.flush()

    copier = threading.Thread(target=copy, name="ppo-fabric job output", daemon=True)
    copier.start()
    interrupted = False
    try:
        while True:
            try:
                status = job.wait()
                break
            except KeyboardInterrupt:
                interrupted = True
                job.stop(signal.SIGINT)  # a second interrupt: `stop` kills
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    copier.join(timeout=5)
    if interrupted:
        raise KeyboardInterrupt(said[-1] if said else "the job was interrupted")
    if terminated:
        raise SystemExit(128 + terminated[0])
    return status, said
