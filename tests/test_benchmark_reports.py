"""The resumable learning reports: a run trained by one benchmark is reported by another instead of being
trained twice, and SB3 runs stopped at the threshold or the wall cap never pass for a final return."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ppo_fabric.runs.metrics_file import read_rows
from tests.conftest import benchmark_script


def _tts_run(overrides: list[str], **extra: object) -> dict:
    return {"overrides": overrides, "commit": "abc1234", "total_env_steps": 1_001_472, "final_mean_return": 1800.0,
            "wall_seconds": 140.0, "sps": 7100.0, "curve": [[2048, 1.0, -300.0], [1_001_472, 140.0, 1800.0]],
            **extra}  # fmt: skip


def test_learning_takes_a_run_with_the_same_overrides(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    learning = benchmark_script(monkeypatch, "learning")
    task = learning.SUITES["mujoco"][1]  # Hopper-v5
    layouts = learning.common.LAYOUTS

    def ours(seed: int = 2, steps: int | None = None, evaluate: bool = False) -> list[str]:
        return learning.common.overrides(task.overrides, layouts["pipelined"], seed, steps, evaluate)

    same = [*task.overrides, *layouts["pipelined"], "seed=2"]
    assert ours() == same
    report = tmp_path / "time_to_score.json"
    report.write_text(json.dumps({"runs": [
        _tts_run([*task.overrides, *layouts["coupled"], "seed=2"]),  # another variant
        _tts_run([*task.overrides, *layouts["pipelined"], "seed=3"]),  # another seed
        _tts_run(same, workload="hopper", load=[1.0, 1.0]),
    ]}))  # fmt: skip
    r = learning.reused(ours(), [report, tmp_path / "missing.json"], False)
    assert r is not None and r["run_by"] == "time_to_score.json" and "workload" not in r and "load" not in r
    assert r["final_mean_return"] == 1800.0 and r["overrides"] == same and r["commit"] == "abc1234"
    assert learning.reused(ours(seed=1), [report], False) is None
    assert learning.reused(ours(steps=50_000), [report], False) is None  # another budget
    report.write_text(json.dumps({"runs": [_tts_run(same, stopped="threshold")]}))
    assert learning.reused(ours(), [report], False) is None  # never reached its budget
    sitting = tmp_path / "s2" / "learning_mujoco.json"  # a --seed-list sitting of this benchmark, gathered
    sitting.parent.mkdir()
    sitting.write_text(json.dumps({"runs": [_tts_run(same)]}))
    r = learning.reused(ours(), [sitting], False)
    assert r is not None and r["sitting"] == str(sitting) and "run_by" not in r
    # an evaluated sitting (--eval): gathered with its evaluations; a run that was not evaluated is not
    evaluated = ours(evaluate=True)
    assert evaluated == [*learning.common.EVALUATION, *same]
    evals = {"final_eval_return": 2100.0, "best_eval_return": 2200.0, "eval_curve": [[1_001_472, 140.0, 2100.0]],
             "final_eval": {"eval/return_mean": 2100.0}}  # fmt: skip
    sitting.write_text(json.dumps({"runs": [_tts_run(same), _tts_run(evaluated, **evals)]}))
    r = learning.reused(evaluated, [sitting], True)
    assert r is not None and r["overrides"] == evaluated and {k: r[k] for k in evals} == evals
    assert "final_eval_return" not in learning.reused(ours(), [sitting], False)
    sitting.write_text(json.dumps({"runs": [_tts_run(evaluated)]}))  # its evaluations lost: train it again
    assert learning.reused(evaluated, [sitting], True) is None
    # time_to_score's records before 2026-12 put the evaluation's overrides last: the same run
    report.write_text(json.dumps({"runs": [_tts_run([*same, *learning.common.EVALUATION], **evals)]}))
    assert learning.reused(evaluated, [report], True) is not None


def test_a_suite_scored_by_evaluation_ranks_its_metric_and_shows_the_others(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The games suite: a run's score is `eval/score` from its evaluations.csv, every `eval/*` metric of the
    last evaluation is kept, a task's own evaluation settings win over the benchmark's, and the report ranks
    the score (to 3 decimals) and lists the task's further metrics."""
    learning = benchmark_script(monkeypatch, "learning")
    csv = tmp_path / "evaluations.csv"
    csv.write_text("step,time/wall_s,time/eval_s,eval/score,eval/random/win_rate,eval/search:1/win_rate\n"
                   "1000,5.0,0.5,0.40,0.7,\n2000,9.0,0.25,0.55,0.9,0.25\n")  # fmt: skip
    curve = learning.common.evaluation_curve(csv, "eval/score")
    assert curve == [[1000, 5.0, 0.40, 0.5], [2000, 9.0, 0.55, 0.25]]
    final = learning.common.final_evaluation(csv)
    assert final == {"eval/score": 0.55, "eval/random/win_rate": 0.9, "eval/search:1/win_rate": 0.25}
    seen: list[list[str]] = []

    def run_once(overrides: list[str], curve: bool, eval_key: str, run_dir: Path | None) -> dict:
        seen.append(overrides)
        assert run_dir is None, "a temporary folder unless --keep-runs"
        assert eval_key == "eval/score"
        return {"total_env_steps": 2000, "final_mean_return": 0.0, "wall_seconds": 9.0, "sps": 222.0,
                "curve": [], "eval_curve": curve_of[eval_key], "final_eval": final}  # fmt: skip

    curve_of = {"eval/score": curve}
    monkeypatch.setattr(learning, "run_once", run_once)
    task = learning.task_named("connect_four_v3")
    overrides = learning.common.overrides(
        task.overrides, learning.variants_of("games")["coupled"], 1, None, True
    )
    key = {"env": task.env, "variant": "coupled", "seed": 1}
    r = {**key, **learning.run_record(task, overrides, **key)}  # the sweep puts the key first
    (overrides,) = seen
    assert overrides.index("eval.episodes=100") > overrides.index("eval.episodes=10"), "the task's own wins"
    assert r["final_eval_return"] == 0.55 and r["best_eval_return"] == 0.55 and r["final_eval"] == final
    r2 = {**r, "seed": 2, "final_eval_return": 0.35, "final_eval": {"eval/search:1/win_rate": 0.75}}
    text = learning.markdown("games", {"runs": [r, r2], "machine": learning.common.machine()}, "cmd")
    assert "| connect_four_v3 | 0.450 [0.350, 0.550] (2) |" in text, (
        "the IQM of the two scores, to 3 decimals"
    )
    assert "| connect_four_v3 | coupled | `eval/search:1/win_rate` | 0.500 ± 0.354 (2) |" in text
    assert "| connect_four_v3 | coupled | `eval/random/win_rate` | 0.900 (1) |" in text


def test_a_kept_learning_run_has_a_folder_of_its_own_and_reports_the_whole_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`--keep-runs DIR`: each (env, variant, seed) trains in a folder of its own under DIR, which the same
    command finds again (run_once resumes it), with a checkpoint every 10 minutes; the record's wall time
    and rate are the whole run's, over every sitting, not the last sitting's."""
    learning = benchmark_script(monkeypatch, "learning")
    given: list[tuple[list[str], Path | None]] = []

    def run_once(overrides: list[str], curve: bool, eval_key: str, run_dir: Path | None) -> dict:
        given.append((overrides, run_dir))
        return {"total_env_steps": 6000, "final_mean_return": 0.0, "wall_seconds": 20.0, "sps": 150.0,
                "total_wall_seconds": 60.0, "curve": []}  # fmt: skip

    monkeypatch.setattr(learning, "run_once", run_once)
    task = learning.task_named("CartPole-v1/velocities-zeroed")
    key = {"env": task.env, "variant": "lstm", "seed": 3}
    base = learning.common.overrides(task.overrides, learning.variants_of("recurrent")["lstm"], 3, None, True)
    r = learning.run_record(task, base, tmp_path, **key)
    ((overrides, run_dir),) = given
    assert run_dir == tmp_path / "CartPole-v1_velocities-zeroed_lstm_seed3"
    assert overrides[-1] == "checkpoint.every_minutes=10" and r["overrides"] == overrides
    assert (r["wall_seconds"], r["sps"]) == (60.0, 100.0), "the whole run's, not the last sitting's"
    learning.run_record(task, base, **key)
    assert given[-1][1] is None and "checkpoint.every_minutes=10" not in given[-1][0]


def test_stopped_sb3_runs_show_no_final_return(monkeypatch: pytest.MonkeyPatch) -> None:
    tts = benchmark_script(monkeypatch, "time_to_score")

    def run(variant: str, seed: int, final: float, wall_at: float | None, **extra: object) -> dict:
        return {"workload": "halfcheetah", "variant": variant, "seed": seed, "commit": "abc1234",
                "final_mean_return": final, "best_mean_return": final, "wall_at_threshold": wall_at,
                "step_at_threshold": None if wall_at is None else 400_000, "wall_seconds": 300.0, "sps": 700.0,
                "load": [1.0, 1.1], **extra}  # fmt: skip

    runs = [run("pipelined", 1, 1800.0, 60.0), run("sb3", 1, 1510.0, 290.0, stopped="threshold"),
            run("sb3", 2, 900.0, None, stopped="wall cap")]  # fmt: skip
    md = tts.markdown({"runs": runs, "machine": {"cpu": "x", "cores": 2, "torch": "t"}}, "cmd")
    sb3 = next(line for line in md.splitlines() if line.startswith("| sb3 "))
    cells = [c.strip() for c in sb3.strip("|").split("|")]
    assert cells[2] == "290 (1/2)" and cells[4] == cells[5] == "stopped"
    assert "sb3 seed 1 at 300 s (threshold); sb3 seed 2 at 300 s (wall cap)" in md
    capped = tts.markdown({"runs": runs[2:], "machine": {"cpu": "x", "cores": 2, "torch": "t"}}, "cmd")
    assert "| sb3 | 2 | > 300 (cap) | never |" in capped
    pipelined = next(line for line in md.splitlines() if line.startswith("| pipelined "))
    assert "1800" in pipelined


def test_a_run_stopped_at_its_timeout_reports_its_last_logged_update(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    common = benchmark_script(monkeypatch, "common")
    csv = tmp_path / "metrics.csv"
    rows = [  # step, time/wall_s, time/sps, time/collect_s, time/train_s, rollout/return_mean20
        (1000, 10.0, 100.0, 4.0, 6.0, ""), (2000, 20.0, 100.0, 4.0, 6.0, "-20.5"),
        (4000, 30.0, 133.3, 4.0, 6.0, ""), (6000, 40.0, 150.0, 4.0, 6.0, "-19.0"),
    ]  # fmt: skip
    csv.write_text("step,time/wall_s,time/sps,time/collect_s,time/train_s,rollout/return_mean20\n"
                   + "".join(",".join(map(str, r)) + "\n" for r in rows))  # fmt: skip
    s = common.stopped_summary(csv, 45.0)
    assert (s["steps_this_run"], s["sps"], s["wall_seconds"], s["stopped_after_s"]) == (
        6000,
        150.0,
        40.0,
        45.0,
    )
    assert s["time_split"] == {"collect": 16.0, "train": 24.0} and s["final_mean_return"] == -19.0
    # the second half of 40 s of logged wall time: steps 2000 -> 6000 over 20 s -> 30 s -> 40 s
    assert common.steady_sps(csv) == pytest.approx((6000 - 2000) / (40.0 - 20.0))
    csv.write_text("step,time/wall_s,time/sps\n1000,10.0,100.0\n")
    assert common.steady_sps(csv) is None
    with pytest.raises(SystemExit, match="before it logged an update"):
        common.stopped_summary(tmp_path / "none.csv", 45.0)


def test_atari_to_score_runs_gpu_strategies_layout_and_reports_the_threshold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ats = benchmark_script(monkeypatch, "atari_to_score")
    gs = benchmark_script(monkeypatch, "gpu_strategies")
    run = ats.overrides("decoupled-envpool-3", "ALE/Breakout-v5", 4_500_000, 2, False, ["algo.lr=1e-4"])
    _, layout, _ = gs.variants(1, [3], False, (3,))["decoupled-envpool-3"]
    assert run == [*gs.WORKLOADS["atari"][1], *layout, "env.id=ALE/Breakout-v5", "algo.total_steps=4500000",
                   "seed=2", "algo.lr=1e-4"]  # fmt: skip
    # CPU players step 8 sync envs each, as gpu_strategies' rows do; a dry run puts the trainer on the CPU
    cpu = ats.overrides("decoupled-gpu-14", "ALE/Pong-v5", 10, 1, True, [])
    assert "env.num_envs=8" in cpu and "algo.players=14" in cpu and "algo.trainer_device=cpu" in cpu
    with pytest.raises(SystemExit, match="unknown layout 'nope'"):
        ats.overrides("nope", "ALE/Pong-v5", 10, 1, False, [])
    summary = {"curve": [[1000, 10.0, -21.0], [2000, 20.0, 18.5], [3000, 30.0, 17.0]], "total_env_steps": 3000,
               "final_mean_return": 17.0, "wall_seconds": 30.0, "sps": 100.0, "sps_steady": 110.0,
               "process_seconds": 75.0, "time_split": {"collect": 20.0, "train": 9.0}}  # fmt: skip
    figures = ats.common.threshold_figures
    row = {"env_id": "ALE/Pong-v5", "layout": "coupled-gpu", "seed": 1, "overrides": ["x"], "commit": "abc1234",
           "gpu": "H100", **figures(summary, 18.0), **ats.record(summary)}  # fmt: skip
    assert (row["step_at_threshold"], row["wall_at_threshold"], row["best_mean_return"]) == (2000, 20.0, 18.5)
    md = ats.markdown({"runs": [row], "machine": {"cpu": "x", "cores": 16, "torch": "t", "python": "3"},
                       "gpus": [{"name": "H100"}], "command": "cmd"})  # fmt: skip
    assert (
        "| ALE/Pong-v5 | coupled-gpu | 1 | 3,000 | 18 | 2,000 | 20 | 17.0 | 18.5 | off | 110 | 45 | H100 | abc1234 |"
        in md
    )
    never = ats.markdown({"runs": [{**row, **figures({**summary, "curve": summary["curve"][:1]}, 18.0)}],
                          "machine": {"cpu": "x", "cores": 2, "torch": "t", "python": "3"}, "command": "c"})  # fmt: skip
    assert "| 18 | never | never |" in never and "GPU none (dry run)" in never
    # --eval: the row shows the return of the run's last evaluation
    evaluated = figures({**summary, "eval_curve": [[1000, 10.0, 5.0, 1.0], [3000, 30.0, 19.5, 1.0]]}, 18.0)
    md = ats.markdown({"runs": [{**row, **evaluated}], "machine": {"cpu": "x", "cores": 2, "torch": "t",
                       "python": "3"}, "command": "c"})  # fmt: skip
    assert "| 17.0 | 18.5 | 19.5 | 110 |" in md
    # a run continued over commands (--run-dir): the whole run's wall time, the last command's start-up
    whole = {**summary, "total_wall_seconds": 90.0, "wall_seconds": 50.0}
    resumed = {**figures(whole, 18.0), **ats.record(whole, commands=2)}
    assert (resumed["wall_seconds"], resumed["command_wall_seconds"], resumed["commands"]) == (90.0, 50.0, 2)
    md = ats.markdown({"runs": [{**row, **resumed}], "machine": {"cpu": "x", "cores": 16, "torch": "t",
                       "python": "3"}, "command": "cmd"})  # fmt: skip
    assert "| coupled-gpu (2 commands, resumed) | 1 |" in md and "| 110 | 25 | H100 | abc1234 |" in md
    # a labelled variant of the layout is its own row; a rerun with the same label replaces it, and a row
    # written before labels existed counts as unlabelled
    labelled = {**row, "label": "rollout32", "overrides": ["y"]}
    key = ("env_id", "layout", "label", "seed")

    def rerun(runs: list[dict], new: dict) -> list[dict]:
        report = {"runs": list(runs)}
        ats.common.sweep(report, [{k: new.get(k, "") for k in key}], True, lambda **_: new, lambda _: None)
        return report["runs"]

    runs = rerun([row], labelled)
    assert runs == [row, labelled] and rerun(runs, {**labelled, "commit": "def5678"})[0] == row
    assert rerun(runs, {**row, "label": ""}) == [labelled, {**row, "label": ""}]
    md = ats.markdown({"runs": runs, "machine": {"cpu": "x", "cores": 16, "torch": "t", "python": "3"},
                       "gpus": [{"name": "H100"}], "command": "cmd"})  # fmt: skip
    assert (
        "| ALE/Pong-v5 | coupled-gpu rollout32 | 1 |" in md
        and "Overrides of `coupled-gpu rollout32`: `y`" in md
    )


@pytest.mark.slow
def test_a_kept_run_continues_in_the_next_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`run_once(run_dir=...)`: the same call after a command was stopped resumes the run from its
    checkpoint (two real processes); the figures are the whole run's, the wall split by command."""
    common = benchmark_script(monkeypatch, "common")
    monkeypatch.syspath_prepend(str(Path(common.__file__).parent))  # run_once imports job_trace beside it
    run_dir = tmp_path / "run"
    overrides = ["algo.total_steps=1024", "algo.update_epochs=1", "checkpoint.every=1", "checkpoint.keep=0"]
    first = common.run_once(overrides, curve=True, run_dir=run_dir)
    assert first["total_env_steps"] == 1024 and first["total_wall_seconds"] == first["wall_seconds"]
    # as a command stopped after its second update leaves it: nothing written after that update
    for path in (run_dir / "checkpoints").glob("*.ckpt"):
        if not path.name.startswith("step_") or int(path.name.split("_")[1]) > 512:
            path.unlink()
    (run_dir / "summary.json").unlink()
    lines = (run_dir / "metrics.csv").read_text().splitlines(keepends=True)
    (run_dir / "metrics.csv").write_text("".join(lines[:3]))  # the header, the rows of steps 256 and 512
    wall_512 = float(read_rows(run_dir / "metrics.csv")[-1]["time/wall_s"])
    second = common.run_once(overrides, curve=True, run_dir=run_dir)
    assert second["resumed_from"].endswith(".ckpt") and "step_000000000512_" in second["resumed_from"]
    assert second["total_env_steps"] == 1024 and second["steps_this_run"] == 512
    assert second["total_wall_seconds"] > second["wall_seconds"] > 0
    assert [p[0] for p in second["curve"]] == [p[0] for p in first["curve"]]  # one timeline, not two
    assert second["total_wall_seconds"] == pytest.approx(wall_512 + second["wall_seconds"], abs=0.05)
    figures = common.threshold_figures(second, 475.0)
    assert figures["wall_seconds"] == second["total_wall_seconds"]
    # stopped by its timeout instead, the command's figures come from metrics.csv: the same split
    stopped = common.stopped_summary(run_dir / "metrics.csv", 60.0)
    assert stopped["wall_seconds"] == pytest.approx(second["total_wall_seconds"], abs=0.5)


def test_overrides_that_set_the_same_are_the_same_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Older time_to_score records end with the evaluation's overrides, learning's begin with them: the same
    run; without evaluation, or with another value anywhere, not; a key set twice keeps its last value."""
    common = benchmark_script(monkeypatch, "common")
    ev, base = common.EVALUATION, ["exp=mujoco", "strategy=coupled", "seed=1"]
    assert common.effective([*base, *ev]) == common.effective([*ev, *base])
    assert common.effective([*base, *ev]) != common.effective([*ev, *base[:2], "seed=2"])
    assert common.effective(base) != common.effective([*ev, *base])  # that run was not evaluated
    assert common.effective(["eval.episodes=10", "eval.episodes=100"]) == {"eval.episodes": "100"}
    # a run kept over sittings (--keep-runs: checkpoints every 10 minutes) is the same run: it was never reused
    assert common.effective([*base, "checkpoint.every_minutes=10"]) == common.effective(base)


def test_a_report_of_another_scripts_format_is_replaced_not_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`make bench`'s fast_recipe and cartpole_solve sittings write where retired scripts wrote (no `runs`,
    or runs keyed by `layout`): they ended in KeyError; they start a new report, with a line."""
    common = benchmark_script(monkeypatch, "common")
    keys = ("workload", "variant", "seed")
    mine = {"runs": [{"workload": "cartpole", "variant": "coupled", "seed": 1}]}
    for name, old in (("a", {"rows": []}), ("b", {"runs": [{"layout": "coupled", "seed": 1}]}), ("c", mine)):
        (tmp_path / f"{name}.json").write_text(json.dumps(old))
        report = common.load_report(tmp_path / f"{name}.json", {"runs": []}, keys)
        assert report == (mine if name == "c" else {"runs": []})
    assert capsys.readouterr().out.count("holds another script's report") == 2
    assert common.load_report(tmp_path / "none.json", {"runs": [], "x": 1}, keys) == {"runs": [], "x": 1}


def test_the_sb3_baseline_refuses_env_options_it_does_not_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SB3 child builds the plain env: a workload that hides velocities, adds noise, repeats actions or
    preprocesses frames would have SB3 train on another env than ppo-fabric's, unsaid."""
    sb3 = benchmark_script(monkeypatch, "sb3_baseline")
    assert sb3.flat_workload(["env=lunarlander"])["env.id"] == "LunarLander-v3"
    with pytest.raises(SystemExit, match="cannot run env.mask_velocity=True"):
        sb3.flat_workload(["env.mask_velocity=true"])


def test_reports_name_each_runs_machine_and_a_whole_runs_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    """A report gathers sittings: its Machine line names the CPUs its runs recorded, not only the last
    sitting's; a run trained over several commands reports its whole rate beside its whole wall time (the
    rate was the last command's alone)."""
    common = benchmark_script(monkeypatch, "common")
    m = {"cpu": "Xeon", "cores": 2, "torch": "2.13"}
    assert common.machines_line([{"machine": "EPYC"}, {"machine": "Xeon"}, {}], m) == (
        "EPYC, Xeon (the runs' own; 1 runs from before runs named theirs); the last sitting on 2 cores, torch 2.13"
    )
    assert common.machines_line([{}], m).startswith("Xeon (the last sitting's)")
    summary = {"curve": [[512, 10.0, 1.0], [1024, 30.0, 2.0]], "total_env_steps": 1024, "final_mean_return": 2.0,
               "wall_seconds": 20.0, "total_wall_seconds": 32.0, "sps": 25.6}  # fmt: skip
    figures = common.threshold_figures(summary, 100.0)
    assert figures["wall_seconds"] == 32.0 and figures["sps"] == 1024 / 32.0


def test_a_sitting_with_nothing_to_run_rewrites_a_report_only_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`sweep` with every cell done runs nothing; `time_to_score` re-renders its report then, `learning` does not
    (its report records the machine and command of the last sitting that ran something)."""
    common = benchmark_script(monkeypatch, "common")
    report = {"runs": [{"env": "e", "variant": "v", "seed": 1, "final_mean_return": 1.0}]}
    cells = [{"env": "e", "variant": "v", "seed": 1}]
    for rerender, writes in ((True, 1), (False, 0)):
        written: list[dict] = []
        common.sweep(report, cells, False, lambda **_: pytest.fail("ran"), written.append, rerender=rerender)
        assert len(written) == writes


def test_a_sweeps_arguments_refuse_what_would_run_nothing_and_its_lines_say_the_headline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--seeds 0` ran nothing and exited 0, `--steps 0` trained the recipe's whole budget; each run's line names
    its seed and, where the report has a threshold, the wall time to it."""
    import argparse

    common = benchmark_script(monkeypatch, "common")
    parser = argparse.ArgumentParser()
    common.sweep_arguments(parser, seeds=3)
    for bad in (["--seeds", "0"], ["--steps", "0"], ["--seeds", "-1"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    assert parser.parse_args(["--seeds", "2"]).seeds == 2
    cell = {"workload": "cartpole", "variant": "coupled", "seed": 2}
    r = {"threshold": 475.0, "wall_at_threshold": 31.4, "final_mean_return": 500.0, "wall_seconds": 60.2}
    assert common.progress_line(cell, r) == "cartpole coupled seed 2: wall at 475: 31 s, final 500.0, 60 s"
    r |= {"wall_at_threshold": None}
    assert common.progress_line(cell, r) == "cartpole coupled seed 2: wall at 475: never, final 500.0, 60 s"
    assert common.progress_line(cell, r | {"threshold": None}) == "cartpole coupled seed 2: final 500.0, 60 s"


@pytest.mark.parametrize(
    ("script", "argv", "says"),
    [
        ("time_to_score", ["--name", "../elsewhere"], "a file name without a directory"),
        ("checkouts_ab", ["--name", "a/b", "."], "a file name without a directory"),
        ("checkouts_ab", ["/nonexistent/checkout"], "not a checkout of ppo-fabric"),
        ("update_layers", ["--exps", "nope"], "invalid choice: 'nope'"),
        ("update_layers", ["--updates", "0"], "must be 1 or more"),
    ],
)
def test_the_benchmark_tools_refuse_bad_arguments_in_one_usage_line(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    script: str,
    argv: list[str],
    says: str,
) -> None:
    """Each was a traceback, or worse: `--name ../x` wrote the report outside `--out`, a missing checkout
    failed after the other checkouts' runs, an unknown recipe failed at the first run."""
    module = benchmark_script(monkeypatch, script)
    monkeypatch.setattr("sys.argv", [f"{script}.py", *argv])
    with pytest.raises(SystemExit) as ended:
        module.main()
    assert ended.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert says in err[-1], err
