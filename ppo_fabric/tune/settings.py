"""The tuner's own settings: the `tune.*` arguments of `python -m ppo_fabric.tune`.

They are not part of the training config (a trial is a normal run that knows nothing of the study), so
they live in a typed dataclass of their own; OmegaConf refuses an unknown key or a wrong type, and
`check` refuses values that would make a study meaningless. Every problem is one `ConfigError` line.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ppo_fabric.config.values import ConfigError

OBJECTIVES = ("return", "eval")
# summary.json values a study may optimise besides the mean return (a `policies.<name>.final_mean_return`
# of a multi-agent run too).
SUMMARY_METRICS = (
    "final_mean_return",
    "best_mean_return",
    "sps",
    "wall_seconds",
    "episodes",
    "total_env_steps",
)
PRUNERS = ("median", "hyperband", "none")
SAMPLERS = ("tpe", "random")
DIRECTIONS = ("maximize", "minimize")


@dataclass
class PrunerConfig:
    kind: str = "median"  # median | hyperband | none
    startup_trials: int = 5  # median: trials that finish before any is pruned
    warmup_steps: int | None = None  # median: env steps before a trial may be pruned; null: total_steps / 3
    min_resource: int | None = None  # hyperband: env steps of the first rung; null: total_steps / 27
    reduction_factor: int = 3  # hyperband


@dataclass
class TuneConfig:
    trials: int = 20  # the study's size: finished trials (earlier invocations included) to reach
    jobs: int = 1  # trials at a time on this machine
    seeds: int = 1  # runs per trial (seeds seed, seed+1, ...), at the same time; objective = their mean
    objective: str = "return"  # return | eval | a summary.json metric
    eval_episodes: int = 10  # objective=eval: deterministic episodes per seed after training
    direction: str = "maximize"
    sampler: str = "tpe"  # tpe | random
    sampler_seed: int = 0
    pruner: PrunerConfig = field(default_factory=PrunerConfig)
    report_every: int | None = None  # env steps between intermediate values; null: one update
    name: str | None = None  # study name; null: derived from the overrides and the objective
    dir: str | None = None  # study directory; null: runs/tune/<name>
    storage: str | None = None  # null: SQLite in the study dir; a database URL; or a journal file path
    poll_seconds: float = 0.5  # how often metrics.csv of a running trial is read


def split_arguments(argv: list[str]) -> tuple[list[str], list[str]]:
    """(tune.* arguments, training overrides)."""
    tune = [a for a in argv if a.lstrip("+").startswith("tune.")]
    return tune, [a for a in argv if a not in tune]


def parse(arguments: list[str]) -> TuneConfig:
    """`tune.key=value` arguments -> a checked TuneConfig."""
    base = OmegaConf.structured(TuneConfig)
    dotlist = []
    for arg in arguments:
        key, sep, value = arg.lstrip("+").partition("=")
        if not sep:
            raise ConfigError(f"cannot parse argument {arg!r}; write tune settings as tune.key=value")
        key = key[len("tune.") :]
        if key == "pruner":
            key = "pruner.kind"  # tune.pruner=median reads naturally; the group holds its settings
        dotlist.append(f"{key}={value}")
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(dotlist))
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or ""
        reason = str(exc).strip().splitlines()[0]
        if "Key '" in reason and "not in" in reason:
            known = ", ".join(f"tune.{k}" for k in OmegaConf.to_container(base) if k != "pruner")
            raise ConfigError(
                f"tune.{key}: unknown tuner setting; known: {known}, tune.pruner.<{', '.join(PrunerConfig.__dataclass_fields__)}>"
            ) from None
        raise ConfigError(f"tune.{key}: {reason}") from None
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, TuneConfig)
    check(cfg)
    return cfg


def check_objective_for(cfg: TuneConfig, run: Any, policies: list[str] | None) -> None:
    """An objective the trials' summaries cannot hold, refused before the first trial (each trained its whole
    budget, then failed for want of the number): `evaluation.*` with evaluation off, and `policies.<name>.*`
    naming no policy of the run (`policies`: its policy names, None for a single-agent run)."""
    if cfg.objective.startswith("evaluation.") and run.eval.every in (None, 0):
        raise ConfigError(
            f"tune.objective={cfg.objective} needs evaluation during training, which eval.every={run.eval.every} "
            "turns off; set eval.every, or use tune.objective=eval (episodes on each trial's last checkpoint)"
        )
    named = re.fullmatch(r"policies\.([^.]+)\..+", cfg.objective)
    if named is None:
        return
    if policies is None:
        raise ConfigError(
            f"tune.objective={cfg.objective} names a policy of a multi-agent run; env.id={run.env.id} is "
            "single-agent: use tune.objective=return"
        )
    if named.group(1) not in policies:
        raise ConfigError(
            f"tune.objective={cfg.objective}: the run has no policy {named.group(1)!r} (its policies: "
            f"{', '.join(policies)})"
        )


def _positive(name: str, value: int | float | None, allow_none: bool = False, zero: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value < 0 or (value == 0 and not zero):
        raise ConfigError(f"tune.{name}={value} must be {'>= 0' if zero else '> 0'}")


def check(cfg: TuneConfig) -> None:
    """Values that parse but make no study: counts, names of objectives, samplers and pruners."""
    for name in ("trials", "jobs", "seeds", "eval_episodes"):
        _positive(name, getattr(cfg, name))
    _positive("poll_seconds", cfg.poll_seconds)
    _positive("report_every", cfg.report_every, allow_none=True)
    if not (
        cfg.objective in OBJECTIVES
        or cfg.objective in SUMMARY_METRICS
        or re.fullmatch(r"policies\.[^.]+\.final_mean_return", cfg.objective)
        or re.fullmatch(r"evaluation\.(last|best)\.[^.]+", cfg.objective)
    ):
        raise ConfigError(
            f"tune.objective={cfg.objective} is not one of {', '.join(OBJECTIVES)} or a summary.json metric "
            f"({', '.join(SUMMARY_METRICS)}, policies.<name>.final_mean_return, evaluation.last.return_mean, "
            "evaluation.best.return_mean, ...)"
        )
    for name, value, allowed in (
        ("direction", cfg.direction, DIRECTIONS),
        ("sampler", cfg.sampler, SAMPLERS),
        ("pruner", cfg.pruner.kind, PRUNERS),
    ):
        if value not in allowed:
            raise ConfigError(f"tune.{name}={value} is not one of {', '.join(allowed)}")
    _positive("pruner.startup_trials", cfg.pruner.startup_trials, zero=True)
    _positive("pruner.warmup_steps", cfg.pruner.warmup_steps, allow_none=True, zero=True)
    _positive("pruner.min_resource", cfg.pruner.min_resource, allow_none=True)
    if cfg.pruner.reduction_factor < 2:
        raise ConfigError(f"tune.pruner.reduction_factor={cfg.pruner.reduction_factor} must be >= 2")
    if cfg.name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", cfg.name):
        raise ConfigError(f"tune.name={cfg.name} may hold only letters, digits, '.', '_' and '-'")


def intermediate_values(cfg: TuneConfig) -> bool:
    """Whether the training return reported per update tracks the objective (so pruning can use it):
    the mean return (`return`, `eval`, a return metric, an evaluation's `return_mean`), never a speed, a
    count, an episode length or a game's score."""
    return (
        cfg.objective in OBJECTIVES
        or cfg.objective.endswith("_mean_return")
        or re.fullmatch(r"evaluation\.(last|best)\.return_mean", cfg.objective) is not None
    )


def identity(cfg: TuneConfig, fixed: list[str], search: list[str]) -> dict[str, Any]:
    """What makes two invocations the same study: the overrides and how a trial is scored (not the
    number of trials, the jobs, the sampler or the pruner, which may change when a study continues)."""
    return {
        "fixed": list(fixed),
        "search": list(search),
        "objective": cfg.objective,
        "seeds": cfg.seeds,
        "eval_episodes": cfg.eval_episodes if cfg.objective == "eval" else None,
        "direction": cfg.direction,
    }


def study_name(cfg: TuneConfig, env_id: str, ident: dict[str, Any]) -> str:
    """`tune.name`, or `<env id>-<hash of the study's identity>`: the same command names the same study."""
    if cfg.name is not None:
        return cfg.name
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:10]
    env = re.sub(r"[^A-Za-z0-9._-]+", "_", env_id.rsplit(":", 1)[-1]).strip("_") or "env"
    return f"{env}-{digest}"


def study_dir(cfg: TuneConfig, name: str) -> Path:
    return Path(cfg.dir) if cfg.dir is not None else Path("runs") / "tune" / name


def storage_url(cfg: TuneConfig, directory: Path) -> str:
    """The storage as the user gave it, SQLite in the study dir when not given."""
    if cfg.storage is None:
        return f"sqlite:///{(directory / 'study.db').resolve()}"
    return cfg.storage
