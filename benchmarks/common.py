"""What the benchmarks share: one training run in a subprocess, the machine's description, the command line,
one run record (`record`), the sweep over tasks x variants x seeds (`sweep`) and the report files."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from itertools import product
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
# The layouts the benchmarks compare: one definition. Run records hold these overrides, and `learning.py`
# takes a run another report holds when they set the same (`effective`): change a layout, and both re-run it.
DECOUPLED_1_1 = ("strategy=decoupled", "fabric.devices=2", "algo.players=1")
LAYOUTS: dict[str, tuple[str, ...]] = {
    "coupled": ("strategy=coupled", "fabric.devices=1"),
    "pipelined": (*DECOUPLED_1_1, "algo.pipeline=true"),  # 1 player + 1 trainer, one update of lag
    "synchronous": (*DECOUPLED_1_1, "algo.pipeline=false"),
    "pipelined_1_2": (
        "strategy=decoupled",
        "fabric.devices=3",
        "algo.pipeline=true",
    ),  # 1 player + 2 trainers
    "synchronous_1_2": ("strategy=decoupled", "fabric.devices=3", "algo.pipeline=false"),
}
STOP_GRACE_S = 15.0  # a run stopped at its timeout gets this long to checkpoint and end before it is killed


def argument_parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser whose --help is the script's docstring with its line breaks (the docstrings hold tables)."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def command_line(script: str) -> str:
    """How this benchmark was launched, for the report's `Command:` line: the script and its arguments."""
    return " ".join([".venv/bin/python", f"benchmarks/{Path(script).name}", *map(shlex.quote, sys.argv[1:])])


def write_report(out: Path, name: str, report: dict[str, Any], markdown: str) -> None:
    """`<name>.json` (the figures) and `<name>.md` (the table) under `out`; the table is also printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown)
    print(markdown)


def git_commit() -> str:
    """HEAD, flagged when ppo_fabric/ or conf/ have uncommitted changes (the figures then belong to no commit)."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout.strip()

    # a copy of the tree sent elsewhere (a lent GPU machine) may carry an older .git: PPO_FABRIC_COMMIT names it
    named = os.environ.get("PPO_FABRIC_COMMIT")
    if named:
        return named
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--", "ppo_fabric", "conf") else "")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict[str, Any]:
    import torch

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version()}  # fmt: skip


def machines_line(runs: list[dict[str, Any]], machine: dict[str, Any]) -> str:
    """The report's `Machine:` words: the CPUs its runs recorded (runs from before they recorded one are
    counted apart), else the last sitting's, which is all an older report knows."""
    named = sorted({r["machine"] for r in runs if r.get("machine")})
    unnamed = sum(1 for r in runs if not r.get("machine"))
    if not named:
        return f"{machine['cpu']} (the last sitting's), {machine['cores']} cores, torch {machine['torch']}"
    more = f"; {unnamed} runs from before runs named theirs" if unnamed else ""
    return f"{', '.join(named)} (the runs' own{more}); the last sitting on {machine['cores']} cores, torch {machine['torch']}"


def fmt(value: float | None, spec: str = ".1f", none: str = "n/a") -> str:
    """A figure for a table; `none` where there is none (no episode ended, the threshold never reached)."""
    return none if value is None else format(value, spec)


def learning_curve(metrics_csv: Path, key: str = "rollout/return_mean20") -> list[list[float]]:
    """[env step, `time/wall_s`, `key`] of every logged update that has `key`."""
    from ppo_fabric.runs.metrics_file import read_rows

    return [
        [int(row["step"]), float(row["time/wall_s"]), float(row[key])]
        for row in read_rows(metrics_csv)
        if row.get(key)
    ]


def evaluation_curve(evaluations_csv: Path, key: str = "eval/return_mean") -> list[list[float]]:
    """[env step, `time/wall_s`, `key`, `time/eval_s`] of every evaluation during training (`eval.every`),
    from the run's evaluations.csv; empty without."""
    from ppo_fabric.runs.metrics_file import read_rows

    return [
        [int(row["step"]), float(row["time/wall_s"]), float(row[key]), float(row["time/eval_s"])]
        for row in read_rows(evaluations_csv)
        if row.get(key)
    ]


def final_evaluation(evaluations_csv: Path) -> dict[str, float]:
    """Every `eval/*` metric of the run's last evaluation (per policy, per opponent); empty without."""
    from ppo_fabric.runs.metrics_file import read_rows

    rows = read_rows(evaluations_csv)
    return {k: float(v) for k, v in (rows[-1] if rows else {}).items() if k.startswith("eval/") and v}


def steady_sps(metrics_csv: Path) -> float | None:
    """Env steps per second over the second half of the run's logged wall time (`time/wall_s`): the rate of a
    long run, without the start-up, the first update's compilation and the warm-up a short run's SPS
    carries. None with fewer than two logged rows in that half."""
    from ppo_fabric.runs.metrics_file import read_rows, series

    points = series(read_rows(metrics_csv), "time/wall_s")  # (step, wall s)
    if len(points) < 3:
        return None
    half = points[-1][1] / 2
    later = [p for p in points if p[1] >= half]
    if len(later) < 2 or later[-1][1] <= later[0][1]:
        return None
    return (later[-1][0] - later[0][0]) / (later[-1][1] - later[0][1])


class LoggedNothing(SystemExit):
    """A run stopped at its timeout before it logged an update: there is no figure to report (a benchmark
    that can say so and go on catches it; one that cannot ends with the message). `trace` is the run's
    timestamped stderr (`job_trace.Trace.text`), the processes' stacks at the stop included."""

    def __init__(self, message: str, trace: str = "") -> None:
        super().__init__(message)
        self.trace = trace


def stopped_summary(metrics_csv: Path, timeout: float) -> dict[str, Any]:
    """What a run stopped at `timeout` seconds had done, from its metrics.csv (the benchmark kills it, so it
    may have written no summary.json, and an interrupted one would not say where the timeout fell): env steps, SPS and wall seconds of the last logged update, and the summed `time/*_s` columns
    as its time split. `stopped_after_s` marks the figures as those of a run cut short."""
    from ppo_fabric.runs.metrics_file import read_rows, series

    rows = read_rows(metrics_csv)
    if not rows:
        raise LoggedNothing(f"benchmark run stopped after {timeout:.0f} s before it logged an update")
    last = rows[-1]
    split = {name: sum(v for _, v in series(rows, f"time/{name}_s")) for name in ("collect", "train")}
    returns = series(rows, "rollout/return_mean20")
    return {"steps_this_run": int(float(last["step"])), "total_env_steps": int(float(last["step"])),
            "sps": float(last["time/sps"]), "wall_seconds": float(last["time/wall_s"]),
            "time_split": {k: v for k, v in split.items() if v}, "stopped_after_s": timeout,
            "final_mean_return": returns[-1][1] if returns else None}  # fmt: skip


def stop_run(proc: subprocess.Popen[str], signum: int) -> None:
    """Stop a run's job as a user would (`signum` to its process group: it writes its checkpoint and ends),
    and kill what is left after `STOP_GRACE_S`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signum)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_once(
    overrides: list[str],
    curve: bool = False,
    timeout: float | None = None,
    keep_metrics: Path | None = None,
    eval_key: str = "eval/return_mean",
    run_dir: Path | None = None,
) -> dict[str, Any]:
    """Train in a fresh process (as a user would launch it) and return its summary.json, plus `sps_steady`
    (`steady_sps`) and, with `curve`, the learning curve (`learning_curve`), the evaluation curve of `eval_key`
    and the last evaluation's metrics (`final_eval`).

    With `timeout`, a run still going after that many seconds is stopped as a cluster would stop it
    (SIGTERM: it checkpoints at the next update and ends; its process group is killed `STOP_GRACE_S` later
    if not) and the figures are those of its last logged update (`stopped_summary`): a benchmark on a
    machine lent for minutes keeps a row for every run it started. `keep_metrics`: where to copy the run's
    metrics.csv (every logged metric of every update), which the run's temporary folder otherwise takes.

    `run_dir`: the run's folder, kept, instead of a temporary one, and `resume=auto`: the same call made again
    continues the run from its last checkpoint (the project's exact resume), so a budget longer than one
    command's limit is run in several commands, each stopped at `timeout`; the figures are the whole run's."""
    kept = run_dir is not None
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = run_dir if run_dir is not None else Path(tmp) / "run"
        cmd = [
            sys.executable,
            "-m",
            "ppo_fabric",
            "logger.tensorboard=false",
            "eval.every=0",  # the figures compare with runs and libraries that do not evaluate; --eval turns it on
            f"hydra.run.dir={run_dir}",
            *(["resume=auto"] if kept else []),
            *overrides,
        ]
        import job_trace  # beside this file, on the path of every script that imports common

        from ppo_fabric.runs.metrics_file import read_rows

        # a run with a timeout may be stopped before it logs anything: trace it, so that it says why
        before = read_rows(run_dir / "metrics.csv") if (run_dir / "metrics.csv").is_file() else []
        wall_before = float(before[-1]["time/wall_s"]) if before else 0.0  # a kept run's earlier commands
        where = Path(tmp) / "trace"
        env = job_trace.traced_env(where, time.time() + timeout) if timeout is not None else None
        started = time.monotonic()
        proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env
        )
        trace = job_trace.Trace(proc, started, where)
        try:
            proc.wait(timeout=timeout)
        except (
            KeyboardInterrupt
        ):  # the run is in a session of its own: the terminal's Ctrl+C never reached it
            stop_run(proc, signal.SIGINT)
            trace.join()
            kept_note = f"the run keeps its checkpoint in {run_dir}" if kept else "the run is discarded"
            print(f"benchmarks: stopped by Ctrl+C; {kept_note}", file=sys.stderr, flush=True)
            raise SystemExit(130) from None
        except subprocess.TimeoutExpired:
            if not (run_dir / "metrics.csv").is_file() or not read_rows(run_dir / "metrics.csv"):
                job_trace.dump_stacks(proc.pid)  # nothing logged yet: where is every process?
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            trace.join()
            try:
                summary = stopped_summary(run_dir / "metrics.csv", float(timeout or 0))
            except LoggedNothing as nothing:
                raise LoggedNothing(f"{nothing}: {trace.digest()}", trace.text()) from None
        else:
            trace.join()
            if proc.returncode != 0:
                raise SystemExit(
                    f"benchmark run failed (exit {proc.returncode}): {' '.join(cmd)}\n{trace.stderr()[-2000:]}"
                )
            summary = json.loads((run_dir / "summary.json").read_text())
        if kept and "total_wall_seconds" not in summary:  # stopped: metrics.csv's wall is the whole run's;
            # this command's share is what it added to the last row before it (a stopped command's last row
            # is its checkpoint's update, where the next one resumes)
            total = summary["wall_seconds"]
            summary |= {"total_wall_seconds": total, "wall_seconds": total - wall_before}
        summary["process_seconds"] = time.monotonic() - started  # start-up and shutdown included
        if env is not None:  # traced: how its processes started, in one line
            summary["start_up_trace"] = trace.digest()
        summary["sps_steady"] = steady_sps(run_dir / "metrics.csv")
        if curve:
            summary["curve"] = learning_curve(run_dir / "metrics.csv")
            summary["eval_curve"] = evaluation_curve(run_dir / "evaluations.csv", eval_key)
            summary["final_eval"] = final_evaluation(run_dir / "evaluations.csv")
        if keep_metrics is not None:
            keep_metrics.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(run_dir / "metrics.csv", keep_metrics)
        return summary


EVALUATION = ["eval.every=auto", "eval.episodes=10"]  # --eval: ~15 evaluations a run and one at its end


def thin(curve: list[list[float]], points: int) -> list[list[float]]:
    """Every k-th point and the last, so a long run's curve stays a few kB in the results."""
    if len(curve) <= points:
        return curve
    step = -(-len(curve) // points)
    return [*curve[::step], *([curve[-1]] if (len(curve) - 1) % step else [])]


def threshold_figures(summary: dict[str, Any], threshold: float | None, points: int = 500) -> dict[str, Any]:
    """A run's figures, from its summary and `curve` ([env step, wall s, mean20]): final and best mean
    return and, with a `threshold`, the env step and wall time at which the mean first reached it (all from
    the whole curve; the curve kept for the plot is thinned to `points`, a 5M-step run logs ~2,400)."""
    curve = summary["curve"]
    first = next((p for p in curve if p[2] >= threshold), None) if threshold is not None else None
    evaluated = summary.get("eval_curve") or []
    eval_figures = {}
    if evaluated:  # the final evaluation (at the last update) and the best, the time spent evaluating
        eval_before = sum(e[3] for e in evaluated if first is not None and e[1] <= first[1])
        eval_figures = {
            "final_eval_return": evaluated[-1][2],
            "best_eval_return": max(e[2] for e in evaluated),
            "eval_seconds": sum(e[3] for e in evaluated),
            "wall_at_threshold_no_eval": None if first is None else first[1] - eval_before,
            "eval_curve": evaluated,
            "final_eval": summary.get("final_eval", {}),  # every eval/* metric of the last evaluation
        }
    total_wall = summary.get("total_wall_seconds")  # a resumed run's whole training time (and rate over it)
    return {
        "total_env_steps": summary["total_env_steps"],
        "final_mean_return": summary["final_mean_return"],
        "best_mean_return": max((point[2] for point in curve), default=None),
        "threshold": threshold,
        "step_at_threshold": None if first is None else first[0],
        "wall_at_threshold": None if first is None else first[1],
        "wall_seconds": total_wall or summary["wall_seconds"],
        "sps": summary["total_env_steps"] / total_wall if total_wall else summary["sps"],
        "curve": thin(curve, points),
        **eval_figures,
    }


def record(
    overrides: list[str],
    train: Callable[[], dict[str, Any]],
    threshold: float | None = None,
    points: int = 500,
) -> dict[str, Any]:
    """One run's record, every benchmark's: its overrides, the commit and CPU it ran on, why it stopped
    early if it did, and `threshold_figures` of the summary `train()` returns."""
    commit = git_commit()  # the code the run starts with (a sitting outlasts commits made beside it)
    s = train()
    return {"overrides": overrides, "commit": commit, "machine": machine()["cpu"],
            **({"stopped": s["stopped"]} if s.get("stopped") else {}), **threshold_figures(s, threshold, points)}  # fmt: skip


def overrides(
    recipe: Iterable[str],
    layout: Iterable[str],
    seed: int,
    steps: int | None,
    evaluate: bool,
    extra: Iterable[str] = (),
) -> list[str]:
    """A run's overrides: the evaluation's first (a recipe's own evaluation settings win), the recipe, the
    layout, the seed, the budget, then `extra`."""
    budget = [f"algo.total_steps={steps}"] if steps else []
    return [*(EVALUATION if evaluate else []), *recipe, *layout, f"seed={seed}", *budget, *extra]


# How often a run saves, not what it learns (resume is exact): `--keep-runs` adds it, and a kept run is the
# same run as one trained in a single sitting.
NOT_THE_RUN = ("checkpoint.every_minutes",)


def effective(overrides: list[str]) -> dict[str, str]:
    """What overrides set, a key's last value winning: two lists that set the same are the same run, wherever
    they put the evaluation's (time_to_score's records before 2026-12 put them last); `NOT_THE_RUN` left out."""
    return {k: v for k, v in (o.partition("=")[::2] for o in overrides) if k not in NOT_THE_RUN}


def mean_reached(values: list[float | None], fmt: str) -> str:
    """Mean over the runs that got there (None: did not), with how many did when not all."""
    import statistics

    got = [v for v in values if v is not None]
    if not got:
        return "never"
    shown = format(statistics.mean(got), fmt)
    return shown if len(got) == len(values) else f"{shown} ({len(got)}/{len(values)})"


def load_report(path: Path, fresh: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """The report at `path` to add runs to, or `fresh` when there is none or another script wrote it (its
    runs keyed otherwise: a retired script's file of the same name), which this sitting replaces, saying so
    (the old one stays in git history)."""
    if not path.is_file():
        return fresh
    report = json.loads(path.read_text())
    runs = report.get("runs")
    if isinstance(runs, list) and all(isinstance(r, dict) and all(k in r for k in keys) for r in runs):
        return report
    print(f"{path} holds another script's report (no runs keyed by {', '.join(keys)}): this sitting starts "
          "a new one in its place", flush=True)  # fmt: skip
    return fresh


def positive(text: str) -> int:
    """A whole number >= 1 (`--seeds 0` ran nothing and exited 0; `--steps 0` trained the recipe's budget)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be 1 or more")
    return value


def file_name(text: str) -> str:
    """A report's name: a file name inside `--out`, never a path (`--name ../x` wrote beside it)."""
    if not text or text in (".", "..") or "/" in text or "\\" in text:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a file name without a directory (the report goes to --out)"
        )
    return text


def sweep_arguments(parser: argparse.ArgumentParser, seeds: int) -> None:
    """The options of a sweep over seeds: which seeds, the budget, evaluation, re-running, where to write."""
    parser.add_argument("--seeds", type=positive, default=seeds, help="seeds 1..N")
    parser.add_argument("--seed-list", nargs="+", type=int, default=None,
                        help="these seeds instead of 1..N: held-out seeds, or one seed per sitting when "
                        "sittings run side by side (each with its own --out)")  # fmt: skip
    parser.add_argument(
        "--steps", type=positive, default=None, help="env steps per run (default: the recipe's)"
    )
    parser.add_argument("--eval", action="store_true", help="evaluate during training (eval.every=auto, 10 "
                        "episodes); the IQM table ranks the final evaluation return")  # fmt: skip
    parser.add_argument("--force", action="store_true", help="re-run runs already in the results")
    parser.add_argument("--out", type=Path, default=RESULTS)


def cells(args: argparse.Namespace, **axes: Iterable[Any]) -> Iterator[dict[str, Any]]:
    """Every run's key, seed-major (a sitting cut short still covers every task and variant): `--seed-list`,
    else seeds 1..`--seeds`, each with every combination of the axes, in their order."""
    for seed in args.seed_list or range(1, args.seeds + 1):
        yield from (
            {**dict(zip(axes, values, strict=True)), "seed": seed} for values in product(*axes.values())
        )


def groups(
    runs: list[dict[str, Any]], field: str, tasks: Iterable[Any], variants: Iterable[str]
) -> Iterator[tuple[Any, str, list[dict[str, Any]]]]:
    """A report's rows: the runs of each (task, variant) that has some, in the orders given, by seed."""
    for task, variant in product(tasks, variants):
        if rows := sorted(
            (r for r in runs if (r[field], r["variant"]) == (task, variant)), key=lambda r: r["seed"]
        ):
            yield task, variant, rows


def footer(runs: list[dict[str, Any]], name: str, command: str, plot: str) -> list[str]:
    """A report's last lines: the commits of its runs, the last sitting's command, its plot."""
    commits = ", ".join(sorted({r["commit"] for r in runs}))
    return [f"Commits of the runs: {commits} (each run's own is in `{name}.json`). The last sitting: `{command}`.",
            "", f"![{plot}]({name}.png)", ""]  # fmt: skip


def sweep(
    report: dict[str, Any],
    cells: Iterable[dict[str, Any]],
    force: bool,
    run: Callable[..., dict[str, Any] | None],
    write: Callable[[dict[str, Any]], None],
    field: str = "runs",
    rerender: bool = True,
    say: Callable[[dict[str, Any], dict[str, Any]], str | None] | None = None,
) -> None:
    """Each cell (a run's key: task, variant, seed) the report's `field` lacks, or every one with `force`, trained
    by `run(**cell)`: its record replaces the report's runs of that key (a key missing from an older run reads
    as "", and a run with no record, None, leaves none) and the report is written after each run, so a sitting
    stopped anywhere keeps what it ran; when none ran and `rerender`, the report is written once as today's
    code writes it (a report that records the sitting's machine and command keeps the last real one's).
    `say(cell, record)`: the line printed after each run (None: none; default: the key, final return, wall)."""
    ran = False
    for cell in cells:
        done = [r for r in report[field] if all(r.get(k, "") == v for k, v in cell.items())]
        if done and not force:
            continue
        r = run(**cell)
        report[field] = [x for x in report[field] if x not in done]
        if r is not None:
            report[field].append({**cell, **r})
            line = say(cell, r) if say is not None else progress_line(cell, r)
            if line is not None:
                print(line, flush=True)
        write(report)
        ran = True
    if rerender and not ran and report[field]:
        write(report)


def progress_line(cell: dict[str, Any], r: dict[str, Any]) -> str:
    """`<task> <variant> seed <n>: final <return>, <wall> s`, with the time to the threshold where there is one."""
    key = " ".join(str(v) for k, v in cell.items() if k != "seed")
    reached = ""
    if r.get("threshold") is not None:
        wall = r.get("wall_at_threshold")
        reached = f"wall at {r['threshold']:g}: {'never' if wall is None else f'{wall:.0f} s'}, "
    return f"{key} seed {cell.get('seed', '')}: {reached}final {r['final_mean_return']}, {r['wall_seconds']:.0f} s"


def mean_std(values: list[float], spec: str = ".1f") -> str:
    """`mean ± std` over seeds (one value as it is; none: n/a)."""
    import statistics

    if not values:
        return "n/a"
    if len(values) == 1:
        return format(values[0], spec)
    return f"{statistics.mean(values):{spec}} ± {statistics.stdev(values):{spec}}"


def plot_curves(
    runs: list[dict[str, Any]],
    panel_key: str,
    panels: list[str],
    variants: tuple[str, ...],
    x: int,
    path: Path,
    thresholds: dict[str, float] | None = None,
    ylabel: str = "mean return, last 20 episodes",
) -> None:
    """Every run's learning curve (`learning_curve` points: [step, wall s, return], x = 0: against env steps,
    1: against wall time), one panel per value of the runs' `panel_key`, one colour per variant, a dotted line
    at each panel's threshold."""
    if not panels:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    colours = dict(zip(variants, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for ax, panel in zip(axes[0], panels, strict=True):
        labelled: set[str] = set()
        for r in (r for r in runs if r[panel_key] == panel and r["curve"]):
            points = list(zip(*r["curve"], strict=True))
            ax.plot(points[x], points[2], color=colours[r["variant"]], alpha=0.75, linewidth=1.1,
                    label=None if r["variant"] in labelled else r["variant"])  # fmt: skip
            labelled.add(r["variant"])
        if thresholds and panel in thresholds:
            ax.axhline(thresholds[panel], color="grey", linestyle=":", linewidth=1)
        ax.set(title=panel, xlabel=("env steps", "wall time (s)")[x], ylabel=ylabel)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
