"""The benchmarks and tools by name: run from the repository root.

    python -m benchmarks                 # list them (also: python -m benchmarks list)
    python -m benchmarks NAME [args...]  # run benchmarks/NAME.py, the same as python benchmarks/NAME.py args...
    python -m benchmarks all             # the `all` set in order (what `make bench` runs), one process each

`TABLE` below is the one list of what is runnable, what `all` runs and with which arguments. `all` runs each
entry as `python -m benchmarks NAME ARGS` in its own process; a failing one is reported and the rest still
run, and the exit status is 1 if any failed. Standard library only: the GPU tools run on a machine whose
python has the package's dependencies but no `.venv`.
"""

from __future__ import annotations

import runpy
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent


class Entry(NamedTuple):
    name: str  # benchmarks/<name>.py
    purpose: str  # one line
    kind: str  # "all": a benchmark `all` runs with `args`; "benchmark": not in `all`; "tool": not a benchmark
    args: tuple[str, ...] = ()  # its arguments in `all`


# make bench's CartPole sitting: three layouts (the synchronous 1+1 one too) and SB3, SPS and time to 475
CARTPOLE_SITTING = ("--workloads", "cartpole", "--seeds", "3", "--force",
                    "--variants", "coupled", "pipelined", "synchronous", "sb3")  # fmt: skip
EVERY_LAYOUT = ("coupled", "pipelined", "synchronous", "pipelined_1_2", "synchronous_1_2")
# In `all`'s order (make bench's); a script `all` runs twice with other arguments has a row for each run.
TABLE: tuple[Entry, ...] = (
    Entry("time_to_score", "the layouts and Stable-Baselines3 on CleanRL's CartPole: SPS and time to 475", "all",
          CARTPOLE_SITTING),
    Entry("scaling", "throughput vs env.num_envs and fabric.devices", "all"),
    Entry("time_to_score", "the high-throughput recipe (exp=fast) next to CleanRL's workload: SPS", "all",
          ("--workloads", "fast", "cartpole", "--variants", "coupled", "--seeds", "3", "--force",
           "--name", "fast_recipe")),
    Entry("time_to_score", "the default config solves CartPole-v1 in every layout", "all",
          ("--workloads", "default", "--variants", *EVERY_LAYOUT, "--seeds", "1", "--force",
           "--name", "cartpole_solve")),
    Entry("time_to_score", "LunarLander-v3 (200) and Pendulum-v1 (-200) reach their targets with their env configs",
          "all", ("--workloads", "lunarlander", "pendulum", "--variants", "coupled", "--seeds", "2", "--force",
                  "--name", "targets")),
    Entry("learning", "recurrent PPO (LSTM vs MLP) on CartPole with the velocities hidden, evaluated", "all",
          ("--suite", "recurrent", "--envs", "CartPole-v1/velocities-dropped", "--seeds", "2", "--force")),
    Entry("learning", "multi-agent PPO on PettingZoo envs (MPE spread, a two-team game), evaluated", "all",
          ("--suite", "multiagent", "--seeds", "1", "--force")),
    Entry("learning", "multi-seed learning on the suites (classic, box2d, mujoco, minatar, recurrent, multiagent, "
          "games)", "benchmark"),
    Entry("time_to_score", "wall-clock to a score: coupled, decoupled pipelined and SB3", "benchmark"),
    Entry("update_layers", "what the direct minibatch-step layers save (optim.GradientStep)", "benchmark"),
    Entry("chaos", "LunarLander pipelined to 1M with faults injected, against undisturbed runs", "benchmark"),
    Entry("gpu_check", "the CUDA paths (resume, resume across devices, SIGTERM, ...), PASS or FAIL", "tool"),
    Entry("gpu_strategies", "coupled and decoupled on CUDA: SPS, GPU utilisation, time split", "tool"),
    Entry("atari_to_score", "an Atari game to a score (Pong: 18) at a GPU layout, wall time and curve", "tool"),
    Entry("minibatch_step", "the Nature-CNN minibatch step: eager vs compiled vs one CUDA graph", "tool"),
    Entry("checkouts_ab", "one training run on several checkouts (git worktrees), alternated", "tool"),
    Entry("stats", "IQM, bootstrap CIs, P(improvement) and profiles of a learning or time_to_score report", "tool"),
)  # fmt: skip
NAMES = tuple(dict.fromkeys(entry.name for entry in TABLE))
ALL = tuple((entry.name, entry.args) for entry in TABLE if entry.kind == "all")


def command(name: str, args: tuple[str, ...] | list[str]) -> str:
    return " ".join(["python -m benchmarks", name, *args])


def listing() -> str:
    width = max(len(name) for name in NAMES)

    def lines(kinds: tuple[str, ...]) -> list[str]:
        rows = [e for e in TABLE if e.kind in kinds]
        return [
            f"{'*' if e.kind == 'all' else ' '} {e.name:<{width}}  {e.purpose}"
            + (f"  [{' '.join(e.args)}]" if e.args else "")
            for e in rows
        ]

    return "\n".join(
        [
            "benchmarks (python -m benchmarks NAME [args]; * = run by `python -m benchmarks all` = make bench,",
            "in this order, with the [arguments] shown):",
            *lines(("all", "benchmark")),
            "",
            "tools:",
            *lines(("tool",)),
        ]
    )


def run_script(name: str, args: list[str]) -> None:
    """benchmarks/<name>.py as `python benchmarks/<name>.py args` runs it: its argv, its directory first on
    sys.path (the scripts import `common`), `__name__ == "__main__"`; its SystemExit is ours."""
    path = HERE / f"{name}.py"
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(HERE))
    runpy.run_path(str(path), run_name="__main__")


def run_all() -> int:
    """Every `all` entry in its own process, in order; one failing does not stop the rest."""
    failed: list[str] = []
    started = time.monotonic()
    for i, (name, args) in enumerate(ALL, 1):
        print(f"== [{i}/{len(ALL)}] {command(name, args)}", flush=True)
        t0 = time.monotonic()
        rc = subprocess.run([sys.executable, "-m", "benchmarks", name, *args], check=False).returncode
        print(f"== [{i}/{len(ALL)}] exit {rc} after {time.monotonic() - t0:.0f} s", flush=True)
        if rc != 0:
            failed.append(f"{command(name, args)} (exit {rc})")
    print(f"== all: {len(ALL) - len(failed)} of {len(ALL)} passed in {time.monotonic() - started:.0f} s")
    for line in failed:
        print(f"FAILED {line}")
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("list", "-h", "--help"):
        usage = __doc__.split("\n\n")[1] + "\n\n" if argv[:1] in (["-h"], ["--help"]) else ""
        print(usage + listing())
        return 0
    name, args = argv[0], argv[1:]
    if name == "all":
        if args:
            print("python -m benchmarks all takes no arguments", file=sys.stderr)
            return 2
        return run_all()
    if name.endswith(".py"):  # python -m benchmarks scaling.py
        name = name[:-3]
    if name not in NAMES:
        print(f"unknown benchmark {name!r}; one of: all, list, {', '.join(NAMES)}", file=sys.stderr)
        return 2
    run_script(name, args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
