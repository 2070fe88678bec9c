"""A chaos run: LunarLander-v3 pipelined (1 player + 1 trainer) to 1M env steps with faults injected on a
schedule (`chaos_env.py`), run as a requeued cluster job runs (`resume=auto`, `restarts=4`,
`env.on_error=restart`, `stall_timeout`), SIGTERMed past 60% of its steps and run again; against undisturbed
runs of the same seeds.

    python -m benchmarks chaos                                  # seeds 1-3, 1M steps (~15 min on 2 cores)
    python -m benchmarks chaos --seeds 1 --steps 300000 --gap 40000 --out /tmp/chaos   # smoke test

Needs Box2D (the bench extra). Writes benchmarks/results/chaos.{json,md}.
"""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import RESULTS, run_once  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
WORKLOAD = ["env=lunarlander", *common.LAYOUTS["pipelined"]]
STALL, SIGTERM_AT = 20, 0.6  # the chaos runs' stall_timeout (s); SIGTERM once past this fraction of the steps


def chaos_command(run_dir: Path, state: Path, seed: int, steps: int, gap: int, stall: int) -> list[str]:
    return [
        sys.executable, "-m", "ppo_fabric", *WORKLOAD, f"seed={seed}", f"algo.total_steps={steps}",
        "env.id=benchmarks.chaos_env:ChaosLunarLander-v3", f"+env.kwargs.state_dir={state}",
        f"+env.kwargs.gap={gap}", "env.on_error=restart", f"stall_timeout={stall}", "restarts=4",
        "checkpoint.every=4", "checkpoint.keep=0", "logger.tensorboard=false", "resume=auto",
        "eval.every=0",  # as the undisturbed runs (common.run_once): the wall times compare
        f"hydra.run.dir={run_dir}",
    ]  # fmt: skip


def last_step(metrics_csv: Path) -> int:
    from ppo_fabric.runs.metrics_file import read_rows

    rows = read_rows(metrics_csv) if metrics_csv.is_file() else []
    return int(float(rows[-1]["step"])) if rows else 0


def chaos_seed(seed: int, steps: int, gap: int, stall: int, sigterm_at: float) -> dict[str, Any]:
    """One chaos run: the command until its SIGTERM stop, then the same command to the end."""
    from chaos_env import FAULTS  # needs Box2D, as the runs do: --help and `markdown` do without it

    from ppo_fabric.runs import checkpoint as ckpt

    with tempfile.TemporaryDirectory() as tmp:
        run_dir, state = Path(tmp) / "run", Path(tmp) / "faults"
        state.mkdir()
        cmd = chaos_command(run_dir, state, seed, steps, gap, stall)
        started = time.monotonic()
        first = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        sigterm_step = None
        while first.poll() is None:
            fired = all((state / f"{f}.fired").exists() for f in FAULTS)
            at = last_step(run_dir / "metrics.csv")
            if sigterm_step is None and fired and at >= sigterm_at * steps:
                first.send_signal(signal.SIGTERM)
                sigterm_step = at
            time.sleep(0.5)
        err_first = first.stderr.read() if first.stderr else ""
        requeue = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        wall = time.monotonic() - started
        if requeue.returncode != 0:
            raise SystemExit(f"seed {seed}: the requeued command failed ({requeue.returncode}):\n"
                             f"{err_first[-2000:]}\n{requeue.stderr[-2000:]}")  # fmt: skip
        stderr = err_first + requeue.stderr
        summary = json.loads((run_dir / "summary.json").read_text())
        checkpoints = sorted((run_dir / "checkpoints").glob("*.ckpt"))
        nonfinite = [p.name for p in checkpoints if ckpt.nonfinite_tensor(ckpt.load(p, env_state="fresh"))]
        lines = stderr.splitlines()
        return {
            "seed": seed,
            "faults_fired": [f for f in FAULTS if (state / f"{f}.fired").exists()],
            "first_command_exit": first.returncode,
            "sigterm_at_step": sigterm_step,
            "supervisor_restarts": sum("; restart " in line for line in lines),
            "envs_rebuilt": sum("env rebuilt (restart" in line for line in lines),
            "stalls": [line.split("error: ", 1)[1][:160] for line in lines if "no progress for" in line],
            "stall_stack_dirs": len(list(run_dir.glob("stall-*"))),
            "skipped_lines": [line for line in lines if " skipped " in line],
            "checkpoints": len(checkpoints),
            "nonfinite_checkpoints": nonfinite,
            "total_env_steps": summary["total_env_steps"],
            "final_mean_return": summary["final_mean_return"],
            "summary_env_restarts": summary.get("env_restarts"),
            "wall_seconds": wall,
            "errors": [line for line in lines if line.startswith("ppo-fabric: error: ")],
        }


def undisturbed_seed(seed: int, steps: int) -> dict[str, Any]:
    s = run_once([*WORKLOAD, f"seed={seed}", f"algo.total_steps={steps}"])
    return {"seed": seed, "final_mean_return": s["final_mean_return"], "wall_seconds": s["process_seconds"],
            "sps": s["sps"]}  # fmt: skip


def spread(values: list[float]) -> str:
    return common.mean_std(values) + (
        f" (min {min(values):.1f}, max {max(values):.1f})" if len(values) > 1 else ""
    )


def markdown(report: dict[str, Any]) -> str:
    calm, chaos = report["undisturbed"], report["chaos"]
    calm_returns = [r["final_mean_return"] for r in calm]
    lines = [
        "# Chaos run: LunarLander-v3 pipelined with faults injected", "",
        f"Command: `{report['command']}`  ", f"Commit: {report['commit']}; machine: {report['machine']['cpu']}, "
        f"{report['machine']['cores']} cores, torch {report['machine']['torch']}. {report['note']}", "",
        f"Workload: `{' '.join(WORKLOAD)}`, {report['steps']:,} env steps. Faults, in order, {report['gap']:,} env "
        "steps of the player apart: the player SIGKILLed, a burst of 20 NaN observations, an env that raises, an "
        f"env that never returns (`stall_timeout={report['stall']}`); then SIGTERM once past "
        f"{report['sigterm_at']:.0%} of the steps, and the same command again (`resume=auto`).", "",
        "| seed | faults fired | supervisor restarts | envs rebuilt | stall (stacks dirs) | SIGTERM at | "
        "checkpoints (non-finite) | final return (chaos) | final return (undisturbed) | wall s (chaos / calm) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    by_seed = {r["seed"]: r for r in calm}
    for r in chaos:
        c = by_seed.get(r["seed"], {})
        lines.append(
            f"| {r['seed']} | {', '.join(r['faults_fired'])} | {r['supervisor_restarts']} | {r['envs_rebuilt']} | "
            f"{len(r['stalls'])} ({r['stall_stack_dirs']}) | {_step(r['sigterm_at_step'])} | "
            f"{r['checkpoints']} ({len(r['nonfinite_checkpoints'])}) | {r['final_mean_return']:.1f} | "
            f"{c.get('final_mean_return', float('nan')):.1f} | {r['wall_seconds']:.0f} / "
            f"{c.get('wall_seconds', float('nan')):.0f} |"
        )
    chaos_returns = [r["final_mean_return"] for r in chaos]
    lines += [
        "", f"Final mean return, undisturbed: {spread(calm_returns)}; with the faults: {spread(chaos_returns)}.  ",
        f"Verdict: {report['verdict']}", "",
        "The lines the runs printed for the stall and the errors (first seed):", "", "```",
        *(chaos[0]["errors"] if chaos else []), "```", "",
    ]  # fmt: skip
    return "\n".join(lines)


def _step(step: int | None) -> str:
    return "none" if step is None else f"{step:,}"


def verdict(calm: list[float], chaos: list[dict[str, Any]]) -> str:
    """Every fault fired and counted, every checkpoint finite, and each chaos run's final return within the
    undisturbed runs' spread over the same seeds: their mean ± 2 standard deviations (their range, when
    wider)."""
    from chaos_env import FAULTS

    problems = []
    for r in chaos:
        if r["faults_fired"] != list(FAULTS):
            problems.append(f"seed {r['seed']}: faults fired {r['faults_fired']}")
        if r["sigterm_at_step"] is None or r["first_command_exit"] != 143:
            problems.append(
                f"seed {r['seed']}: no SIGTERM stop (first command exit {r['first_command_exit']})"
            )
        if r["nonfinite_checkpoints"]:
            problems.append(f"seed {r['seed']}: non-finite checkpoints {r['nonfinite_checkpoints']}")
        if r["supervisor_restarts"] < 2 or r["envs_rebuilt"] < 2 or not r["stalls"]:
            problems.append(f"seed {r['seed']}: faults not all counted")
    if len(calm) >= 2:
        mean, std = statistics.mean(calm), statistics.stdev(calm)
        low, high = min(min(calm), mean - 2 * std), max(max(calm), mean + 2 * std)
        for r in chaos:
            if not low <= r["final_mean_return"] <= high:
                problems.append(
                    f"seed {r['seed']}: final {r['final_mean_return']:.1f} outside [{low:.1f}, {high:.1f}]"
                )
    return "PASS" if not problems else "FAIL: " + "; ".join(problems)


def main() -> None:
    parser = common.argument_parser(__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--gap", type=int, default=120_000, help="player env steps between faults")
    parser.add_argument("--note", default="", help="a line for the report (e.g. the machine's load)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    calm = [undisturbed_seed(s, args.steps) for s in args.seeds]
    for r in calm:
        print(
            f"undisturbed seed {r['seed']}: {r['final_mean_return']:.1f} in {r['wall_seconds']:.0f} s",
            flush=True,
        )
    chaos = []
    for seed in args.seeds:
        chaos.append(chaos_seed(seed, args.steps, args.gap, STALL, SIGTERM_AT))
        r = chaos[-1]
        print(f"chaos seed {seed}: {r['final_mean_return']:.1f}, faults {r['faults_fired']}, "
              f"{r['supervisor_restarts']} restarts, {r['envs_rebuilt']} envs rebuilt", flush=True)  # fmt: skip
    report = {
        "command": common.command_line(__file__), "commit": common.git_commit(), "machine": common.machine(),
        "note": args.note, "steps": args.steps, "gap": args.gap, "stall": STALL,
        "sigterm_at": SIGTERM_AT, "undisturbed": calm, "chaos": chaos,
        "verdict": verdict([r["final_mean_return"] for r in calm], chaos),
    }  # fmt: skip
    common.write_report(args.out, "chaos", report, markdown(report))


if __name__ == "__main__":
    main()
