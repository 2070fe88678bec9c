"""Coupled and decoupled on a CUDA machine: SPS, GPU utilisation and the collect / transfer / train time split of
each workload (CartPole, LunarLander, Pong; `envpool`: Pong collected by gymnasium and by EnvPool) at each layout
(`variants`), one fresh process a run. Workloads, variants, options and the figures: benchmarks/README.md,
"gpu_strategies.py".

    .venv/bin/python benchmarks/gpu_strategies.py [--steps 500000] [--atari-steps 500000] [--only atari]
        [--variants gpu|cpu|KEY ...] [--players 1 2 4 6] [--envpool-players 2] [--run-timeout S] [--dry-run]
    .venv/bin/python benchmarks/gpu_strategies.py --only envpool [--envpool-steps 500000] [--envpool-dry-run]
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import RESULTS, run_once  # noqa: E402

# key -> (label, overrides, modules the env needs, the option that sets its env-step budget, the env overrides
# of its decoupled rows after the workload's). A player is one process, so a Pong player steps its envs in turn
# (sync) and the players are the parallelism: 32 async envs in each of 14 players would be 448 processes.
# `envpool` is Pong, coupled, at the `ENVPOOL` variants instead of the layouts.
WORKLOADS: dict[str, tuple[str, list[str], tuple[str, ...], str, list[str]]] = {
    "cartpole": ("CartPole-v1, 64 envs", ["env=cartpole", "env.num_envs=64", "algo.minibatch_size=512"],
                 (), "steps", []),
    "lunarlander": ("LunarLander-v3, 16 envs", ["env=lunarlander"], ("Box2D",), "steps", []),
    "atari": ("Pong-v5", ["exp=atari", "env.num_envs=32", "env.vector=async"], ("ale_py", "cv2"), "atari_steps",
              ["env.vector=sync", "env.num_envs=8"]),
    "envpool": ("Pong-v5, 32 envs", ["exp=atari", "env.num_envs=32", "strategy=coupled"], (), "envpool_steps", []),
}  # fmt: skip
# The `envpool` workload's variants, gymnasium's collection against EnvPool's: key -> (name, overrides before
# the fabric, modules the row needs).
ENVPOOL: dict[str, tuple[str, list[str], tuple[str, ...]]] = {
    "gymnasium-async": ("gymnasium AsyncVectorEnv, GPU", ["env.backend=gymnasium", "env.vector=async"],
                        ("ale_py", "cv2")),
    "envpool": ("EnvPool, GPU", ["env.backend=envpool"], ("envpool",)),
}  # fmt: skip
ENVPOOL_DRY_STEPS = 4096  # one batch: 32 envs x 128 steps
SMI_QUERY = "timestamp,index,utilization.gpu,memory.used"
VARIANT_GROUPS = {
    "gpu": (
        "coupled-gpu",
        "coupled-gpu-compile",
        "decoupled-gpu-",
        "decoupled-gpuplay-",
        "decoupled-envpool-",
        "decoupled-gpus",
    ),
    "cpu": ("coupled-cpu", "decoupled-cpu"),
}


def variants(
    gpus: int, players: list[int], dry_run: bool = False, envpool_players: tuple[int, ...] = ()
) -> dict[str, tuple[str, list[str], bool]]:
    """The layouts: variant key -> (name, overrides, runs on the CPU only). The CPU rows are there so that each
    GPU figure has a reference taken on the same machine. A dry run puts every GPU role on the CPU."""
    gpu_fabric, trainer = ("cpu", "cpu") if dry_run else ("gpu", "cuda")
    out = {"coupled-gpu": ("coupled, GPU", ["strategy=coupled", f"fabric={gpu_fabric}"], False)}
    out["coupled-gpu-compile"] = (
        "coupled, GPU, algo.compile=true",
        ["strategy=coupled", f"fabric={gpu_fabric}", "algo.compile=true"], False)  # fmt: skip
    on_gpu = "cpu" if dry_run else "auto"  # players acting where the trainer is (the CPU in a dry run)

    def decoupled(players: int, trainers: int, player_device: str, *extra: str) -> list[str]:
        return ["strategy=decoupled", "fabric=cpu", f"fabric.devices={players + trainers}",
                f"algo.players={players}", f"algo.player_device={player_device}",
                f"algo.trainer_device={trainer}", *extra]  # fmt: skip

    def plural(n: int, word: str) -> str:
        return f"{n} {word}{'s' if n > 1 else ''}"

    for k in players:
        out[f"decoupled-gpu-{k}"] = (
            f"decoupled, 1 GPU trainer + {plural(k, 'CPU player')}", decoupled(k, 1, "cpu"), False)  # fmt: skip
    # the same players acting on the GPU (one CUDA context each), stepping their envs on the CPU
    for k in players:
        out[f"decoupled-gpuplay-{k}"] = (
            f"decoupled, 1 GPU trainer + {plural(k, 'player')} acting on the GPU", decoupled(k, 1, on_gpu), False)  # fmt: skip
    # few players, each an EnvPool of C++ threads sharing the cores left after one per process
    for k in envpool_players:
        threads = max(1, ((os.cpu_count() or 2) - k - 1) // k)
        out[f"decoupled-envpool-{k}"] = (
            f"decoupled, 1 GPU trainer + {plural(k, 'EnvPool player')} ({plural(threads, 'thread')} each) "
            "acting on the GPU",
            decoupled(k, 1, on_gpu, "env.backend=envpool", f"env.envpool.num_threads={threads}"), False)  # fmt: skip
    if players:  # the most players again with the trainer's minibatch step compiled (CUDA graphs)
        k = max(players)
        name, overrides, _ = out[f"decoupled-gpu-{k}"]
        out[f"decoupled-gpu-{k}-compile"] = (
            f"{name}, algo.compile=true",
            [*overrides, "algo.compile=true"],
            False,
        )
    if gpus >= 2:
        out["decoupled-gpus"] = (
            f"decoupled, {gpus} GPU trainers + {gpus} CPU players", decoupled(gpus, gpus, "cpu"), False)  # fmt: skip
    out["coupled-cpu"] = ("coupled, CPU", ["strategy=coupled", "fabric=cpu"], True)
    out["decoupled-cpu"] = (
        "decoupled, CPU (1 player + 1 trainer)", ["strategy=decoupled", "fabric=cpu", "fabric.devices=2"], True)  # fmt: skip
    return out


def envpool_variants(dry_run: bool) -> dict[str, tuple[str, list[str], bool]]:
    """The `envpool` workload's variants as `variants` gives the layouts: on the CPU in a dry run."""
    fabric, gpu = ("cpu", "CPU dry run") if dry_run else ("gpu", "GPU")
    return {k: (name.replace("GPU", gpu), [*o, f"fabric={fabric}"], False) for k, (name, o, _) in ENVPOOL.items()}  # fmt: skip


def layout_overrides(workload: str, layout: list[str]) -> list[str]:
    """A row's overrides before its budget: the workload's, the env layout of its decoupled rows (an EnvPool
    player keeps the workload's envs), then the layout's own."""
    _, base, _, _, decoupled_envs = WORKLOADS[workload]
    envs = decoupled_envs if "strategy=decoupled" in layout and "env.backend=envpool" not in layout else []
    return [*base, *envs, *layout]


def chosen(all_variants: dict[str, Any], asked: list[str] | None) -> list[str]:
    """The variant keys `--variants` names, in the order named (a group, `gpu`/`cpu`, expands in the table's
    order): a job cut short has run the rows named first."""
    if not asked:
        return list(all_variants)
    out: list[str] = []
    for name in asked:
        prefixes = VARIANT_GROUPS.get(name, (name,))
        out += [
            k
            for k in all_variants
            if k not in out and any(k == p or (p.endswith("-") and k.startswith(p)) for p in prefixes)
        ]
    return out


class GpuSampler:
    """`nvidia-smi ... -lms 500` in the background while a run executes, its output in a temp file.

    Samples carry nvidia-smi's own timestamp, so the loop window can be cut out afterwards however the
    output was buffered; `stdbuf -oL` (when present) makes it flush every line, and it is stopped with
    SIGINT, as Ctrl+C would, before anything harder. Without nvidia-smi it records nothing (reported n/a).
    """

    def __init__(self, interval_ms: int = 500) -> None:
        self.interval_ms = interval_ms
        self.available = shutil.which("nvidia-smi") is not None
        self.samples: list[tuple[float | None, str, float | None, float | None]] = []  # (t, gpu, util, MiB)
        self.proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> GpuSampler:
        if self.available:
            self.file = tempfile.TemporaryFile(mode="w+")
            cmd = ["nvidia-smi", f"--query-gpu={SMI_QUERY}", "--format=csv,noheader,nounits",
                   "-lms", str(self.interval_ms)]  # fmt: skip
            if shutil.which("stdbuf"):
                cmd = ["stdbuf", "-oL", *cmd]
            self.proc = subprocess.Popen(cmd, stdout=self.file, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.file.seek(0)
        for line in self.file.read().splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 4:
                self.samples.append((_stamp(parts[0]), parts[1], _number(parts[2]), _number(parts[3])))
        self.file.close()

    def stats(self, loop_start: float, loop_end: float) -> dict[str, Any] | None:
        """Per GPU (nvidia-smi's index): mean utilisation % over the whole process and over the training
        loop's window, max utilisation % and max memory used (MiB, every process on that GPU)."""
        if not self.available:
            return None
        per_gpu: dict[str, dict[str, Any]] = {}
        for gpu in sorted({s[1] for s in self.samples}):
            mine = [s for s in self.samples if s[1] == gpu]
            util = [s[2] for s in mine if s[2] is not None]
            loop = [
                s[2] for s in mine if s[2] is not None and s[0] is not None and loop_start <= s[0] <= loop_end
            ]
            mem = [s[3] for s in mine if s[3] is not None]
            per_gpu[gpu] = {"samples": len(mine), "loop_samples": len(loop),
                            "util_mean": _mean(util), "util_mean_loop": _mean(loop),
                            "util_max": max(util) if util else None, "mem_max_mib": max(mem) if mem else None}  # fmt: skip
        return per_gpu


def _stamp(text: str) -> float | None:
    """nvidia-smi's timestamp ('YYYY/MM/DD HH:MM:SS.mmm', local time) as a POSIX time."""
    try:
        return datetime.strptime(text, "%Y/%m/%d %H:%M:%S.%f").timestamp()
    except ValueError:
        return None


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def figures(s: dict[str, Any]) -> dict[str, Any]:
    """What a GPU row adds to `common.record`, from the run's summary (`run_once`): the steady rate, the
    process's life (the start-up is its rest), why it stopped early, the time split (`split`) and how its
    processes started."""
    return {"sps_steady": s.get("sps_steady"), "process_seconds": s.get("process_seconds"),
            "stopped_after_s": s.get("stopped_after_s"), "time_split": s["time_split"], "split": split(s),
            "ranks_in_sync": s.get("ranks_in_sync"), "start_up_trace": s.get("start_up_trace")}  # fmt: skip


def split(summary: dict[str, Any]) -> dict[str, float | None]:
    """Seconds of collect / transfer / train and each as a fraction of the run's wall time.

    Coupled (rank 0): collect (env steps, policy forward, host-device copies) and train; no transfer.
    Decoupled: the player's collect, the player's send + wait_params as the transfer (sending the batch and
    waiting for the new parameters: the transfer itself plus any wait for the trainer) and the trainer's
    train. With the pipeline on, the player and the trainer overlap, so the fractions need not sum to 1.
    """
    t = summary["time_split"]
    if "player" in t:
        player, trainer = t["player"], t["trainer"]
        seconds = {"collect": player.get("collect", 0.0),
                   "transfer": player.get("send", 0.0) + player.get("wait_params", 0.0),
                   "train": trainer.get("train", 0.0)}  # fmt: skip
    else:
        seconds = {"collect": t.get("collect"), "transfer": None, "train": t.get("train")}  # None: not logged
    wall = summary["wall_seconds"]
    out: dict[str, float | None] = {f"{k}_s": v for k, v in seconds.items()}
    out |= {k: (v / wall if v is not None and wall > 0 else None) for k, v in seconds.items()}
    return out


def gpu_info() -> list[dict[str, str]]:
    """Name, memory and driver of every GPU, from nvidia-smi (empty without it)."""
    if shutil.which("nvidia-smi") is None:
        return []
    query = "index,name,memory.total,driver_version"
    proc = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True)  # fmt: skip
    rows = [[p.strip() for p in line.split(",")] for line in proc.stdout.splitlines() if line.strip()]
    return [dict(zip(query.split(","), r, strict=False)) for r in rows]


def _rounded(tree: dict[str, Any]) -> dict[str, Any]:
    return {k: _rounded(v) if isinstance(v, dict) else round(v, 2) for k, v in tree.items()}


def _per_gpu(row: dict[str, Any], key: str) -> str:
    """One figure per GPU; with several GPUs each is prefixed by its nvidia-smi index."""
    gpu = row["gpu"]
    if not gpu:
        return "n/a"
    if len(gpu) == 1:
        return common.fmt(next(iter(gpu.values()))[key], ".0f")
    return ", ".join(f"{i}: {common.fmt(s[key], '.0f')}" for i, s in gpu.items())


def _startup(row: dict[str, Any]) -> float | None:
    life = row.get("process_seconds")
    return None if life is None else life - row["wall_seconds"]


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    gpus = ", ".join(f"{g.get('name')} ({g.get('memory.total')} MiB, driver {g.get('driver_version')})"
                     for g in m["gpu_info"]) or m["gpu"]  # fmt: skip
    lines = [
        "# Strategies on the GPU",
        "",
        f"Machine: {m['gpus']} GPU(s): {gpus}; {m['cpu']}, {m['cores']} cores; torch {m['torch']}, "
        f"Python {m['python']}; code {m['commit']}.",
        "",
        "One run at a time, each `python -m ppo_fabric` in a fresh process. SPS = env steps / training wall "
        "time (process start-up excluded). GPU: nvidia-smi every 500 ms; util % is the mean over the "
        "training loop (the last `wall_seconds` before the process exited: it includes the second or so of "
        "shutdown and misses as much of the loop's start) / over the whole process (start-up included); max "
        "util and max memory (MiB, every process on the GPU) over the whole process. Time split as fractions "
        "of the wall time: coupled, rank 0's collect and train (no transfer: host-device copies are in "
        "collect); decoupled, the player's collect, its send + wait for parameters (transfer, and any wait "
        "for the trainer) and the trainer's train, which overlap with the pipeline on. Steady SPS: env steps "
        "per second over the second half of the run's logged wall time (no start-up, compilation or "
        "warm-up): the rate of a long run. A row marked 'stopped at S s' is a run the benchmark ended "
        "after S seconds (`--run-timeout`): its figures are those of its last logged update, its split "
        "the summed per-update collect and train seconds. Start-up: seconds from launching the job to the "
        "start of its training loop (the process's life less the loop's wall time; shutdown included).",
        "",
        "| workload | variant | env steps | SPS | steady SPS | start-up s | GPU util % loop / all | "
        "GPU util max % | GPU mem max MiB | collect | send+wait | train | final mean return |",
        "|---|---|---:|---:|---:|---:|---|---|---|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        s = r["split"]
        util = "n/a" if not r["gpu"] else f"{_per_gpu(r, 'util_mean_loop')} / {_per_gpu(r, 'util_mean')}"
        stopped = f" (stopped at {r['stopped_after_s']:.0f} s)" if r.get("stopped_after_s") else ""
        lines.append(
            f"| {r['workload']} | {r['variant']}{stopped} | {r.get('total_env_steps', r.get('steps')):,} | {r['sps']:,.0f} | "
            f"{common.fmt(r.get('sps_steady'), ',.0f')} | {common.fmt(_startup(r), '.0f')} | {util} | "
            f"{_per_gpu(r, 'util_max')} | {_per_gpu(r, 'mem_max_mib')} | {common.fmt(s['collect'], '.2f')} | "
            f"{'-' if 'strategy=coupled' in r['overrides'] else common.fmt(s['transfer'], '.2f')} | {common.fmt(s['train'], '.2f')} | "
            f"{common.fmt(r['final_mean_return'], '.1f')} |"
        )
    lines += ["", "Overrides of each row (`run_once` adds `logger.tensorboard=false hydra.run.dir=<tmp>`) and its "
              "time split in seconds:", ""]  # fmt: skip
    for r in report["rows"]:
        raw = json.dumps(_rounded(r["time_split"]))
        lines.append(f"- {r['workload']}, {r['variant']}: `{' '.join(r['overrides'])}`; {raw}")
    lines += ["", *(f"- {n}" for n in report["notes"]), "", f"Command: `{report['command']}`", ""]
    return "\n".join(lines)


def main() -> None:
    parser = common.argument_parser(__doc__)
    parser.add_argument("--steps", type=int, default=500_000, help="env steps of CartPole and LunarLander")
    parser.add_argument("--atari-steps", type=int, default=500_000, help="env steps of Pong (slower)")
    parser.add_argument("--cpu-steps-frac", type=float, default=1.0,
                        help="the CPU reference rows run this fraction of the steps (their SPS stays "
                        "comparable, their final return does not)")  # fmt: skip
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="torch_threads of the CPU rows (default: the config's 1; 0 lets torch decide)")  # fmt: skip
    parser.add_argument("--envpool-steps", type=int, default=500_000, help="env steps of each EnvPool row")
    parser.add_argument("--envpool-variants", nargs="+", choices=list(ENVPOOL), default=None,
                        help="these EnvPool rows only (default both); the others are kept")  # fmt: skip
    parser.add_argument("--envpool-dry-run", action="store_true",
                        help="the EnvPool rows on the CPU, 4,096 steps, no CUDA needed, nothing written")  # fmt: skip
    parser.add_argument("--only", nargs="+", choices=list(WORKLOADS),
                        help="these workloads only; the output's rows of the others are kept")  # fmt: skip
    parser.add_argument("--variants", nargs="+", default=None,
                        help="variant keys or groups (gpu, cpu); default all; the other rows are kept")  # fmt: skip
    parser.add_argument("--players", nargs="+", type=int, default=[1, 2, 4, 6],
                        help="K of the decoupled-gpu-K rows (CPU players feeding one GPU trainer) and of the "
                        "decoupled-gpuplay-K rows (the players act on the GPU)")  # fmt: skip
    parser.add_argument("--envpool-players", nargs="+", type=int, default=[2],
                        help="K of the decoupled-envpool-K rows: K EnvPool players acting on the GPU")  # fmt: skip
    parser.add_argument("--run-timeout", type=float, default=None,
                        help="stop a run after this many seconds and report its last logged update "
                        "(the row says so); default: none")  # fmt: skip
    parser.add_argument("--dry-run", action="store_true",
                        help="every GPU role on the CPU: checks the script anywhere (use a small --steps)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("extra", nargs="*", help="overrides applied to every run (after --)")
    args = parser.parse_args()
    import torch

    if args.envpool_dry_run:  # the EnvPool rows' commands on the CPU, one batch each: printed, not written
        args.only, args.envpool_steps, args.run_timeout = ["envpool"], ENVPOOL_DRY_STEPS, None
    elif not torch.cuda.is_available() and not args.dry_run:
        raise SystemExit(
            "gpu_strategies.py needs a CUDA device (torch.cuda.is_available() is False); "
            "--dry-run runs the same layouts on the CPU"
        )
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    info = gpu_info()
    gpu_name = info[0]["name"] if info else (torch.cuda.get_device_name(0) if gpus else "none (dry run)")
    m = common.machine() | {"gpu": gpu_name, "gpus": gpus, "gpu_info": info, "commit": common.git_commit()}
    name = "gpu-strategies-dryrun" if args.dry_run else "gpu-strategies"
    table = variants(gpus, args.players, args.dry_run, tuple(args.envpool_players))
    keys = chosen(table, args.variants)
    unknown = set(args.variants or []) - set(VARIANT_GROUPS) - set(table)
    if unknown and not args.envpool_dry_run:
        parser.error(f"unknown --variants {sorted(unknown)}; choose from gpu, cpu, {', '.join(table)}")
    pooled = envpool_variants(args.envpool_dry_run or args.dry_run)  # a dry run: every GPU role on the CPU
    selected = args.only or [w for w in WORKLOADS if w != "envpool"]
    cells = [{"key": w, "variant_key": v} for w in sorted(selected, key=lambda w: w != "envpool")  # EnvPool's first
             for v in ([k for k in ENVPOOL if k in (args.envpool_variants or ENVPOOL)] if w == "envpool" else keys)]  # fmt: skip
    # an earlier report's rows that this sitting does not redo are kept when it was made on this machine, so a
    # benchmark can be split over several jobs (each row keeps its own commit)
    path = args.out / f"{name}.json"
    earlier = json.loads(path.read_text()) if path.is_file() and not args.envpool_dry_run else {}
    same = all(earlier.get("machine", {}).get(k) == m[k] for k in ("gpu", "gpus", "cpu", "cores"))
    rows = earlier.get("rows", []) if same else []
    kept = [r for r in rows if {"key": r.get("key"), "variant_key": r.get("variant_key")} not in cells]
    notes = []
    if args.dry_run:
        notes.append("dry run: every GPU role ran on the CPU (fabric=cpu, algo.trainer_device=cpu); the figures "
                     "say nothing about a GPU")  # fmt: skip
    if kept:
        notes.append("rows of " + ", ".join(sorted({r["workload"] + " / " + r["variant"] for r in kept})) + " come "
                     "from an earlier run of this script on the same machine (commit "
                     + ", ".join(sorted({r["commit"] for r in kept})) + ")")  # fmt: skip
    if gpus < 2 and not args.dry_run:
        notes.append("decoupled-gpus (one trainer per GPU) skipped: one GPU")
    if not shutil.which("nvidia-smi"):
        notes.append("GPU utilisation and memory n/a: nvidia-smi not found")
    if args.cpu_steps_frac != 1.0:
        notes.append(f"CPU rows ran {args.cpu_steps_frac:g} of the GPU rows' env steps: compare their SPS, "
                     "not their final return")  # fmt: skip
    report = {"machine": m, "command": common.command_line(__file__), "rows": kept, "notes": notes}

    def row(key: str, variant_key: str) -> dict[str, Any] | None:
        """One run's row, or None (a note says why): its modules missing, or stopped before it logged."""
        workload, _, modules, budget, _ = WORKLOADS[key]
        variant, layout, on_cpu = (pooled if key == "envpool" else table)[variant_key]
        needs = (*modules, *(ENVPOOL[variant_key][2] if key == "envpool" else ()))
        if missing := [mod for mod in needs if importlib.util.find_spec(mod) is None]:
            what = workload if set(missing) <= set(modules) else f"{workload} / {variant}"
            note = f"{what}: skipped, {', '.join(missing)} not installed"
            notes.extend([note] if note not in notes else [])
            print(note, flush=True)
            return None
        steps = getattr(args, budget)
        if on_cpu:
            steps = max(1, round(steps * args.cpu_steps_frac))
        threads = [f"torch_threads={args.cpu_threads}"] if on_cpu and args.cpu_threads is not None else []
        run = [*layout_overrides(key, layout), *threads, f"algo.total_steps={steps}", *args.extra]
        summary: dict[str, Any] = {}

        def train() -> dict[str, Any]:
            with GpuSampler() as sampler:
                summary.update(run_once(run, curve=True, timeout=args.run_timeout))
                exited = time.time()  # before the sampler stops (which may take a few seconds)
            summary["gpu"] = sampler.stats(exited - summary["wall_seconds"], exited)
            return summary

        try:
            r = common.record(run, train)
        except common.LoggedNothing as stopped:  # no row; the next layout may still fit
            log = args.out / f"trace-{variant_key}.log"  # its stderr, timestamped, and its stacks
            args.out.mkdir(parents=True, exist_ok=True)
            log.write_text(stopped.trace)
            notes.append(f"{workload} / {variant}: no row, {stopped} (trace: {log.name})")
            print(f"{workload:24s} {variant:38s} {stopped}", flush=True)
            return None
        out = {"workload": workload, "variant": variant, **r, **figures(summary), "gpu": summary["gpu"],
               "roles": summary.get("roles")}  # fmt: skip
        sp = out["split"]
        print(f"{workload:24s} {variant:38s} {summary['sps']:10,.0f} SPS  GPU util {_per_gpu(out, 'util_mean_loop')} % "
              f"(max {_per_gpu(out, 'util_max')}), mem {_per_gpu(out, 'mem_max_mib')} MiB  collect "
              f"{common.fmt(sp['collect'], '.2f')} send+wait {common.fmt(sp['transfer'], '.2f')} train "
              f"{common.fmt(sp['train'], '.2f')}", flush=True)  # fmt: skip
        if summary.get("start_up_trace"):
            print(f"{'':24s} start-up: {summary['start_up_trace']}", flush=True)
        return out

    def write(report: dict[str, Any]) -> None:
        if args.envpool_dry_run:
            print(markdown(report))
        else:
            common.write_report(args.out, name, report, markdown(report))

    common.sweep(
        report, cells, True, row, write, field="rows", say=lambda cell, r: None
    )  # row() prints its own


if __name__ == "__main__":
    main()
