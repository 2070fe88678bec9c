"""Resume as a user meets it, in real (short, in-process) runs: the same run continues from its own config in
its own directory, "train longer" keeps the learning rate from jumping, a requeued `resume=auto` of a
finished run is done, and the Python API speaks in one line.

Each test would have failed on the rules before: the resume rebuilt the config from the command line
(CartPole's values, the default 200k budget) and rewrote config.yaml, the lr line was recomputed from step
0, `resume=<ckpt>` started a new timestamped directory, and a finished `resume=auto` exited 2.
"""

from __future__ import annotations

import functools
import json
import traceback
from pathlib import Path

import pytest
import yaml

import ppo_fabric
from ppo_fabric import cli
from ppo_fabric.config.values import ConfigError
from ppo_fabric.runs import checkpoint as ckpt
from ppo_fabric.runs.metrics_file import read_rows, series
from tests.envs import factory_envs

pytestmark = pytest.mark.slow
QUIET = ["logger.tensorboard=false", "algo.update_epochs=1"]


def _run(run_dir: Path, *overrides: str, env: object = None) -> dict:
    return ppo_fabric.run([*QUIET, f"hydra.run.dir={run_dir}", *overrides], env=env)


def test_resume_continues_the_runs_own_config_in_its_own_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # a new timestamped directory would land in ./runs
    run_dir = tmp_path / "acrobot"
    _run(run_dir, "env.id=Acrobot-v1", "algo.total_steps=1536", "algo.lr=1e-3")
    config = (run_dir / "config.yaml").read_text()
    out = capsys.readouterr().out
    assert "Acrobot-v1 with env=gym, the generic defaults" in out

    # only the checkpoint and a longer budget: the run's env, lr and epochs, not the defaults'
    summary = ppo_fabric.run([f"resume={run_dir / 'checkpoints' / 'last.ckpt'}", "algo.total_steps=3072"])
    out = capsys.readouterr().out
    assert "changed: algo.total_steps: 1536 -> 3072" in out
    assert summary["env_id"] == "Acrobot-v1" and summary["total_env_steps"] == 3072
    assert not (tmp_path / "runs").exists()  # continued in the checkpoint's run directory
    assert (run_dir / "config.yaml").read_text() == config  # never overwritten
    record = [json.loads(line) for line in (run_dir / "resumes.jsonl").read_text().splitlines()]
    assert record[0]["env_step"] == 1536 and record[0]["changed"] == {"algo.total_steps": [1536, 3072]}
    resumed = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resumed["algo"]["update_epochs"] == 1 and resumed["algo"]["lr"] == 1e-3

    rows = read_rows(run_dir / "metrics.csv")
    steps = [s for s, _ in series(rows, "train/lr")]
    assert steps == sorted(steps) and steps[0] < 1536 < steps[-1]  # one continuous metrics.csv
    lrs = [lr for _, lr in series(rows, "train/lr")]
    last_before = max(lr for s, lr in series(rows, "train/lr") if s <= 1536)
    assert all(lr <= min(last_before, 1e-3) + 1e-12 for s, lr in series(rows, "train/lr") if s > 1536), lrs
    assert (run_dir / "learning_curve.png").is_file()


def test_a_change_to_the_experiment_is_refused_unless_allowed(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _run(run_dir, "algo.total_steps=512")
    last = run_dir / "checkpoints" / "last.ckpt"
    with pytest.raises(ConfigError, match=r"algo.gamma=0.9 \(was 0.98\).*resume_overrides=allow"):
        ppo_fabric.run([f"resume={last}", "algo.total_steps=1024", "algo.gamma=0.9"])
    summary = ppo_fabric.run(
        [f"resume={last}", "algo.total_steps=1024", "algo.gamma=0.9", "resume_overrides=allow"]
    )
    assert summary["total_env_steps"] == 1024
    changed = json.loads((run_dir / "resumes.jsonl").read_text().splitlines()[-1])["changed"]
    assert changed["algo.gamma"] == [0.98, 0.9]
    # continued in a directory of its own (a branch): the change is noted there too (it was not at all)
    branch = tmp_path / "branch"
    ppo_fabric.run([f"resume={last}", "algo.total_steps=1536", "algo.gamma=0.95", "resume_overrides=allow",
                    f"hydra.run.dir={branch}"])  # fmt: skip
    (noted,) = [json.loads(line) for line in (branch / "resumes.jsonl").read_text().splitlines()]
    assert noted["changed"]["algo.gamma"] == [0.9, 0.95] and noted["resume"] == str(last)
    assert yaml.safe_load((branch / "config.yaml").read_text())["algo"]["gamma"] == 0.95


def test_resume_auto_of_a_run_whose_summary_failed_says_so(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A full disk took summary.json after the final checkpoint (that session failed, exit 1); the
    requeued command said the run "is complete; nothing to do", as of a run that ended well. A summary
    from an earlier session (a stop at 256 env steps) is no summary of the end either: it read "was
    stopped by SIGTERM at 512 env steps"."""
    run_dir = tmp_path / "run"
    _run(run_dir, "algo.total_steps=512")
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").unlink()
    _run(run_dir, "algo.total_steps=512", "resume=auto")
    said = (
        f"resume=auto: the run in {run_dir} finished its training (512 env steps >= algo.total_steps=512), but "
        "its last session failed before writing summary.json: its checkpoints and metrics.csv are whole; "
        "nothing to train"
    )
    assert said in capfd.readouterr().err
    stale = summary | {"total_env_steps": 256, "interrupted": True, "stop_signal": "SIGTERM"}
    (run_dir / "summary.json").write_text(json.dumps(stale))
    _run(run_dir, "algo.total_steps=512", "resume=auto")
    assert said in capfd.readouterr().err


def test_requeued_resume_auto_of_a_finished_run_is_done(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    first = _run(run_dir, "algo.total_steps=512", "resume=auto")
    capfd.readouterr()
    again = _run(run_dir, "algo.total_steps=512", "resume=auto")  # the same command, again
    assert again == first
    assert "is complete (512 env steps >= algo.total_steps=512); nothing to do" in capfd.readouterr().err
    with pytest.raises(SystemExit) as exc:  # the command line: exit 0 with that one line
        cli.main([*QUIET, f"hydra.run.dir={run_dir}", "resume=auto"])
    assert exc.value.code == 0
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "nothing to do" in err
    # a run stopped past a smaller budget was called complete (its summary: interrupted, no final evaluation)
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").write_text(
        json.dumps(summary | {"interrupted": True, "stop_signal": "SIGINT"})
    )
    _run(run_dir, "algo.total_steps=256", "resume=auto")
    assert f"the run in {run_dir} was stopped by SIGINT at 512 env steps, at or past algo.total_steps=256: " \
           "nothing to train (raise algo.total_steps to go on)" in capfd.readouterr().err  # fmt: skip


def test_a_resume_from_an_earlier_checkpoint_keeps_one_timeline_of_metrics(tmp_path: Path) -> None:
    """A run resumed from a checkpoint older than its last logged update (a crash some updates after it, or
    `resume=` an earlier one) logs those steps again: the rows logged after the checkpoint are dropped, not
    kept beside the new ones (metrics.csv read as a curve would go back in time)."""
    run_dir = tmp_path / "run"
    _run(run_dir, "algo.total_steps=1024", "checkpoint.every=1", "checkpoint.keep=0", "eval.every=256")
    first = read_rows(run_dir / "metrics.csv")
    assert [int(r["step"]) for r in first] == [256, 512, 768, 1024]
    (step_512,) = (run_dir / "checkpoints").glob("step_000000000512_*.ckpt")
    summary = ppo_fabric.run([f"resume={step_512}"])
    assert summary["total_env_steps"] == 1024 and summary["steps_this_run"] == 512
    again = read_rows(run_dir / "metrics.csv")
    assert [int(r["step"]) for r in again] == [256, 512, 768, 1024]
    assert again[:2] == first[:2] and again[2:] != first[2:]  # the later rows are the resumed run's own
    evaluations = [int(r["step"]) for r in read_rows(run_dir / "evaluations.csv")]
    assert evaluations == sorted(evaluations) and len(evaluations) == len(set(evaluations))


def test_a_config_error_from_python_is_one_line_and_a_short_traceback(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _run(run_dir, "algo.total_steps=512")
    with pytest.raises(ConfigError) as exc:  # the README's snippet without resume=auto, run twice
        _run(run_dir, "algo.total_steps=512")
    assert "already holds a run" in str(exc.value) and "\n" not in str(exc.value)
    assert exc.value.__cause__ is None and exc.value.__suppress_context__
    frames = traceback.extract_tb(exc.value.__traceback__)
    assert [f.name for f in frames if "ppo_fabric" in f.filename] == ["run"]


def test_an_env_factory_from_python(tmp_path: Path) -> None:
    summary = _run(
        tmp_path / "run", "algo.total_steps=512", "env.vector=sync", env=factory_envs.short_cartpole
    )
    assert summary["env_id"] == "tests.envs.factory_envs:short_cartpole"
    # its checkpoint holds the envs (the entry point was a closure, which no pickle takes): exact resume
    state = ckpt.load(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert state["ranks"][0]["envs"] is not None
    with pytest.raises(ConfigError, match="module-level function or class"):
        _run(tmp_path / "other", "algo.total_steps=512", env=lambda: None)
    # the env argument won over an env.id given beside it, silently; a string was read a character at a time
    with pytest.raises(ConfigError, match=r"run\(\) was given both env=.* and env.id=CartPole-v1; pass one"):
        _run(tmp_path / "both", "env.id=CartPole-v1", env=factory_envs.short_cartpole)
    with pytest.raises(ConfigError, match=r"list of strings, e.g. run\(\['algo.total_steps=512'\]\)"):
        ppo_fabric.run("algo.total_steps=512")  # type: ignore[arg-type]


def test_a_partial_env_factory_from_python(tmp_path: Path) -> None:
    """`env=functools.partial(factory, k=v)`, the usual way to hand an env its options: the keywords become
    `env.kwargs` (as `+env.kwargs.k=v` on a command line), so the run's other processes, a resume and
    `load_policy` build the same env. It was refused as not a module-level function."""
    env = functools.partial(factory_envs.short_cartpole, limit=20, render_mode=None)
    summary = _run(tmp_path / "run", "algo.total_steps=512", env=env)
    assert summary["env_id"] == "tests.envs.factory_envs:short_cartpole"
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert config["env"]["kwargs"] == {"limit": 20, "render_mode": None}
    built = ppo_fabric.load_policy(tmp_path / "run").make_env(trust_env=True)
    assert built.spec.max_episode_steps == 20
    built.close()
    literal = functools.partial(factory_envs.short_cartpole, a="it's", b=[1, 2.5, True], c=False, d=-3)
    assert cli.unpartial(literal)[1] == {"a": "'it\\'s'", "b": "[1,2.5,true]", "c": "false", "d": "-3"}
    with pytest.raises(ConfigError, match="give the partial's arguments as keywords"):
        _run(tmp_path / "positional", env=functools.partial(factory_envs.short_cartpole, 20))
    with pytest.raises(ConfigError, match=r"limit=<object .*> cannot be written in the run's config"):
        _run(tmp_path / "object", env=functools.partial(factory_envs.short_cartpole, limit=object()))


def test_a_resume_auto_with_the_env_id_keeps_the_runs_own_values(tmp_path: Path) -> None:
    """The same command requeued (`env.id=Acrobot-v1 resume=auto`, the budget raised) continues the run:
    the generic option added in case it started afresh (`env=gym`) is not the user's override, and taken
    for one it refused the resume (env.num_envs=4, was 2)."""
    run_dir = tmp_path / "acrobot"
    _run(run_dir, "env.id=Acrobot-v1", "env.num_envs=2", "algo.total_steps=512", "resume=auto")
    summary = _run(run_dir, "env.id=Acrobot-v1", "algo.total_steps=1024", "resume=auto")
    assert summary["total_env_steps"] == 1024 and summary["resumed_from"] is not None
    assert ckpt.load(run_dir / "checkpoints" / "last.ckpt")["config"]["env"]["num_envs"] == 2


def test_a_resume_auto_with_an_option_of_its_own_keeps_the_runs_own_values(tmp_path: Path) -> None:
    """`resume=auto` with an option the user gives (`logger=none`) beside the generic one added in case the
    run started afresh (`env=gym`): every key `env=gym` sets read as set by the user's option, and the resume
    took env=gym's value (algo.total_steps: 512 -> 1,000,000 trained a 512-step run to 1M; algo.lr,
    set by the run, refused the resume as a change the user never asked for)."""
    run_dir = tmp_path / "acrobot"
    _run(run_dir, "env.id=Acrobot-v1", "algo.lr=0.001", "algo.total_steps=512", "resume=auto")
    summary = _run(run_dir, "env.id=Acrobot-v1", "logger=none", "algo.total_steps=1024", "resume=auto")
    assert summary["total_env_steps"] == 1024
    *_, last = (run_dir / "resumes.jsonl").read_text().splitlines()
    changed = json.loads(last)["changed"]  # and the logger's keys, which logger=none sets
    assert [k for k in changed if not k.startswith("logger.")] == ["algo.total_steps"], changed
    assert changed["algo.total_steps"] == [512, 1024]


def test_an_env_setting_changed_on_resume_is_applied_with_fresh_envs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`env.max_episode_steps=5 resume_overrides=allow`: the envs came back from their snapshot with their
    old time limit, and the run trained on 500-step episodes while its config, its line and resumes.jsonl
    said 5 (env.kwargs and normalisation likewise). Such a change now starts the envs afresh, and says so."""
    run_dir = tmp_path / "run"
    _run(run_dir, "algo.total_steps=512", "eval.every=0")
    capsys.readouterr()
    summary = _run(run_dir, "algo.total_steps=1024", "eval.every=0", f"resume={run_dir / 'checkpoints' / 'last.ckpt'}",
                   "env.max_episode_steps=5", "resume_overrides=allow")  # fmt: skip
    assert summary["final_mean_return"] == 5.0  # CartPole's reward of 1 a step, every episode cut at 5
    assert ("ppo-fabric: resume: env.max_episode_steps changed (the saved envs hold the old settings); envs "
            "and RNG start fresh, normaliser statistics carried over") in capsys.readouterr().out  # fmt: skip


@pytest.mark.parametrize("resume", ["auto", "path"])
def test_a_resume_repeating_an_option_that_leaves_the_env_id_to_be_given(tmp_path: Path, resume: str) -> None:
    """`env=gym env.id=Acrobot-v1`, resumed with `env=gym` again (the id left out): a traceback ending in
    OmegaConf's `MissingMandatoryValue: env.id`. The option's unset id is none of the user's: the run's stays."""
    run_dir = tmp_path / "run"
    _run(run_dir, "env=gym", "env.id=Acrobot-v1", "algo.total_steps=512", "eval.every=0")
    at = "resume=auto" if resume == "auto" else f"resume={run_dir / 'checkpoints' / 'last.ckpt'}"
    summary = _run(run_dir, "env=gym", "algo.total_steps=1024", "eval.every=0", at)
    assert summary["total_env_steps"] == 1024 and summary["env_id"] == "Acrobot-v1"


def test_a_resume_whose_env_change_changes_the_spaces_names_that_change(tmp_path: Path) -> None:
    """`env.observation_noise=0.5` on a resume widens the observation space: the refusal named no key."""
    run_dir = tmp_path / "run"
    _run(run_dir, "algo.total_steps=512", "eval.every=0")
    with pytest.raises(
        ConfigError, match=r"differs from the checkpoint's \(this resume changes env.observation_noise\)$"
    ):
        _run(run_dir, "algo.total_steps=1024", "eval.every=0", "resume=auto", "env.observation_noise=0.5",
             "resume_overrides=allow")  # fmt: skip
