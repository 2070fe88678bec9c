"""Where a benchmark run that logged nothing spent its time: a timestamped trace of its stderr.

A run stopped at its timeout before its first update (`common.LoggedNothing`) used to leave no clue: a
15-process job on a lent GPU machine logged nothing within 150 s while 4-process jobs started in ~50 s.
A traced run gets a `sitecustomize.py` on its PYTHONPATH (so every Python process of the job loads it:
the supervisor, each rank, any env worker) that

- writes `[trace] pid P up` as the interpreter starts, and `[trace] pid P importing M` when the process
  starts to import one of `MARKS` (torch, Lightning, a strategy, the Atari and EnvPool packages), through
  an audit hook that looks at import events only;
- registers `faulthandler` for SIGUSR1: `dump_stacks` sends it to every process of the job before the
  run is stopped, and each writes its threads' Python stacks to a file of its own beside the
  sitecustomize (`stacks-<pid>.txt`: fifteen processes writing to one pipe at once would interleave),
  and once by itself at the run's deadline, in case a library has taken SIGUSR1 over.

`Trace` reads the run's stderr on a thread and stamps each line with the seconds since launch; `digest`
turns the markers and the stacks into one line (how many processes were up, importing what, by when, and
where each stood when it was stopped) and `text` is the whole trace, the stacks after it, for a log file. The benchmark's own figures do not depend on it: it only adds words to a run
that has none.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

# the imports whose start marks a stage of a process's start-up, in the order a rank reaches them
MARKS = ("torch", "lightning_fabric", "ppo_fabric.ppo", "ppo_fabric.ppo_decoupled", "ale_py", "envpool")
STACKS_SIGNAL = signal.SIGUSR1
STACKS_WAIT_S = 3.0  # how long the processes get to write their stacks before the run is stopped
DEADLINE_ENV = "PPO_FABRIC_TRACE_DEADLINE"  # epoch seconds at which every traced process writes its stacks
ALE_BANNER = "A.L.E: Arcade Learning Environment"  # written once by each process that builds an ALE env

SITECUSTOMIZE = f'''"""Written by benchmarks/job_trace.py for one traced benchmark run."""
import faulthandler, os, signal, sys, time

_stacks = open(os.path.join(os.path.dirname(__file__), f"stacks-{{os.getpid()}}.txt"), "w")
faulthandler.register(signal.{STACKS_SIGNAL.name}, file=_stacks, all_threads=True)
if os.environ.get("{DEADLINE_ENV}"):  # also at the run's deadline, should a library take the signal over
    faulthandler.dump_traceback_later(max(0.1, float(os.environ["{DEADLINE_ENV}"]) - time.time()), file=_stacks)
_marks = set({MARKS!r})


def _on_import(event, args):
    if event == "import" and args[0] in _marks:
        _marks.discard(args[0])
        os.write(2, f"[trace] pid {{os.getpid()}} importing {{args[0]}}\\n".encode())


sys.addaudithook(_on_import)
os.write(2, f"[trace] pid {{os.getpid()}} up\\n".encode())
'''


def traced_env(where: Path, deadline: float | None = None) -> dict[str, str]:
    """The environment for a traced run: this process's, with `where` (a fresh directory that will hold the
    sitecustomize) first on PYTHONPATH. With `deadline` (time.time() seconds), every process also writes its
    stacks then by itself (`faulthandler.dump_traceback_later`): on the H100 machine the ranks of a job wrote
    none on SIGUSR1 while its supervisor did, so the signal alone is not relied on."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ)
    if deadline is not None:
        env[DEADLINE_ENV] = f"{deadline:.3f}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(where), env.get("PYTHONPATH")) if p)
    return env


class Trace:
    """The run's stderr, line by line, each stamped with the seconds since `started` (read on a thread so
    the run never blocks on a full pipe), and the stacks its processes wrote to `where`."""

    def __init__(self, proc: subprocess.Popen[str], started: float, where: Path) -> None:
        self.lines: list[tuple[float, str]] = []
        self.where = where
        self._thread = threading.Thread(target=self._read, args=(proc, started), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen[str], started: float) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            self.lines.append((time.monotonic() - started, line.rstrip("\n")))

    def join(self, timeout: float = 5.0) -> None:
        self._thread.join(timeout)

    def stderr(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def stacks(self) -> dict[int, str]:
        """pid -> the stacks that process wrote (processes that wrote none are left out)."""
        out = {}
        for path in sorted(self.where.glob("stacks-*.txt")):
            text = path.read_text(errors="replace").strip()
            if text:
                out[int(path.stem.split("-")[1])] = text
        return out

    def text(self) -> str:
        lines = [f"{t:8.1f} {line}" for t, line in self.lines]
        for pid, stack in self.stacks().items():
            lines += ["", f"--- stacks of pid {pid} ---", stack]
        return "\n".join(lines) + "\n"

    def digest(self) -> str:
        """One line: the processes up and the last of them, then for each start-up stage how many processes
        reached it and when the last did, the processes loading ALE, and where the processes that wrote their
        stacks stood (`where_stopped`)."""

        def stage(what: str, times: list[float]) -> str | None:
            return f"{len(times)} {what} (first {times[0]:.0f} s, last {times[-1]:.0f} s)" if times else None

        def marked(suffix: str) -> list[float]:
            return [t for t, line in self.lines if line.startswith("[trace] pid ") and line.endswith(suffix)]

        parts = [stage("processes up", marked(" up"))]
        parts += [stage(f"importing {mark}", marked(f" importing {mark}")) for mark in MARKS]
        parts.append(stage("loading ALE", [t for t, line in self.lines if ALE_BANNER in line]))
        stacks = self.stacks()
        if stacks:
            places: dict[str, int] = {}
            for stack in stacks.values():
                places[where_stopped(stack)] = places.get(where_stopped(stack), 0) + 1
            parts.append(f"stacks of {len(stacks)}: " + ", ".join(f"{n} at {p}" for p, n in places.items()))
        return "; ".join(p for p in parts if p) or "nothing on stderr"


def where_stopped(stack: str) -> str:
    """Where a process stood, from its faulthandler dump: the innermost frame of the project (ppo_fabric/)
    in its main thread, else that thread's innermost frame, as `file:line in function`."""
    main = stack.split("\n\n")[-1]  # the dump lists the other threads first and the main thread last
    frames = [line.strip() for line in main.splitlines() if line.strip().startswith("File ")]
    if not frames:
        return "no Python frame"
    ours = [f for f in frames if "ppo_fabric" in f]
    frame = (ours or frames)[0]  # most recent call first
    path, _, rest = frame.removeprefix('File "').partition('", line ')
    line, _, function = rest.partition(" in ")
    return f"{'/'.join(Path(path).parts[-2:])}:{line} in {function}"


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (Linux /proc; elsewhere none): a supervised job runs in a process group
    of its own, so signalling the run's group would miss it."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def dump_stacks(pid: int) -> None:
    """Ask `pid` and every process below it for its Python stacks (SIGUSR1: the traced run's faulthandler
    writes them to stderr and the process goes on), then give them `STACKS_WAIT_S` to write."""
    for p in [pid, *descendants(pid)]:
        with contextlib.suppress(OSError):
            os.kill(p, STACKS_SIGNAL)
    time.sleep(STACKS_WAIT_S)
