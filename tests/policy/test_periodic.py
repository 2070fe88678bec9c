"""Evaluation during training (`eval.*`, policy/periodic.py): the cadence, episodes played side by side
against the one-by-one reference, seeds apart from training's, and in a real coupled run the `eval/*` rows,
the record in summary.json and checkpoints, `best.ckpt` chosen by evaluation, the curve, and resume."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import ppo_fabric
from ppo_fabric.config.values import compose
from ppo_fabric.envs.guard import EnvFault
from ppo_fabric.envs.make import env_seeds
from ppo_fabric.learn.learners import policy_specs
from ppo_fabric.models.agent import ActorCritic
from ppo_fabric.policy.evaluate import play
from ppo_fabric.policy.evaluator import EVALUATOR_NICE
from ppo_fabric.policy.periodic import METRICS, PeriodicEvaluation, cadence
from ppo_fabric.policy.scorers import evaluation_seed, play_side_by_side
from ppo_fabric.policy.trained import Policy
from ppo_fabric.runs import checkpoint as ckpt
from ppo_fabric.runs.metrics_file import read_rows, series


def _cfg(every: object, total: int = 30_000) -> object:
    return OmegaConf.create({"eval": {"every": every}, "algo": {"total_steps": total}})


def test_cadence() -> None:
    assert cadence(_cfg(0), 256) == 0 and cadence(_cfg(None), 256) == 0
    assert cadence(_cfg(5000), 256) == 5000
    assert cadence(_cfg("auto"), 256) == 2000  # ~15 evaluations a run
    assert cadence(_cfg("auto", total=1024), 512) == 512  # never more often than once an update


def test_side_by_side_equals_one_by_one_and_uses_its_own_seeds() -> None:
    torch.manual_seed(0)
    env = gym.make("CartPole-v1")
    model_cfg = OmegaConf.create(
        {"encoder": "auto", "actor_hidden": [16], "critic_hidden": [16], "activation": "tanh"}
    )
    model = ActorCritic(env.observation_space, env.action_space, model_cfg)
    policy = Policy(model, env.observation_space, env.action_space)
    seed = evaluation_seed(42)
    envs = [gym.make("CartPole-v1") for _ in range(4)]
    together = play_side_by_side(policy, envs, deterministic=True, seed=seed)
    alone = [play(policy, gym.make("CartPole-v1"), 1, True, seed + k)[:2] for k in range(4)]
    assert together == ([r[0] for r, _ in alone], [n[0] for _, n in alone])
    assert not {seed + k for k in range(4)} & set(env_seeds(42, 0, 64))


@pytest.mark.slow
def test_a_coupled_run_evaluates_keeps_its_best_and_resumes_the_record(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    common = ["logger.tensorboard=false", "eval.every=1536", "eval.episodes=4", "env.normalize_obs=true",
              "checkpoint.every=4", "checkpoint.keep=0"]  # fmt: skip
    summary = ppo_fabric.run([*common, "algo.total_steps=4096", f"hydra.run.dir={run_dir}"])
    evaluated = series(read_rows(run_dir / "evaluations.csv"), "eval/return_mean")
    assert [s for s, _ in evaluated] == [1536, 3072, 4096], "at the cadence, and at the last update"
    updates = [row["step"] for row in read_rows(run_dir / "metrics.csv")]
    assert len(updates) == len(set(updates)) == 16, (
        "metrics.csv: one row per update, no evaluation among them"
    )
    assert not any(key.startswith("eval/") for key in read_rows(run_dir / "metrics.csv")[0])
    record = summary["evaluation"]
    best = max(evaluated, key=lambda p: p[1])
    assert record["best"]["env_step"] == best[0] and record["best"]["return_mean"] == pytest.approx(best[1])
    assert record["last"]["env_step"] == 4096
    saved = ckpt.load(run_dir / "checkpoints" / "best.ckpt")
    assert saved["env_step"] == best[0], "best.ckpt holds the parameters of the best evaluation"
    numbered = sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*.ckpt"))
    assert numbered == [1024, 2048, 3072, 4096], (
        "a new best writes best.ckpt, not a numbered copy off its cadence"
    )
    assert (run_dir / "learning_curve.png").stat().st_size > 0

    resumed = ppo_fabric.run([f"resume={run_dir / 'checkpoints' / 'last.ckpt'}", "algo.total_steps=6144"])
    steps = [s for s, _ in series(read_rows(run_dir / "evaluations.csv"), "eval/return_mean")]
    assert steps == [1536, 3072, 4096, 4608, 6144]
    assert resumed["evaluation"]["best"]["return_mean"] >= record["best"]["return_mean"]
    assert json.loads((run_dir / "summary.json").read_text())["evaluation"] == resumed["evaluation"]


def test_a_session_without_evaluation_keeps_the_runs_record_and_best(tmp_path: Path) -> None:
    """A run that evaluated, resumed with eval.every=0 and again with evaluation on: the middle session
    carries the record on (it dropped it) and leaves best.ckpt alone (best by training return replaced the
    best evaluation's), so the last session's best is the run's, never a worse one scored after."""
    run_dir = tmp_path / "run"
    common = ["logger.tensorboard=false", "eval.episodes=2", f"hydra.run.dir={run_dir}"]
    first = ppo_fabric.run([*common, "eval.every=512", "algo.total_steps=2048"])
    best = run_dir / "checkpoints" / "best.ckpt"
    assert ckpt.load(best)["env_step"] == first["evaluation"]["best"]["env_step"]
    before = best.read_bytes()
    last = run_dir / "checkpoints" / "last.ckpt"
    off = ppo_fabric.run([*common, f"resume={last}", "algo.total_steps=3072", "eval.every=0"])
    assert off["evaluation"] == first["evaluation"] | {"in_flight": None}
    assert ckpt.load(last)["evaluation"]["best"] == first["evaluation"]["best"]
    assert best.read_bytes() == before, "best.ckpt is the best evaluation's, whatever training returned"
    on = ppo_fabric.run([*common, f"resume={last}", "algo.total_steps=3584", "eval.every=512"])
    assert on["evaluation"]["best"]["return_mean"] >= first["evaluation"]["best"]["return_mean"]


def test_a_kept_best_alone_is_a_record_to_keep() -> None:
    """A checkpoint written before the record rule may hold a last evaluation after its step (dropped)
    and a best before it (kept): with evaluation off that best is still the run's record to carry on."""
    cfg, _ = compose(["eval.every=0"])
    saved = {"last": {"env_step": 5000, "return_mean": 9.0}, "best": {"env_step": 100, "return_mean": 50.0}}
    evaluation = PeriodicEvaluation(cfg, policy_specs(cfg), 512, 1024, saved)
    assert evaluation.keeps_record and not evaluation.on
    assert evaluation.state(upto=1024)["best"] == saved["best"]


def _evaluation(*overrides: str, background: bool = False) -> tuple[PeriodicEvaluation, dict]:
    cfg, _ = compose(["eval.every=512", "eval.episodes=4", *overrides])
    specs = policy_specs(cfg)
    torch.manual_seed(0)
    models = {n: ActorCritic(s.obs_space, s.action_space, s.model) for n, s in specs.items()}
    return PeriodicEvaluation(cfg, specs, 512, 0, None, background), models


def test_a_background_evaluation_scores_the_snapshot_taken_when_it_started() -> None:
    """The decoupled player's thread: the metrics of the parameters as they were at `start`, whatever
    happens to the live model meanwhile, equal to the same evaluation run in place."""
    here, model = _evaluation()
    expected = here.run(model, None, 512)
    there, same = _evaluation(background=True)
    there.start(same, None, 512)
    assert there.busy and there.next_step == 1024
    with torch.no_grad():
        for p in same["main"].parameters():  # training goes on while the episodes play
            p.add_(1.0)
    step, metrics = there.collect(wait=True)
    assert step == 512 and not there.busy and there.collect() is None
    assert {k: metrics[k] for k in METRICS} == {k: expected[k] for k in METRICS}
    assert metrics["time/eval_background_s"] > 0 and there.state() == here.state()
    if hasattr(os, "getpriority"):  # it runs in the player's and the trainer's idle moments
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, there.evaluator.process.pid) == min(mine + EVALUATOR_NICE, 19)
    there.close()
    here.close()


def test_a_resume_owes_the_evaluation_its_checkpoint_had_in_flight() -> None:
    """A decoupled checkpoint is written while its own update's evaluation plays in the background; a run
    resumed from it after a crash owes that evaluation (its cadence started above the checkpoint's step,
    so those parameters were never scored); one whose evaluation had reached it owes nothing."""
    cfg, _ = compose(["eval.every=512", "eval.episodes=2"])
    specs = policy_specs(cfg)
    running, models = _evaluation(background=True)
    running.start(models, None, 512)
    saved = running.state()  # what the checkpoint at 512 holds
    assert saved["in_flight"] == 512
    resumed = PeriodicEvaluation(cfg, specs, 512, 512, saved, background=True)
    assert resumed.owed and resumed.due(512)
    resumed.start(models, None, 512)
    assert not resumed.owed and resumed.collect(wait=True)[0] == 512
    running.collect(wait=True)
    done = PeriodicEvaluation(cfg, specs, 512, 512, running.state(), background=True)
    assert not done.owed and not done.due(512) and done.due(1024)
    for evaluation in (running, resumed, done):
        evaluation.close()


def test_a_resume_replays_an_earlier_updates_evaluation_on_the_parameters_its_checkpoint_kept() -> None:
    """A decoupled checkpoint at 1024 is written while the evaluation of 512 plays: it keeps the snapshot
    that evaluation scores, and a run resumed from it plays that evaluation first, with the same result,
    whatever the live parameters are by then; then the cadence goes on."""
    running, models = _evaluation(background=True)
    cfg, specs = running.cfg, running.specs
    running.start(models, None, 512)
    with torch.no_grad():
        for p in models["main"].parameters():  # training goes on
            p.add_(1.0)
    saved, kept = running.state(upto=1024), running.in_flight_policy(1024)
    assert saved["in_flight"] == 512 and kept is not None and kept["env_step"] == 512
    assert running.in_flight_policy(512) is None  # the checkpoint's own update: its own parameters
    resumed = PeriodicEvaluation(cfg, specs, 512, 1024, saved, background=True, in_flight_policy=kept)
    assert resumed.replay is not None and not resumed.owed
    resumed.start_replay()
    assert resumed.replay is None and resumed.busy
    step, metrics = resumed.collect(wait=True)
    assert step == 512 and metrics["eval/return_mean"] == running.collect(wait=True)[1]["eval/return_mean"]
    assert resumed.state()["last"]["env_step"] == 512 and resumed.due(1024)
    ignored = PeriodicEvaluation(cfg, specs, 512, 1024, saved, background=False, in_flight_policy=kept)
    assert ignored.replay is None  # in the run's own process every evaluation ends at its update
    for evaluation in (running, resumed, ignored):
        evaluation.close()


def test_a_stop_leaves_a_background_evaluation_in_flight(tmp_path: Path) -> None:
    """At a stop the decoupled player waited for the evaluation still playing (minutes on a slow env, past
    a cluster's grace period): it now takes only a finished one, keeps the running one in flight for the
    stop's checkpoint (a resume owes it), and its process is given up at once."""
    from ppo_fabric.policy.periodic import finish_in_background

    slow = ["env.id=tests.faulty_env:FaultyCartPole-v0", "+env.kwargs.fault=slow", "+env.kwargs.pause=2",
            "+env.kwargs.after=1"]  # fmt: skip
    evaluation, models = _evaluation(*slow, background=True)
    session = SimpleNamespace(env_step=lambda done: 512 * done)
    evaluation.start(models, None, 512)
    started = time.monotonic()
    finish_in_background(evaluation, session, 1, models, None, final=False)  # type: ignore[arg-type]
    assert evaluation.busy and evaluation.state()["in_flight"] == 512
    process = evaluation.evaluator.process
    evaluation.close()
    assert time.monotonic() - started < 5 and not process.is_alive()


def test_an_evaluation_that_costs_more_than_the_training_is_said_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """On a slow simulator eval.every=auto's 10 whole episodes took 28 times the training of a short run,
    which crawled with no word of why: said once a run, past 10 s and twice the training since the last."""
    evaluation, _ = _evaluation()
    capsys.readouterr()
    evaluation.since = time.perf_counter() - 6.0
    evaluation.say_cost(5.0, 512)  # 5 s of evaluation after 1 s of training: under 10 s, not said
    evaluation.since = time.perf_counter() - 15.0
    evaluation.say_cost(12.0, 1024)  # 12 s after 3 s
    evaluation.since = time.perf_counter() - 15.0
    evaluation.say_cost(12.0, 1536)  # once a run
    assert capsys.readouterr().err == (
        "ppo-fabric: the evaluation at env step 1,024 took 12 s, 4 times the training since the one before; "
        "lower eval.episodes (4) or raise eval.every (0: none)\n"
    )
    evaluation.close()


def test_a_resumes_owed_evaluation_is_not_weighed_against_training_it_never_did(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The evaluation a resumed run owes plays before any training of its session: it was said to take
    "318310 times the training since the one before". The next one is weighed as any other."""
    from ppo_fabric.policy import periodic

    evaluation, _ = _evaluation()
    capsys.readouterr()
    monkeypatch.setattr(periodic, "_models", lambda learners: {})
    monkeypatch.setattr(periodic, "_frozen", lambda collector: None)
    monkeypatch.setattr(evaluation, "due", lambda step, last=False: True)
    monkeypatch.setattr(evaluation, "run", lambda *a: {"time/eval_s": 30.0})
    monkeypatch.setattr(evaluation, "improved", lambda step: False)
    logged = SimpleNamespace(log_evaluation=lambda metrics, step: None)
    session = SimpleNamespace(
        start_update=4, end_update=10, env_step=lambda u: 128 * u, logger=logged, wall_s=lambda: 0.0
    )
    periodic.evaluate_if_due(evaluation, session, 4, {}, None)  # type: ignore[arg-type]
    assert capsys.readouterr().err == ""
    evaluation.since = time.perf_counter() - 31.0  # then 1 s of training, and another 30-s evaluation
    periodic.evaluate_if_due(evaluation, session, 5, {}, None)  # type: ignore[arg-type]
    assert "the evaluation at env step 640 took 30 s" in capsys.readouterr().err
    evaluation.close()


def test_a_checkpoint_keeps_the_record_as_it_stood_at_its_own_step() -> None:
    """A decoupled checkpoint at step 4608 held the evaluation at 5120 (it finished in the background
    while later updates ran, and was amended in): after a crash and a resume from 4608, the summary named
    a best from the timeline the resumed run did not follow, and best.ckpt held its parameters."""
    evaluation, _ = _evaluation()
    for step, score in ((512, 10.0), (1024, 30.0), (1536, 20.0), (2048, 40.0)):
        evaluation._record(step, {"eval/return_mean": score}, 0.1)
    evaluation.pending = 2560
    at = evaluation.state(upto=1536)
    assert (at["last"]["env_step"], at["best"]["env_step"], at["in_flight"]) == (1536, 1024, None)
    assert evaluation.state(upto=2560)["in_flight"] == 2560
    assert evaluation.state(upto=100) == {
        "last": None,
        "best": None,
        "in_flight": None,
        "seed": evaluation.seed,
    }
    assert evaluation.state()["best"]["env_step"] == 2048  # the summary's: everything so far
    evaluation.best_policy = (2048, {}, None)  # best.ckpt is never ahead of its checkpoint
    assert (
        evaluation.take_best_policy(upto=1536) is None and evaluation.take_best_policy(upto=2048)[0] == 2048
    )
    # a checkpoint written before this rule held later evaluations: they are dropped on resume
    legacy = PeriodicEvaluation(evaluation.cfg, evaluation.specs, 512, 1536, evaluation.state())
    assert legacy.best is None and legacy.last is None and legacy.state(upto=1536)["best"] is None
    legacy.close()
    resumed = PeriodicEvaluation(evaluation.cfg, evaluation.specs, 512, 1536, at)  # its record goes on
    resumed._record(2048, {"eval/return_mean": 25.0}, 0.1)
    assert (
        resumed.state(upto=2048)["best"]["env_step"] == 1024
        and resumed.state()["last"]["return_mean"] == 25.0
    )
    evaluation.close()
    resumed.close()


def test_an_evaluation_env_that_fails_ends_the_run_in_one_line_or_loses_only_its_episode(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A NaN observation in an evaluation episode: an EnvFault naming the env and its seed (the run ends
    with it, as with a training env); with env.on_error=restart the episode is left out and counted, the
    env rebuilt, and the record keeps no NaN, each evaluation saying so in a line (it was silent, and a run
    whose every evaluation failed ended with no best.ckpt and not a word)."""
    faulty = ["env=gym", "env.id=tests.faulty_env:FaultyCartPole-v0", "+env.kwargs.fault=nan_obs",
              "+env.kwargs.after=3"]  # fmt: skip
    evaluation, model = _evaluation(*faulty)
    with pytest.raises(EnvFault, match=r"^evaluation env 0 \(seed \d+\): step returned bad data "
                       r"\(observation holds NaN\); env.on_error=restart"):  # fmt: skip
        evaluation.run(model, None, 512)
    evaluation, model = _evaluation(*faulty, background=True)  # from the evaluator process, the same line
    evaluation.start(model, None, 512)
    with pytest.raises(EnvFault, match=r"^evaluation env 0 \(seed \d+\): step returned bad data"):
        evaluation.collect(wait=True)
    process = evaluation.evaluator.process
    evaluation.close()
    assert not process.is_alive()
    evaluation, model = _evaluation(*faulty, "env.on_error=restart")
    capfd.readouterr()
    metrics = evaluation.run(model, None, 512)
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "ppo-fabric: 4 of 4 evaluation episodes failed (first: evaluation env 0 (seed "
    ), lines
    assert lines[0].endswith("step returned bad data (observation holds NaN)); left out of the evaluation, "
                             "their envs rebuilt"), lines  # fmt: skip
    first = list(evaluation.scorer.envs)
    metrics = evaluation.run(model, None, 1024)
    assert metrics["eval/failed_episodes"] == 4 and "eval/return_mean" not in metrics
    assert evaluation.state() == {"last": None, "best": None, "in_flight": None, "seed": evaluation.seed}, (
        "nothing scored, nothing recorded"
    )
    assert not set(map(id, evaluation.scorer.envs)) & set(map(id, first)), "rebuilt after each evaluation"
    assert len(evaluation.scorer.envs) == 4
    # a third in a row ends the run: every evaluation left out had ended it with exit 0 and no evaluation
    with pytest.raises(EnvFault, match=r"^3 evaluations in a row had every episode fail \(env.on_error=restart "
                       r"left them out; the lines above name why\), the last at env step 1,536: the run ends"):  # fmt: skip
        evaluation.run(model, None, 1536)
    evaluation.close()


@pytest.mark.parametrize("background", [False, True], ids=["in-process", "background"])
def test_a_final_evaluation_with_nothing_ever_scored_ends_the_run(background: bool) -> None:
    """A run with fewer evaluations than three (here only its final one) whose every episode failed: the
    run ended with exit 0, no evaluation and no best.ckpt. One that scored before is a transient fault."""
    faulty = ["env=gym", "env.id=tests.faulty_env:FaultyCartPole-v0", "+env.kwargs.fault=nan_obs",
              "+env.kwargs.after=3", "env.on_error=restart", "algo.total_steps=1024"]  # fmt: skip
    evaluation, model = _evaluation(*faulty, background=background)
    with pytest.raises(EnvFault, match=r"^the final evaluation \(env step 1,024\) had every episode fail, and "
                       r"no evaluation of the run scored one"):  # fmt: skip
        if background:
            evaluation.start(model, None, 1024)
            evaluation.collect(wait=True)
        else:
            evaluation.run(model, None, 1024)
    evaluation.last = {"env_step": 512, "return_mean": 10.0}  # as a resumed record, or an earlier evaluation
    evaluation.unscored = 0
    if background:
        evaluation.start(model, None, 1024)
        metrics = evaluation.collect(wait=True)[1]
    else:
        metrics = evaluation.run(model, None, 1024)
    assert metrics["eval/failed_episodes"] == 4
    evaluation.close()


TEAMS = ["env=pettingzoo", "env.id=ppo_fabric.envs.toy_multiagent:teams_v0", "algo.rollout_steps=32",
         "algo.minibatch_size=64", "multiagent.policies={adversary:{},agent:{model:{actor_hidden:[32]}}}",
         "multiagent.policy_mapping={adversary_*:adversary,agent_*:agent}", "env.num_envs=4",
         "algo.update_epochs=2", "logger.tensorboard=false"]  # fmt: skip


def test_an_env_module_with_both_apis_is_evaluated_as_it_trains() -> None:
    """A module with `parallel_env()` and `env()` (MPE's) trains as Parallel, so its evaluation plays
    every policy's episodes rather than games against opponents (which need two seats)."""
    from ppo_fabric.policy.scorers import Games, ParallelEpisodes, scorer_for

    both = [*TEAMS, "env.id=tests.both_apis_env"]
    game = ["exp=tictactoe"]
    for overrides, kind in ((both, ParallelEpisodes), (game, Games)):
        cfg, _ = compose(overrides)
        scorer = scorer_for(cfg, policy_specs(cfg), seed=7)
        assert type(scorer) is kind, overrides
        scorer.close()


def test_an_evaluation_scores_alike_each_time_and_leaves_the_random_state() -> None:
    """Games against random and scripted players drawn anew each evaluation, and sampled actions from a
    stream of the evaluation's own: the same weights score the same at every evaluation (so a resumed
    run's record is the uninterrupted one's), and the training's torch stream is where it was."""
    from ppo_fabric.policy.scorers import score, scorer_for

    cfg, _ = compose(
        ["exp=tictactoe", "eval.opponents=[random]", "eval.episodes=8", "eval.deterministic=false"]
    )
    specs = policy_specs(cfg)
    scorer = scorer_for(cfg, specs, seed=7)
    torch.manual_seed(0)
    models = {n: ActorCritic(s.obs_space, s.action_space, s.model) for n, s in specs.items()}
    before = torch.random.get_rng_state()
    first = score(scorer, models, None)
    assert torch.equal(torch.random.get_rng_state(), before), "an evaluation moved training's random state"
    torch.rand(3)  # training goes on between evaluations
    assert score(scorer, models, None) == first


def test_an_evaluation_episode_of_an_env_without_a_time_limit_ends(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A greedy policy that never reaches the only terminal state: the evaluation (in training and in the
    evaluate tool) cuts its episodes at EVAL_MAX_EPISODE_STEPS instead of holding the run for ever, and says
    so once a run (each evaluation was 10 x 100,000 env steps, the run crawling with no word)."""
    from ppo_fabric.config import faults
    from ppo_fabric.policy.scorers import score, scorer_for

    monkeypatch.setattr(faults, "EVAL_MAX_EPISODE_STEPS", 50)
    cfg, _ = compose(["env.id=tests.endless_env:make", "eval.episodes=2"])
    specs = policy_specs(cfg)
    (spec,) = specs.values()
    model = ActorCritic(spec.obs_space, spec.action_space, spec.model)
    with torch.no_grad():
        model.head.linear.weight.zero_()
        model.head.linear.bias.copy_(torch.tensor([1.0, 0.0]))  # always action 0: never ends by itself
    scorer = scorer_for(cfg, specs, seed=3)
    capsys.readouterr()
    metrics = score(scorer, dict.fromkeys(specs, model), None)
    assert metrics["eval/length_mean"] == 50 and metrics["eval/return_mean"] == 50.0
    assert capsys.readouterr().err == (
        "ppo-fabric: 2 of 2 evaluation episodes ran 50 steps without ending and were cut there: "
        "env.id=tests.endless_env:make has no time limit of its own; set env.max_episode_steps (or eval.every=0)\n"
    )
    score(scorer, dict.fromkeys(specs, model), None)
    assert capsys.readouterr().err == ""  # once a run


def test_multiagent_evaluation_episodes_and_games_end_at_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Parallel env's episode and a turn-based game with no end of their own stop at the same cap as a
    single-agent env's (the toy games end at their episode length: 1,000 steps here, 40 moves allowed)."""
    from ppo_fabric.config import faults
    from ppo_fabric.envs.toy_multiagent import teams_v0, turn_v0
    from ppo_fabric.games.play import play_games
    from ppo_fabric.policy.evaluate import play_parallel

    class First:
        mask_width = None

        def predict(self, obs: Any, state: Any, start: Any, deterministic: bool, mask: Any) -> tuple:
            return np.asarray(0), None

    def first_legal(obs: Any, mask: Any) -> int:
        return 0 if mask is None else int(np.flatnonzero(mask)[0])

    monkeypatch.setattr(faults, "EVAL_MAX_EPISODE_STEPS", 40)
    env = teams_v0(episode_length=1000)
    groups = {"all": list(env.possible_agents)}
    _, lengths = play_parallel({"all": First()}, groups, env, 2, True, seed=0)
    assert lengths == [40, 40]
    results = play_games(lambda: turn_v0(length=1000), first_legal, first_legal, 2, seed=0)
    assert results.lengths == [40, 40]


def test_a_multiagent_run_evaluates_every_policy(tmp_path: Path) -> None:
    """A Parallel env: every policy plays its agents; each policy's mean return and all agents' together,
    whose mean is the record (the episodes replayed by hand from the final checkpoint give the same)."""
    summary = ppo_fabric.run([*TEAMS, "algo.total_steps=1024", "eval.every=512", "eval.episodes=3",
                              f"hydra.run.dir={tmp_path}"])  # fmt: skip
    rows = [r for r in read_rows(tmp_path / "evaluations.csv") if r.get("eval/return_mean")]
    assert [int(r["step"]) for r in rows] == [512, 1024]
    assert all(r["eval/adversary/return_mean"] and r["eval/agent/return_mean"] for r in rows)
    assert summary["evaluation"]["last"]["return_mean"] == pytest.approx(float(rows[-1]["eval/return_mean"]))
    from ppo_fabric.policy.evaluate import evaluate

    again = evaluate(checkpoint=str(tmp_path / "checkpoints" / "last.ckpt"), episodes=3,
                     seed=summary["evaluation"]["seed"])  # fmt: skip
    assert again["mean_return"] == pytest.approx(float(rows[-1]["eval/return_mean"]))
    assert again["policies"]["agent"]["mean_return"] == pytest.approx(
        float(rows[-1]["eval/agent/return_mean"])
    )


@pytest.mark.slow  # seconds in process (a run, or every option composed): not the unit tier
def test_a_game_is_evaluated_against_its_opponents(tmp_path: Path) -> None:
    """A turn-based game: the trained policy's games against each opponent of eval.opponents, its win rate
    against each and its score over all (the record); an opponent that cannot play here is refused in one
    line before anything trains."""
    game = ["exp=tictactoe", "algo.total_steps=1024", "logger.tensorboard=false", "eval.every=1024",
            "eval.episodes=4"]  # fmt: skip
    summary = ppo_fabric.run([*game, f"hydra.run.dir={tmp_path / 'run'}"])
    (row,) = [r for r in read_rows(tmp_path / "run" / "evaluations.csv") if r.get("eval/score")]
    assert float(row["eval/random/win_rate"]) == float(row["eval/win_rate"]), "random is the only default"
    first, second = (float(row[f"eval/random/win_rate_moving_{seat}"]) for seat in ("first", "second"))
    assert (first + second) / 2 == float(row["eval/win_rate"]), "2 games from each seat"
    assert float(row["eval/win_rate_moving_first"]) == first
    rates = [float(row[f"eval/{k}_rate"]) for k in ("win", "draw", "loss")]
    assert sum(rates) == pytest.approx(1.0) and all(r * 4 == int(r * 4) for r in rates), "4 games"
    assert summary["evaluation"]["last"] == {"env_step": 1024, "score": pytest.approx(rates[0] + rates[1] / 2),
                                             "win_rate": rates[0]}  # fmt: skip
    with pytest.raises(
        ValueError, match=r"^eval.opponents: opponent=win_or_block plays connect_four_v3 only"
    ):
        ppo_fabric.run([*game, "eval.opponents=[random,win_or_block]", f"hydra.run.dir={tmp_path / 'bad'}"])


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1", "MountainCarContinuous-v0"])
def test_the_greedy_numpy_actor_takes_predicts_deterministic_actions(env_id: str) -> None:
    """What the evaluation steps with: NumPy on the parameters, the same actions as `predict` (the mode,
    observations normalised by the frozen statistics, Box actions clipped); None for a recurrent policy."""
    torch.manual_seed(1)
    env = gym.make(env_id)
    model_cfg = OmegaConf.create({"encoder": "auto", "actor_hidden": [16, 16], "critic_hidden": [16],
                                  "activation": "tanh"})  # fmt: skip
    model = ActorCritic(env.observation_space, env.action_space, model_cfg)
    if isinstance(env.action_space, gym.spaces.Box):
        with torch.no_grad():
            model.head.mean.bias.fill_(3.0)  # past the bounds: clipped
    dim = env.observation_space.shape[0]
    stats = {"mean": torch.full((dim,), 0.5, dtype=torch.float64), "var": torch.full((dim,), 4.0, dtype=torch.float64),
             "count": torch.tensor(100.0, dtype=torch.float64)}  # fmt: skip
    policy = Policy(model, env.observation_space, env.action_space, obs_normalization=stats)
    batch = np.random.default_rng(0).normal(size=(64, dim)).astype(np.float32)
    expected, _ = policy.predict(batch, None, None, True)
    np.testing.assert_allclose(policy.greedy_actor()(batch), expected, rtol=1e-5, atol=1e-5)
    lstm = OmegaConf.merge(
        model_cfg, {"lstm": {"hidden_size": 8, "num_layers": 1, "shared": False, "seq_len": 4}}
    )
    recurrent = ActorCritic(env.observation_space, env.action_space, lstm)
    assert Policy(recurrent, env.observation_space, env.action_space).greedy_actor() is None


def test_held_out_players_are_reported_apart_and_choose_nothing() -> None:
    """The players a run never trains against are kept out of the record (`eval/score`, which picks
    best.ckpt) and reported on their own (`eval/held_out/*`); a sparring partner is not held out, and
    when every opponent is held out the record keeps them all."""
    from ppo_fabric.games.play import RandomPlayer, aec_env_factory
    from ppo_fabric.policy.scorers import HELD_OUT, Games, held_out

    defaults = ["random", "win_or_block", *HELD_OUT]
    plain = OmegaConf.create({"selfplay": {"scripted": "win_or_block", "scripted_prob": 0.2}})
    assert held_out(plain, defaults) == set(HELD_OUT)
    league = OmegaConf.create({"selfplay": {"scripted": ["win_or_block", "search:1"], "scripted_prob": 0.4}})
    assert held_out(league, defaults) == {"win_or_block:centre", "win_or_block:careful"}
    off = OmegaConf.create({"selfplay": {"scripted": "search:1", "scripted_prob": 0.0}})
    assert "search:1" in held_out(off, defaults)
    assert held_out(plain, ["search:1"]) == set()  # nothing else to keep a record on

    games = Games.__new__(Games)  # its opponents by hand: random players under two labels
    games.games, games.seed = 6, 0
    games.factory = aec_env_factory("pettingzoo.classic.tictactoe_v3")
    games._opponents = lambda: [("random", RandomPlayer(1)), ("search:1", RandomPlayer(2))]  # type: ignore[method-assign]
    games.held_out = {"search:1"}
    metrics = games.play(RandomPlayer(3))
    assert metrics["eval/win_rate"] == metrics["eval/random/win_rate"]
    assert metrics["eval/held_out/win_rate"] == metrics["eval/search:1/win_rate"]
    assert 0.0 <= metrics["eval/held_out/score"] <= 1.0 and "eval/held_out/draw_rate" not in metrics


def test_one_opponent_may_be_named_without_a_list() -> None:
    """`eval.opponents=random` was read a letter at a time (`opponent=r is unknown; choose random, ...`)."""
    from ppo_fabric.policy.scorers import check_opponents

    assert check_opponents(compose(["exp=connect_four", "eval.opponents=random"])[0]) == ["random"]


def test_evaluation_episodes_differ_across_training_seeds() -> None:
    """`seed + 1000003 + k` gave seeds 43 and 44 nine of their ten evaluation episodes in common: a table
    over seeds 1-10 drew on 19 starting states, not 100. Each run's seeds are now its own (below 2**31, as
    some simulators need), the same for a seed every time, and apart from its training envs'."""
    firsts = [evaluation_seed(seed) for seed in range(1, 11)]
    episodes = [{first + k for k in range(1000)} for first in firsts]
    assert sum(map(len, episodes)) == len(set().union(*episodes)), "two runs share an evaluation episode"
    assert all(first >= 0 and first + 1000 < 2**31 for first in firsts)
    assert firsts == [evaluation_seed(seed) for seed in range(1, 11)]
    assert not episodes[0] & set(env_seeds(1, 0, 1024))
