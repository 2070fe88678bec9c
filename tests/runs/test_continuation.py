"""A resume continues the run's own config (`continuation.continued_config`), its learning-rate schedule
(`LrSchedule.continued`), and a run that names only `env.id` gets that id's tuned values (`tuned`).

Each would have failed on the rules before: the config was rebuilt from the command line (the default
total_steps, CartPole's values for another env), the lr line was recomputed from step 0 (it jumped up on
"train longer"), and `env.id=Acrobot-v1` composed conf/env/cartpole.yaml's tuned values.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ppo_fabric.config.tuned import (
    options_of_note,
    table,
    tuned_options,
    with_tuned_values,
    without_tuned_values,
)
from ppo_fabric.config.values import ConfigError, compose, composer
from ppo_fabric.learn.schedule import LrSchedule
from ppo_fabric.runs.continuation import continued_config, named_keys


def _saved(overrides: list[str]) -> dict:
    cfg, _ = compose(with_tuned_values(overrides))
    return OmegaConf.to_container(cfg, resolve=True)


def _resume(overrides: list[str], saved: dict) -> tuple[dict, dict]:
    overrides = with_tuned_values([*overrides, "resume=/x/checkpoints/last.ckpt"])
    cfg, _ = compose(overrides)
    merged, changes = continued_config(cfg, saved, overrides, composer())
    return OmegaConf.to_container(merged, resolve=True), changes


def test_resume_without_the_original_overrides_trains_the_same_run() -> None:
    saved = _saved(["env=gym", "env.id=Acrobot-v1", "algo.total_steps=30000", "algo.lr=3e-4"])
    merged, changes = _resume([], saved)
    assert merged["algo"] == saved["algo"] and merged["env"] == saved["env"]
    assert merged["tuning"] == saved["tuning"]  # the run's own record, not today's command line
    assert changes == {}


def test_budget_and_logging_change_freely_and_are_reported() -> None:
    saved = _saved(["env.id=Acrobot-v1", "algo.total_steps=30000"])
    merged, changes = _resume(
        ["algo.total_steps=60000", "checkpoint.every=5", "logger.tensorboard=false"], saved
    )
    assert merged["algo"]["total_steps"] == 60000 and merged["checkpoint"]["every"] == 5
    assert changes == {
        "algo.total_steps": (30000, 60000),
        "checkpoint.every": (0, 5),
        "logger.tensorboard": (True, False),
    }


@pytest.mark.parametrize(
    ("given", "named"),
    [
        (["algo.lr=1e-3"], "algo.lr=0.001 (was 0.00025)"),
        (["seed=7"], "seed=7 (was 42)"),
        (["strategy=decoupled", "fabric.devices=2"], "strategy=decoupled (was coupled)"),
        # a group option names the keys it changes
        (["env=cartpole", "env.id=Acrobot-v1"], "algo.update_epochs=20 (was 4)"),
        (["+env.kwargs.y=2"], "env.kwargs.y=2 (was (absent))"),
        (["env.max_episode_steps=50"], "env.max_episode_steps=50 (was null)"),  # set to null, not absent
    ],
)
def test_changes_to_the_experiment_are_refused_in_one_line(given: list[str], named: str | None) -> None:
    saved = _saved(["env.id=Acrobot-v1"])
    with pytest.raises(ConfigError) as exc:
        _resume(given, saved)
    text = str(exc.value)
    assert "\n" not in text and "resume_overrides=allow" in text
    if named is not None:
        assert named in text, text


@pytest.mark.parametrize(
    ("given", "named"),
    [
        (["model.actor_hidden=[32]"], "model.actor_hidden=[32] (was [64, 64])"),
        (["strategy=decoupled", "fabric.devices=2"], "strategy=decoupled (was coupled)"),
        (["env.id=CartPole-v1"], "env.id=CartPole-v1 (was Acrobot-v1)"),
    ],
)
def test_what_no_resume_may_change_is_refused_without_offering_allow(given: list[str], named: str) -> None:
    """The networks, the env and the strategy are the checkpoint's: resume_overrides=allow does not let
    them change (the checks that load the checkpoint refused them next), so the line does not offer it."""
    saved = _saved(["env.id=Acrobot-v1"])
    for allow in ([], ["resume_overrides=allow"]):
        with pytest.raises(ConfigError) as exc:
            _resume([*given, *allow], saved)
        text = str(exc.value)
        assert named in text and "cannot change on a resume" in text and "\n" not in text, text


def test_resume_overrides_allow_applies_and_reports_every_change() -> None:
    saved = _saved(["env.id=Acrobot-v1"])
    merged, changes = _resume(["algo.lr=1e-3", "resume_overrides=allow"], saved)
    assert merged["algo"]["lr"] == 1e-3 and merged["resume_overrides"] == "allow"
    assert changes == {"algo.lr": (2.5e-4, 1e-3)}  # what the command asks of its resume is no change


def test_resume_overrides_allow_holds_for_its_own_resume_only() -> None:
    """The next resume of a session resumed with allow refuses a change again (allow was saved with the
    run's config and taken from the checkpoint: every later resume changed the experiment unasked)."""
    saved = _saved(["env.id=Acrobot-v1", "resume_overrides=allow", "resume_env=fresh"])
    merged, changes = _resume([], saved)
    assert merged["resume_overrides"] == "refuse" and merged["resume_env"] == "restore" and changes == {}
    with pytest.raises(ConfigError, match=r"algo.update_epochs=2 \(was 4\).*resume_overrides=allow"):
        _resume(["algo.update_epochs=2"], saved)


def test_repeating_the_original_command_line_changes_nothing() -> None:
    original = ["env.id=Acrobot-v1", "algo.total_steps=30000", "model.actor_hidden=[32,32]"]
    merged, changes = _resume(original, _saved(original))
    assert changes == {}


def test_naming_the_env_id_again_adds_no_tuned_values_to_a_resume() -> None:
    """`env.id=CartPole-v1` given again on resume: its tuned option (env=cartpole) is not put in front, so
    the keys the run changed from it (rollout_steps, num_envs) are not named, reset or refused."""
    original = ["env.id=CartPole-v1", "algo.rollout_steps=64", "algo.minibatch_size=64", "env.num_envs=2"]
    saved = _saved(original)
    merged, changes = _resume(["env.id=CartPole-v1"], saved)
    assert changes == {} and merged["algo"] == saved["algo"] and merged["env"] == saved["env"]
    fresh = with_tuned_values(["env.id=CartPole-v1", "resume=auto"])  # may start a new run: tuned
    assert fresh[0] == "env=cartpole"


def test_keys_the_saved_config_lacks_take_todays_defaults_and_its_own_keys_stay() -> None:
    saved = _saved(["env.id=Acrobot-v1", "+env.kwargs.foo=1"])
    del saved["stall_timeout"], saved["env"]["max_restarts"]  # a run from before these keys existed
    merged, changes = _resume([], saved)
    assert merged["stall_timeout"] == 600 and merged["env"]["max_restarts"] == 100
    assert merged["env"]["kwargs"] == {"foo": 1}
    assert changes == {}


def test_named_keys_tell_key_overrides_from_group_options() -> None:
    keys, options = named_keys(["env=gym", "algo.lr=1", "+env.kwargs.a=2", "~model.lstm", "hydra.run.dir=x"])
    assert keys == [("algo", "lr"), ("env", "kwargs", "a"), ("model", "lstm")]
    assert options == ["env=gym"]


# ------------------------------------------------------------------------------------- lr schedule
def test_a_fresh_schedule_is_the_linear_line_from_step_zero() -> None:
    line = LrSchedule(end_step=1000)
    assert [line.fraction(s) for s in (0, 250, 1000)] == [1.0, 0.75, 0.0]
    assert LrSchedule(end_step=1000, anneal=False).fraction(999) == 1.0


def test_same_budget_continues_the_same_line_exactly() -> None:
    line = LrSchedule(end_step=1000)
    again = LrSchedule.continued(line.state(400), 500, 1000, anneal=True)
    assert again == line


def test_train_longer_from_an_interrupted_run_continues_from_where_the_rate_stands() -> None:
    line = LrSchedule(end_step=1000)
    longer = LrSchedule.continued(line.state(400), 500, 2000, anneal=True)
    assert longer.fraction(500) == pytest.approx(0.5)  # what the next update would have used: no jump
    assert longer.fraction(1250) == pytest.approx(0.25) and longer.fraction(2000) == 0.0


def test_train_longer_from_a_finished_run_never_raises_the_rate() -> None:
    line = LrSchedule(end_step=10240)
    last = line.fraction(9984)  # the last update's fraction (1/40)
    longer = LrSchedule.continued(line.state(9984), 10240, 20480, anneal=True)
    assert longer.fraction(10240) == pytest.approx(last)
    assert all(longer.fraction(s) <= last for s in range(10240, 20481, 256))
    # the rule before: the line recomputed from step 0 jumped the rate up twentyfold
    assert LrSchedule(end_step=20480).fraction(10240) > 19 * last


def test_a_checkpoint_without_a_schedule_keeps_the_line_from_step_zero() -> None:
    assert LrSchedule.continued(None, 500, 2000, anneal=True) == LrSchedule(end_step=2000)


# ------------------------------------------------------------------------------------ tuned values
def test_env_id_alone_gets_its_own_tuned_values_or_the_generic_ones() -> None:
    acrobot, _ = compose(with_tuned_values(["env.id=Acrobot-v1"]))
    assert acrobot.algo.update_epochs == 4 and acrobot.algo.lr == 2.5e-4 and acrobot.algo.gamma == 0.99
    assert "generic defaults" in acrobot.tuning and "Acrobot-v1" in acrobot.tuning
    lunar, _ = compose(with_tuned_values(["env.id=LunarLander-v3", "algo.lr=1e-4"]))
    assert lunar.algo.gamma == 0.999 and lunar.algo.lr == 1e-4  # tuned, and the user's override still wins
    assert lunar.tuning.startswith("env=lunarlander")
    hopper, _ = compose(with_tuned_values(["env.id=Hopper-v5"]))
    assert hopper.env.id == "Hopper-v5" and hopper.algo.update_epochs == 10 and hopper.env.normalize_obs


def test_a_chosen_option_is_kept_and_recorded() -> None:
    given = with_tuned_values(["env=cartpole", "env.id=Acrobot-v1"])
    cfg, _ = compose(given)
    assert cfg.algo.update_epochs == 20 and cfg.tuning.startswith("env=cartpole")
    assert with_tuned_values(given) == given  # settled once: every process sees the same command line
    default, _ = compose(with_tuned_values([]))
    assert default.env.id == "CartPole-v1" and "default env option" in default.tuning


def test_a_users_own_config_decides_as_a_command_line_would(tmp_path: Path) -> None:
    """A primary config of the user's (`--config-path/--config-name`) that picks an env option is recorded
    as its choice (the note said ours, CartPole); one that sets only `env.id` over ours gets that id's
    values, as `env.id=` on the command line does (it trained Acrobot with CartPole's 20 epochs)."""
    (tmp_path / "lunar.yaml").write_text("defaults:\n  - config\n  - override env: lunarlander\n  - _self_\n")
    (tmp_path / "acro.yaml").write_text("defaults:\n  - config\n  - _self_\nenv:\n  id: Acrobot-v1\n")
    where = str(tmp_path)
    lunar = with_tuned_values(["seed=3"], where, "lunar")
    assert lunar == ["seed=3", "tuning='env=lunarlander (chosen by the config lunar)'"]
    acro = with_tuned_values(["seed=3", "resume=auto", "hydra.run.dir=R"], where, "acro")
    cfg, _ = compose(acro, where, "acro")
    assert cfg.env.id == "Acrobot-v1" and cfg.algo.update_epochs == 4 and cfg.algo.gamma == 0.99
    assert acro[0] == "env=gym" and "(env.id set by the config acro)" in cfg.tuning
    assert without_tuned_values(acro) == ["seed=3", "resume=auto", "hydra.run.dir=R"]  # as typed
    assert with_tuned_values(["env.id=CartPole-v1"], where, "acro")[0] == "env=cartpole"  # the line wins
    assert with_tuned_values([], where, "nosuch")[-1] == "tuning='the env option the config nosuch picks'"


@pytest.mark.slow  # seconds in process (a run, or every option composed): not the unit tier
def test_every_option_the_table_names_exists() -> None:
    for _, options in table():
        compose(list(options))
    assert tuned_options("ALE/Breakout-v5") == ("exp=atari",)
    assert tuned_options("my_pkg.envs:make_env") is None


def test_a_resume_auto_that_finds_a_checkpoint_continues_the_runs_own_config() -> None:
    """`resume=auto` may start a new run, so the env id's tuned option is added in front of the command
    line; when it finds a checkpoint, that option is not the user's: it reset every key of its file, and
    `env=lunarlander` cut a 3M-step run back to the recipe's 1M (the lr annealing to zero there)."""
    saved = _saved(["env.id=LunarLander-v3", "algo.total_steps=3000000"])
    settled = with_tuned_values(["env.id=LunarLander-v3", "resume=auto", "hydra.run.dir=R"])
    assert settled[0] == "env=lunarlander"
    typed = without_tuned_values(settled)
    assert typed == ["env.id=LunarLander-v3", "resume=auto", "hydra.run.dir=R"]
    cfg, _ = compose(settled)
    merged, changes = continued_config(cfg, saved, typed, composer())
    assert OmegaConf.select(merged, "algo.total_steps") == 3000000 and changes == {}
    # taken as named, an added option that is not the run's own (it started with env=gym) resets its keys
    generic = _saved(["env=gym", "env.id=LunarLander-v3", "algo.total_steps=3000000"])
    with pytest.raises(ConfigError, match="would change the run's experiment"):
        continued_config(cfg, generic, settled, composer())
    assert continued_config(cfg, generic, typed, composer())[1] == {}
    # the other shapes of with_tuned_values' output come back as typed
    for line in (["env=gym", "env.id=Acrobot-v1"], ["env.id=Acrobot-v1", "seed=3"], ["seed=3"], []):
        assert without_tuned_values(with_tuned_values([*line, "resume=auto"])) == [*line, "resume=auto"]
    own = ["env=lunarlander", "env.id=LunarLander-v3", "tuning=mine"]  # the user's own note: theirs
    assert without_tuned_values(own) == own


def test_the_runs_own_option_named_again_changes_nothing() -> None:
    """`resume=auto exp=cartpole_lstm` of a run started with `exp=cartpole_lstm algo.total_steps=16384`:
    the option is the run's own (its `tuning` note names it), so its keys stay as the run had them. Taken
    as named, it set total_steps back to the recipe's 200k, and a finished run trained 65k steps more."""
    saved = _saved(["exp=cartpole_lstm", "algo.total_steps=16384", "algo.lr=3e-4"])
    merged, changes = _resume(["exp=cartpole_lstm"], saved)
    assert changes == {} and merged["algo"] == saved["algo"], changes
    merged, changes = _resume(["exp=cartpole_lstm", "algo.total_steps=30000"], saved)  # its keys still change
    assert changes == {"algo.total_steps": (16384, 30000)}
    with pytest.raises(ConfigError, match=r"model.actor_hidden=\[64, 64\] \(was \[64\]\)"):  # another option
        _resume(["exp=fast"], saved)
    default = _saved(["algo.rollout_steps=64"])  # env=cartpole, the default option, is the run's own too
    assert _resume(["env=cartpole"], default)[1] == {}


@pytest.mark.parametrize(
    ("given", "options"),
    [
        (["exp=cartpole_lstm", "algo.total_steps=1"], ["exp=cartpole_lstm"]),
        (["env=gym", "exp=mujoco", "env.id=Hopper-v5"], ["env=gym", "exp=mujoco"]),
        (["env.id=LunarLander-v3"], ["env=lunarlander"]),
        (["env.id=MinAtar/Breakout-v1"], ["exp=minatar"]),
        (["env.id=Taxi-v3"], ["env=gym"]),
        ([], ["env=cartpole"]),
    ],
)
def test_the_note_names_the_options_the_run_was_composed_with(given: list[str], options: list[str]) -> None:
    note = with_tuned_values(given)[-1].removeprefix("tuning=").strip("'")
    assert options_of_note(note) == options
    assert options_of_note("mine") == options_of_note(None) == []


def test_a_known_packages_module_id_gets_the_ids_tuned_values() -> None:
    """`ale_py:ALE/Pong-v5` builds ALE's Pong (importing ale_py registers it) and gets its recipe, as
    `ALE/Pong-v5` does (it got the generic defaults: raw frames, no skip or stack); another module's env
    is its own, whatever id follows the colon (`*NoFrameskip-v4` matched a foreign one)."""
    assert tuned_options("ale_py:ALE/Pong-v5") == tuned_options("ALE/Pong-v5") == ("exp=atari",)
    assert tuned_options("minatar:MinAtar/Breakout-v1") == ("exp=minatar",)
    assert tuned_options("gymnasium:CartPole-v1") == ("env=cartpole",)
    assert tuned_options("my.mod:CartPole-v1") is None
    assert tuned_options("mygames:PongNoFrameskip-v4") is None


def test_a_relaunch_composes_with_the_tuned_option_and_names_only_the_users_keys() -> None:
    """The supervisor relaunches a failed job with `resume=auto` after the command line it started with:
    the tuned option stays in it (keys only it brings, `model.grid.*` of exp=minatar, compose), and the
    overrides after the note are kept when the option is taken out for naming the user's keys."""
    settled = with_tuned_values(["env.id=MinAtar/Breakout-v1", "model.grid.filters=32"])
    relaunch = [*settled, "hydra.run.dir=R", "resume=auto"]
    assert relaunch[0] == "exp=minatar"
    assert compose([*relaunch[:-1], "resume=null"])[0].model.grid.filters == 32
    typed = ["env.id=MinAtar/Breakout-v1", "model.grid.filters=32", "hydra.run.dir=R", "resume=auto"]
    assert without_tuned_values(relaunch) == typed


def test_a_fresh_run_names_how_its_config_differs_from_the_attempt_it_replaces(tmp_path: Path) -> None:
    """`resume=auto` where an earlier attempt wrote no checkpoint starts afresh and replaces its records
    and config.yaml: with another command line, it trained another experiment than the directory's without
    a word. The differences are named (the first `shown`); the same command again names none."""
    from ppo_fabric.runs.continuation import config_differences
    from ppo_fabric.runs.metrics import save_resolved_config

    earlier, _ = compose(["algo.lr=5e-4", "env.num_envs=16", "algo.total_steps=4096"])
    save_resolved_config(earlier, tmp_path)
    same, _ = compose(["algo.lr=5e-4", "env.num_envs=16", "algo.total_steps=4096", "resume_env=fresh"])
    assert config_differences(tmp_path, same) is None  # a per-session key is no difference
    other, _ = compose(["algo.total_steps=8192"])
    assert config_differences(tmp_path, other, shown=2) == (
        "algo.total_steps: 4096 -> 8192, algo.lr: 0.0005 -> 0.001 and 1 more"
    )
    assert config_differences(tmp_path / "nothing-there", other) is None
