"""EnvPool vs gymnasium collection backends on CartPole: `exp=fast` (64 envs) and `exp=cleanrl_cartpole` (4).

Runs `python -m ppo_fabric exp=<exp> env.backend=<backend>` once per seed, alternating backends so drifting
machine load hits both alike, each in a fresh process, one at a time, with a fixed step budget (`--steps`,
default 200k: long enough that start-up is not in the SPS, which counts training steps over the run's own
clock). Records SPS, collection and training seconds, the final mean return, the CPU seconds the run's
processes used (user + sys, start-up included) and the 1-minute load average before it: on a machine shared
with other work, wall-clock SPS moves with the load, CPU seconds per env step much less. The target:
on 2 CPU cores, EnvPool >= 1.5x gymnasium's SPS on `exp=fast`. Writes benchmarks/results/envpool_cpu.{json,md}.

`--stepping`: the env stepping alone, no policy and no training (what the backend changes): `exp=fast`'s
64 CartPole envs built by `make_vector_env` on each backend, 3,000 vector steps of random actions, wall and
CPU seconds, `--repeats` times alternating; writes benchmarks/results/envpool_cpu_stepping.{json,md}.

`--async`: EnvPool's sync pool against its async mode on `exp=fast` (64 envs; async: `env.envpool.batch_size`
32, so the policy acts on the 32 envs that are ready first while the other 32 step), `--seeds` runs each,
alternating, with the run's own SPS (env steps over its clock) and collection/training seconds; the async run
takes half the env steps per update from the same [32, 64] storage. Writes envpool_cpu_async.{json,md}.

    .venv/bin/python benchmarks/envpool_vs_gymnasium.py [--seeds 3] [--steps 200000] [--out DIR]
    .venv/bin/python benchmarks/envpool_vs_gymnasium.py --stepping [--repeats 7]
    .venv/bin/python benchmarks/envpool_vs_gymnasium.py --async [--seeds 1] [--steps 50000]
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # ppo_fabric of this checkout
import common  # noqa: E402
from common import RESULTS, run_once  # noqa: E402

EXPS = ("fast", "cleanrl_cartpole")
BACKENDS = ("gymnasium", "envpool")


def _split(summary: dict[str, Any], key: str) -> float | None:
    split = summary.get("time_split") or {}
    value = split.get(key)
    return float(value) if isinstance(value, (int, float)) else None


def stepping(repeats: int, out: Path, vector_steps: int = 3000, num_envs: int = 64) -> None:
    """Vector steps per second of the bare envs on each backend (the section `--stepping` writes)."""
    import time

    import numpy as np
    from omegaconf import OmegaConf

    from ppo_fabric.config.defaults import with_defaults
    from ppo_fabric.envs.make import make_vector_env

    rows = []
    actions = np.random.default_rng(0).integers(0, 2, (vector_steps, num_envs))
    for repeat in range(repeats):
        for backend in BACKENDS:
            env = {"id": "CartPole-v1", "num_envs": num_envs, "vector": "sync", "backend": backend}
            cfg = OmegaConf.create(with_defaults({"env": env})["env"])
            envs, _ = make_vector_env(cfg, seed=repeat, rank=0)
            load = os.getloadavg()[0]
            wall, cpu = time.perf_counter(), time.process_time()
            for a in actions:
                envs.step(a)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            envs.close()
            rows.append({"backend": backend, "repeat": repeat, "env_steps_per_s": vector_steps * num_envs / wall,
                         "wall_s": wall, "cpu_s": cpu, "load_before": load})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    med = {b: statistics.median(r["env_steps_per_s"] for r in rows if r["backend"] == b) for b in BACKENDS}
    cpu_med = {b: statistics.median(r["cpu_s"] for r in rows if r["backend"] == b) for b in BACKENDS}
    result = {"machine": common.machine(), "git": common.git_commit(), "rows": rows, "median_env_steps_per_s": med,
              "median_cpu_s": cpu_med, "ratio": med["envpool"] / med["gymnasium"]}  # fmt: skip
    m = result["machine"]
    lines = [
        "# EnvPool vs gymnasium: env stepping alone (CartPole-v1, 64 envs, random actions)",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores; git {result['git']}. `make_vector_env` on each backend (same-step "
        f"autoreset and episode statistics included), {vector_steps:,} vector steps, backends alternating.",
        "",
        "| backend | repeat | env steps/s | wall s | CPU s (this process, all threads) | load before |",
        "|---|---:|---:|---:|---:|---:|",
        *(
            f"| {r['backend']} | {r['repeat']} | {r['env_steps_per_s']:,.0f} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | "
            f"{r['load_before']:.1f} |"
            for r in rows
        ),  # fmt: skip
        "",
        f"**Median env steps/s: gymnasium {med['gymnasium']:,.0f}, envpool {med['envpool']:,.0f}: "
        f"{result['ratio']:.2f}x; median CPU s gymnasium {cpu_med['gymnasium']:.2f}, envpool {cpu_med['envpool']:.2f}.**",
        "",
        f"Command: `{common.command_line(__file__)}`",
        "",
    ]
    common.write_report(out, "envpool_cpu_stepping", result, "\n".join(lines))


ASYNC_MODES = {"sync": [], "async": ["env.envpool.batch_size=32"]}  # exp=fast: 64 envs


def async_runs(seeds: int, steps: int, out: Path) -> None:
    """`exp=fast` on EnvPool, sync pool against async (the section `--async` writes)."""
    rows: list[dict[str, Any]] = []
    for seed in range(1, seeds + 1):
        for mode, extra in ASYNC_MODES.items():
            load = os.getloadavg()[0]
            s = run_once(
                ["exp=fast", "env.backend=envpool", f"seed={seed}", f"algo.total_steps={steps}", *extra]
            )
            row = {"mode": mode, "seed": seed, "sps": s["sps"], "env_steps": s["total_env_steps"],
                   "final_mean_return": s["final_mean_return"], "time_split": s.get("time_split"),
                   "load_before": load}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    med = {m: statistics.median(r["sps"] for r in rows if r["mode"] == m) for m in ASYNC_MODES}
    result = {"machine": common.machine(), "git": common.git_commit(), "steps": steps, "rows": rows,
              "median_sps": med, "ratio": med["async"] / med["sync"]}  # fmt: skip
    m = result["machine"]
    lines = [
        "# EnvPool sync vs async collection (CartPole-v1 `exp=fast`, coupled, 1 process)",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}; git {result['git']}. Each run in a fresh "
        f"process, one at a time, modes alternating; {steps:,} env steps per run. Async: "
        "`env.envpool.batch_size=32` of 64 envs (1,024 env steps per update instead of 2,048).",
        "",
        "| mode | seed | SPS | collect s | train s | load before | final mean return |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        split = r["time_split"] or {}
        ret = "n/a" if r["final_mean_return"] is None else f"{r['final_mean_return']:.1f}"
        lines.append(
            f"| {r['mode']} | {r['seed']} | {r['sps']:,.0f} | {split.get('collect', 0):.1f} | "
            f"{split.get('train', 0):.1f} | {r['load_before']:.1f} | {ret} |"
        )
    lines += [
        "",
        f"**Median SPS sync {med['sync']:,.0f}, async {med['async']:,.0f}: {result['ratio']:.2f}x.**",
        "",
        f"Command: `{common.command_line(__file__)}`",
        "",
    ]
    common.write_report(out, "envpool_cpu_async", result, "\n".join(lines))


def main() -> None:
    parser = common.argument_parser(__doc__)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--stepping", action="store_true", help="the env stepping alone (see above)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--async", dest="asynchronous", action="store_true", help="sync vs async pool (above)"
    )
    args = parser.parse_args()
    if args.stepping:
        stepping(args.repeats, args.out)
        return
    if args.asynchronous:
        async_runs(args.seeds, args.steps, args.out)
        return
    rows: list[dict[str, Any]] = []
    for seed in range(1, args.seeds + 1):
        for exp in EXPS:
            for backend in BACKENDS:
                load = os.getloadavg()[0]
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                s = run_once([f"exp={exp}", f"env.backend={backend}", f"seed={seed}",
                              f"algo.total_steps={args.steps}"])  # fmt: skip
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
                row = {"exp": exp, "backend": backend, "seed": seed, "sps": s["sps"],
                       "env_steps": s["total_env_steps"], "final_mean_return": s["final_mean_return"],
                       "time_split": s.get("time_split"), "cpu_seconds": cpu, "load_before": load}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    medians = {
        exp: {
            b: statistics.median(r["sps"] for r in rows if r["exp"] == exp and r["backend"] == b)
            for b in BACKENDS
        }
        for exp in EXPS
    }
    ratios = {exp: medians[exp]["envpool"] / medians[exp]["gymnasium"] for exp in EXPS}
    cpu = {
        exp: {
            b: statistics.median(r["cpu_seconds"] for r in rows if r["exp"] == exp and r["backend"] == b)
            for b in BACKENDS
        }
        for exp in EXPS
    }
    result = {"machine": common.machine(), "git": common.git_commit(), "steps": args.steps, "rows": rows,
              "median_sps": medians, "ratio": ratios, "median_cpu_seconds": cpu, "target": {"fast": 1.5}}  # fmt: skip
    m = result["machine"]
    lines = [
        "# EnvPool vs gymnasium collection (CartPole-v1, coupled, 1 process)",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}; git {result['git']}. Each run in a fresh "
        f"process, one at a time, backends alternating; {args.steps:,} env steps per run.",
        "",
        "| exp | backend | seed | SPS | collect s | train s | CPU s (all processes) | load before | final mean return |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        split = r["time_split"] or {}
        ret = "n/a" if r["final_mean_return"] is None else f"{r['final_mean_return']:.1f}"
        lines.append(
            f"| {r['exp']} | {r['backend']} | {r['seed']} | {r['sps']:,.0f} | {split.get('collect', 0):.1f} | "
            f"{split.get('train', 0):.1f} | {r['cpu_seconds']:.1f} | {r['load_before']:.1f} | {ret} |"
        )
    lines.append("")
    for exp in EXPS:
        target = " (target >= 1.5x)" if exp == "fast" else ""
        lines.append(
            f"**exp={exp}: median SPS gymnasium {medians[exp]['gymnasium']:,.0f}, envpool "
            f"{medians[exp]['envpool']:,.0f}: {ratios[exp]:.2f}x{target}; median CPU seconds gymnasium "
            f"{cpu[exp]['gymnasium']:.1f}, envpool {cpu[exp]['envpool']:.1f}.**"
        )
        lines.append("")
    lines += [f"Command: `{common.command_line(__file__)}`", ""]
    common.write_report(args.out, "envpool_cpu", result, "\n".join(lines))


if __name__ == "__main__":
    main()
