"""Prove the CUDA paths of a run on a machine with a GPU: resume, resume across devices, preemption.

CPU tests exercise the same code, but a borrowed GPU machine is where device bugs show (optimiser state left
on the CPU, a CUDA RNG state never saved, a signal that kills instead of stopping). Each check trains
CartPole in a fresh `python -m ppo_fabric` process of the python running this script (a GPU box lent
without network may have no `.venv`; any python with the package's dependencies will do):

  resume_round_trip  N updates with a checkpoint after each, then the same run resumed from update N/2:
                     the final parameters must be equal within float tolerance. Deterministic settings in
                     every process (cuDNN deterministic, TF32 off, torch.use_deterministic_algorithms,
                     CUBLAS_WORKSPACE_CONFIG=:4096:8 before CUDA starts), set by a sitecustomize module
                     on the runs' PYTHONPATH so that any process a run starts gets them too.
  cpu_to_gpu_resume  a `fabric=cpu` checkpoint at N/2 resumed with `fabric=gpu`: exit 0, N updates' env steps.
  gpu_to_cpu_resume  the round trip's GPU checkpoint at N/2 resumed with `fabric=cpu`: the same.
  sigterm            SIGTERM to the run's process group once it has logged a few updates: every process
                     gone within `collectives.timeout`, exit status 143, and a `last.ckpt` that loads.
  compile_on_off     the same seed trained with `algo.compile=false` and `=true` (CUDA graphs on CUDA):
                     both finish, and the first update's losses, KL and clip fraction (same rollout, same
                     starting parameters) agree within float tolerance. Runs without the deterministic
                     settings (compiled kernels need not have deterministic variants); TF32 stays off.
  graph_step         the same seed trained for 3 updates with `algo.compile=false` and `=graph` (the whole
                     minibatch step, Adam included, captured in one CUDA graph after 2 eager steps and
                     replayed; the lr, annealed, refilled before each update): every update's losses, KL and
                     clip fraction agree within float tolerance, and the final parameters closely. TF32 off.
  envpool_pong       `exp=atari env.backend=envpool` (Pong through EnvPool, Nature CNN on the device) for N
                     updates of 8 envs x 128 steps: exit 0, every env step counted, a finite loss logged;
                     SKIP where EnvPool is not installed or does not import (the reason says which).
                     No deterministic settings (nothing is compared).
  decoupled_gpu_trainer
                     strategy=decoupled with 2 CPU players feeding 1 GPU trainer (3 processes launched on
                     the CPU, `algo.trainer_device=cuda`): the summary places the trainer on cuda:0 and the
                     players on the CPU, every rank ends on the same parameters, and CartPole is learned
                     (mean return >= 195 after 60k env steps); its checkpoint then resumes with the trainer
                     on the CPU for 2 more updates. With `--device cpu` the same layout with the trainer on
                     the CPU.
  decoupled_two_gpu_trainers
                     2 CPU players feeding 2 GPU trainers (`cuda:0`, `cuda:1`), whose DDP runs over the
                     trainers' NCCL group (one trainer has no DDP and never uses NCCL): 8 updates, every env
                     step counted, finite losses logged, every rank on the same parameters; on GPUs once
                     eager and once with `algo.compile=true` (CUDA graphs under DDP). SKIP with fewer than 2
                     CUDA devices; `--device cpu`: eager, the trainers on the CPU (DDP over gloo).

Every run has `fabric.tf32=false`: the checks compare numbers, and the package turns TF32 on by default.

One `PASS name`, `FAIL name: reason` or `SKIP name: reason` line per check; exit status 1 if any failed.
A failed run's last lines of output (with tracebacks: the runs have PPO_FABRIC_TRACEBACK=1) follow its FAIL
line, indented, and are kept in the report as `log_tail`. Without CUDA every check is skipped (exit 0).
`--device cpu` runs the same checks with `fabric=cpu` everywhere, which exercises this script on any
machine. Results (and the machine) go to --out, by default benchmarks/results/gpu_check.json, rewritten
after every check (`"finished": false` until the last), so a job killed part way keeps what it proved; on a
machine whose files come back from one folder only, point --out into it. Runs use a key file of their own
(PPO_FABRIC_KEY_FILE in the work directory), so the user's key is neither read nor created.

    python3 benchmarks/gpu_check.py [--device cuda|cpu] [--updates 4] [--out PATH] [--keep] [--only CHECK ...]
    make gpu-check [PY=python3] [ARGS="--device cpu"]
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # ppo_fabric from this checkout, whichever python runs the script
sys.path.insert(0, str(ROOT / "benchmarks"))
import common  # noqa: E402
from common import RESULTS  # noqa: E402

CHECKS = (
    "resume_round_trip",
    "cpu_to_gpu_resume",
    "gpu_to_cpu_resume",
    "sigterm",
    "compile_on_off",
    "graph_step",
    "envpool_pong",
    "decoupled_gpu_trainer",
    "decoupled_two_gpu_trainers",
)
PER_UPDATE = 256  # env=cartpole: 8 envs x 32 steps
# fabric.tf32=false: the package turns TF32 on for CUDA runs, and these checks compare numbers
BASE = ["env=cartpole", "logger.tensorboard=false", "torch_threads=1", "seed=7", "fabric.tf32=false"]
RUN_TIMEOUT = 600.0  # seconds one training process may take before its check fails
SIGTERM_TIMEOUT = 20  # collectives.timeout of the SIGTERM run: the bound on its exit
LOGGED_BEFORE_SIGTERM = 3  # metric rows (updates) the run logs before it gets the signal

# decoupled_gpu_trainer: 2 players x 256 steps per update, ~117 updates (CPU: a return of 500 at the end)
LEARN_STEPS = 60_000
LEARNED_RETURN = 195.0  # CartPole-v0's "solved" bar: far above a random policy's ~22

# Imported by every python process of the runs (they put its directory first on PYTHONPATH), before any
# CUDA work; `use_deterministic_algorithms` makes an op without a deterministic kernel raise, naming it.
SITECUSTOMIZE = """\
import os

if os.environ.get("PPO_FABRIC_GPU_CHECK_DETERMINISTIC") == "1":
    import torch

    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True)
"""


@dataclass
class Result:
    name: str
    status: str  # PASS | FAIL | SKIP
    reason: str = ""
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        return f"{self.status} {self.name}" + (f": {self.reason}" if self.reason else "")


class CheckFailed(Exception):
    """A check's one-line reason for failing, and the tail of the failing process's output (`log`)."""

    def __init__(self, reason: str, log: str = "") -> None:
        super().__init__(reason)
        self.log = log


class CheckSkipped(Exception):
    """A check's one-line reason for not running here (a missing optional dependency)."""


class Runs:
    """Training processes in one work directory, with the deterministic environment every check shares."""

    def __init__(self, work: Path, fabric: str, updates: int) -> None:
        self.work, self.fabric, self.updates = work, fabric, updates
        site = work / "site"
        site.mkdir(parents=True, exist_ok=True)
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        path = [str(site), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        self.env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(path),
            CUBLAS_WORKSPACE_CONFIG=":4096:8",
            PPO_FABRIC_GPU_CHECK_DETERMINISTIC="1",
            PPO_FABRIC_KEY_FILE=str(work / "signing.key"),
            PPO_FABRIC_TRACEBACK="1",  # a failing rank prints its traceback, which `log_tail` keeps
        )
        self._round_trip_source: Path | None = None

    def command(self, run_dir: Path, overrides: list[str], base: list[str] = BASE) -> list[str]:
        return [sys.executable, "-m", "ppo_fabric", *base, f"hydra.run.dir={run_dir}", *overrides]

    def train(
        self, name: str, overrides: list[str], deterministic: bool = True, base: list[str] = BASE
    ) -> Path:
        """A run to its end; its directory. Raises CheckFailed with the last line it wrote on failure."""
        run_dir = self.work / name
        env = self.env if deterministic else dict(self.env, PPO_FABRIC_GPU_CHECK_DETERMINISTIC="0")
        try:
            proc = subprocess.run(
                self.command(run_dir, overrides, base), cwd=self.work, env=env, capture_output=True,
                text=True, timeout=RUN_TIMEOUT,
            )  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            raise CheckFailed(f"run {name!r} took over {RUN_TIMEOUT:.0f}s") from exc
        if proc.returncode != 0:
            raise CheckFailed(
                f"run {name!r} exited {proc.returncode}: {last_line(proc.stderr or proc.stdout)}",
                tail(proc.stdout + proc.stderr),
            )
        return run_dir

    def steps(self, updates: int) -> str:
        return f"algo.total_steps={updates * PER_UPDATE}"

    def round_trip_source(self) -> Path:
        """The uninterrupted run (a checkpoint after every update) that two checks resume from; run once."""
        if self._round_trip_source is None:
            every = ["checkpoint.every=1", "checkpoint.keep=0"]
            self._round_trip_source = self.train(
                "full", [f"fabric={self.fabric}", self.steps(self.updates), *every]
            )
        return self._round_trip_source


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.replace("\r", "\n").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def tail(text: str, lines: int = 30) -> str:
    """The last `lines` non-empty lines of a process's output (progress bars' carriage returns split)."""
    kept = [line.rstrip() for line in text.replace("\r", "\n").splitlines() if line.strip()]
    return "\n".join(line[:400] for line in kept[-lines:])


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint as plain data, tensors on the CPU; never unpickles the env snapshot."""
    from ppo_fabric.runs import checkpoint as ckpt

    try:
        return ckpt.load(path, env_state="fresh")
    except ValueError as exc:
        raise CheckFailed(f"{path.name} does not load: {exc}") from exc


def numbered_checkpoint(run_dir: Path, iteration: int) -> Path:
    """The numbered checkpoint written after update `iteration`, whatever the file naming scheme."""
    for path in sorted((run_dir / "checkpoints").glob("*.ckpt")):
        if path.name not in ("last.ckpt", "best.ckpt") and load_checkpoint(path)["update"] == iteration:
            return path
    raise CheckFailed(f"no checkpoint of update {iteration} in {run_dir / 'checkpoints'}")


def tensors(tree: Any, prefix: str = "") -> dict[str, Any]:
    """The tensors of a (nested) state dict by dotted name, on the CPU."""
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in tensors(sub, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): tree.detach().cpu()} if hasattr(tree, "detach") else {}


def total_env_steps(run_dir: Path) -> int:
    return int(json.loads((run_dir / "summary.json").read_text())["total_env_steps"])


def final_parameters(a_dir: Path, b_dir: Path) -> tuple[dict[str, Any], dict[str, Any], float]:
    """Two runs' final parameters (`last.ckpt`) by name, and their largest absolute difference."""
    a, b = (tensors(load_checkpoint(d / "checkpoints" / "last.ckpt")["agent"]) for d in (a_dir, b_dir))
    if a.keys() != b.keys() or not a:
        raise CheckFailed(f"parameter names differ: {sorted(a.keys() ^ b.keys())[:4]}")
    return a, b, max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def metric_rows(run_dir: Path) -> list[dict[str, str]]:
    from ppo_fabric.runs.metrics_file import read_rows

    return read_rows(run_dir / "metrics.csv")


def logged_losses(run_dir: Path) -> list[float]:
    return [float(r["loss/value"]) for r in metric_rows(run_dir) if r.get("loss/value")]


# ------------------------------------------------------------------------------------------------ checks
def resume_round_trip(runs: Runs) -> dict[str, Any]:
    import torch

    n = runs.updates
    full = runs.round_trip_source()
    resumed = runs.train(
        "resumed", [f"fabric={runs.fabric}", runs.steps(n), f"resume={numbered_checkpoint(full, n // 2)}"]
    )
    a, b, diff = final_parameters(full, resumed)
    if not all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a):
        raise CheckFailed(f"parameters after resume at update {n // 2} differ by up to {diff:.3g}")
    return {"max_abs_diff": diff, "updates": n, "resumed_at": n // 2}


def cpu_to_gpu_resume(runs: Runs) -> dict[str, Any]:
    n = runs.updates
    half = runs.train("cpu_half", ["fabric=cpu", runs.steps(n // 2)])
    source = half / "checkpoints" / "last.ckpt"
    return cross_device(runs, "cpu_to_gpu", source, runs.fabric)


def gpu_to_cpu_resume(runs: Runs) -> dict[str, Any]:
    source = numbered_checkpoint(runs.round_trip_source(), runs.updates // 2)
    return cross_device(runs, "gpu_to_cpu", source, "cpu")


def cross_device(runs: Runs, name: str, source: Path, fabric: str) -> dict[str, Any]:
    run_dir = runs.train(name, [f"fabric={fabric}", runs.steps(runs.updates), f"resume={source}"])
    steps, want = total_env_steps(run_dir), runs.updates * PER_UPDATE
    if steps != want:
        raise CheckFailed(f"total_env_steps={steps}, want {want}")
    return {"resumed_from": str(source.relative_to(runs.work)), "fabric": fabric, "total_env_steps": steps}


def sigterm(runs: Runs) -> dict[str, Any]:
    run_dir = runs.work / "sigterm"
    overrides = [f"fabric={runs.fabric}", "algo.total_steps=100000000", "logger.log_every=1",
                 f"collectives.timeout={SIGTERM_TIMEOUT}"]  # fmt: skip
    log = (runs.work / "sigterm.log").open("w")
    proc = subprocess.Popen(
        runs.command(run_dir, overrides), cwd=runs.work, env=runs.env, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the signal goes to every process, as a cluster's does
    )  # fmt: skip
    try:
        wait_for_updates(proc, run_dir, LOGGED_BEFORE_SIGTERM)
        os.killpg(proc.pid, signal.SIGTERM)
        sent = time.monotonic()
        try:
            status = proc.wait(timeout=SIGTERM_TIMEOUT)
        except subprocess.TimeoutExpired as exc:
            raise CheckFailed(
                f"still running {SIGTERM_TIMEOUT}s (collectives.timeout) after SIGTERM"
            ) from exc
        took = time.monotonic() - sent
        left = group_alive(proc.pid)
        if status != 143:
            output = (runs.work / "sigterm.log").read_text()
            raise CheckFailed(
                f"exit status {status} after SIGTERM, want 143 (last line: {last_line(output)})", tail(output)
            )
        if left:
            raise CheckFailed("processes of the run were still alive after it exited")
        path = run_dir / "checkpoints" / "last.ckpt"
        if not path.is_file():
            raise CheckFailed("no last.ckpt after SIGTERM")
        state = load_checkpoint(path)
        return {"exit_seconds": round(took, 2), "env_step": int(state.get("env_step", -1))}
    finally:
        if proc.poll() is None or group_alive(proc.pid):
            with_group(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


COMPARED = ("loss/policy", "loss/value", "loss/entropy", "train/approx_kl", "train/clip_fraction")


def eager_against(
    runs: Runs, mode: str, label: str, updates: int, compared: int
) -> tuple[dict[str, Path], dict[str, list[dict[str, float]]], float]:
    """The same seed trained for `updates` updates with `algo.compile=false` and `=mode`, without the
    deterministic settings (compiled kernels need not have deterministic variants; TF32 stays off): each
    run must take every env step and log every update, and the `COMPARED` metrics of the first `compared`
    updates must agree within float tolerance. Returns (run dirs, those metrics, their largest difference)
    by mode."""
    import math

    args = [f"fabric={runs.fabric}", runs.steps(updates), "logger.log_every=1"]
    dirs = {
        m: runs.train(f"{label}_{m}", [*args, f"algo.compile={m}"], deterministic=False)
        for m in ("false", mode)
    }
    for run_dir in dirs.values():
        if total_env_steps(run_dir) != updates * PER_UPDATE:
            raise CheckFailed(
                f"{run_dir.name}: total_env_steps={total_env_steps(run_dir)}, want {updates * PER_UPDATE}"
            )
    rows = {m: [{k: float(r[k]) for k in COMPARED} for r in metric_rows(d)] for m, d in dirs.items()}
    if any(len(r) != updates for r in rows.values()):
        raise CheckFailed(
            f"updates logged: eager {len(rows['false'])}, {label} {len(rows[mode])}; want {updates}"
        )
    pairs = list(zip(rows["false"][:compared], rows[mode][:compared], strict=True))
    bad = [
        f"update {i + 1} {k} eager {e[k]:.6g} vs {label} {g[k]:.6g}"
        for i, (e, g) in enumerate(pairs)
        for k in COMPARED
        if not math.isclose(g[k], e[k], rel_tol=1e-3, abs_tol=1e-4)
    ]
    if bad:
        raise CheckFailed(", ".join(bad))
    worst = max(abs(g[k] - e[k]) for e, g in pairs for k in COMPARED)
    return dirs, {m: r[:compared] for m, r in rows.items()}, worst


def compile_on_off(runs: Runs) -> dict[str, Any]:
    _, rows, worst = eager_against(runs, "true", "compiled", updates=2, compared=1)
    return {"eager": rows["false"][0], "compiled": rows["true"][0], "max_abs_diff": worst}


def graph_step(runs: Runs) -> dict[str, Any]:
    dirs, rows, worst = eager_against(runs, "graph", "graph", updates=3, compared=3)
    _, _, diff = final_parameters(dirs["false"], dirs["graph"])
    if diff > 1e-3:
        raise CheckFailed(f"final parameters differ by up to {diff:.3g} (eager vs graph)")
    return {"eager": rows["false"], "graph": rows["graph"], "max_abs_diff": worst, "param_max_abs_diff": diff}


def wait_for_updates(proc: subprocess.Popen, run_dir: Path, rows: int, limit: float = 300.0) -> None:
    """Until the run's metrics.csv holds `rows` logged updates."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise CheckFailed(f"the run exited {proc.returncode} before logging {rows} updates")
        if len(metric_rows(run_dir)) >= rows:
            return
        time.sleep(0.2)
    raise CheckFailed(f"no {rows} logged updates within {limit:.0f}s")


def group_alive(pgid: int) -> bool:
    return with_group(pgid, 0)


def with_group(pgid: int, sig: int) -> bool:
    """Signal a process group; False when no process of it is left."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


ATARI_PER_UPDATE = 1024  # exp=atari: 8 envs x 128 steps


def envpool_missing() -> str | None:
    """Why EnvPool cannot run here, or None: the package's own import check, which tells a missing EnvPool
    from a wheel copied without its dependencies (dm-env, optree: found, then failing to import)."""
    from ppo_fabric.envs.envpool_backend import EnvPoolError, import_envpool

    try:
        import_envpool()
    except EnvPoolError as exc:
        return str(exc)
    return None


def envpool_pong(runs: Runs) -> dict[str, Any]:
    """Pong collected by EnvPool, trained on the device: the run ends with every step and a finite loss."""
    import math

    reason = envpool_missing()
    if reason is not None:
        raise CheckSkipped(reason)
    want = runs.updates * ATARI_PER_UPDATE
    overrides = ["exp=atari", "env.backend=envpool", f"fabric={runs.fabric}", f"algo.total_steps={want}",
                 "logger.log_every=1"]  # fmt: skip
    # Nothing is compared, so no deterministic settings: an op of the CNN without a deterministic CUDA
    # kernel must not fail a check about EnvPool. BASE less CartPole and its one torch thread.
    base = [o for o in BASE if o not in ("env=cartpole", "torch_threads=1")]
    run_dir = runs.train("envpool_pong", overrides, deterministic=False, base=base)
    summary = json.loads((run_dir / "summary.json").read_text())
    if summary["total_env_steps"] != want:
        raise CheckFailed(f"total_env_steps={summary['total_env_steps']}, want {want}")
    losses = logged_losses(run_dir)
    if not losses or not all(math.isfinite(v) for v in losses):
        raise CheckFailed(f"loss/value not logged or not finite: {losses[:4]}")
    return {
        "total_env_steps": want,
        "sps": round(float(summary["sps"]), 1),
        "time_split": summary.get("time_split"),
    }


def decoupled_summary(run_dir: Path, want: list[tuple[str, str]], where: str = "") -> dict[str, Any]:
    """A decoupled run's summary, its ranks placed as `want` (role, device) and ending on the same parameters."""
    summary = json.loads((run_dir / "summary.json").read_text())
    placed = [(r["role"], r["device"]) for r in summary.get("roles", [])]
    if placed != want:
        raise CheckFailed(f"{where}ranks placed as {placed}, want {want}")
    if summary.get("ranks_in_sync") is not True:
        raise CheckFailed(f"{where}the ranks ended with different parameters")
    return summary


def decoupled_gpu_trainer(runs: Runs) -> dict[str, Any]:
    trainer = "cuda" if runs.fabric == "gpu" else "cpu"
    overrides = ["strategy=decoupled", "fabric=cpu", "fabric.devices=3", "algo.players=2", "algo.player_device=cpu",
                 f"algo.trainer_device={trainer}", f"algo.total_steps={LEARN_STEPS}"]  # fmt: skip
    run_dir = runs.train("decoupled_gpu_trainer", overrides)
    want = [("player", "cpu"), ("player", "cpu"), ("trainer", "cuda:0" if trainer == "cuda" else "cpu")]
    summary = decoupled_summary(run_dir, want)
    final = summary.get("final_mean_return")
    if final is None or final < LEARNED_RETURN:
        raise CheckFailed(
            f"final mean return {final} after {LEARN_STEPS} env steps, want >= {LEARNED_RETURN:g}"
        )
    # The trainer's checkpoint (optimiser state from its GPU) continues with the trainer on the CPU.
    done = int(summary["total_env_steps"])
    more = [*overrides[:-2], "algo.trainer_device=cpu", f"algo.total_steps={done + 1024}",
            f"resume={run_dir / 'checkpoints' / 'last.ckpt'}"]  # fmt: skip
    resumed = json.loads((runs.train("decoupled_resumed_on_cpu", more) / "summary.json").read_text())
    if int(resumed["total_env_steps"]) != done + 1024:
        raise CheckFailed(
            f"resumed on the CPU: total_env_steps={resumed['total_env_steps']}, want {done + 1024}"
        )
    return {"final_mean_return": final, "sps": summary.get("sps"), "roles": summary["roles"],
            "resumed_on_cpu_total_env_steps": resumed["total_env_steps"]}  # fmt: skip


def decoupled_two_gpu_trainers(runs: Runs) -> dict[str, Any]:
    import torch

    gpu = runs.fabric == "gpu"
    if gpu and torch.cuda.device_count() < 2:
        raise CheckSkipped(
            f"needs 2 CUDA devices (one per trainer), this machine has {torch.cuda.device_count()}"
        )
    # On GPUs also compiled (CUDA graphs under DDP, never run before); the CPU dry run stays eager.
    return {f"compile_{on}": two_trainers(runs, gpu, on) for on in (("false", "true") if gpu else ("false",))}


def two_trainers(runs: Runs, gpu: bool, compile_step: str) -> dict[str, Any]:
    """One run of 2 CPU players + 2 trainers; raises CheckFailed naming the compile setting."""
    import math

    updates, players = 8, 2
    want_steps = updates * players * PER_UPDATE
    overrides = ["strategy=decoupled", "fabric=cpu", "fabric.devices=4", f"algo.players={players}",
                 "algo.player_device=cpu", f"algo.trainer_device={'cuda' if gpu else 'cpu'}",
                 f"algo.total_steps={want_steps}", "logger.log_every=1", f"algo.compile={compile_step}"]  # fmt: skip
    # compiled kernels need not have deterministic variants (as in compile_on_off)
    run_dir = runs.train(
        f"two_trainers_compile_{compile_step}", overrides, deterministic=compile_step == "false"
    )
    trainers = [("trainer", "cuda:0"), ("trainer", "cuda:1")] if gpu else [("trainer", "cpu")] * 2
    where = f"algo.compile={compile_step}: "
    summary = decoupled_summary(run_dir, [("player", "cpu")] * players + trainers, where)
    if int(summary["total_env_steps"]) != want_steps:
        raise CheckFailed(f"{where}total_env_steps={summary['total_env_steps']}, want {want_steps}")
    losses = logged_losses(run_dir)
    if len(losses) != updates or not all(math.isfinite(v) for v in losses):
        raise CheckFailed(f"{where}loss/value of {updates} updates not logged or not finite: {losses[:4]}")
    return {"roles": summary["roles"], "sps": summary.get("sps"), "total_env_steps": want_steps}


CHECK_FUNCTIONS: dict[str, Callable[[Runs], dict[str, Any]]] = {
    "resume_round_trip": resume_round_trip,
    "cpu_to_gpu_resume": cpu_to_gpu_resume,
    "gpu_to_cpu_resume": gpu_to_cpu_resume,
    "sigterm": sigterm,
    "compile_on_off": compile_on_off,
    "graph_step": graph_step,
    "envpool_pong": envpool_pong,
    "decoupled_gpu_trainer": decoupled_gpu_trainer,
    "decoupled_two_gpu_trainers": decoupled_two_gpu_trainers,
}


# ------------------------------------------------------------------------------------------------ driver
def cuda_device() -> str | None:
    """The first CUDA device's name, or None (this does not create a CUDA context)."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def run_checks(
    device: str,
    updates: int,
    keep: bool,
    only: tuple[str, ...] = CHECKS,
    done: Callable[[list[Result], str], None] | None = None,
) -> tuple[list[Result], str]:
    """Run the checks in order; `done(results so far, device name)` after each one."""
    if device == "cuda":
        name = cuda_device()
        if name is None:
            reason = (
                "no CUDA device (torch.cuda.is_available() is False); --device cpu runs the checks on the CPU"
            )
            skipped = [Result(check, "SKIP", reason) for check in only]
            for result in skipped:
                print(result.line())
            return skipped, "none"
    else:
        name = "cpu (fabric=cpu for every run)"
    print(f"gpu_check: {name}; python {sys.executable}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="ppo-fabric-gpu-check-"))
    runs = Runs(work, "gpu" if device == "cuda" else "cpu", updates)
    results = []
    for check in only:
        start = time.monotonic()
        try:
            result = Result(check, "PASS", details=CHECK_FUNCTIONS[check](runs))
        except CheckFailed as exc:
            result = Result(check, "FAIL", str(exc), details={"log_tail": exc.log} if exc.log else {})
        except CheckSkipped as exc:
            result = Result(check, "SKIP", str(exc))
        except Exception as exc:  # a bug of the check itself still gives its one line
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
            result = Result(check, "FAIL", reason, details={"log_tail": tail(traceback.format_exc())})
        result.seconds = round(time.monotonic() - start, 2)
        print(result.line(), flush=True)
        if result.details.get("log_tail"):
            print("\n".join("    " + line for line in result.details["log_tail"].splitlines()), flush=True)
        results.append(result)
        if done is not None:
            done(results, name)
    if keep:
        print(f"gpu_check: runs kept in {work}")
    else:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return results, name


def main(argv: list[str] | None = None) -> int:
    parser = common.argument_parser(__doc__)
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cpu: every run with fabric=cpu"
    )
    parser.add_argument(
        "--updates", type=int, default=4, help="N: updates of the uninterrupted run (even, >= 2)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_check.json", help="the JSON report")
    parser.add_argument("--keep", action="store_true", help="keep the runs' directories (printed at the end)")
    parser.add_argument(
        "--only", nargs="+", choices=CHECKS, default=list(CHECKS), help="run these checks only"
    )
    args = parser.parse_args(argv)
    if args.updates < 2 or args.updates % 2:
        parser.error("--updates must be even and at least 2")
    only = tuple(args.only)
    head = {"device": args.device, "commit": common.git_commit(), "machine": common.machine(),
            "python": sys.executable, "updates": args.updates}  # fmt: skip

    def write(results: list[Result], device_name: str) -> None:
        """The report as it stands: rewritten after every check, so a killed job keeps what it proved."""
        report = head | {"device_name": device_name, "finished": len(results) == len(only),
                         "checks": [asdict(r) for r in results]}  # fmt: skip
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")

    results, device_name = run_checks(args.device, args.updates, args.keep, only, write)
    write(results, device_name)
    return 1 if any(r.status == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
