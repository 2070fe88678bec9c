"""benchmarks/stats.py against values worked by hand: the interquartile mean (rliable's, scipy's trim_mean at
0.25: floor(n/4) cut from each end), the probability of improvement (Mann-Whitney U / nm, ties half), the
stratified bootstrap's intervals and performance profiles; and the reports' table, plot and command."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import benchmark_script

REPS = 200


@pytest.fixture
def st(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    return benchmark_script(monkeypatch, "stats")


def test_iqm_is_the_mean_of_the_middle_half(st) -> None:  # type: ignore[no-untyped-def]
    assert st.iqm([8, 1, 7, 2, 6, 3, 5, 4]) == pytest.approx((3 + 4 + 5 + 6) / 4)  # n = 8: cut 2 each end
    assert st.iqm([[1, 2], [3, 100]]) == pytest.approx((2 + 3) / 2)  # every value pooled
    assert st.iqm([5.0]) == 5.0


def test_iqm_rounds_a_fractional_cut_down(st) -> None:  # type: ignore[no-untyped-def]
    """k = floor(n/4) from each end, never interpolated: n = 10 keeps the middle 6 (interpolating 2.5 cut
    values, as a 'weighted' IQM would, gives (0.5*4 + 8 + 16 + 32 + 64 + 0.5*128) / 5 = 37.2 instead)."""
    powers = [2**i for i in range(10)]  # 1, 2, 4, ..., 512
    assert st.iqm(powers) == pytest.approx((4 + 8 + 16 + 32 + 64 + 128) / 6)  # 42
    assert st.iqm([100, 1, 2, 3, 4]) == pytest.approx(3.0)  # n = 5: floor(1.25) = 1, middle 3
    assert st.iqm([1, 2, 3, 4, 5, 100]) == pytest.approx(3.5)  # n = 6: floor(1.5) = 1, middle 4
    assert st.iqm([1, 2, 9]) == pytest.approx(4.0)  # n = 3: floor(0.75) = 0, the plain mean
    scipy_stats = pytest.importorskip("scipy.stats")
    for n in range(1, 13):
        x = np.random.default_rng(n).normal(size=n) ** 3
        assert st.iqm(x) == pytest.approx(scipy_stats.trim_mean(x, 0.25))


def test_probability_of_improvement_counts_pairs_and_half_ties(st) -> None:  # type: ignore[no-untyped-def]
    """x = [1, 2, 3], y = [2, 2, 4]: x=1 beats nothing; x=2 ties both 2s (1/2 + 1/2); x=3 beats both 2s.
    U = 0 + 1 + 2 = 3 of 9 pairs."""
    x, y = [1, 2, 3], [2, 2, 4]
    p, low, high = st.probability_of_improvement({"a": x}, {"a": y}, reps=REPS)
    assert p == pytest.approx(3 / 9) and 0 <= low <= p <= high <= 1
    converse = st.probability_of_improvement({"a": y}, {"a": x}, reps=REPS)[0]
    assert converse == pytest.approx(6 / 9)  # the two add up to 1
    # averaged over tasks: task b ties its only pair (1/2)
    two = st.probability_of_improvement({"a": x, "b": [5]}, {"a": y, "b": [5]}, reps=REPS)
    assert two[0] == pytest.approx((1 / 3 + 1 / 2) / 2)
    same, low, high = st.probability_of_improvement({"a": x}, {"a": x}, reps=REPS)
    assert same == 0.5 and low < 0.5 < high  # equal runs: P is 1/2, and resampling both can tip it either way
    assert st.probability_of_improvement({"a": [2, 2]}, {"a": [2, 2, 2]}, reps=REPS) == (0.5, 0.5, 0.5)
    assert st.probability_of_improvement({"a": [3, 4]}, {"a": [1, 2]}, reps=REPS) == (1.0, 1.0, 1.0)
    scipy_stats = pytest.importorskip("scipy.stats")
    u = scipy_stats.mannwhitneyu(x, y, alternative="greater").statistic
    assert p == pytest.approx(u / 9)
    with pytest.raises(ValueError, match="different tasks"):
        st.probability_of_improvement({"a": x}, {"b": y})


def test_a_bootstrap_interval_collapses_when_every_run_is_equal(st) -> None:  # type: ignore[no-untyped-def]
    assert st.stratified_bootstrap_ci({"a": [3.0] * 4}, reps=REPS) == (3.0, 3.0, 3.0)
    # stratified: each resample keeps each task's own runs (4 zeros, 4 tens), so the pooled mean is always 5
    split = {"a": [0.0] * 4, "b": [10.0] * 4}
    assert st.stratified_bootstrap_ci(split, reps=REPS) == (5.0, 5.0, 5.0)  # the IQM of 0, 0, 10, 10
    point, _, _ = st.stratified_bootstrap_ci({"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]}, reps=REPS)
    assert point == pytest.approx(4.5)  # the default statistic: IQM of every run pooled


def test_an_interval_holds_its_point_and_widens_with_fewer_runs(st) -> None:  # type: ignore[no-untyped-def]
    runs = np.random.default_rng(1).normal(100.0, 20.0, size=40)
    widths = {}
    for n in (5, 40):
        point, low, high = st.stratified_bootstrap_ci({"a": runs[:n]}, reps=REPS)
        assert point == pytest.approx(st.iqm(runs[:n])) and low < point < high
        widths[n] = high - low
    assert widths[5] > 1.5 * widths[40]
    _, low, high = st.stratified_bootstrap_ci({"a": runs}, reps=REPS, level=0.5)
    assert high - low < widths[40]  # a 50% interval is narrower than the 95% one


def test_the_same_seed_gives_the_same_interval(st) -> None:  # type: ignore[no-untyped-def]
    x = {"a": [1.0, 5.0, 2.0, 8.0], "b": [3.0, 3.5, 9.0]}
    y = {"a": [2.0, 4.0, 6.0], "b": [1.0, 7.0, 2.0, 2.5]}
    assert st.stratified_bootstrap_ci(x, reps=REPS, seed=3) == st.stratified_bootstrap_ci(
        x, reps=REPS, seed=3
    )
    assert st.stratified_bootstrap_ci(x, reps=REPS, seed=3) != st.stratified_bootstrap_ci(
        x, reps=REPS, seed=4
    )
    same = st.probability_of_improvement(x, y, reps=REPS, seed=7)
    assert same == st.probability_of_improvement(x, y, reps=REPS, seed=7)
    # the order the tasks are given in does not change the draws
    assert st.stratified_bootstrap_ci(dict(reversed(x.items())), reps=REPS, seed=3) == (
        st.stratified_bootstrap_ci(x, reps=REPS, seed=3)
    )


def test_performance_profile_is_the_fraction_of_runs_above_tau(st) -> None:  # type: ignore[no-untyped-def]
    profile = st._profile_statistic(np.array([0, 1, 2.5, 4.0]))
    assert profile({"a": np.array([[1.0, 2, 3, 4]])})[0].tolist() == [1.0, 0.75, 0.5, 0.0]  # strictly above


def test_bad_scores_are_refused(st) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="no runs"):
        st.iqm([])
    with pytest.raises(ValueError, match="NaN"):
        st.stratified_bootstrap_ci({"a": [1.0, float("nan")]}, reps=REPS)
    with pytest.raises(ValueError, match="level"):
        st.stratified_bootstrap_ci({"a": [1.0]}, level=95)


def test_profiles_plot_to_a_png(st, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """One panel per env, a variant with a single run included; nothing written without a final score."""
    path = tmp_path / "profiles.png"
    assert st.plot_profiles(_runs(), "env", path, reps=50)
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000
    sb3 = [r for r in _runs() if r["variant"] == "sb3"]  # stopped: no final return
    assert not st.plot_profiles(sb3, "env", tmp_path / "none.png") and not (tmp_path / "none.png").exists()


def _runs() -> list[dict]:
    def run(env: str, variant: str, seed: int, final: float | None, **extra: object) -> dict:
        return {"env": env, "variant": variant, "seed": seed, "final_mean_return": final, **extra}

    return [run("A", "coupled", 1, 1.0), run("A", "coupled", 2, 2.0), run("A", "coupled", 3, 3.0),
            run("A", "pipelined", 1, 2.0), run("A", "pipelined", 2, 2.0), run("A", "pipelined", 3, 4.0),
            run("B", "coupled", 1, 5.0), run("B", "pipelined", 1, 5.0), run("B", "pipelined", 2, None),
            run("B", "sb3", 1, 9.0, stopped="threshold")]  # fmt: skip


def test_the_reports_table_and_command(st, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Per env, each variant's IQM [CI] (runs) and P(pipelined > coupled); the suite row averages P over
    the envs (A: pipelined 2, 2, 4 vs coupled 1, 2, 3 -> 6/9, B: a tie -> 1/2); runs stopped or without a
    final return are left out (sb3 has none). The command writes `<name>_stats.{md,png}` beside nothing
    else and leaves the report as it was."""
    lines = st.markdown_table(_runs(), "env", reps=REPS, variants=["coupled", "pipelined"])
    assert (
        lines[0]
        == "| env | IQM coupled [95% CI] (runs) | IQM pipelined [95% CI] (runs) | P(pipelined > coupled) [95% CI] |"
    )
    cells = {line.split(" | ")[0].strip("| "): [c.strip() for c in line.strip("|").split("|")[1:]]
             for line in lines[2:5]}  # fmt: skip
    assert cells["A"][0].startswith("2.0 [") and cells["A"][0].endswith("] (3)")
    assert cells["A"][1].startswith("2.7 [") and cells["A"][2].startswith("0.67 [")
    assert cells["B"][:3] == ["5.0 (1)", "5.0 (1)", "0.50 [0.50, 0.50]"]
    assert (
        cells["all envs"][2].startswith(f"{(6 / 9 + 1 / 2) / 2:.2f} [") and "(2 envs)" in cells["all envs"][2]
    )
    assert st.markdown_table([r for r in _runs() if r["variant"] == "sb3"], "env") == []
    assert lines[-1].endswith(
        "Left out (no run with a final score of the table's kind, or stopped short): sb3."
    )
    evaluated = [r | {"final_eval_return": 1.0} for r in _runs() if r["variant"] != "sb3"]  # sb3: never
    sb3 = [r | {"stopped": False, "final_mean_return": 9.0} for r in _runs() if r["variant"] == "sb3"]
    ranked = st.markdown_table(evaluated + sb3, "env", reps=REPS)
    assert "IQM sb3" not in ranked[0] and ranked[-1].endswith("stopped short): sb3.")

    report = tmp_path / "learning_x.json"
    report.write_text(json.dumps({"runs": _runs()}))
    before = report.read_text()
    st.main([str(report), "--reps", str(REPS)])
    assert report.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["learning_x.json", "learning_x_stats.md",
                                                          "learning_x_stats.png"]  # fmt: skip
    md = (tmp_path / "learning_x_stats.md").read_text()
    assert "P(pipelined > coupled)" in md and "(learning_x_stats.png)" in md


def test_the_learning_and_time_to_score_reports_carry_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    learning = benchmark_script(monkeypatch, "learning")
    machine = {"cpu": "x", "cores": 2, "torch": "t"}
    runs = [{**r, "env": {"A": "CartPole-v1", "B": "Acrobot-v1"}[r["env"]], "commit": "abc1234",
             "total_env_steps": 500_000, "wall_seconds": 60.0, "sps": 8000.0} for r in _runs()[:9]]  # fmt: skip
    md = learning.markdown("classic", {"runs": runs, "machine": machine}, "cmd")
    table = md.split("## The final return over seeds")[1]
    assert table.index("| CartPole-v1 |") < table.index("| Acrobot-v1 |")  # the suite's order
    assert "(learning_classic_profile.png)" in md
    # an evaluated Acrobot (learning.py --eval): its final evaluation ranked alone, every run's training return
    evaluated = [
        {**r, "final_eval_return": -80.0 - r["seed"]} if r["env"] == "Acrobot-v1" else r for r in runs
    ]
    md = learning.markdown("classic", {"runs": evaluated, "machine": machine}, "cmd")
    ranked, training = md.split("## The final evaluation return")[1].split(
        "## Every run's final training return"
    )
    assert "| Acrobot-v1 | -81.0 (1) |" in ranked and "CartPole-v1" not in ranked.split("IQM:")[0]
    assert "| CartPole-v1 |" in training and "| Acrobot-v1 | 5.0 (1) |" in training
    tts = benchmark_script(monkeypatch, "time_to_score")
    runs = [{**r, "workload": {"A": "lunarlander", "B": "hopper"}[r["env"]], "commit": "abc1234",
             "best_mean_return": r["final_mean_return"], "wall_at_threshold": None, "step_at_threshold": None,
             "wall_seconds": 60.0, "sps": 8000.0, "load": [1.0, 1.0]} for r in _runs() if r["final_mean_return"]]  # fmt: skip
    md = tts.markdown({"runs": runs, "machine": machine}, "cmd")
    table = md.split("### The final return over seeds")[1]
    assert "| P(pipelined > coupled) [95% CI] |" in table and "sb3" not in table.split("\n\n")[1]
    assert "Runs stopped before their budget have no final return" in table
    assert "(time_to_score_profile.png)" in md
    # evaluated runs (--eval) rank their final evaluation return; a candidate variant is compared with coupled
    evaluated = [{**r, "final_eval_return": 1000.0 + r["final_mean_return"], "best_eval_return": 2000.0,
                  "eval_seconds": 1.5, "wall_at_threshold_no_eval": None} for r in runs]  # fmt: skip
    evaluated += [{**r, "variant": "notrunc"} for r in evaluated if r["variant"] == "pipelined"]
    md = tts.markdown({"runs": evaluated, "machine": machine}, "cmd", "parity")
    table = md.split("### The final evaluation return over seeds")[1]
    assert "| P(notrunc > coupled) [95% CI] |" in table and "(parity_profile.png)" in md
    iqm = benchmark_script(monkeypatch, "stats").iqm(
        [
            r["final_eval_return"]
            for r in evaluated
            if r["variant"] == "coupled" and r["workload"] == "lunarlander"
        ]
    )
    assert f"| lunarlander | {iqm:.1f} [" in table, "the IQM of the final evaluation returns"
    assert "| final eval | best eval | eval s |" in md and "| 2000.0 ± 0.0 | 1.5 |" in md


def test_threshold_figures_take_the_evaluations(monkeypatch: pytest.MonkeyPatch) -> None:
    """The final evaluation is the last one, the best the highest, and the wall time to the threshold leaves
    out the evaluations that ran before it (1.0 s and 2.0 s, not the 5.0 s one after)."""
    common = benchmark_script(monkeypatch, "common")
    curve = [[100, 10.0, 50.0], [200, 20.0, 120.0], [300, 30.0, 90.0]]
    evals = [[100, 11.0, 60.0, 1.0], [200, 19.0, 150.0, 2.0], [300, 31.0, 140.0, 5.0]]
    summary = {"curve": curve, "eval_curve": evals, "total_env_steps": 300, "final_mean_return": 90.0,
               "wall_seconds": 31.0, "sps": 10.0}  # fmt: skip
    figures = common.threshold_figures(summary, 100.0)
    assert figures["wall_at_threshold"] == 20.0 and figures["wall_at_threshold_no_eval"] == 17.0
    assert figures["final_eval_return"] == 140.0 and figures["best_eval_return"] == 150.0
    assert figures["eval_seconds"] == 8.0
    assert "final_eval_return" not in common.threshold_figures({**summary, "eval_curve": []}, 100.0)


def test_the_cli_refuses_what_is_not_a_report_in_one_line(
    st, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    """A missing file, a markdown report given for its JSON, a JSON of something else, `--reps 0`: each ended in
    a traceback (FileNotFoundError, JSONDecodeError, ValueError); now a usage line and exit status 2."""
    (tmp_path / "report.md").write_text("# a report\n")
    (tmp_path / "other.json").write_text(json.dumps({"runs": [{"seed": 1}]}))
    (tmp_path / "list.json").write_text("[1, 2]")
    cases = {
        str(tmp_path / "missing.json"): "not a readable JSON report (FileNotFoundError)",
        str(tmp_path / "report.md"): "not a readable JSON report (JSONDecodeError)",
        str(tmp_path / "other.json"): "not a learning or time-to-score report",
        str(tmp_path / "list.json"): "not a learning or time-to-score report",
    }
    for path, said in cases.items():
        with pytest.raises(SystemExit) as ended:
            st.main([path, "--out", str(tmp_path)])
        assert ended.value.code == 2 and said in capsys.readouterr().err
    with pytest.raises(SystemExit):
        st.main([str(tmp_path / "other.json"), "--reps", "0"])
    assert "--reps 0" in capsys.readouterr().err
