"""ppo-fabric vs Stable-Baselines3 PPO on CleanRL's CartPole workload: speed and sample efficiency.

Both libraries train the same workload (CleanRL `ppo.py` defaults): 4 sync CartPole-v1 envs x 128 steps,
4 epochs x 4 minibatches of 128, Adam lr 2.5e-4 annealed linearly to 0, gamma 0.99, GAE lambda 0.95,
clip 0.2, ent_coef 0.01, vf_coef 0.5, max_grad_norm 0.5, separate 64x64 tanh actor and critic MLPs with
orthogonal init, 200k env steps, CPU, one torch thread.

Why it is built this way:

* SB3 is configured from ppo-fabric's composed `exp=cleanrl_cartpole` config, not from a second copy of
  the numbers: if the experiment changes (value clipping, Adam eps, ...), SB3 follows, so the two never
  silently train different workloads. The composed values are checked against CleanRL's defaults above,
  and any difference is printed and written into the report.

* Every (library, seed) run is its own child process, started one after the other, never two at once:
  a run then owns the CPU it is timed on, and neither library inherits the other's imports, caches or
  thread pools. Seeds alternate which library goes first, so a slow drift of the machine (heat, a
  neighbour) does not always land on the same library.
* A child imports everything first, then warms torch up (first optimizer, first orthogonal init: lazy
  one-time costs of ~1.5 s that would land on whichever library hit them first), and times only the
  training call, so interpreter start-up and imports stay out of the SPS figure. The timed
  scope is the same for both: ppo-fabric's `run()` composes the config, builds Fabric, the envs and the
  model, trains and saves its final checkpoint; for SB3 the timer covers building the vector env and
  the model and `learn()`. The training loop alone (`loop_sps`) is reported too.
* "Solved" is the first update after which the mean return of the last 20 finished episodes reaches
  475, checked once per update (every 512 env steps) for both libraries, so neither gets a finer grid.
  SB3's own `ep_info_buffer` averages 100 episodes, so the SB3 child keeps its own 20-episode window
  from the Monitor's `infos["episode"]`, matching ppo-fabric's `rollout/return_mean20`.
* Both libraries run the same number of env steps: `--steps` rounded down to whole 512-step updates
  (200000 -> 199680), because ppo-fabric stops at whole updates while SB3 would otherwise overshoot.

Run from the repository root:  .venv/bin/python benchmarks/cartpole_vs_sb3.py [--seeds 3]
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import hashlib
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

from sb3_baseline import sb3_settings, warm_up_torch

IMPLS = ("ppo-fabric", "sb3")
SOLVED_RETURN = 475.0
WINDOW = 20
BUSY_UTIL = 0.9  # CPU/wall below this: something else took the core; the report says so
REPO = Path(__file__).resolve().parent.parent
EXPERIMENT = "cleanrl_cartpole"

# CleanRL's ppo.py defaults for CartPole: the composed experiment is checked against these.
CLEANRL: dict[str, Any] = {
    "env.id": "CartPole-v1",
    "env.num_envs": 4,
    "env.vector": "sync",
    "env.action_repeat": 1,
    "algo.rollout_steps": 128,
    "algo.minibatch_size": 128,
    "algo.update_epochs": 4,
    "algo.lr": 2.5e-4,
    "algo.anneal_lr": True,
    "algo.gamma": 0.99,
    "algo.gae_lambda": 0.95,
    "algo.norm_adv": True,
    "algo.clip_coef": 0.2,
    "algo.ent_coef": 0.01,
    "algo.vf_coef": 0.5,
    "algo.max_grad_norm": 0.5,
    "algo.target_kl": None,
    "model.actor_hidden": [64, 64],
    "model.critic_hidden": [64, 64],
    "model.activation": "tanh",
}
# Also given to SB3, though not in the list above (CleanRL: Adam eps 1e-5, value clipping on).
EXTRA_KEYS = ("algo.adam_eps", "algo.clip_vloss", "env.max_episode_steps", "env.kwargs")


def resolved_workload(steps: int) -> dict[str, Any]:
    """The workload as ppo-fabric composes `exp=cleanrl_cartpole`: flat `group.key` -> value."""
    from omegaconf import OmegaConf

    from ppo_fabric.config.values import compose

    cfg, _ = compose([f"exp={EXPERIMENT}", f"algo.total_steps={steps}"])
    out: dict[str, Any] = {}
    for key in (*CLEANRL, *EXTRA_KEYS):
        value = OmegaConf.select(cfg, key)
        out[key] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    return out


def deviations(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Keys where the composed experiment differs from CleanRL's defaults."""
    return {
        key: {"cleanrl": want, "experiment": workload[key]}
        for key, want in CLEANRL.items()
        if workload[key] != want
    }


def steps_per_update(workload: dict[str, Any]) -> int:
    return int(workload["env.num_envs"]) * int(workload["algo.rollout_steps"])


# ============================================================================================ children
def _window_mean(window: deque[float]) -> float | None:
    return sum(window) / len(window) if window else None


def child_ppo_fabric(
    seed: int, steps: int, threads: int, run_dir: Path, workload: dict[str, Any]
) -> dict[str, Any]:
    """Train ppo-fabric in this process; the solve step comes from the per-update rows of metrics.csv."""
    # Imports first: `ppo_fabric.run` imports these lazily, and they must not count as training time.
    import gymnasium  # noqa: F401
    import hydra  # noqa: F401
    import lightning_fabric  # noqa: F401
    import lightning_fabric.loggers  # noqa: F401
    import tensordict  # noqa: F401
    import torch

    import ppo_fabric
    import ppo_fabric.cli  # noqa: F401
    import ppo_fabric.ppo  # noqa: F401  (the strategy, imported by the first run otherwise)
    from ppo_fabric.app import process

    process.quiet_libraries()  # the same warning filters the `ppo-fabric` command applies
    if threads > 0:
        torch.set_num_threads(threads)  # before the warm-up; run() sets it again from torch_threads
    warm_up_torch()
    # The SB3 run was given the parent's composition; this one composes again: they must agree.
    same_workload = resolved_workload(steps) == workload
    overrides = [
        "exp=cleanrl_cartpole",
        f"algo.total_steps={steps}",
        f"seed={seed}",
        f"torch_threads={threads}",
        "fabric=cpu",
        "logger.tensorboard=false",
        "logger.csv=true",
        "logger.log_every=1",
        "eval.every=0",  # SB3's PPO here evaluates nothing either
        f"hydra.run.dir={run_dir}",
    ]
    c0, t0 = time.process_time(), time.perf_counter()
    summary = ppo_fabric.run(overrides)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0

    csv_files = sorted(Path(summary["run_dir"]).rglob("metrics.csv"))
    if not csv_files:
        raise RuntimeError(f"no metrics.csv under {summary['run_dir']}")
    solved_at: int | None = None
    curve: list[tuple[int, float]] = []
    with csv_files[0].open(newline="") as fh:
        for row in csv.DictReader(fh):
            value = row.get("rollout/return_mean20") or ""
            if not value:
                continue
            step, ret = int(float(row["step"])), float(value)
            curve.append((step, round(ret, 2)))
            if solved_at is None and ret >= SOLVED_RETURN:
                solved_at = step
    total = int(summary["total_env_steps"])
    return {
        "env_steps": total,
        "wall_s": wall,
        "sps": total / wall,
        "loop_wall_s": float(summary["wall_seconds"]),
        "loop_sps": float(summary["sps"]),
        "cpu_s": cpu,
        "solved_step": solved_at,
        "final_return_mean20": summary.get("final_mean_return"),
        "episodes": int(summary["episodes"]),
        "torch_threads": torch.get_num_threads(),
        "curve": curve,
        "same_workload_as_sb3": same_workload,
    }


def child_sb3(seed: int, steps: int, threads: int, workload: dict[str, Any]) -> dict[str, Any]:
    """Train SB3 PPO in this process, configured to the same workload, with a 20-episode return window."""
    import gymnasium  # noqa: F401
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.utils import LinearSchedule
    from stable_baselines3.common.vec_env import DummyVecEnv
    from torch import nn

    if threads > 0:
        torch.set_num_threads(threads)  # ppo-fabric does the same through its torch_threads=1 default
    warm_up_torch()

    class Return20(BaseCallback):
        """Mean return of the last 20 finished episodes (Monitor's infos), read once per rollout."""

        def __init__(self) -> None:
            super().__init__()
            self.window: deque[float] = deque(maxlen=WINDOW)
            self.episodes = 0
            self.solved_at: int | None = None
            self.curve: list[tuple[int, float]] = []

        def _on_step(self) -> bool:
            for info in self.locals["infos"]:
                episode = info.get("episode")
                if episode is not None:
                    self.window.append(float(episode["r"]))
                    self.episodes += 1
            return True

        def _on_rollout_end(self) -> None:
            # Same grid as ppo-fabric's metrics.csv: one reading per update, after its rollout.
            mean = _window_mean(self.window)
            if mean is None:
                return
            self.curve.append((self.num_timesteps, round(mean, 2)))
            if self.solved_at is None and mean >= SOLVED_RETURN:
                self.solved_at = self.num_timesteps

    callback = Return20()
    c0, t0 = time.process_time(), time.perf_counter()
    env_kwargs = dict(workload["env.kwargs"] or {})
    if workload["env.max_episode_steps"] is not None:
        env_kwargs["max_episode_steps"] = int(workload["env.max_episode_steps"])
    env = make_vec_env(  # Monitor on each env, then DummyVecEnv: SB3's sync vector env
        workload["env.id"],
        n_envs=int(workload["env.num_envs"]),
        seed=seed,
        vec_env_cls=DummyVecEnv,
        env_kwargs=env_kwargs,
    )
    settings = sb3_settings(workload, nn, LinearSchedule)
    model = PPO("MlpPolicy", env, **settings, seed=seed, device="cpu", verbose=0)
    t1 = time.perf_counter()
    model.learn(total_timesteps=steps, callback=callback)
    t2, cpu = time.perf_counter(), time.process_time() - c0
    env.close()
    total = int(model.num_timesteps)
    return {
        "env_steps": total,
        "wall_s": t2 - t0,
        "sps": total / (t2 - t0),
        "loop_wall_s": t2 - t1,
        "loop_sps": total / (t2 - t1),
        "cpu_s": cpu,
        "solved_step": callback.solved_at,
        "final_return_mean20": _window_mean(callback.window),
        "episodes": callback.episodes,
        "torch_threads": torch.get_num_threads(),
        "curve": callback.curve,
        "sb3_settings": {k: repr(v) for k, v in settings.items()},
    }


def child_main(args: argparse.Namespace) -> None:
    """Entry point of a child process: one run, its result written as JSON to --result."""
    workload = json.loads(Path(args.workload).read_text())
    if args.child == "ppo-fabric":
        result = child_ppo_fabric(args.seed, args.steps, args.threads, Path(args.run_dir), workload)
    else:
        result = child_sb3(args.seed, args.steps, args.threads, workload)
    Path(args.result).write_text(json.dumps(result))


# ============================================================================================== parent
def _git(*args: str) -> bytes:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, check=True).stdout


def code_version() -> dict[str, Any]:
    """The code that runs: HEAD, plus a digest of the uncommitted diff of ppo_fabric/ and conf/.

    The working tree may change while a long benchmark runs (others edit it); recording this for every
    run shows whether all runs trained the same code.
    """
    try:
        commit = _git("rev-parse", "--short", "HEAD").decode().strip()
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no").strip())
        diff = _git("diff", "HEAD", "--", "ppo_fabric", "conf")
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None, "diff_sha1": None, "id": None}
    diff_sha1 = hashlib.sha1(diff).hexdigest()[:12] if diff else None
    return {
        "commit": commit,
        "dirty": dirty,
        "diff_sha1": diff_sha1,
        "id": commit + (f"+{diff_sha1}" if diff_sha1 else ""),
    }


def machine() -> dict[str, Any]:
    """What the figures were measured on; SPS means little without it."""
    import gymnasium
    import lightning_fabric as lightning
    import numpy
    import stable_baselines3
    import torch

    import ppo_fabric

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    code = code_version()
    return {
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "usable_cores": usable,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "gymnasium": gymnasium.__version__,
        "numpy": numpy.__version__,
        "stable_baselines3": stable_baselines3.__version__,
        "ppo_fabric": ppo_fabric.__version__,
        "git_commit": code["commit"],
        "git_dirty": code["dirty"],
        "git_diff_sha1": code["diff_sha1"],
    }


def run_child(
    impl: str, seed: int, steps: int, threads: int, tmp: Path, workload_path: Path
) -> dict[str, Any]:
    """Run one (library, seed) in a fresh interpreter and wait for it; returns its result."""
    result_path = tmp / f"{impl}-seed{seed}.json"
    log_path = tmp / f"{impl}-seed{seed}.log"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        impl,
        "--seed",
        str(seed),
        "--steps",
        str(steps),
        "--threads",
        str(threads),
        "--result",
        str(result_path),
        "--run-dir",
        str(tmp / f"{impl}-seed{seed}"),
        "--workload",
        str(workload_path),
    ]
    load_before = os.getloadavg()[0]
    code = code_version()["id"]
    with log_path.open("w") as log:
        proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0 or not result_path.is_file():
        tail = "\n".join(log_path.read_text().splitlines()[-30:])
        raise SystemExit(f"{impl} seed {seed} failed (exit {proc.returncode}):\n{tail}")
    result = json.loads(result_path.read_text())
    # CPU time of the run's own process: on a machine others also use, wall-clock SPS drops while CPU
    # SPS barely moves, and CPU/wall well under 1 (one torch thread, sync envs) shows the run was starved.
    result["cpu_util"] = result["cpu_s"] / result["wall_s"]
    result["cpu_sps"] = result["env_steps"] / result["cpu_s"]
    result["loadavg_1min_before"] = load_before
    result["code"] = code
    # How close a run that never "solved" came: the best per-update mean20 and where it happened.
    best = max(result["curve"], key=lambda point: point[1], default=None)
    result["best_return_mean20"], result["best_step"] = (None, None) if best is None else (best[1], best[0])
    result["loadavg_1min_after"] = os.getloadavg()[0]
    return result


def median_or_none(values: list[float | None]) -> float | None:
    """Median where None ("never solved") counts as infinitely late; None if the median is such a run."""
    if not values:
        return None
    ranked = sorted(math.inf if v is None else float(v) for v in values)
    med = statistics.median(ranked)
    return None if math.isinf(med) or math.isnan(med) else med


def summarize(runs: list[dict[str, Any]], impls: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for impl in impls:
        rows = [r for r in runs if r["impl"] == impl]
        out[impl] = {
            "runs": len(rows),
            "median_wall_s": statistics.median(r["wall_s"] for r in rows),
            "median_sps": statistics.median(r["sps"] for r in rows),
            "median_loop_sps": statistics.median(r["loop_sps"] for r in rows),
            "median_cpu_sps": statistics.median(r["cpu_sps"] for r in rows),
            "min_cpu_util": min(r["cpu_util"] for r in rows),
            "median_solved_step": median_or_none([r["solved_step"] for r in rows]),
            "solved_runs": sum(r["solved_step"] is not None for r in rows),
            "median_final_return_mean20": median_or_none([r["final_return_mean20"] for r in rows]),
            "median_best_return_mean20": median_or_none([r["best_return_mean20"] for r in rows]),
        }
    if all(i in out for i in IMPLS):
        out["sps_ratio_ppo_fabric_over_sb3"] = out["ppo-fabric"]["median_sps"] / out["sb3"]["median_sps"]
        out["loop_sps_ratio_ppo_fabric_over_sb3"] = (
            out["ppo-fabric"]["median_loop_sps"] / out["sb3"]["median_loop_sps"]
        )
        out["cpu_sps_ratio_ppo_fabric_over_sb3"] = (
            out["ppo-fabric"]["median_cpu_sps"] / out["sb3"]["median_cpu_sps"]
        )
    return out


def _fmt(value: float | None, spec: str = ",.0f") -> str:
    return "never" if value is None else format(value, spec)


def table(runs: list[dict[str, Any]], summary: dict[str, Any], impls: list[str]) -> str:
    """Markdown table: one row per run, then one median row per library."""
    head = (
        "| library | seed | env steps | wall s | SPS | loop SPS | CPU SPS | CPU/wall "
        "| solved at (mean20 >= 475) | best mean20 (at step) | final mean20 |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        lines.append(
            f"| {r['impl']} | {r['seed']} | {r['env_steps']:,} | {r['wall_s']:.1f} | {r['sps']:,.0f} | "
            f"{r['loop_sps']:,.0f} | {r['cpu_sps']:,.0f} | {r['cpu_util']:.2f} | {_fmt(r['solved_step'])} | "
            f"{_fmt(r['best_return_mean20'], '.1f')} ({_fmt(r['best_step'])}) | "
            f"{_fmt(r['final_return_mean20'], '.1f')} |"
        )
    for impl in impls:
        s = summary[impl]
        lines.append(
            f"| **{impl} median** | {s['runs']} runs | | {s['median_wall_s']:.1f} | {s['median_sps']:,.0f} | "
            f"{s['median_loop_sps']:,.0f} | {s['median_cpu_sps']:,.0f} | min {s['min_cpu_util']:.2f} | "
            f"{_fmt(s['median_solved_step'])} ({s['solved_runs']}/{s['runs']} solved) | "
            f"{_fmt(s['median_best_return_mean20'], '.1f')} | {_fmt(s['median_final_return_mean20'], '.1f')} |"
        )
    return "\n".join(lines)


def markdown(report: dict[str, Any]) -> str:
    m, s, impls = report["machine"], report["summary"], report["impls"]
    per_update = report["steps_per_update"]
    lines = [
        "# ppo-fabric vs Stable-Baselines3: CleanRL CartPole workload",
        "",
        f"Generated {report['finished']} by `benchmarks/cartpole_vs_sb3.py` (`{' '.join(report['argv'])}`).",
        "",
        "## Machine",
        "",
        f"- CPU: {m['cpu_model']}, {m['cpu_count']} logical cores ({m['usable_cores']} usable)",
        f"- {m['platform']}, Python {m['python']}",
        f"- torch {m['torch']}, lightning {m['lightning']}, gymnasium {m['gymnasium']}, numpy {m['numpy']}",
        f"- stable-baselines3 {m['stable_baselines3']}, ppo-fabric {m['ppo_fabric']} "
        f"(git {m['git_commit']}"
        + (", uncommitted changes" if m["git_dirty"] else "")
        + (f"; diff of ppo_fabric/ and conf/ sha1 {m['git_diff_sha1']}" if m["git_diff_sha1"] else "")
        + ")",
        f"- torch threads per run: ppo-fabric {report['threads']} (its `torch_threads`), SB3 "
        + (f"{report['sb3_threads']}" if report["sb3_threads"] else "torch's default (SB3 as users run it)")
        + " (`torch.set_num_threads`); runs one at a time, each in its own process",
        "",
        "## Workload",
        "",
        f"ppo-fabric's `exp={report['experiment']}` as composed; SB3 is configured from the same values "
        "(`clip_vloss` -> `clip_range_vf`, `adam_eps` -> Adam `eps`, `anneal_lr` -> linear schedule):",
        "",
        ", ".join(f"`{k}={v}`" for k, v in report["workload"].items()),
        "",
        f"{report['env_steps']:,} env steps per run (`--steps {report['requested_steps']}` rounded down to "
        f"whole {per_update}-step updates). ppo-fabric runs `exp={report['experiment']}` "
        f"`algo.total_steps={report['env_steps']}` `logger.tensorboard=false`.",
        "",
    ]
    differs = report["deviations_from_cleanrl"]
    lines += [
        "Differences from CleanRL's `ppo.py` defaults: "
        + (
            ", ".join(f"`{k}` {d['experiment']!r} (CleanRL {d['cleanrl']!r})" for k, d in differs.items())
            if differs
            else "none in the keys checked"
        )
        + ". Not checked (not settings of the experiment): CleanRL clips the value loss with max(clipped, "
        "unclipped) and halves the MSE; it does not bootstrap truncated episodes, both libraries here do.",
        "",
    ]
    mismatched = [r for r in report["runs"] if r.get("same_workload_as_sb3") is False]
    if mismatched:
        lines += [
            "**Warning: some ppo-fabric runs composed a different workload from the one SB3 was given** "
            f"(the config changed during the benchmark): seeds {', '.join(str(r['seed']) for r in mismatched)}.",
            "",
        ]
    lines += [
        "## Results",
        "",
        table(report["runs"], s, impls),
        "",
    ]
    if "sps_ratio_ppo_fabric_over_sb3" in s:
        lines += [
            f"**SPS ratio ppo-fabric / SB3 (medians): {s['sps_ratio_ppo_fabric_over_sb3']:.2f}x** "
            f"(training loop only: {s['loop_sps_ratio_ppo_fabric_over_sb3']:.2f}x; "
            f"per CPU second: {s['cpu_sps_ratio_ppo_fabric_over_sb3']:.2f}x)",
            "",
        ]
    codes = sorted({str(r["code"]) for r in report["runs"]})
    if len(codes) > 1:
        lines += [
            f"**Warning: the code changed during the benchmark** (runs saw {', '.join(codes)}; see each run's "
            "`code` in the JSON). Compare only runs of the same code.",
            "",
        ]
    starved = [r for r in report["runs"] if r["cpu_util"] < BUSY_UTIL]
    if starved:
        names = ", ".join(f"{r['impl']} seed {r['seed']} ({r['cpu_util']:.2f})" for r in starved)
        lines += [
            f"**Warning: the machine was busy.** These runs got less than {BUSY_UTIL:.0%} of a core "
            f"(CPU/wall): {names}. Their wall-clock SPS is understated; CPU SPS is the fairer comparison.",
            "",
        ]
    lines += [
        "- wall s / SPS: the training call after all imports: ppo-fabric's `run()` (config, Fabric, envs, "
        "model, loop, final checkpoint); SB3's vector env and model construction plus `learn()`.",
        "- loop SPS: the collect/update loop alone (ppo-fabric's own `sps`; SB3's `learn()`).",
        "- CPU SPS: env steps per CPU second of the run's process over the same scope as SPS; CPU/wall "
        "near 1.0 means the run had its core to itself (one torch thread, sync envs).",
        f"- solved at: env step of the first update after which the mean return of the last {WINDOW} "
        f"finished episodes is >= {SOLVED_RETURN:g}, read once per {per_update}-step update for both; "
        "`never` if it did not happen. Medians count `never` as later than any step.",
        "- best mean20: the highest per-update mean20 of the run, and the env step of that update.",
        f"- final mean20: mean return of the last {WINDOW} episodes finished in the run.",
        "",
    ]
    return "\n".join(lines)


def to_json(report: dict[str, Any]) -> str:
    """Indented JSON with each `[step, mean20]` curve point on one line: readable, a third of the size."""
    text = json.dumps(report, indent=2)
    return re.sub(r"\[\s+(-?[\d.]+),\s+(-?[\d.]+)\s+\]", r"[\1, \2]", text) + "\n"


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--seeds", type=int, default=3, help="seeds 1..N for each library (default 3)")
    p.add_argument("--steps", type=int, default=200_000, help="env steps per run (default 200000)")
    p.add_argument("--only", choices=("both", *IMPLS), default="both", help="which library to run")
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads per run (default 1; 0: torch decides)"
    )
    p.add_argument(
        "--sb3-threads",
        type=int,
        default=-1,
        help="torch threads for SB3 only (default: as --threads; 0: torch decides, as SB3 users get it)",
    )
    p.add_argument("--name", default="cartpole_vs_sb3", help="basename of the result files")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="where results go")
    # Internal: a child process runs one (library, seed).
    p.add_argument("--child", choices=IMPLS, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is None:
        if args.seeds < 1:
            p.error("--seeds must be at least 1")
        if args.steps < 1:
            p.error("--steps must be positive")
        if args.threads < 0:
            p.error("--threads must be >= 0")
    return args


def threads_for(impl: str, args: argparse.Namespace) -> int:
    """SB3 may run with other thread settings (its users get torch's default, one thread per core)."""
    return args.sb3_threads if impl == "sb3" and args.sb3_threads >= 0 else args.threads


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child is not None:
        child_main(args)
        return
    impls = list(IMPLS) if args.only == "both" else [args.only]
    workload = resolved_workload(args.steps)
    per_update = steps_per_update(workload)
    steps = (args.steps // per_update) * per_update
    if steps == 0:
        raise SystemExit(f"--steps {args.steps} is less than one update ({per_update} env steps)")
    differs = deviations(workload)
    for key, d in differs.items():
        print(f"note: exp={EXPERIMENT} sets {key}={d['experiment']!r} (CleanRL: {d['cleanrl']!r})")
    info = machine()
    print(
        f"{info['cpu_model']} ({info['usable_cores']} usable cores), torch {info['torch']}, "
        f"SB3 {info['stable_baselines3']}, ppo-fabric {info['ppo_fabric']}; {steps:,} steps per run, "
        f"{args.threads} torch thread(s), one run at a time",
        flush=True,
    )
    runs: list[dict[str, Any]] = []
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="cartpole_vs_sb3-") as tmp_name:
        tmp = Path(tmp_name)
        workload_path = tmp / "workload.json"
        workload_path.write_text(json.dumps(workload))
        for index, seed in enumerate(range(1, args.seeds + 1)):
            order = impls if index % 2 == 0 else impls[::-1]  # alternate who goes first
            for impl in order:
                print(f"  {impl:<10} seed {seed} ...", end="", flush=True)
                result = run_child(impl, seed, steps, threads_for(impl, args), tmp, workload_path)
                result |= {"impl": impl, "seed": seed}
                runs.append(result)
                print(
                    f" {result['wall_s']:.1f}s, {result['sps']:,.0f} SPS (CPU/wall {result['cpu_util']:.2f}), solved at "
                    f"{_fmt(result['solved_step'])}, final mean20 {_fmt(result['final_return_mean20'], '.1f')}",
                    flush=True,
                )
    runs.sort(key=lambda r: (impls.index(r["impl"]), r["seed"]))
    summary = summarize(runs, impls)
    report = {
        "benchmark": "cartpole_vs_sb3",
        "finished": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "argv": ["benchmarks/cartpole_vs_sb3.py", *(sys.argv[1:] if argv is None else argv)],
        "total_wall_s": time.time() - started,
        "machine": info,
        "threads": args.threads,
        "sb3_threads": threads_for("sb3", args),
        "requested_steps": args.steps,
        "env_steps": steps,
        "solved_return": SOLVED_RETURN,
        "window": WINDOW,
        "experiment": EXPERIMENT,
        "workload": workload,
        "deviations_from_cleanrl": differs,
        "steps_per_update": per_update,
        "impls": impls,
        "runs": runs,
        "summary": summary,
    }
    print()
    print(table(runs, summary, impls))
    if "sps_ratio_ppo_fabric_over_sb3" in summary:
        print(
            f"\nSPS ratio ppo-fabric / SB3 (medians): {summary['sps_ratio_ppo_fabric_over_sb3']:.2f}x "
            f"(loop only {summary['loop_sps_ratio_ppo_fabric_over_sb3']:.2f}x, "
            f"per CPU second {summary['cpu_sps_ratio_ppo_fabric_over_sb3']:.2f}x)"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / f"{args.name}.json", to_json(report))
    write_atomic(args.out / f"{args.name}.md", markdown(report))
    print(f"wrote {args.out / (args.name + '.json')} and {args.out / (args.name + '.md')}")


if __name__ == "__main__":
    main()
