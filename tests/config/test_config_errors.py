"""Every bad input must stop the run before any process or vector env starts, with one clear line.

Users meet these messages on their very first typo, so each test checks three things: the error is a
`ConfigError` (not a Hydra/OmegaConf/Fabric exception with a traceback), its text is a single line, and it
names the offending key (plus the fix where there is an obvious one). A few cases go through the real CLI
in a subprocess, because only there can we see the exit status, the stream the message goes to, and that
nothing else (a traceback, a warning, a summary line) leaks out.

Cases that once escaped validation (a traceback, a run that trained on `inf`, an unrelated message) are kept
in `REGRESSIONS` so they stay fixed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import open_dict

import ppo_fabric
from ppo_fabric.app.preflight import load
from ppo_fabric.config.faults import RunFault
from ppo_fabric.config.values import ConfigError, compose, group_options

# A run small enough to finish in well under a second: one rollout of the default CartPole, 4 envs x 128
# steps. No env.id here: it would fill in the id that the `env=gym` case leaves missing.
TINY = ["algo.total_steps=512", "logger=none"]
BATCH_512 = ["algo.rollout_steps=128", "env.num_envs=4"]


def _assert_one_line(message: str) -> None:
    """A message the CLI prints after `ppo-fabric: error:` must fit on that one line and not be a dump."""
    assert message, "empty error message"
    assert message == message.strip(), f"leading/trailing whitespace: {message!r}"
    assert "\n" not in message and "\r" not in message, f"multi-line message: {message!r}"
    assert "Traceback" not in message, message


def _config_error(overrides: list[str]) -> str:
    """The one-line message `load` raises for `overrides` (fails the test if it raises anything else)."""
    with pytest.raises(ConfigError) as info:
        load(overrides)
    message = str(info.value)
    _assert_one_line(message)
    return message


# (overrides, fragments that must all appear in the message). The first fragment is always the key, so a
# message that forgets to say *what* is wrong fails here.
CASES: list[Any] = [
    # env ids
    pytest.param(
        ["env.id=CartPol-v1"],
        ["env.id='CartPol-v1'", "not a registered", "did you mean", "CartPole-v1"],
        id="env-near-miss",
    ),
    pytest.param(
        ["env.id=CartPole-v99"],
        ["env.id='CartPole-v99'", "not a registered", "CartPole-v1"],
        id="env-bad-version",
    ),
    pytest.param(["env.id=Zzqx-v0"], ["env.id='Zzqx-v0'", "not a registered"], id="env-unknown"),
    pytest.param(
        ["env.id=nosuch_mod_xyz:Env-v0"],
        ["env.id='nosuch_mod_xyz:Env-v0'", "cannot import module", "nosuch_mod_xyz"],
        id="env-module-missing",
    ),
    # config groups and keys
    pytest.param(["env=nosuch"], ["env=nosuch", "unknown option", "available:", "cartpole"], id="group-env"),
    pytest.param(["exp=nosuch"], ["exp=nosuch", "unknown option", "cleanrl_cartpole"], id="group-exp"),
    pytest.param(["algo.foo=1"], ["algo.foo", "unknown config key", "keys of 'algo'"], id="key-nested"),
    pytest.param(["env.foo=1"], ["env.foo", "unknown config key", "+env.foo="], id="key-nested-open"),
    pytest.param(["foo=1"], ["foo", "unknown config key", "+foo="], id="key-top"),
    # numbers: range
    pytest.param(["algo.total_steps=0"], ["algo.total_steps=0", "out of range", "> 0"], id="total-steps-0"),
    pytest.param(
        ["algo.total_steps=-5"], ["algo.total_steps=-5", "out of range", "> 0"], id="total-steps-neg"
    ),
    pytest.param(["env.num_envs=0"], ["env.num_envs=0", "out of range", "> 0"], id="num-envs-0"),
    pytest.param(["algo.lr=0"], ["algo.lr=0", "out of range", "> 0"], id="lr-0"),
    pytest.param(["algo.lr=-1"], ["algo.lr=-1", "out of range", "> 0"], id="lr-neg"),
    pytest.param(["seed=-1"], ["seed=-1", "out of range", "in [0, 4294967295]"], id="seed-neg"),
    pytest.param(
        ["env.max_episode_steps=0"], ["env.max_episode_steps=0", "out of range"], id="max-episode-steps-0"
    ),
    pytest.param(["algo.gamma=1.5"], ["algo.gamma=1.5", "[0, 1]"], id="gamma-high"),
    pytest.param(["algo.gamma=-0.1"], ["algo.gamma=-0.1", "[0, 1]"], id="gamma-neg"),
    pytest.param(["algo.gae_lambda=2"], ["algo.gae_lambda=2", "[0, 1]"], id="gae-lambda-high"),
    pytest.param(["algo.gae_lambda=-0.5"], ["algo.gae_lambda=-0.5", "[0, 1]"], id="gae-lambda-neg"),
    # a coupled run has no player processes: it trained with every process collecting, without a word
    pytest.param(["algo.players=3"], ["algo.players=3", "strategy=decoupled"], id="players-coupled"),
    # V-trace applies in the recomputation the refresh turns off: the run went on without either
    pytest.param(
        ["algo.lag_vtrace=true", "algo.lag_refresh_advantages=false"],
        ["algo.lag_vtrace=true", "algo.lag_refresh_advantages=false turns off"],
        id="vtrace-without-refresh",
    ),
    # 1 - clip_coef <= 0: a falling ratio went unclipped, and the run trained without a word
    pytest.param(["algo.clip_coef=1"], ["algo.clip_coef=1", "out of range", "(0, 1)"], id="clip-coef-1"),
    pytest.param(["algo.clip_coef=0"], ["algo.clip_coef=0", "out of range", "(0, 1)"], id="clip-coef-0"),
    # numbers: type
    pytest.param(["algo.lr=abc"], ["algo.lr='abc'", "must be a finite number"], id="lr-not-number"),
    pytest.param(
        ["algo.total_steps=abc"],
        ["algo.total_steps='abc'", "must be a finite number"],
        id="total-steps-not-number",
    ),
    pytest.param(["algo.lr=nan"], ["algo.lr=nan", "must be a finite number"], id="lr-nan"),
    pytest.param(["algo.lr=null"], ["algo.lr", "required"], id="lr-null"),
    pytest.param(["env.num_envs=2.5"], ["env.num_envs=2.5", "whole number"], id="num-envs-fraction"),
    # batch layout, pinned to 128 rollout steps x 4 envs = 512 samples
    pytest.param(
        [*BATCH_512, "algo.minibatch_size=100"],
        ["algo.minibatch_size=100", "does not divide", "512", "128"],
        id="minibatch-not-divisor",
    ),
    pytest.param(  # it suggested 8, which the sequence check then refused (8 steps, not whole sequences of 16)
        ["exp=cartpole_lstm", "algo.minibatch_size=24"],
        ["algo.minibatch_size=24", "does not divide the batch of 256", "such as 16, 32, 64"],
        id="minibatch-not-divisor-recurrent",
    ),
    pytest.param(  # it trained, then failed at its first evaluation: a traceback and no checkpoint
        ["env=pettingzoo", "env.id=tests.envs.factory_envs:three_player_turns"],
        ["plays two-player games", "has 3 players (first, second, third): set eval.every=0"],
        id="three-player-game-evaluated",
    ),
    pytest.param(  # a misspelt key added with + trained as if it were not there
        ["+algo.lrr=3e-4"],
        ["+algo.lrr: ppo-fabric reads no such key", "--cfg job --package algo lists them"],
        id="added-key-nothing-reads",
    ),
    pytest.param(  # Hydra's "'algo.target_kl' does not exist" of a key that holds null
        ["~algo.target_kl"],
        ["~algo.target_kl: nothing to delete (no such key, or it holds null already"],
        id="delete-a-null",
    ),
    pytest.param(  # it was told env.kwargs is an unknown key
        ["env.kwargs={a:1,b:2}"],
        ["env.kwargs: it holds no key 'a'; add keys with +env.kwargs.a=VALUE, or give the mapping whole"],
        id="dict-into-an-empty-mapping",
    ),
    pytest.param(  # it was read as the default set of opponents
        ["exp=connect_four", "eval.opponents=[]"],
        ["eval.opponents=[] names no opponent", "eval.every=0"],
        id="no-opponents",
    ),
    pytest.param(
        ["algo.minibatch_size=1"],
        ["algo.minibatch_size", "at least 2", "algo.norm_adv"],
        id="minibatch-1-norm-adv",
    ),
    pytest.param(
        [*BATCH_512, "algo.total_steps=100"],
        ["algo.total_steps=100", "smaller than one batch", "512"],
        id="total-steps-below-batch",
    ),
    pytest.param(
        ["strategy=decoupled"],
        ["strategy=decoupled", "at least 2 processes", "fabric.devices"],
        id="decoupled-one-process",
    ),
    # choices and booleans
    pytest.param(["env.vector=foo"], ["env.vector='foo'", "sync", "async"], id="vector-choice"),
    pytest.param(["strategy=foo"], ["strategy='foo'", "coupled", "decoupled"], id="strategy-choice"),
    pytest.param(
        ["model.activation=foo"], ["model.activation='foo'", "tanh", "relu"], id="activation-choice"
    ),
    pytest.param(
        ["fabric.accelerator=tpu"], ["fabric.accelerator='tpu'", "cpu", "cuda"], id="accelerator-choice"
    ),
    pytest.param(["algo.anneal_lr=maybe"], ["algo.anneal_lr='maybe'", "true or false"], id="bool"),
    # null read as sampled actions and as evaluation off, silently
    pytest.param(
        ["eval.deterministic=null"],
        ["eval.deterministic=null", "true or false"],
        id="eval-deterministic-null",
    ),
    pytest.param(["eval.every=null"], ["eval.every=null", "or auto"], id="eval-every-null"),
    pytest.param(["model.actor_hidden=[0]"], ["model.actor_hidden=[0]", "positive widths"], id="hidden-zero"),
    pytest.param(
        ["model.actor_hidden=64"], ["model.actor_hidden=64", "list of positive widths"], id="hidden-not-list"
    ),
    # override syntax
    pytest.param(["seed=[1"], ["cannot parse override", "[1"], id="syntax-unclosed-list"),
    pytest.param(["algo.lr"], ["cannot parse override", "algo.lr"], id="syntax-no-value"),
    pytest.param(
        ["multiagent.policy_mapping={x:a}"],
        ["multiagent.policy_mapping", "single-agent", "PettingZoo"],
        id="ma-map",
    ),
    pytest.param(
        ["hydra.run.dir=/proc/x/run"], ["hydra.run.dir=/proc/x/run", "cannot be created"], id="run-dir-proc"
    ),
    pytest.param(  # it said only that module 'CartPole-v1' cannot be imported
        ["exp=connect_four", "env.id=CartPole-v1"],
        ["env.id='CartPole-v1'", "a gymnasium id needs env=gym"],
        id="gym-id-in-a-pettingzoo-recipe",
    ),
    # a directory that exists but takes no files (even root's): it was said to be one that "cannot be created"
    pytest.param(["hydra.run.dir=/sys"], ["hydra.run.dir=/sys is not writable ("], id="run-dir-unwritable"),
    # resume (paths that exist are covered by the tests below)
    pytest.param(
        ["resume=/nonexistent/ppo-fabric/last.ckpt"],
        ["resume='/nonexistent/ppo-fabric/last.ckpt'", "no such checkpoint"],
        id="resume-missing",
    ),
]


@pytest.mark.parametrize(("overrides", "fragments"), CASES)
def test_bad_config_is_one_line_naming_the_key(overrides: list[str], fragments: list[str]) -> None:
    """Each bad override gives a single line that names the key and, where there is one, the fix."""
    message = _config_error(overrides)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from {message!r}"


def test_a_logger_option_without_plot_is_taken() -> None:
    """`logger.plot` came after users wrote logger options of their own: one without it plots (the
    default), and a value that is not a boolean is refused."""
    from ppo_fabric.config.values import check_values, compose

    cfg, _ = compose([])
    with open_dict(cfg):
        del cfg.logger["plot"]
    check_values(cfg)
    with open_dict(cfg):
        cfg.logger.plot = "maybe"
    with pytest.raises(ConfigError, match="logger.plot='maybe' must be true or false"):
        check_values(cfg)


def test_a_tuning_note_by_hand_is_refused() -> None:
    """`tuning=` records where a run's values come from and is set at launch; typed by hand it turned the
    choice of tuned values off (Acrobot trained with CartPole's values under the note `mine`)."""
    with pytest.raises(ConfigError, match=r"^tuning='mine' is not for the command line"):
        ppo_fabric.run(["env.id=Acrobot-v1", "tuning=mine", "algo.total_steps=256"])


def test_runs_started_together_get_their_own_directories() -> None:
    """The default run directory is named to the microsecond: two runs of a loop started in the same
    second shared one name, and the second was refused (the directory in use by a live run)."""
    from ppo_fabric.config.values import compose

    first, second = compose([])[1], compose([])[1]
    assert first != second and first.startswith("runs/") and second.startswith("runs/")


def test_unknown_group_option_lists_every_option() -> None:
    """The user has to pick a valid option next, so all of them, not a sample, must be in the message."""
    message = _config_error(["env=nosuch"])
    for option in group_options("env"):
        assert option in message, f"option {option!r} not listed in {message!r}"


def test_python_api_raises_config_error() -> None:
    """`ppo_fabric.run` is the documented API; it must raise the same `ConfigError`, not start training,
    and a caller catches it (and `RunFault`) by the names the package root gives."""
    with pytest.raises(ppo_fabric.ConfigError, match=r"algo\.lr=0 ") as info:
        ppo_fabric.run(["algo.lr=0"])
    _assert_one_line(str(info.value))
    assert ppo_fabric.ConfigError is ConfigError and ppo_fabric.RunFault is RunFault
    assert {"ConfigError", "RunFault"} <= set(ppo_fabric.__all__)


# ------------------------------------------------------------------------------------- optional extras
@pytest.mark.parametrize(
    "overrides", [["env.id=LunarLander-v3"], ["env=lunarlander"]], ids=["env-id", "env-group"]
)
def test_missing_extra_names_the_pip_extra(overrides: list[str]) -> None:
    """Without box2d, the one useful thing to say is which extra to install; gymnasium's text names a wheel."""
    if importlib.util.find_spec("Box2D") is not None:
        pytest.skip("box2d is installed here, so LunarLander builds")
    message = _config_error(overrides)
    assert "env.id='LunarLander-v3'" in message, message
    assert "ppo-fabric[box2d]" in message, message


# ---------------------------------------------------------------------------------------------- resume
@pytest.fixture(scope="module")
def finished_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real checkpoint from the smallest CartPole run, so resume checks see what training writes."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    summary = ppo_fabric.run(["env.id=CartPole-v1", *TINY, f"hydra.run.dir={run_dir}"])
    checkpoint = Path(summary["checkpoint"])
    assert checkpoint.is_file(), summary
    return checkpoint


def test_resume_garbage_file(tmp_path: Path) -> None:
    """A file that is not a torch pickle must be refused up front, not fail after the processes start."""
    garbage = tmp_path / "last.ckpt"
    garbage.write_bytes(b"\x00\xffthis is not a checkpoint\x80" * 16)
    message = _config_error([f"resume={garbage}"])
    assert f"resume='{garbage}'" in message and "not a readable checkpoint" in message, message


def test_resume_empty_file(tmp_path: Path) -> None:
    """A zero-byte file (a copy interrupted early) must read as unreadable, not as an EOF traceback."""
    empty = tmp_path / "last.ckpt"
    empty.write_bytes(b"")
    message = _config_error([f"resume={empty}"])
    assert f"resume='{empty}'" in message and "not a readable checkpoint" in message, message


def test_resume_foreign_torch_file(tmp_path: Path) -> None:
    """A valid torch file from some other program loads fine; the format check must still refuse it."""
    foreign = tmp_path / "model.pt"
    torch.save({"state_dict": {}}, foreign)
    message = _config_error([f"resume={foreign}"])
    assert f"resume='{foreign}'" in message and "not a ppo-fabric checkpoint" in message, message


def test_resume_other_env(finished_checkpoint: Path) -> None:
    """Acrobot has other spaces than CartPole: loading those weights would crash or silently mislearn."""
    message = _config_error([f"resume={finished_checkpoint}", "env.id=Acrobot-v1"])
    for fragment in (f"resume='{finished_checkpoint}'", "CartPole-v1", "Acrobot-v1", "env.id"):
        assert fragment in message, f"{fragment!r} missing from {message!r}"


def test_resume_other_model(finished_checkpoint: Path) -> None:
    """Different hidden widths mean the saved state dict cannot load into the new network."""
    message = _config_error(
        [f"resume={finished_checkpoint}", "model.actor_hidden=[32]", "algo.total_steps=1024"]
    )
    assert f"resume='{finished_checkpoint}'" in message and "model" in message, message


def test_resume_already_finished(finished_checkpoint: Path) -> None:
    """Resuming at the same budget would start Fabric just to do nothing; say how to train further."""
    message = _config_error([f"resume={finished_checkpoint}", "algo.total_steps=512"])
    assert "algo.total_steps=512" in message and "raise algo.total_steps" in message, message


def test_resume_compatible_checkpoint_is_accepted(finished_checkpoint: Path) -> None:
    """The guard against the cases above must not also refuse the legitimate resume; the line it prints
    shows the values as the run takes them (`algo.total_steps=1.024e3` is 1024, not 1024.0)."""
    _, _, facts = load([f"resume={finished_checkpoint}", "algo.total_steps=1.024e3"])
    (before, now) = facts["resume_changes"]["algo.total_steps"]
    assert now == 1024 and isinstance(now, int) and before < now


# ------------------------------------------------------------------------------ fixed gaps (regressions)
_NO_CUDA = pytest.mark.skipif(
    torch.cuda.is_available(), reason="a CUDA device is present, so fabric=gpu is valid"
)


def _case(overrides: list[str], key: str, *, forbidden: str = "", cuda_free: bool = False) -> Any:
    """A case that once escaped validation (traceback, exit 0, or an unrelated message). A job of several
    processes is refused by the child `run()` starts for it: a `multiprocess` test."""
    marks = [_NO_CUDA] if cuda_free else []
    if "fabric.devices=2" in overrides:
        marks.append(pytest.mark.multiprocess)
    return pytest.param(overrides, key, forbidden, id=overrides[0], marks=marks)


REGRESSIONS: list[Any] = [
    _case(["env=gym"], "env.id"),
    _case(["algo.lr=inf"], "algo.lr"),
    _case(["algo.clip_coef=inf"], "algo.clip_coef"),
    _case(["collectives.timeout=inf"], "collectives.timeout"),
    _case(["fabric.precision=foo"], "fabric.precision"),
    _case(["fabric.strategy=foo"], "fabric.strategy"),
    _case(["fabric=gpu"], "fabric.accelerator", cuda_free=True),
    _case(["model.encoder=foo"], "model.encoder", forbidden="env.id="),
    _case(["env.kwargs=5"], "env.kwargs"),
    _case(["seed=[1"], "seed=[1"),
    _case(["=1"], "'=1'"),
    # strings Hydra reads for "off", which `if` takes for true: self-play and normalisation came on
    _case(["selfplay.enabled=off"], "selfplay.enabled='off' must be true or false"),
    _case(["env.normalize_obs=no"], "env.normalize_obs='no' must be true or false"),
    _case(["model=lstm", "model.lstm.shared=off"], "model.lstm.shared='off' must be true or false"),
    # accepted, then a traceback in the job (a rank failure the supervisor would restart)
    _case(["algo.max_skipped_updates=null"], "algo.max_skipped_updates is required"),
    _case(["eval.episodes=null"], "eval.episodes is required"),
    _case(["model=lstm", "model.lstm.seq_len=null"], "model.lstm.seq_len is required"),
    _case(["env.on_error=restart", "env.max_restarts=null"], "env.max_restarts is required"),
    _case(["env.observation_noise=abc"], "env.observation_noise='abc' must be a finite number"),
    _case(["seed=5000000000"], "seed=5000000000 is out of range; it must be in [0, 4294967295]"),
    _case(["fabric.accelerator=mps"], "no MPS device", cuda_free=True),
    _case(
        ["fabric.precision=bf16-true"],
        "fabric.precision=bf16-true (every parameter in that type) is not supported",
    ),
    _case(["fabric.precision=64-true"], "fabric.precision=64-true (every parameter"),
    _case(
        ["strategy=decoupled", "fabric.devices=2", "fabric.accelerator=mps"],
        "trainers run on CUDA or the CPU",
    ),
    # checked in the job (exp=tictactoe), or ignored (CartPole)
    _case(["exp=tictactoe", "eval.opponents=[foo]", "algo.total_steps=1024"], "opponent=foo is unknown"),
    _case(["eval.opponents=[random]"], "eval.opponents is set but env.id=CartPole-v1 is a single-agent env"),
]


@pytest.mark.parametrize(("overrides", "key", "forbidden"), REGRESSIONS)
def test_validation_regressions(overrides: list[str], key: str, forbidden: str, tmp_path: Path) -> None:
    """Through `run` (not `load`), since some of these once failed only after Fabric was built."""
    with pytest.raises(ConfigError) as info:
        ppo_fabric.run([*TINY, f"hydra.run.dir={tmp_path / 'run'}", *overrides])
    message = str(info.value)
    _assert_one_line(message)
    assert key in message, f"{key!r} missing from {message!r}"
    assert not forbidden or forbidden not in message, message


def test_a_yaml_syntax_error_names_its_file_line_and_column(tmp_path: Path) -> None:
    """It said only `while parsing a flow sequence`."""
    (tmp_path / "bad.yaml").write_text("defaults:\n  - config\n  - _self_\nalgo:\n  lr: [1, 2\n")
    with pytest.raises(ConfigError) as info:
        compose([], config_path=str(tmp_path), config_name="bad")
    assert str(info.value) == (
        f"{tmp_path / 'bad.yaml'}, line 6, column 1: YAML syntax: expected ',' or ']', but got '<stream end>' "
        "(while parsing a flow sequence)"
    )


def test_a_resume_naming_a_key_of_the_runs_own_option_is_told_so(tmp_path: Path) -> None:
    """`resume=... model.lstm.seq_len=16` of an exp=cartpole_lstm run was told to add +model.lstm.seq_len,
    which then said it cannot change: the key is the run's own option's, not the default config's."""
    message = _config_error([f"resume={tmp_path / 'last.ckpt'}", "model.lstm.seq_len=16"])
    assert message.startswith("model.lstm.seq_len: not a key of the default config, over which a resume's"), (
        message
    )
    assert "name that option beside it" in message and "+model.lstm" not in message, message
    # a kwarg the run added (+env.kwargs.after), with resume=auto alike: it said "unknown config key"
    message = _config_error(["resume=auto", "env.kwargs.after=1500"])
    assert message.startswith("env.kwargs.after: not a key of the default config, over which a resume's"), (
        message
    )
    assert message.endswith(
        "or one the run added (+env.kwargs.after=VALUE changes it, with resume_overrides=allow)"
    )


def test_resume_names_the_changed_key(finished_checkpoint: Path) -> None:
    """A user who changed one width needs to see which one."""
    message = _config_error(
        [f"resume={finished_checkpoint}", "model.actor_hidden=[32]", "algo.total_steps=1024"]
    )
    assert "model.actor_hidden=[32]" in message and "[64, 64]" in message, message


def test_resume_directory_points_at_the_file(tmp_path: Path) -> None:
    """A directory is named with a file it holds; one that holds none was told to use a last.ckpt it lacked."""
    message = _config_error([f"resume={tmp_path}"])
    assert "is a directory that holds no checkpoints/*.ckpt" in message and "last.ckpt" not in message, (
        message
    )
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step_000000000512_ab12cd34.ckpt").write_bytes(b"")
    message = _config_error([f"resume={tmp_path}"])
    assert message.endswith(f"such as {tmp_path / 'checkpoints' / 'step_000000000512_ab12cd34.ckpt'}"), (
        message
    )
    # the head of the run's timeline, not the highest-numbered file (a branch a resume left, pasted back)
    (tmp_path / "checkpoints" / "step_000000016384_9b0ba3d5.ckpt").write_bytes(b"")
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"")
    assert _config_error([f"resume={tmp_path}"]).endswith(f"such as {tmp_path / 'checkpoints' / 'last.ckpt'}")


# ------------------------------------------------------------------------------------------------- CLI
def _cli(args: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run `python -m ppo_fabric` the way a user does, from an unrelated directory."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("PPO_FABRIC_TRACEBACK", "LT_CLI_USED", "WORLD_SIZE")
    }
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "ppo_fabric", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return proc, time.monotonic() - start


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        pytest.param(["env.id=CartPol-v1"], "CartPole-v1", id="env-near-miss"),
        pytest.param(["env=nosuch"], "available:", id="group-option"),
        pytest.param(["seed=[1"], "cannot parse override", id="syntax"),
        pytest.param(["resume=last.ckpt"], "not a readable checkpoint", id="resume-garbage-relative"),
        pytest.param(
            ["hydra.run.dir=/proc/ppo-fabric-run"],
            "hydra.run.dir=/proc/ppo-fabric-run",
            id="run-dir-uncreatable",
        ),
        pytest.param(
            ["multiagent.policies={a:{},b:{}}"], "multiagent.policies", id="multiagent-on-gymnasium-env"
        ),
    ],
)
def test_cli_exits_2_with_one_stderr_line(args: list[str], fragment: str, tmp_path: Path) -> None:
    """Scripts rely on exit 2 for usage errors; users must see one line, not a traceback or warnings."""
    (tmp_path / "last.ckpt").write_bytes(b"garbage" * 8)  # relative to cwd, like a user typing a path
    proc, elapsed = _cli(args, tmp_path)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stdout == "", proc.stdout
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ppo-fabric: error: "), lines[0]
    assert fragment in lines[0], lines[0]
    assert elapsed < 30, f"took {elapsed:.1f}s to reject a config"
    assert not (tmp_path / "runs").exists(), "a rejected config must not create a run directory"


@pytest.mark.parametrize(
    ("missing", "fragment"),
    [
        ("envpool", "env.backend=envpool needs EnvPool"),
        ("dm_env", "does not import (No module named 'dm_env')"),
    ],
)
def test_envpool_that_does_not_import_is_named(
    monkeypatch: pytest.MonkeyPatch, missing: str, fragment: str
) -> None:
    """EnvPool missing, or installed without a dependency of its own (found, then failing to import): one
    line that says which."""
    import importlib

    real = importlib.import_module

    def import_module(name: str, *args: Any) -> Any:
        if name == "envpool":
            raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", import_module)
    with pytest.raises(ConfigError) as error:
        load(["env.backend=envpool", "algo.total_steps=512"])
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_under_fabric_run_each_nodes_first_rank_says_the_mistake(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every rank `fabric run` started checks the same command line: the line came once per rank. Each
    node's first rank says it (another node may find another mistake)."""
    from ppo_fabric.config.arguments import fail

    monkeypatch.setenv("LT_CLI_USED", "1")
    for rank, said in (("1", ""), ("0", "ppo-fabric: error: restarts=2 needs the supervisor\n")):
        monkeypatch.setenv("LOCAL_RANK", rank)
        with pytest.raises(SystemExit) as ended:
            fail("restarts=2 needs the supervisor")
        assert ended.value.code == 2 and capsys.readouterr().err == said


def test_a_run_directory_whose_checkpoints_cannot_be_written_is_refused_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run continued in its own directory, whose `checkpoints/` takes no files (a read-only mount, an
    immutable folder), trained its whole session and failed at its final checkpoint."""
    from ppo_fabric.config import values

    (tmp_path / "checkpoints").mkdir()
    writable = values._unwritable
    monkeypatch.setattr(
        values, "_unwritable", lambda d: "Read-only file system" if d.name == "checkpoints" else writable(d)
    )
    message = _config_error([f"hydra.run.dir={tmp_path}"])
    assert message == (
        f"hydra.run.dir={tmp_path}: {tmp_path / 'checkpoints'} is not writable (Read-only file system)"
    ), message


def test_a_sweeps_resume_auto_needs_a_stable_sweep_directory(tmp_path: Path) -> None:
    """`-m seed=1,2 hydra.sweep.dir=DIR resume=auto` continues each job in DIR/N: it was refused for the
    timestamped hydra.run.dir, which a sweep's jobs never use."""
    compose(["resume=auto", f"hydra.sweep.dir={tmp_path}"], sweep=True)
    with pytest.raises(
        ConfigError, match=r"^resume=auto needs a stable run directory, but hydra.sweep.dir=multirun/"
    ):
        compose(["resume=auto"], sweep=True)
    with pytest.raises(ConfigError, match=r"but hydra.run.dir=runs/"):  # a run's own check is unchanged
        compose(["resume=auto"])


def test_only_a_checkpoint_at_its_runs_end_owing_its_final_evaluation_resumes_with_nothing_to_train() -> None:
    """A stop during the final evaluation leaves a checkpoint at `algo.total_steps` owing it: its resume
    plays it. A mid-run checkpoint owing its evaluation is not such: resumed with `algo.total_steps` at or
    below its env step, it is refused like any other (it ran as a 'complete' run of nothing)."""
    from ppo_fabric.app.preflight import owes_its_final_evaluation

    def state(step: int, in_flight: int | None, total: int) -> dict:
        return {
            "env_step": step,
            "evaluation": {"in_flight": in_flight},
            "config": {"algo": {"total_steps": total}},
        }

    assert owes_its_final_evaluation(state(1024, 1024, 1024))
    assert owes_its_final_evaluation(state(1024, 1024, 1000))  # the last update passes total_steps
    assert not owes_its_final_evaluation(state(1024, 1024, 2048))  # mid-run
    assert not owes_its_final_evaluation(state(1024, 512, 1024))  # an earlier one, given up
    assert not owes_its_final_evaluation(state(1024, None, 1024)) and not owes_its_final_evaluation(
        {"env_step": 1024, "config": {"algo": {"total_steps": 1024}}}
    )  # nothing owed, or evaluation off
