"""What does an experiment tracker cost a run? `logger=default` (TensorBoard + CSV), `logger=none`,
`logger=mlflow` (embedded SQLite store) and `logger=wandb` (offline), each on CleanRL's CartPole workload
(`exp=cleanrl_cartpole`: 512 env steps per update, so a log row every ~0.1 s, the worst case for a
per-row cost), each in a fresh `python -m ppo_fabric` process, the loggers interleaved `--repeats` times.

Records per run: the process's wall time (imports, the tracker's start-up, training, the tracker's close),
the training loop's wall time and SPS (summary.json); the table gives medians, and the start-up/close
overhead as the process wall time minus the training wall time, against `logger=none`'s.
Stores go to a temporary folder (MLFLOW_TRACKING_URI, WANDB_DIR, WANDB_MODE=offline).
Writes benchmarks/results/trackers.{json,md}.

`--calls` instead times the tracker calls themselves in this process (no training, so far less
sensitive to a busy machine): opening the tracker run, one log row of 16 metrics (mean over `--rows`), and
closing it with the artifacts; writes benchmarks/results/trackers_calls.{json,md}.

    .venv/bin/python benchmarks/trackers.py                       # 50k steps, 3 repeats
    .venv/bin/python benchmarks/trackers.py --steps 20000 --repeats 1 --out /tmp/trk   # smoke test
    .venv/bin/python benchmarks/trackers.py --calls
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import RESULTS  # noqa: E402

LOGGERS = ("none", "default", "mlflow", "wandb")


def run(logger: str, steps: int, tmp: Path, index: int) -> dict[str, Any]:
    run_dir = tmp / f"{logger}-{index}"
    env = dict(os.environ)
    env |= {
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}",
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp / "wandb"),
        "WANDB_CONFIG_DIR": str(tmp / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp / "wandb-data"),
    }
    cmd = [sys.executable, "-m", "ppo_fabric", "exp=cleanrl_cartpole", f"algo.total_steps={steps}"]
    cmd += [f"logger={logger}", f"hydra.run.dir={run_dir}"]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"benchmark run failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "logger": logger,
        "process_wall_s": wall,
        "train_wall_s": summary["wall_seconds"],
        "sps": summary["sps"],
        "updates": summary["iterations"],
        "load_before": load,
    }


def time_calls(rows: int, out: Path) -> None:
    """Open, log `rows` rows, close: for each tracker, in this process, into a temporary store."""
    from ppo_fabric.config import compose
    from ppo_fabric.trackers import open_tracker

    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # MLflow puts a given store's artifacts in ./mlruns
        os.environ |= {
            "MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db",
            "WANDB_MODE": "offline",
            "WANDB_CONFIG_DIR": f"{tmp}/wandb-config",
            "WANDB_CACHE_DIR": f"{tmp}/wandb-cache",
            "WANDB_DATA_DIR": f"{tmp}/wandb-data",
        }
        for name in ("mlflow", "wandb"):
            cfg, _ = compose([f"logger={name}"])
            for attempt in ("first", "again"):  # the first opens a new store / starts wandb's service
                run_dir = Path(tmp) / f"{name}-{attempt}"
                run_dir.mkdir()
                (run_dir / "config.yaml").write_text("seed: 1\n")
                t0 = time.perf_counter()
                tracker = open_tracker(cfg, run_dir)
                t1 = time.perf_counter()
                for i in range(rows):
                    tracker.log({f"metric/{k}": float(i + k) for k in range(16)}, 512 * (i + 1))
                t2 = time.perf_counter()
                tracker.close(run_dir, {"total_env_steps": 512 * rows, "sps": 1.0}, 0)
                t3 = time.perf_counter()
                results[f"{name} ({attempt})"] = {
                    "open_s": t1 - t0,
                    "log_row_ms": 1000 * (t2 - t1) / rows,
                    "close_s": t3 - t2,
                }
                print(name, attempt, results[f"{name} ({attempt})"], flush=True)
    lines = [
        "# Experiment trackers: the cost of their calls",
        "",
        f"Command: `{common.command_line(__file__)}`  ",
        f"Commit: {common.git_commit()}; machine: {common.machine()}; load average {os.getloadavg()[0]:.1f}  ",
        f"{rows} rows of 16 metrics each; `first` opens a new store (MLflow creates its tables; wandb starts "
        "its service), `again` a second run in the same process. MLflow rows are buffered and sent in one "
        "batch per `logger.flush_seconds` (here: at close); wandb offline writes each row to its run file.",
        "",
        "| tracker | open s | per log row ms | close s |",
        "|---|---|---|---|",
    ]
    for key, r in results.items():
        lines.append(f"| {key} | {r['open_s']:.2f} | {r['log_row_ms']:.3f} | {r['close_s']:.2f} |")
    common.write_report(out, "trackers_calls", {"machine": common.machine(), "rows": rows, "results": results},
                        "\n".join(lines) + "\n")  # fmt: skip


def main() -> None:
    parser = common.argument_parser(__doc__)
    parser.add_argument("--steps", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", action="store_true", help="time the tracker calls in-process instead")
    parser.add_argument("--rows", type=int, default=500)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.calls:
        time_calls(args.rows, args.out)
        return
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for logger in LOGGERS:
                runs.append(run(logger, args.steps, Path(tmp), i))
                print(runs[-1], flush=True)
    med: dict[str, dict[str, float]] = {}
    for logger in LOGGERS:
        mine = [r for r in runs if r["logger"] == logger]
        med[logger] = {
            k: statistics.median(r[k] for r in mine) for k in ("process_wall_s", "train_wall_s", "sps")
        }
        med[logger]["outside_training_s"] = statistics.median(
            r["process_wall_s"] - r["train_wall_s"] for r in mine
        )
    base = med["none"]
    lines = [
        "# Experiment trackers: what they cost a run",
        "",
        f"Command: `{common.command_line(__file__)}`  ",
        f"Commit: {common.git_commit()}; machine: {common.machine()}  ",
        f"Workload: exp=cleanrl_cartpole, {args.steps} env steps ({runs[0]['updates']} updates, one log row "
        f"each), {args.repeats} interleaved repeat(s); medians. Load average before the runs: "
        f"{min(r['load_before'] for r in runs):.1f}-{max(r['load_before'] for r in runs):.1f}.",
        "",
        "| logger | training SPS | SPS vs none | process wall s | outside training s | extra vs none s |",
        "|---|---|---|---|---|---|",
    ]
    for logger in LOGGERS:
        m = med[logger]
        lines.append(
            f"| {logger} | {m['sps']:,.0f} | {m['sps'] / base['sps']:.1%} | {m['process_wall_s']:.1f} | "
            f"{m['outside_training_s']:.1f} | {m['outside_training_s'] - base['outside_training_s']:+.1f} |"
        )
    report = {"machine": common.machine(), "steps": args.steps, "runs": runs, "medians": med}
    common.write_report(args.out, "trackers", report, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
