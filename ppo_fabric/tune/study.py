"""`python -m ppo_fabric.tune`: hyperparameter search with Optuna, each trial a normal run.

    python -m ppo_fabric.tune env.id=Acrobot-v1 'algo.lr=tag(log, interval(1e-5, 1e-2))' \\
        'algo.gae_lambda=choice(0.9, 0.95, 0.98)' tune.trials=50 tune.jobs=2

Training overrides with a sweep (Hydra's grammar, `tune_space.py`) are searched, the others are fixed;
`tune.*` arguments set the tuner (`tune_config.py`). Everything is checked before any trial starts: the
tuner's settings, the search expressions, and the training config of the lowest and highest values of the
space (the same checks as `python -m ppo_fabric`). The study lives in a storage (SQLite in the study dir by
default) under a name derived from the command, so rerunning the same command continues it; trials stopped
by an interrupt are queued again with the same values. Each trial is run by `tune_trial.py`; `tune.jobs`
threads each manage one trial at a time. At the end: trials.csv, best.json, the best trial as a command
to paste, and the optimisation-history and parameter-importance plots.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from ppo_fabric.compat.linux import drop_hung_up_terminal
from ppo_fabric.config.faults import STOP_SIGNALS
from ppo_fabric.config.values import ConfigError
from ppo_fabric.tune.settings import TuneConfig
from ppo_fabric.tune.space import Space, SpaceError
from ppo_fabric.tune.trial import Outcome, StopFlags, TrialRun

USAGE = """usage: python -m ppo_fabric.tune [training overrides] [search expressions] [tune.key=value ...]

Search expressions (Hydra's override grammar): key=choice(a, b), key=a,b,c, key=range(1, 5),
key=interval(0.9, 0.99), key=tag(log, interval(1e-5, 1e-2)), key=tag(int, interval(1, 64)).
Other training overrides are the same for every trial.

Tuner settings (defaults in brackets):
  tune.trials [20]        finished trials the study should hold (earlier invocations count)
  tune.jobs [1]           trials at a time
  tune.seeds [1]          runs per trial (seed, seed+1, ...); the objective is their mean
  tune.objective [return] return | eval | a summary.json metric (sps, best_mean_return, ...)
  tune.eval_episodes [10] objective=eval: deterministic evaluation episodes per seed
  tune.direction [maximize]  maximize | minimize
  tune.sampler [tpe]      tpe | random;  tune.sampler_seed [0]
  tune.pruner [median]    median | hyperband | none; tune.pruner.startup_trials [5],
                          tune.pruner.warmup_steps [total_steps/3], tune.pruner.min_resource [total_steps/27]
  tune.report_every [one update]  env steps between intermediate values
  tune.name, tune.dir [runs/tune/<name>], tune.storage [sqlite in the study dir; a DB URL; a journal file]
"""

_FINISHED_STATES = ("COMPLETE", "PRUNED", "FAIL")


@dataclass
class Plan:
    """Everything checked and derived before the first trial starts."""

    tune: TuneConfig
    space: Space
    extra: list[str]  # overrides the tuner adds to every trial (group, metrics.csv when pruning needs it)
    name: str
    directory: Path
    storage: str
    base_seed: int
    total_steps: int
    report_every: int
    identity: dict[str, Any]


def prepare(argv: list[str]) -> Plan:
    """Parse and check the arguments, and the training config of the space's corners; raises
    ConfigError (or SpaceError) with one line."""
    from ppo_fabric.app import preflight
    from ppo_fabric.config.tuned import with_tuned_values
    from ppo_fabric.config.values import compose, training_layout
    from ppo_fabric.tune import settings as tune_config
    from ppo_fabric.tune import space as tune_space

    tune_args, training = tune_config.split_arguments(argv)
    tcfg = tune_config.parse(tune_args)
    space = tune_space.parse(training)
    for text in space.fixed:
        key = text.split("=", 1)[0].lstrip("+~")
        if key == "hydra.run.dir" or key.startswith("hydra.sweep"):
            raise ConfigError(
                f"{text}: the tuner places each trial's run dir under the study dir; set tune.dir"
            )
        if key in ("group", "resume"):
            raise ConfigError(f"{text}: the tuner sets {key} for every trial itself; drop it")
    if not space.params:
        raise ConfigError(
            "nothing to search: give at least one expression such as 'algo.lr=tag(log, interval(1e-5, 1e-2))'"
        )
    cfg = None
    for corner in space.corners():
        try:
            cfg, _ = compose(with_tuned_values([*space.fixed, *corner]))  # as each trial's command line
            facts = preflight.check(cfg)
        except ConfigError as exc:
            raise ConfigError(f"a trial with {' '.join(corner)} cannot run: {exc}") from None
    assert cfg is not None
    spaces = facts["observation_space"]  # a dict by policy name for a multi-agent run
    tune_config.check_objective_for(tcfg, cfg, list(spaces) if isinstance(spaces, dict) else None)
    extra: list[str] = []
    if tune_config.intermediate_values(tcfg) and not cfg.logger.csv:
        # The learning curve the pruner needs comes from metrics.csv: turn it on for the trials.
        if "csv" in cfg.logger:
            extra.append("logger.csv=true")
        elif tcfg.pruner.kind != "none":
            raise ConfigError(
                "this logger writes no metrics.csv (no logger.csv key), which pruning reads; use "
                "logger=default or logger=none, or tune.pruner=none"
            )
    identity = tune_config.identity(tcfg, space.fixed, [p.expression for p in space.params])
    name = tune_config.study_name(tcfg, str(cfg.env.id), identity)
    directory = tune_config.study_dir(tcfg, name).resolve()
    extra.append(f"group={name}")
    batch = training_layout(cfg, int(facts["world_size"])).env_steps
    return Plan(
        tune=tcfg,
        space=space,
        extra=extra,
        name=name,
        directory=directory,
        storage=tune_config.storage_url(tcfg, directory),
        base_seed=int(cfg.seed),
        total_steps=int(cfg.algo.total_steps),
        report_every=tcfg.report_every or batch,
        identity=identity,
    )


def open_study(plan: Plan) -> Any:
    """Create the study, or load it when the storage holds it; refuse one made by another command."""
    import optuna

    plan.directory.mkdir(parents=True, exist_ok=True)
    claim_directory(plan)
    storage: Any = plan.storage
    if "://" not in plan.storage:  # a journal file: several machines can share it over a network disk
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        storage = JournalStorage(JournalFileBackend(str(Path(plan.storage).resolve())))
    try:
        study = optuna.create_study(
            storage=storage,
            study_name=plan.name,
            direction=plan.tune.direction,
            load_if_exists=True,
        )
    except Exception as exc:  # sqlalchemy, journal and optuna errors: one line
        raise ConfigError(
            f"tune.storage={plan.storage}: cannot open the study: {str(exc).splitlines()[0]}"
        ) from None
    known = study.user_attrs.get("identity")
    if known is None:
        study.set_user_attr("identity", plan.identity)
    elif known != plan.identity:
        differs = sorted(k for k in plan.identity if plan.identity[k] != known.get(k))
        raise ConfigError(
            f"study {plan.name} in {plan.storage} was made with other {', '.join(differs)} "
            f"({known[differs[0]]!r}); continue it with the same command, or choose a new tune.name"
        )
    done = len(study.get_trials(deepcopy=False))
    study.sampler = _sampler(plan.tune, done)
    study.pruner = _pruner(plan)
    return study


STUDY_FILE = "study.json"  # in the study dir: the study whose trials it holds


def claim_directory(plan: Plan) -> None:
    """One study per directory: trial directories are numbered from 0 in every study, so a second study
    (or the same one with another storage, whose numbers restart too) in the same `tune.dir` would run its
    trials in the first one's and rewrite its trials.csv. Refused in one line."""
    marker = plan.directory / STUDY_FILE
    mine = {"name": plan.name, "storage": plan.storage}
    if not marker.is_file():
        marker.write_text(json.dumps(mine) + "\n")
        return
    try:
        theirs = json.loads(marker.read_text())
    except (OSError, ValueError):
        theirs = {}
    if theirs != mine:
        raise ConfigError(
            f"tune.dir={plan.directory} holds the trials of study {theirs.get('name')!r} (tune.storage="
            f"{theirs.get('storage')}); give this study another tune.dir, or continue that one"
        )


def _sampler(cfg: TuneConfig, done: int) -> Any:
    """A seeded sampler; offset by the trials already in the study, so a continued study does not draw
    the same random start-up values again."""
    import optuna

    seed = cfg.sampler_seed + done
    if cfg.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def _pruner(plan: Plan) -> Any:
    import optuna

    p = plan.tune.pruner
    if p.kind == "median":
        warmup = p.warmup_steps if p.warmup_steps is not None else plan.total_steps // 3
        return optuna.pruners.MedianPruner(n_startup_trials=p.startup_trials, n_warmup_steps=warmup)
    if p.kind == "hyperband":
        rungs = p.reduction_factor**3
        min_resource = p.min_resource or max(plan.total_steps // rungs, 1)
        return optuna.pruners.HyperbandPruner(
            min_resource=min_resource, max_resource=plan.total_steps, reduction_factor=p.reduction_factor
        )
    return optuna.pruners.NopPruner()


def say(message: str) -> None:
    print(f"ppo-fabric: tune: {message}", flush=True)


class Tuner:
    """Runs the study: `tune.jobs` threads, each asking for a trial and running it until the study holds
    `tune.trials` finished trials or an interrupt arrives."""

    def __init__(self, plan: Plan, study: Any) -> None:
        self.plan = plan
        self.study = study
        self.flags = StopFlags()
        self.lock = threading.Lock()
        self.running = 0
        self.signum = 0

    def finished(self) -> int:
        """Trials that count towards `tune.trials`: every finished one except those an interrupt ended
        (they are queued again)."""
        import optuna

        states = tuple(getattr(optuna.trial.TrialState, s) for s in _FINISHED_STATES)
        trials = self.study.get_trials(deepcopy=False, states=states)
        return sum(1 for t in trials if not t.user_attrs.get("interrupted"))

    def claim(self) -> tuple[Any, list[str]] | None:
        """The next trial and its sampled overrides, or None when the study is full or stopping."""
        with self.lock:
            if self.flags.stop.is_set() or self.finished() + self.running >= self.plan.tune.trials:
                return None
            trial = self.study.ask()
            params = self.plan.space.suggest(trial)
            trial.set_user_attr("overrides", params)
            self.running += 1
            return trial, params

    def worker(self) -> None:
        while (claimed := self.claim()) is not None:
            trial, params = claimed
            try:
                self.run_trial(trial, params)
            except Exception as exc:  # a storage or file error ends this trial, never the study
                self.tell(trial, params, Outcome("failed", reason=f"{type(exc).__name__}: {exc}"))
            finally:
                with self.lock:
                    self.running -= 1

    def run_trial(self, trial: Any, params: list[str]) -> None:
        plan = self.plan
        directory = plan.directory / f"trial_{trial.number:03d}"
        trial.set_user_attr("dir", str(directory))
        say(f"trial {trial.number} started: {' '.join(params)}")
        run = TrialRun(
            overrides=[*plan.space.fixed, *params, *plan.extra],
            seeds=[plan.base_seed + k for k in range(plan.tune.seeds)],
            directory=directory,
            objective=plan.tune.objective,
            eval_episodes=plan.tune.eval_episodes,
            report_every=plan.report_every,
            poll_seconds=plan.tune.poll_seconds,
            flags=self.flags,
        )

        def report(value: float, step: int) -> bool:
            trial.report(value, step)
            return trial.should_prune()

        from ppo_fabric.tune.settings import intermediate_values

        outcome = run.execute(report if intermediate_values(plan.tune) else None)
        self.tell(trial, params, outcome)

    def tell(self, trial: Any, params: list[str], outcome: Outcome) -> None:
        import optuna

        state = optuna.trial.TrialState
        with self.lock:
            if outcome.state == "complete":
                trial.set_user_attr("seed_values", outcome.seed_values)
                self.study.tell(trial, outcome.value)
                say(f"trial {trial.number} complete: {outcome.value:.4g} ({' '.join(params)})")
                return
            trial.set_user_attr("reason", outcome.reason)
            if outcome.state == "pruned":
                self.study.tell(trial, state=state.PRUNED)
                say(f"trial {trial.number} {outcome.reason} ({' '.join(params)})")
                return
            if outcome.state == "interrupted":
                trial.set_user_attr("interrupted", True)
                self.study.enqueue_trial(trial.params, user_attrs={"requeued_from": trial.number})
            self.study.tell(trial, state=state.FAIL)
            say(
                f"trial {trial.number} {'interrupted' if outcome.state == 'interrupted' else 'failed'}: {outcome.reason}"
            )

    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGHUP:
            drop_hung_up_terminal()
        if self.flags.stop.is_set():
            self.flags.kill.set()
            say("second interrupt: killing the running trials")
            return
        self.signum = signum
        self.flags.stop.set()
        say("interrupted: stopping the running trials (their runs write a checkpoint); again to kill them")

    def run(self) -> int:
        """Run the study; returns the exit status (130/143 after an interrupt)."""
        previous = {s: signal.signal(s, self.on_signal) for s in STOP_SIGNALS}
        already = self.finished()
        say(
            f"study {self.plan.name}: {already} of {self.plan.tune.trials} trials done; "
            f"dir {self.plan.directory}, storage {self.plan.storage}"
        )
        try:
            threads = [threading.Thread(target=self.worker, daemon=True) for _ in range(self.plan.tune.jobs)]
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                for t in threads:
                    t.join(timeout=0.2)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        from ppo_fabric.tune.report import write_report

        write_report(self.study, self.plan)
        if self.signum:
            return 128 + self.signum
        return 0 if any(t.state.name == "COMPLETE" for t in self.study.get_trials(deepcopy=False)) else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point: one line and status 2 for bad input, 130 after Ctrl+C, 1 when no trial completed."""
    from ppo_fabric.config.arguments import fail

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(USAGE)
        return 0
    flags = [a for a in args if a.startswith("-")]
    if flags:
        fail(f"unknown flag {flags[0]}; the tuner takes overrides and tune.key=value settings (see --help)")
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    try:
        plan = prepare(args)
        study = open_study(plan)
    except (ConfigError, SpaceError) as exc:
        fail(str(exc))
    except KeyboardInterrupt:  # Ctrl+C during the checks: nothing has started yet
        say("interrupted before any trial started")
        return 130
    return Tuner(plan, study).run()


if __name__ == "__main__":
    sys.exit(main())
