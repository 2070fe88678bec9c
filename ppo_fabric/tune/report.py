"""What a study leaves in its directory after each invocation: trials.csv (one row per trial), best.json
and the best trial printed as a command to paste, optimization_history.png and param_importances.png.

Written from the storage, so the files describe the whole study, trials of earlier invocations and other
machines included. A plot that cannot be drawn yet (no completed trial; importances need two completed
trials and more than one parameter) is skipped with a line saying why.
"""

from __future__ import annotations

import csv
import json
import shlex
import warnings
from pathlib import Path
from typing import Any


def _say(message: str) -> None:
    print(f"ppo-fabric: tune: {message}", flush=True)


def write_table(study: Any, path: Path) -> Path:
    """trials.csv: number, state, value, duration, every parameter, the trial dir and why it ended."""
    trials = study.get_trials(deepcopy=False)
    keys = sorted({k for t in trials for k in t.params})
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["number", "state", "value", "duration_s", *keys, "dir", "reason"])
        for t in trials:
            duration = t.duration.total_seconds() if t.duration is not None else ""
            state = "INTERRUPTED" if t.user_attrs.get("interrupted") else t.state.name
            writer.writerow(
                [
                    t.number,
                    state,
                    "" if t.value is None else t.value,
                    duration if duration == "" else f"{duration:.1f}",
                    *[t.params.get(k, "") for k in keys],
                    t.user_attrs.get("dir", ""),
                    t.user_attrs.get("reason", ""),
                ]
            )
    return path


def best_command(fixed: list[str], params: list[str]) -> str:
    """The best trial as a command to paste: the study's fixed overrides and the trial's values."""
    return shlex.join(["python", "-m", "ppo_fabric", *fixed, *params])


def write_plots(study: Any, directory: Path, n_params: int) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna
    from optuna.visualization import matplotlib as ovm

    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    written = []
    plots = [("optimization_history.png", ovm.plot_optimization_history, 1, 1)]
    plots.append(("param_importances.png", ovm.plot_param_importances, 2, 2))
    for name, plot, min_trials, min_params in plots:
        if len(complete) < min_trials or n_params < min_params:
            _say(
                f"{name} skipped: it needs {min_trials} completed trial(s) and {min_params} searched "
                f"parameter(s) (the study has {len(complete)} and {n_params})"
            )
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ax = plot(study)
            figure = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
            figure.set_size_inches(8, 5)
            figure.tight_layout()
            figure.savefig(directory / name, dpi=100)
            plt.close(figure)
            written.append(directory / name)
        except Exception as exc:  # optuna refuses some histories (e.g. a parameter with one value)
            _say(f"{name} skipped: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
    return written


def write_report(study: Any, plan: Any) -> None:
    """Every output file of the study, and the best trial on stdout."""
    directory: Path = plan.directory
    table = write_table(study, directory / "trials.csv")
    written = [table, *write_plots(study, directory, len(plan.space.params))]
    try:
        best = study.best_trial
    except ValueError:
        _say(f"no trial has completed yet; wrote {', '.join(str(p) for p in written)}")
        return
    params = list(best.user_attrs.get("overrides") or plan.space.overrides_for(best.params))
    command = best_command(plan.space.fixed, params)
    data = {
        "study": plan.name,
        "trial": best.number,
        "value": best.value,
        "objective": plan.tune.objective,
        "seed_values": best.user_attrs.get("seed_values"),
        "overrides": [*plan.space.fixed, *params],
        "command": command,
        "dir": best.user_attrs.get("dir"),
    }
    (directory / "best.json").write_text(json.dumps(data, indent=2) + "\n")
    written.append(directory / "best.json")
    seeds = best.user_attrs.get("seed_values") or []
    if len(seeds) > 1:  # the command trains the first seed: it reproduces that seed's value, not the mean
        each = ", ".join(f"{v:.4g}" for v in seeds)
        _say(f"best trial {best.number}: {plan.tune.objective} {best.value:.4g}, the mean of {len(seeds)} seeds ({each}, "
             f"seed {plan.base_seed} first); train its first seed with:\n  {command}")  # fmt: skip
    else:
        _say(f"best trial {best.number}: {plan.tune.objective} {best.value:.4g}; train it with:\n  {command}")
    _say(f"wrote {', '.join(str(p) for p in written)}")
