"""`python -m ppo_fabric.tune`: search spaces in Hydra's grammar, the tuner's settings, bad input, and two
real studies on a probe env (each trial a `python -m ppo_fabric` run of its own).

Trial processes cost most of the time (seconds of imports each), so the studies are small: three trials two
at a time on `ProbeActionDependent-v0` (solved in a few hundred env steps at a sane lr, never at 1e-6),
and a one-trial study interrupted and continued.
"""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from ppo_fabric.config.values import ConfigError
from ppo_fabric.tune import settings as tune_config
from ppo_fabric.tune import space as tune_space
from ppo_fabric.tune import study as tune
from ppo_fabric.tune.space import SpaceError
from ppo_fabric.tune.trial import Reporter, objective_value, read_returns
from tests.conftest import assert_cli_failure, job_env, job_processes

PROBE = [
    "env=gym",
    "env.id=tests.probe_envs:ProbeActionDependent-v0",
    "env.num_envs=8",
    "algo.rollout_steps=16",
    "algo.minibatch_size=64",
    "logger=none",
]
TEAMS = [
    "env=pettingzoo",
    "env.id=ppo_fabric.envs.toy_multiagent:teams_v0",
    "multiagent.policies={adversary:{},agent:{}}",
    "multiagent.policy_mapping={adversary_*:adversary,agent_*:agent}",
]


# ------------------------------------------------------------------------------------------ search spaces
@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("algo.lr=tag(log, interval(1e-5, 1e-2))", FloatDistribution(1e-5, 1e-2, log=True)),
        ("algo.gae_lambda=interval(0.9, 0.99)", FloatDistribution(0.9, 0.99)),
        ("algo.gae_lambda=choice(0.9, 0.95, 0.98)", CategoricalDistribution([0.9, 0.95, 0.98])),
        ("algo.update_epochs=2,4,8", CategoricalDistribution([2, 4, 8])),
        ("model=choice(mlp, lstm)", CategoricalDistribution(["mlp", "lstm"])),
        ("algo.update_epochs=range(1, 5)", IntDistribution(1, 4)),  # stop exclusive, as in Hydra
        ("algo.rollout_steps=range(16, 129, 16)", IntDistribution(16, 128, step=16)),
        ("algo.minibatch_size=tag(log, range(32, 257))", IntDistribution(32, 256, log=True)),
        ("algo.clip_coef=range(0.1, 0.35, 0.1)", FloatDistribution(0.1, 0.3, step=0.1)),
        ("algo.update_epochs=tag(int, interval(1, 10))", IntDistribution(1, 10)),
        ("algo.minibatch_size=tag(int, log, interval(32, 512))", IntDistribution(32, 512, log=True)),
    ],
)
def test_search_expressions_become_optuna_distributions(expression: str, expected: object) -> None:
    space = tune_space.parse(["env.id=CartPole-v1", expression, "seed=3"])
    assert space.fixed == ["env.id=CartPole-v1", "seed=3"]
    (param,) = space.params
    assert param.key == expression.split("=")[0] and param.distribution == expected


def test_sampled_values_become_overrides_hydra_reads_back() -> None:
    space = tune_space.parse(
        ["+env.kwargs.name=choice('a b', c)", "algo.lr=interval(1, 2)", "algo.norm_adv=true,false"]
    )
    assert [p.key for p in space.params] == ["env.kwargs.name", "algo.lr", "algo.norm_adv"]
    assert space.params[0].override("a b") == "+env.kwargs.name=a\\ b"
    assert space.params[1].override(2.0) == "algo.lr=2.0"  # stays a float
    assert space.params[2].override(False) == "algo.norm_adv=False"
    # the corners are the configs checked before a study starts
    assert space.corners() == [
        ["+env.kwargs.name=a\\ b", "algo.lr=1.0", "algo.norm_adv=True"],
        ["+env.kwargs.name=c", "algo.lr=2.0", "algo.norm_adv=False"],
    ]
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    overrides = space.suggest(study.ask())
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    assert parsed[0].value() in ("a b", "c") and 1 <= parsed[1].value() <= 2
    assert isinstance(parsed[2].value(), bool)


@pytest.mark.parametrize(
    ("expression", "fragment"),
    [
        ("algo.lr=choice(1e-3", "cannot parse override 'algo.lr=choice(1e-3'"),
        ("algo.lr=tag(log, interval(0, 1))", "a log scale needs low > 0"),
        ("algo.lr=interval(0.5, 0.1)", "interval needs low < high"),
        ("algo.lr=tag(fast, interval(0.1, 0.5))", "unknown tag 'fast'"),
        ("algo.lr=tag(log, choice(0.1, 0.5))", "tags apply to range() and interval()"),
        ("model=glob(*)", "glob() cannot be searched"),
        ("algo.update_epochs=range(1, 2)", "fewer than two values"),
        ("algo.update_epochs=tag(int, interval(1.5, 4))", "whole-number bounds"),
        ("algo.lr=choice(0.1, 0.1)", "listed twice"),
        ("algo.lr=choice([1], [2])", "numbers, strings or booleans"),
    ],
)
def test_bad_search_expressions_are_one_line(expression: str, fragment: str) -> None:
    with pytest.raises(SpaceError) as exc:
        tune_space.parse([expression])
    assert fragment in str(exc.value) and "\n" not in str(exc.value)


def test_a_key_fixed_and_searched_is_refused() -> None:
    with pytest.raises(SpaceError, match="also searched"):
        tune_space.parse(["algo.lr=choice(0.1, 0.2)", "algo.lr=0.3"])


# ------------------------------------------------------------------------------------------ tune settings
def test_tune_settings_parse_and_default() -> None:
    cfg = tune_config.parse(["tune.trials=7", "tune.pruner=hyperband", "tune.pruner.reduction_factor=4"])
    assert (cfg.trials, cfg.jobs, cfg.pruner.kind, cfg.pruner.reduction_factor) == (7, 1, "hyperband", 4)
    assert cfg.objective == "return" and cfg.sampler_seed == 0 and cfg.storage is None
    tune_config.parse(["tune.objective=policies.red.final_mean_return"])


def test_the_study_name_is_stable_and_follows_what_scores_a_trial() -> None:
    cfg = tune_config.parse([])
    ident = tune_config.identity(cfg, ["env.id=CartPole-v1"], ["algo.lr=interval(0.1, 0.2)"])
    name = tune_config.study_name(cfg, "CartPole-v1", ident)
    assert name == tune_config.study_name(
        tune_config.parse(["tune.trials=90", "tune.jobs=3"]), "CartPole-v1", ident
    )
    other = tune_config.identity(
        tune_config.parse(["tune.seeds=3"]), ["env.id=CartPole-v1"], ["algo.lr=interval(0.1, 0.2)"]
    )
    assert name.startswith("CartPole-v1-") and tune_config.study_name(cfg, "CartPole-v1", other) != name
    assert tune_config.study_dir(cfg, name) == Path("runs/tune") / name


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["tune.trails=5"], "tune.trails: unknown tuner setting"),
        (["tune.trials=many"], "tune.trials"),
        (["tune.trials=0"], "tune.trials=0 must be > 0"),
        (["tune.objective=speed"], "tune.objective=speed is not one of"),
        (["tune.pruner=asha"], "tune.pruner=asha is not one of median, hyperband, none"),
        (["tune.direction=up"], "tune.direction=up"),
        (["tune.name=a/b"], "tune.name=a/b may hold only"),
        (["tune.pruner.startup_trials=-1"], "tune.pruner.startup_trials=-1 must be >= 0"),
    ],
)
def test_bad_tune_settings_are_one_line(argv: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError) as exc:
        tune_config.parse(argv)
    assert fragment in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["algo.lr=choice(1e-3, 1e-2)", "tune.jobz=2"], "tune.jobz: unknown tuner setting"),
        (["algo.lr=interval(1e-3"], "cannot parse override"),
        (["algo.lr=3e-4"], "nothing to search"),
        (["algo.lr=choice(1e-3, 1e-2)", "algo.learning=3"], "algo.learning: unknown config key"),
        # the corners of the space are checked with the training config's own rules, before any trial
        (["algo.gamma=choice(0.9, 1.5)"], "a trial with algo.gamma=1.5 cannot run: algo.gamma"),
        (["algo.lr=choice(1e-3, 1e-2)", "env.id=NoSuchEnv-v0"], "NoSuchEnv-v0"),
        (["algo.lr=choice(1e-3, 1e-2)", "hydra.run.dir=/tmp/x"], "set tune.dir"),
        (["algo.lr=choice(1e-3, 1e-2)", "resume=auto"], "the tuner sets resume"),
        (["-m", "algo.lr=choice(1e-3, 1e-2)"], "unknown flag -m"),
        # objectives no trial's summary can hold: every trial trained its budget, then failed for want of it
        (
            ["algo.lr=choice(1e-3, 1e-2)", "eval.every=0", "tune.objective=evaluation.last.return_mean"],
            "tune.objective=evaluation.last.return_mean needs evaluation during training, which eval.every=0",
        ),
        (
            ["algo.lr=choice(1e-3, 1e-2)", "tune.objective=policies.main.final_mean_return"],
            "names a policy of a multi-agent run; env.id=CartPole-v1 is single-agent: use tune.objective=return",
        ),
        (
            ["algo.lr=choice(1e-3, 1e-2)", *TEAMS, "tune.objective=policies.green.final_mean_return"],
            "the run has no policy 'green' (its policies: adversary, agent)",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], fragment: str
) -> None:
    assert_cli_failure(capsys, tune.main, [*argv, f"tune.dir={tmp_path}"], fragment)


def test_a_named_study_refuses_another_search(tmp_path: Path) -> None:
    """The same tune.name with another search space would mix incomparable trials: refused."""
    base = ["tune.name=s", f"tune.dir={tmp_path}", *PROBE]
    tune.open_study(tune.prepare([*base, "algo.lr=choice(1e-3, 1e-2)"]))
    tune.open_study(tune.prepare([*base, "algo.lr=choice(1e-3, 1e-2)", "tune.trials=50"]))  # continues
    with pytest.raises(ConfigError, match="study s in .* was made with other search"):
        tune.open_study(tune.prepare([*base, "algo.lr=choice(1e-4, 1e-2)"]))


def test_a_study_directory_holds_one_study(tmp_path: Path) -> None:
    """Trial directories restart at trial_000 in every study: a second study in the same tune.dir (or the
    same one with another storage) would run in the first one's trials, so it is refused in one line."""
    base = [f"tune.dir={tmp_path}", *PROBE, "algo.lr=choice(1e-3, 1e-2)"]
    tune.open_study(tune.prepare(["tune.name=a", *base]))
    tune.open_study(tune.prepare(["tune.name=a", *base]))  # the same study continues
    with pytest.raises(ConfigError, match=rf"tune.dir={tmp_path} holds the trials of study 'a'"):
        tune.open_study(tune.prepare(["tune.name=b", *base]))
    with pytest.raises(ConfigError, match="holds the trials of study 'a'"):
        tune.open_study(
            tune.prepare(["tune.name=a", *base, f"tune.storage=sqlite:///{tmp_path / 'other.db'}"])
        )


# ------------------------------------------------------------------------------------------ trial plumbing
def test_intermediate_values_on_a_grid_of_env_steps(tmp_path: Path) -> None:
    """Mean over seeds at each grid step once every seed has passed it, each seed's latest value <= step."""
    reporter = Reporter(every=100)
    assert reporter.due([[(64, 0.0)], []]) == []  # a seed with no row yet: nothing
    assert reporter.due([[(64, 0.0), (128, 1.0)], [(100, 0.5)]]) == [(100, 0.25)]  # (0.0 + 0.5) / 2
    assert reporter.due([[(128, 1.0), (320, 0.0)], [(100, 0.5), (200, 0.7), (300, 0.9)]]) == [
        (200, (1.0 + 0.7) / 2),
        (300, (1.0 + 0.9) / 2),
    ]
    metrics = tmp_path / "metrics.csv"
    metrics.write_text("step,rollout/return_mean20,time/sps\n128,,10\n256,0.5,10\n384,0.75,1")
    assert read_returns(metrics) == [(256, 0.5), (384, 0.75)]
    assert read_returns(tmp_path / "missing.csv") == []


def test_objective_values_come_from_the_summary(tmp_path: Path) -> None:
    summary = {"final_mean_return": 0.5, "sps": 1000.0, "policies": {"red": {"final_mean_return": 2.0}}}
    (tmp_path / "summary.json").write_text(json.dumps(summary | {"best_mean_return": None}))
    assert objective_value(tmp_path, "return", 0, 1) == 0.5
    assert objective_value(tmp_path, "sps", 0, 1) == 1000.0
    assert objective_value(tmp_path, "policies.red.final_mean_return", 0, 1) == 2.0
    with pytest.raises(ValueError, match="no number for best_mean_return"):
        objective_value(tmp_path, "best_mean_return", 0, 1)
    evaluation = {
        "last": {"env_step": 512, "return_mean": 7.0},
        "best": {"env_step": 256, "return_mean": 9.0},
    }
    (tmp_path / "summary.json").write_text(json.dumps(summary | {"evaluation": evaluation}))
    for objective, value in (("evaluation.last.return_mean", 7.0), ("evaluation.best.return_mean", 9.0)):
        tune_config.parse([f"tune.objective={objective}"])  # accepted
        assert objective_value(tmp_path, objective, 0, 1) == value


def test_a_trial_whose_seeds_all_finished_is_scored_whatever_came_in_the_same_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupt (or a prune) noticed in the poll in which every seed exited 0 does not turn a finished
    trial into an interrupted one, to be run again."""
    from ppo_fabric.tune import trial as trial_module

    class Finished:
        @staticmethod
        def start(*_args: object, **_kwargs: object) -> Finished:
            return Finished()

        def poll(self) -> int:
            return 0

    monkeypatch.setattr(trial_module, "RunProcess", Finished)
    for seed, value in ((1, 2.0), (2, 4.0)):
        (tmp_path / f"seed_{seed}").mkdir()
        (tmp_path / f"seed_{seed}" / "summary.json").write_text(json.dumps({"final_mean_return": value}))
    flags = trial_module.StopFlags()
    flags.stop.set()
    run = trial_module.TrialRun([], [1, 2], tmp_path, "return", 1, None, 0.0, flags)
    outcome = run.execute(None)
    assert (outcome.state, outcome.value) == ("complete", 3.0)


# ------------------------------------------------------------------------------------------ real studies
def _tune(cwd: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "ppo_fabric.tune", *args]
    return subprocess.run(cmd, cwd=cwd, env=job_env(), capture_output=True, text=True, timeout=timeout)


def _rows(directory: Path) -> list[dict[str, str]]:
    with (directory / "trials.csv").open(newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.mark.multiprocess
def test_a_study_prunes_bad_trials_and_its_best_solves_the_probe(tmp_path: Path) -> None:
    """Three trials, two at a time: lr 1e-6 never learns, so the third trial (1e-6, started once one of
    the first two has completed) is stopped by the median pruner at its first report after the warm-up;
    the best trial solves the probe."""
    study_dir = tmp_path / "study"
    proc = _tune(
        tmp_path,
        *PROBE,
        "algo.total_steps=4096",
        "algo.lr=choice(1e-6, 3e-3)",
        "algo.ent_coef=interval(0.0, 0.01)",
        "tune.trials=3",
        "tune.sampler_seed=7",  # draws lr 3e-3, 3e-3, 1e-6: the third starts once a trial has completed
        "tune.jobs=2",
        "tune.pruner.startup_trials=1",
        "tune.pruner.warmup_steps=512",
        "tune.poll_seconds=0.2",
        f"tune.dir={study_dir}",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _rows(study_dir)
    assert len(rows) == 3, rows
    pruned = [r for r in rows if r["state"] == "PRUNED"]
    assert pruned and all(float(r["algo.lr"]) == 1e-6 for r in pruned), rows
    best = json.loads((study_dir / "best.json").read_text())
    assert best["value"] >= 0.95 and "algo.lr=0.003" in best["overrides"], best
    assert f"python -m ppo_fabric {' '.join(PROBE)} algo.total_steps=4096 algo.lr=0.003" in proc.stdout
    # a pruned trial was stopped like any run: SIGTERM, checkpoint written
    pruned_run = Path(pruned[0]["dir"]) / "seed_42"
    assert (pruned_run / "checkpoints" / "last.ckpt").is_file()
    config = (Path(best["dir"]) / "seed_42" / "config.yaml").read_text()
    assert "group: ProbeActionDependent-v0-" in config  # the study name, given to every trial
    for png in ("optimization_history.png", "param_importances.png"):
        assert (study_dir / png).stat().st_size > 1000


@pytest.mark.multiprocess
def test_an_interrupted_study_continues_with_the_same_command(tmp_path: Path) -> None:
    """Ctrl+C stops the running trial (exit 130, no process of it left) and queues its values again; the
    same command (the study dir is derived from it, under runs/tune/) continues the study and completes
    that trial, scored by deterministic evaluation episodes. (A run stopped mid-training writing its
    checkpoint is checked on the pruned trials above.)"""
    args = [
        *PROBE,
        "algo.total_steps=2048",
        "algo.lr=choice(1e-3, 3e-3)",
        "tune.trials=1",
        "tune.objective=eval",
        "tune.eval_episodes=3",
        "tune.pruner=none",
        "tune.poll_seconds=0.2",
    ]
    cmd = [sys.executable, "-m", "ppo_fabric.tune", *args]
    first = subprocess.Popen(
        cmd, cwd=tmp_path, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("runs/tune/*/trial_000/seed_42/output.log")):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.1)
        (run_dir,) = (p.parent for p in tmp_path.glob("runs/tune/*/trial_000/seed_42/output.log"))
        first.send_signal(signal.SIGINT)
        out, err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 130, out[-3000:] + err[-3000:]
    assert "trial 0 interrupted" in out and not job_processes(run_dir)
    study_dir = run_dir.parent.parent
    assert [r["state"] for r in _rows(study_dir)] == ["INTERRUPTED", "WAITING"]

    again = _tune(tmp_path, *args)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"study {study_dir.name}: 0 of 1 trials done" in again.stdout
    rows = _rows(study_dir)
    assert [r["state"] for r in rows] == ["INTERRUPTED", "COMPLETE"]
    assert rows[0]["algo.lr"] == rows[1]["algo.lr"]  # the interrupted values, queued again
    evaluation = json.loads((study_dir / "trial_001" / "seed_42" / "eval.json").read_text())
    assert evaluation["episodes"] == 3 and evaluation["deterministic"]
    assert float(rows[1]["value"]) == pytest.approx(evaluation["mean_return"])
    assert (study_dir / "optimization_history.png").is_file()
    assert "param_importances.png skipped" in again.stdout


def test_journal_storage_and_pruners(tmp_path: Path) -> None:
    """A file path as tune.storage is Optuna's journal (several machines on one disk); a study reopened
    from it holds its trials. Hyperband's first rung defaults to total_steps / 27."""
    base = [*PROBE, "algo.total_steps=2700", "algo.lr=choice(1e-3, 1e-2)", f"tune.dir={tmp_path}"]
    plan = tune.prepare([*base, f"tune.storage={tmp_path / 'journal.log'}", "tune.pruner=hyperband"])
    study = tune.open_study(plan)
    study.tell(study.ask(), 1.0)
    reopened = tune.open_study(plan)
    assert len(reopened.trials) == 1 and (tmp_path / "journal.log").is_file()
    assert isinstance(reopened.pruner, optuna.pruners.HyperbandPruner)
    assert reopened.pruner._min_resource == 100 and reopened.pruner._max_resource == 2700
    median = tune.open_study(tune.prepare([*base, "tune.name=m", f"tune.dir={tmp_path / 'm'}"])).pruner
    assert isinstance(median, optuna.pruners.MedianPruner) and median._n_warmup_steps == 900
    assert plan.report_every == 8 * 16  # one update: num_envs x rollout_steps


def test_failed_trials_are_recorded_and_the_study_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run that fails, and an error in the tuner's own handling of a trial, make FAIL trials with the
    reason; the next trials still run. With no completed trial the tuner exits 1."""
    from ppo_fabric.tune.trial import Outcome, TrialRun

    outcomes = iter(
        [
            Outcome("failed", reason="seed 42 exited with status 1 (see x/output.log)"),
            RuntimeError("disk full"),
        ]
        + [Outcome("complete", 0.5, seed_values=[0.4, 0.6])]
    )

    def execute(self: TrialRun, report: object, env: object = None) -> Outcome:
        assert self.overrides[-1].startswith("group=ProbeActionDependent-v0-") and self.seeds == [42]
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(TrialRun, "execute", execute)
    argv = [*PROBE, "algo.lr=choice(1e-3, 1e-2)", f"tune.dir={tmp_path}"]
    assert tune.main([*argv, "tune.trials=2"]) == 1  # two failures, nothing completed
    assert tune.main([*argv, "tune.trials=3"]) == 0  # the same study, one more trial
    rows = _rows(tmp_path)
    assert [r["state"] for r in rows] == ["FAIL", "FAIL", "COMPLETE"]
    assert "exited with status 1" in rows[0]["reason"] and rows[1]["reason"] == "RuntimeError: disk full"
    assert json.loads((tmp_path / "best.json").read_text())["trial"] == 2
    out = capsys.readouterr().out
    assert "no trial has completed yet" in out
    # two seeds: the command printed trains the first, whose value is not the trial's mean
    assert (
        "best trial 2: return 0.5, the mean of 2 seeds (0.4, 0.6, seed 42 first); train its first seed" in out
    )


def test_return_objectives_are_pruned_and_others_are_not() -> None:
    """The training return is reported for every objective it tracks, the evaluation's return included
    (`evaluation.last.return_mean` ran every trial to its end under the default median pruner)."""
    from ppo_fabric.tune.settings import TuneConfig, intermediate_values

    tracked = [
        "return",
        "eval",
        "final_mean_return",
        "evaluation.last.return_mean",
        "evaluation.best.return_mean",
    ]
    others = ["sps", "evaluation.last.length_mean", "evaluation.last.score"]
    assert [intermediate_values(TuneConfig(objective=o)) for o in tracked] == [True] * len(tracked)
    assert [intermediate_values(TuneConfig(objective=o)) for o in others] == [False] * len(others)


def test_a_failed_trials_reason_carries_the_runs_own_line(tmp_path: Path) -> None:
    """The reason said only `seed 42 exited with status 1`: the run's one-line cause is in its log."""
    from ppo_fabric.tune.trial import run_error

    log = tmp_path / "output.log"
    log.write_text("ppo-fabric: CartPole-v1 ...\nppo-fabric: error: rank 0: the update diverged (x)\nbye\n")
    assert run_error(log) == "rank 0: the update diverged (x)"
    log.write_text("Killed\n")
    assert run_error(log) is None and run_error(tmp_path / "missing.log") is None
