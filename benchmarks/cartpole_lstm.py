"""Does recurrent PPO solve CartPole with the velocities hidden, where a feed-forward policy cannot?

Runs `python -m ppo_fabric exp=cartpole_lstm` (CartPole-v1 with `env.mask_velocity=true`: cart position
and pole angle only; separate actor and critic LSTMs of 64, RL-Zoo's RecurrentPPO settings with 10 epochs, the exp's
200k steps) and the same experiment
with `model=mlp` (everything else kept: the same masked observations, normalisation and PPO
settings), once per seed, each in a fresh process, one at a time. Records the final mean return (last 20
episodes), the first env step at which the mean of the last 20 episodes reached 475, the best and the late
(last 20% of steps) mean20, SPS, wall time and the load average around each run, and draws both learning
curves (`rollout/return_mean20` against env steps, from each run's metrics.csv).
Writes benchmarks/results/cartpole_lstm.{json,md,png}.

    .venv/bin/python benchmarks/cartpole_lstm.py                       # 1 seed x 2 models, the exp's 200k steps each
    .venv/bin/python benchmarks/cartpole_lstm.py --seeds 3
    .venv/bin/python benchmarks/cartpole_lstm.py --seeds 3 --task zeroed     # or noisy; results of their own
    .venv/bin/python benchmarks/cartpole_lstm.py --seeds 5 --first-seed 4 --only lstm --out DIR   # held-out seeds
    .venv/bin/python benchmarks/cartpole_lstm.py --steps 500000            # longer than the exp's budget
    .venv/bin/python benchmarks/cartpole_lstm.py --steps 20000 --out /tmp/cl   # smoke test
    .venv/bin/python benchmarks/cartpole_lstm.py -- env.num_envs=16           # extra overrides after --

A smoke run with `--steps` is far too short to solve anything; write it somewhere other than
benchmarks/results/ so it does not replace a full run's figures.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import RESULTS, first_step_at  # noqa: E402

SOLVED = 475.0  # CartPole-v1's "solved" mean return
MEAN20 = "rollout/return_mean20"
# model name in the report -> overrides on top of exp=cartpole_lstm (which takes model=lstm's defaults, so
# swapping the model group leaves everything else as it is).
MODELS: dict[str, list[str]] = {"lstm": [], "mlp": ["model=mlp"]}
# The partially observed task: `dropped` is the exp's own (velocities removed from the observation); the
# others keep the recipe and change what is hidden. Each task writes its own results (`cartpole_lstm` for
# `dropped`, `cartpole_lstm_<task>` for the others).
TASKS: dict[str, list[str]] = {
    "dropped": [],
    "zeroed": ["env.mask_velocity=zero"],  # velocities read 0, the observation keeps its 4 entries
    "noisy": ["env.mask_velocity=false", "env.observation_noise=0.1"],  # all 4 entries, each with N(0, 0.1^2)
}
TITLES = {"dropped": "velocities dropped", "zeroed": "velocities zeroed", "noisy": "noisy observations"}
TASK_WORDS = {
    "dropped": "observes only the cart position and pole angle (`env.mask_velocity=true`)",
    "zeroed": "sees the velocities as zeros (`env.mask_velocity=zero`)",
    "noisy": "observes all four entries with Gaussian noise of std 0.1 added (`env.mask_velocity=false "
    "env.observation_noise=0.1`)",
}


def read_curve(metrics_csv: Path) -> list[tuple[int, float]]:
    """(env step, mean of the last 20 episodes) for every logged update that had finished episodes."""
    curve = []
    with metrics_csv.open(newline="") as fh:
        for row in csv.DictReader(fh):
            raw = row.get(MEAN20)
            if raw not in (None, "") and math.isfinite(float(raw)):
                curve.append((int(row["step"]), float(raw)))
    return curve


def run_one(
    model: str, seed: int, steps: int | None, extra: list[str], task: str = "dropped"
) -> dict[str, Any]:
    """One training run in a fresh process (as a user launches it); its figures and learning curve."""
    overrides = ["exp=cartpole_lstm", *MODELS[model], *TASKS[task], f"seed={seed}"]
    overrides += [f"algo.total_steps={steps}"] if steps else []
    overrides += extra
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "ppo_fabric", "logger.tensorboard=false", f"hydra.run.dir={run_dir}",
               *overrides]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"benchmark run failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
        s = json.loads((run_dir / "summary.json").read_text())
        metrics = run_dir / "metrics.csv"
        solved_step = first_step_at(metrics, MEAN20, SOLVED)
        curve = read_curve(metrics)
    load_after = os.getloadavg()[0]
    return {
        "model": model,
        "seed": seed,
        "overrides": overrides,
        "total_env_steps": s["total_env_steps"],
        "final_mean_return": s["final_mean_return"],
        "first_step_mean20_at_475": solved_step,
        "best_mean20": max((v for _, v in curve), default=None),
        "sps": s["sps"],
        "wall_seconds": s["wall_seconds"],
        "episodes": s.get("episodes"),
        "load_before": load_before,  # 1-minute load average: above ~1.5, another program shared the CPU
        "load_after": load_after,
        "curve": curve,
    }


def plot(runs: list[dict[str, Any]], out: Path, task: str = "dropped") -> None:
    """rollout/return_mean20 against env steps, one line per run (LSTM blue, MLP orange). Drawn on an Agg
    canvas through the object API, as ppo_fabric/runs/plots.py does, so no GUI backend is ever picked."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colors = {"lstm": "tab:blue", "mlp": "tab:orange"}
    for r in runs:
        if r["curve"]:
            xs, ys = zip(*r["curve"], strict=True)
            ax.plot(xs, ys, color=colors.get(r["model"]), lw=1.5, alpha=0.9,
                    label=f"model={r['model']} seed {r['seed']}")  # fmt: skip
    ax.axhline(SOLVED, color="grey", ls="--", lw=1, label=f"{SOLVED:g} (solved)")
    ax.set_xlabel("env steps")
    ax.set_ylabel("mean return of the last 20 episodes")
    ax.set_title(f"CartPole-v1, {TITLES[task]} (exp=cartpole_lstm)")
    ax.set_ylim(0, 600)  # headroom above 500 for the legend
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", ncols=3, fontsize="small")
    fig.savefig(out)


def late_mean(curve: list[tuple[int, float]], total: int, fraction: float = 0.2) -> float | None:
    """Mean of the logged mean20 values over the last `fraction` of the run: how well a run holds on."""
    late = [v for step, v in curve if step >= (1 - fraction) * total]
    return sum(late) / len(late) if late else None


def markdown(report: dict[str, Any], command: str) -> str:
    m = report["machine"]
    extra = f" Extra overrides: `{' '.join(report['extra_overrides'])}`." if report["extra_overrides"] else ""
    busy = [r for r in report["runs"] if max(r["load_before"], r["load_after"]) > 1.5]
    lines = [
        f"# Recurrent PPO on a partially observed CartPole-v1 (`exp=cartpole_lstm`, task `{report['task']}`)",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, one torch thread per process; "
        f"commit {report['commit']}. The policy {TASK_WORDS[report['task']]}, "
        "with RL-Zoo's RecurrentPPO settings for CartPoleNoVel but 10 epochs per update, not 20 (separate "
        "actor and critic LSTMs of 64, "
        "sequences of 16 steps, observation and reward normalisation); the `mlp` rows run the same "
        f"experiment with `model=mlp` (64x64 actor and critic MLPs), everything else unchanged."
        f"{extra} Solved: mean return of the last 20 episodes (mean20) >= {SOLVED:g}.",
        "",
        "| model | seed | env steps | final mean return (last 20) | first step with mean20 >= 475 | "
        "best mean20 | mean of mean20, last 20% of steps | SPS | wall s | load before/after |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {r['model']} | {r['seed']} | {r['total_env_steps']:,} | {common.fmt(r['final_mean_return'])} | "
            f"{r['first_step_mean20_at_475'] or 'never'} | {common.fmt(r['best_mean20'])} | "
            f"{common.fmt(late_mean(r['curve'], r['total_env_steps']))} | {r['sps']:,.0f} | "
            f"{r['wall_seconds']:.0f} | {r['load_before']:.1f} / {r['load_after']:.1f} |"
            for r in report["runs"]
        ),
        "",
        *(
            [
                f"**Warning:** the 1-minute load average exceeded 1.5 around {len(busy)} of {len(report['runs'])} "
                "runs: other programs shared the CPU, so SPS and wall time are lower than on an idle machine.",
                "",
            ]
            if busy
            else []
        ),  # fmt: skip
        f"![learning curves]({report['png']})" if report["png"] else "",
        "",
        f"Command: `{command}`",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = common.argument_parser(__doc__)
    parser.add_argument(
        "--steps", type=int, default=None, help="env steps per run (default: the exp's, 200k)"
    )
    parser.add_argument("--seeds", type=int, default=1, help="how many seeds, one run per model each")
    parser.add_argument("--first-seed", type=int, default=1, help="seeds FIRST..FIRST+N-1 (held-out checks)")
    parser.add_argument("--only", choices=["both", *MODELS], default="both", help="run one model only")
    parser.add_argument("--task", choices=list(TASKS), default="dropped", help="what the observation hides")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where cartpole_lstm.{json,md,png} go")
    parser.add_argument("extra", nargs="*", help="overrides for every run, after --")
    args = parser.parse_args()
    models = list(MODELS) if args.only == "both" else [args.only]
    runs = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for model in models:
            r = run_one(model, seed, args.steps, args.extra, args.task)
            runs.append(r)
            print(f"model={model} seed {seed}: {r['total_env_steps']:,} steps, final {common.fmt(r['final_mean_return'])}, "
                  f"first mean20 >= 475 at {r['first_step_mean20_at_475']}, {r['sps']:,.0f} SPS, "
                  f"{r['wall_seconds']:.0f} s", flush=True)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    name = "cartpole_lstm" if args.task == "dropped" else f"cartpole_lstm_{args.task}"
    png = args.out / f"{name}.png"
    plot(runs, png, args.task)
    report = {"experiment": "cartpole_lstm", "task": args.task, "steps": args.steps, "extra_overrides": args.extra,
              "machine": common.machine(), "commit": common.git_commit(), "png": png.name, "runs": runs}  # fmt: skip
    common.write_report(args.out, name, report, markdown(report, common.command_line(__file__)))


if __name__ == "__main__":
    main()
