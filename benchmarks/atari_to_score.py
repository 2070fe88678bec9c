"""An Atari game to a score on a GPU machine at one of `gpu_strategies.py`'s layouts (default: 3 EnvPool players
+ 1 GPU trainer): the wall time and env steps until the mean return of the last 20 episodes first reaches
the threshold (Pong: 18), and the curve. Each (game, layout, label, seed) is one row of
`<out>/atari_to_score.{json,md,png}`, replaced by a rerun. `--run-dir`, `--run-timeout`, `--label` and the
rest: benchmarks/README.md, "atari_to_score.py".

    .venv/bin/python benchmarks/atari_to_score.py --dry-run --steps 24576 --out /tmp/ats  # the command, on a CPU
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import gpu_strategies  # noqa: E402
from common import RESULTS, run_once  # noqa: E402

# Marks for Pong, as published (hardware mostly unstated): they set the threshold's context. Like for like only
# without sticky actions, and on other machines.
MARKS = (
    "CleanRL's ppo_atari_envpool.py reports Pong ~20 within 10M steps in ~5-10 minutes "
    "(docs.cleanrl.dev/rl-algorithms/ppo); rl_games + EnvPool ~2 minutes (EnvPool's README, hardware unstated). "
    "Both run EnvPool's defaults, without sticky actions; `exp=atari` keeps ALE v5's (repeat_action_probability "
    "0.25) unless a run says otherwise (`+env.kwargs.repeat_action_probability=0`, labels `no-sticky`, `no-sticky-graph`)"
)


def overrides(layout: str, env_id: str, steps: int, seed: int, dry_run: bool, extra: list[str]) -> list[str]:
    """The layout's overrides exactly as `gpu_strategies.py` composes them for its Pong rows, then the game,
    the budget and the seed."""
    table = gpu_strategies.variants(1, list(range(1, 17)), dry_run, envpool_players=tuple(range(1, 9)))
    if layout not in table:
        raise SystemExit(f"unknown layout {layout!r}; one of {', '.join(sorted(table))}")
    run = gpu_strategies.layout_overrides("atari", table[layout][1])
    return [*run, f"env.id={env_id}", f"algo.total_steps={steps}", f"seed={seed}", *extra]


def record(summary: dict[str, Any], commands: int = 1) -> dict[str, Any]:
    """What a row adds to `common.record`: a GPU row's figures (`gpu_strategies.figures`; the start-up is that
    of the last of the `commands` that ran it)."""
    return {
        **gpu_strategies.figures(summary),
        "command_wall_seconds": summary["wall_seconds"],
        "commands": commands,
    }


def variant(run: dict[str, Any]) -> str:
    """The layout, and the label of its extra overrides when the run has one."""
    return f"{run['layout']} {run['label']}" if run.get("label") else run["layout"]


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    gpus = ", ".join(g.get("name", "?") for g in report.get("gpus", [])) or "none (dry run)"
    lines = [
        "# An Atari game to a score at a GPU layout",
        "",
        f"Machine of the last run: {m['cpu']}, {m['cores']} cores, GPU {gpus}, torch {m['torch']}, Python "
        f"{m['python']}. Each row names the GPU it ran on.",
        "Return: mean of the last 20 training episodes (stochastic policy, as CleanRL reports); last evaluation: "
        "the mean return of the run's last evaluation (`--eval`: 10 greedy episodes in the evaluator). Wall: the "
        "run's `time/wall_s` (interpreter start-up excluded; `start-up s` is the rest of the process's life).",
        "",
        "| game | layout | seed | env steps | threshold | steps to it | wall s to it | final | best | "
        "last evaluation | steady SPS | start-up s | GPU | commit |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in report["runs"]:
        # the start-up of the last command: its process's life less its own training time
        start = gpu_strategies._startup(
            {**r, "wall_seconds": r.get("command_wall_seconds", r["wall_seconds"])}
        )
        stopped = f" (stopped at {r['stopped_after_s']:.0f} s)" if r.get("stopped_after_s") else ""
        stopped += f" ({r['commands']} commands, resumed)" if r.get("commands", 1) > 1 else ""
        lines.append(
            f"| {r['env_id']} | {variant(r)}{stopped} | {r['seed']} | {r['total_env_steps']:,} | "
            f"{r['threshold']:g} | {common.fmt(r['step_at_threshold'], ',', 'never')} | {common.fmt(r['wall_at_threshold'], '.0f', 'never')} | "
            f"{common.fmt(r['final_mean_return'], '.1f')} | {common.fmt(r['best_mean_return'], '.1f')} | "
            f"{common.fmt(r.get('final_eval_return'), '.1f', 'off')} | {common.fmt(r['sps_steady'], ',.0f')} | {common.fmt(start, '.0f')} | {r.get('gpu', '?')} | "
            f"{r['commit']} |"
        )
    lines += ["", f"Published marks: {MARKS}.", "", f"Command: `{report['command']}`", ""]
    lines += [f"Overrides of `{variant(r)}`: `{' '.join(r['overrides'])}`" for r in report["runs"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = common.argument_parser(__doc__)
    p.add_argument("--layout", default="decoupled-envpool-3", help="a gpu_strategies.py variant key")
    p.add_argument("--env-id", default="ALE/Pong-v5")
    p.add_argument("--threshold", type=float, default=18.0)
    p.add_argument("--steps", type=int, default=5_000_000, help="env steps (the lr anneals over them)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--label", default="", help="names a variant of the layout (its extra overrides) in the table"
    )
    p.add_argument("--run-timeout", type=float, default=None, help="stop the run after this many seconds")
    p.add_argument("--keep-metrics", type=Path, default=None, help="copy the run's metrics.csv to this path")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="keep the run here; the same command again resumes it (resume=auto)")  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="every GPU role on the CPU")
    p.add_argument("--eval", action="store_true", help="evaluate during training (eval.every=auto, 10 episodes, "
                   "in the evaluator process): the row gains the last evaluation's return")  # fmt: skip
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("extra", nargs="*", help="overrides after the layout's (after --)")
    args = p.parse_args()
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("SKIP atari_to_score: no CUDA device (--dry-run runs the command on the CPU)")
        return
    run = overrides(args.layout, args.env_id, args.steps, args.seed, args.dry_run, args.extra)
    run += common.EVALUATION if args.eval else []
    name = "atari_to_score_dryrun" if args.dry_run else "atari_to_score"
    report = common.load_report(args.out / f"{name}.json", {"runs": []}, ("env_id", "layout", "seed"))
    report |= {"machine": common.machine(), "gpus": gpu_strategies.gpu_info(),
               "command": common.command_line(__file__)}  # fmt: skip
    gpu = ", ".join(g.get("name", "?") for g in report["gpus"]) or "none (dry run)"
    commands = 1  # how many commands this run took: its earlier ones are in its kept folder
    if args.run_dir is not None and (args.run_dir / "checkpoints" / "last.ckpt").is_file():
        earlier = [r for r in report["runs"] if r.get("run_dir") == str(args.run_dir)]
        commands = earlier[-1].get("commands", 1) + 1 if earlier else 2
    print(f"atari_to_score: {' '.join(run)}", flush=True)

    def row(**_: Any) -> dict[str, Any]:
        summary: dict[str, Any] = {}  # the run's, for the row's own figures beside `common.record`'s

        def train() -> dict[str, Any]:
            kept = {"keep_metrics": args.keep_metrics, "run_dir": args.run_dir}
            return summary.update(run_once(run, curve=True, timeout=args.run_timeout, **kept)) or summary

        r = common.record(run, train, args.threshold)
        return {
            **r,
            "gpu": gpu,
            **record(summary, commands),
            **({"run_dir": str(args.run_dir)} if args.run_dir else {}),
        }

    def write(report: dict[str, Any]) -> None:
        common.write_report(args.out, name, report, markdown(report))
        runs = [{**r, "variant": variant(r)} for r in report["runs"]]
        common.plot_curves(runs, "env_id", sorted({r["env_id"] for r in runs}), tuple(sorted({r["variant"] for r in runs})),
                           1, args.out / f"{name}.png", {args.env_id: args.threshold})  # fmt: skip

    cell = {"env_id": args.env_id, "layout": args.layout, "label": args.label, "seed": args.seed}
    common.sweep(report, [cell], True, row, write)


if __name__ == "__main__":
    main()
