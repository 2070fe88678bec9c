"""Loading a checkpoint never runs code: crafted files, foreign keys, tampered snapshots, plain spaces."""

from __future__ import annotations

import os
import pickle
import stat
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch

import ppo_fabric
from ppo_fabric.config.values import ConfigError
from ppo_fabric.envs.spaces import space_from_data, space_to_data
from ppo_fabric.runs import checkpoint as ckpt
from ppo_fabric.runs import signing
from tests.conftest import numbered_checkpoint

REPO = Path(__file__).resolve().parents[2]
RUN = ["logger.tensorboard=false", "algo.total_steps=1024"]


class Payload:
    """Unpickling this creates `marker`: proof that loading ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return open, (str(self.marker), "w")


def _last(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "last.ckpt"


def _with_snapshot(tiny_run: Path, dest: Path, pickled: bytes, signature: str) -> Path:
    """The tiny run's real checkpoint with its env snapshot replaced."""
    state = ckpt.load(_last(tiny_run))
    state["ranks"][0]["envs"] = {
        "pickle": torch.frombuffer(bytearray(pickled), dtype=torch.uint8),
        "hmac": signature,
    }
    torch.save(state, dest)
    return dest


def _signed_elsewhere(data: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """`data` signed with another installation's key."""
    with monkeypatch.context() as patch:
        patch.setenv(signing.KEY_FILE_ENV, str(tmp_path / "other_key"))
        return signing.sign(data)


@pytest.fixture(params=["object", "snapshot"])
def crafted(request: pytest.FixtureRequest, tiny_run: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(checkpoint, marker): a checkpoint-shaped torch file with a payload object in it, or the real
    checkpoint whose env snapshot is a payload pickle with a made-up signature."""
    marker = tmp_path / "MARKER"
    path = tmp_path / "crafted.ckpt"
    if request.param == "object":
        state = ckpt.load(_last(tiny_run))
        torch.save(state | {"agent": Payload(marker)}, path)
    else:
        _with_snapshot(tiny_run, path, pickle.dumps(Payload(marker)), "0" * 64)
    return path, marker


def test_the_payload_runs_when_unpickled(tmp_path: Path) -> None:
    """Guard: the crafted files below really would create the marker if anything unpickled them."""
    marker = tmp_path / "MARKER"
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.exists()


def _one_line(message: str) -> None:
    assert message and "\n" not in message.strip(), message


def test_resume_refuses_a_crafted_checkpoint(crafted: tuple[Path, Path], tmp_path: Path) -> None:
    path, marker = crafted
    with pytest.raises(ConfigError) as exc:
        ppo_fabric.run([*RUN, f"hydra.run.dir={tmp_path / 'run'}", f"resume={path}"])
    _one_line(str(exc.value))
    assert f"resume='{path}'" in str(exc.value)
    assert not marker.exists()


@pytest.mark.multiprocess
@pytest.mark.parametrize("tool", ["evaluate", "export"])
def test_tools_refuse_a_crafted_checkpoint(tool: str, tmp_path: Path, tiny_run: Path) -> None:
    marker = tmp_path / "MARKER"
    path = tmp_path / "crafted.ckpt"
    torch.save(ckpt.load(_last(tiny_run)) | {"agent": Payload(marker)}, path)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", f"ppo_fabric.{tool}", f"checkpoint={path}", f"out={tmp_path / 'out'}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "not a readable checkpoint" in proc.stderr, proc.stderr
    assert not marker.exists()


def test_evaluate_never_reads_the_env_snapshot(tiny_run: Path, tmp_path: Path) -> None:
    """A payload snapshot, even one 'signed' by this installation, is not unpickled by the tools."""
    from ppo_fabric.policy.evaluate import main as evaluate_main
    from ppo_fabric.policy.export import main as export_main

    marker = tmp_path / "MARKER"
    payload = pickle.dumps(Payload(marker))
    path = _with_snapshot(tiny_run, tmp_path / "x.ckpt", payload, signing.sign(payload))
    assert evaluate_main([f"checkpoint={path}", "episodes=1", f"out={tmp_path}"]) is not None
    assert export_main([f"checkpoint={path}", "format=torchscript", f"out={tmp_path / 'p.pt'}"]) is not None
    assert not marker.exists()


def test_evaluate_builds_no_env_from_a_module_the_checkpoint_names(tiny_run: Path, tmp_path: Path) -> None:
    """A checkpoint is plain data, but the env id in its config can name any module and callable
    (`subprocess:run`, with the arguments in `env.kwargs`): evaluate refuses it in one line unless told
    `trust_env=true`; the env packages ppo-fabric knows are built as before."""
    from ppo_fabric.policy.evaluate import EvalError, evaluate

    marker = tmp_path / "MARKER"
    state = ckpt.load(_last(tiny_run), env_state="fresh")
    state["config"]["env"] |= {"id": "subprocess:run", "kwargs": {"args": ["touch", str(marker)]}}
    crafted = tmp_path / "crafted.ckpt"
    crafted.write_bytes(ckpt.encode(state))
    with pytest.raises(EvalError, match=r"env.id='subprocess:run' would import and run module 'subprocess'"):
        evaluate(crafted, episodes=1, out=tmp_path)
    assert not marker.exists()
    with pytest.raises(EvalError):  # trusted: it runs, and is no gymnasium env
        evaluate(crafted, episodes=1, out=tmp_path, trust_env=True)
    assert marker.exists()


def test_resume_builds_no_env_from_a_module_only_the_checkpoint_names(tiny_run: Path, tmp_path: Path) -> None:
    """`resume=` continues the env its checkpoint names: one of a module outside the known env packages
    is built only when the command line names that id too (the user's own env, or a checkpoint they
    trust); otherwise one line, before anything is built."""
    from ppo_fabric.app.preflight import check_env_trusted

    marker = tmp_path / "MARKER"
    state = ckpt.load(_last(tiny_run), env_state="fresh")
    state["config"]["env"] |= {"id": "subprocess:run", "kwargs": {"args": ["touch", str(marker)]}}
    crafted = tmp_path / "crafted.ckpt"
    crafted.write_bytes(ckpt.encode(state))
    with pytest.raises(ValueError, match=r"env.id='subprocess:run' would import and run module 'subprocess'.*"
                                         r"add env.id=subprocess:run if you trust"):  # fmt: skip
        ppo_fabric.run([f"resume={crafted}", f"hydra.run.dir={tmp_path / 'run'}"])
    assert not marker.exists()
    # another id named is the change of env.id no resume makes (it was told to name the checkpoint's to trust it)
    with pytest.raises(ValueError, match=r"env.id.*cannot change on a resume"):
        ppo_fabric.run([f"resume={crafted}", "env.id=tests.faulty_env:FaultyCartPole-v0",
                        f"hydra.run.dir={tmp_path / 'run'}"])  # fmt: skip
    assert not marker.exists()
    check_env_trusted("x", "my_pkg.envs:Mine-v0", "my_pkg.envs:Mine-v0")  # named on the command line
    check_env_trusted("x", "CartPole-v1", "Acrobot-v1")  # registered ids import nothing of the file's
    check_env_trusted("x", "pettingzoo.classic.tictactoe_v3", "CartPole-v1")  # a known env package


def test_snapshot_signed_elsewhere_is_refused_and_resumes_fresh(
    tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real snapshot signed with another key: one line saying how to continue; env_state=fresh drops it."""
    snapshot = ckpt.load(_last(tiny_run))["ranks"][0]["envs"]
    data = snapshot["pickle"].numpy().tobytes()
    path = _with_snapshot(
        tiny_run, tmp_path / "other.ckpt", data, _signed_elsewhere(data, tmp_path, monkeypatch)
    )
    with pytest.raises(ValueError) as exc:
        ckpt.load(path)
    message = str(exc.value)
    _one_line(message)
    assert "not signed on this installation" in message and "resume_env=fresh" in message, message
    with pytest.raises(ConfigError, match="resume_env=fresh"):
        ppo_fabric.run([*RUN, f"hydra.run.dir={tmp_path / 'refused'}", f"resume={path}"])
    fresh = ckpt.load(path, env_state="fresh")
    assert fresh["ranks"][0]["envs"] is None and fresh["env_step"] == 512
    with pytest.raises(ValueError, match="resume_env='maybe'"):
        ckpt.load(path, env_state="maybe")


def test_resume_env_fresh_trains_on(tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """resume_env=fresh continues a checkpoint signed elsewhere, with fresh envs (warned)."""
    data = ckpt.load(_last(tiny_run))["ranks"][0]["envs"]["pickle"].numpy().tobytes()
    path = _with_snapshot(
        tiny_run, tmp_path / "other.ckpt", data, _signed_elsewhere(data, tmp_path, monkeypatch)
    )
    with warnings.catch_warnings(record=True) as caught:  # pytest.warns would hide the expected ValueError
        warnings.simplefilter("always")
        summary = ppo_fabric.run(
            [*RUN, f"hydra.run.dir={tmp_path / 'run'}", f"resume={path}", "resume_env=fresh"]
        )
    assert any("resume_env=fresh" in str(w.message) for w in caught)
    assert summary["total_env_steps"] == 1024


def test_tampered_snapshot_is_never_unpickled(tiny_run: Path, tmp_path: Path) -> None:
    """Bytes changed, signature kept: refused by load and by restore_envs, before any unpickling."""
    marker = tmp_path / "MARKER"
    snapshot = ckpt.load(_last(tiny_run))["ranks"][0]["envs"]
    path = _with_snapshot(tiny_run, tmp_path / "t.ckpt", pickle.dumps(Payload(marker)), snapshot["hmac"])
    with pytest.raises(ValueError, match="not signed on this installation"):
        ckpt.load(path)
    tampered = ckpt.load(path, env_state="fresh")  # reads it; the snapshot is dropped
    assert tampered["ranks"][0]["envs"] is None
    forged = {"pickle": torch.frombuffer(bytearray(pickle.dumps(Payload(marker))), dtype=torch.uint8)}
    with pytest.raises(ValueError, match="never unpickled"):
        ckpt.restore_envs(forged | {"hmac": snapshot["hmac"]}, fallback=None)
    assert not marker.exists()


def _not_checkpoints(tmp_path: Path, tiny_run: Path) -> dict[str, Path]:
    files = {
        name: tmp_path / f"{name}.ckpt" for name in ("random", "truncated", "foreign", "pickled", "plain")
    }
    files["random"].write_bytes(np.random.default_rng(0).bytes(4096))
    real = _last(tiny_run).read_bytes()
    files["truncated"].write_bytes(real[: len(real) // 2])
    torch.save({"a": 1}, files["foreign"])
    torch.save({"format": ckpt.FORMAT_VERSION, "agent": Payload(tmp_path / "MARKER")}, files["pickled"])
    with files["plain"].open("wb") as fh:  # a plain pickle, not a torch archive
        pickle.dump({"format": ckpt.FORMAT_VERSION, "agent": Payload(tmp_path / "MARKER")}, fh, protocol=2)
    return files


def test_not_a_checkpoint_is_one_line(tmp_path: Path, tiny_run: Path) -> None:
    for name, path in _not_checkpoints(tmp_path, tiny_run).items():
        with pytest.raises(ValueError) as exc:
            ckpt.load(path)
        _one_line(str(exc.value))
        expected = "not a ppo-fabric checkpoint" if name == "foreign" else "not a readable checkpoint"
        assert expected in str(exc.value) and f"resume='{path}'" in str(exc.value), (name, str(exc.value))
    assert not (tmp_path / "MARKER").exists()


def test_incomplete_checkpoint_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "x.ckpt"
    torch.save({"format": ckpt.FORMAT_VERSION, "config": {}}, path)
    with pytest.raises(ValueError, match="incomplete ppo-fabric checkpoint .missing observation_space"):
        ckpt.load(path)


def test_the_update_counter_old_names_load_as_today(tiny_run: Path, tmp_path: Path) -> None:
    """Checkpoints of earlier releases named the update counter `iteration`, a pipelined player's behaviour
    `policy_version` and a self-play snapshot's `version`: they load with today's name, `update`."""
    state = ckpt.load(_last(tiny_run))
    updates = state["update"]
    state["iteration"] = state.pop("update")
    state["ranks"][0]["policy_version"] = updates - 1
    snapshot = {"id": 0, "version": 2, "weights": {}, "wins": 0, "draws": 0, "losses": 0}
    state["ranks"][0]["selfplay"] = {"pool": {"next_id": 1, "snapshots": [snapshot]}}
    path = tmp_path / "old_names.ckpt"
    torch.save(state, path)
    loaded = ckpt.load(path, env_state="fresh")
    assert loaded["update"] == updates > 0 and "iteration" not in loaded
    assert (
        loaded["ranks"][0]["behaviour_update"] == updates - 1 and "policy_version" not in loaded["ranks"][0]
    )
    assert loaded["ranks"][0]["selfplay"]["pool"]["snapshots"][0]["update"] == 2


def test_eval_nulls_saved_before_they_were_refused_load_as_what_the_run_did(
    tiny_run: Path, tmp_path: Path
) -> None:
    """`eval.every: null` (evaluation off) and `eval.deterministic: null` (sampled actions) in a run saved
    before they were refused: its checkpoint loads them as 0 and false, and a resume needs no override."""
    from ppo_fabric.app.preflight import load

    state = ckpt.load(_last(tiny_run))
    state["config"]["eval"]["every"] = None
    state["config"]["eval"]["deterministic"] = None
    path = tmp_path / "old_eval.ckpt"
    torch.save(state, path)
    loaded = ckpt.load(path, env_state="fresh")["config"]["eval"]
    assert (loaded["every"], loaded["deterministic"]) == (0, False)
    cfg, _, _ = load([f"resume={path}", "algo.total_steps=1024", f"hydra.run.dir={tmp_path / 'run'}"])
    assert (cfg.eval.every, cfg.eval.deterministic) == (0, False)


@pytest.mark.parametrize("spaces_pickled", [True, False])
def test_older_format_is_named(tmp_path: Path, spaces_pickled: bool) -> None:
    """Format 1 pickled gymnasium spaces (weights_only refuses it): its format is read without running it."""
    path = tmp_path / "old.ckpt"
    torch.save(
        {"format": 1, "config": {}, "observation_space": gym.spaces.Discrete(2) if spaces_pickled else 0},
        path,
    )
    with pytest.raises(ValueError) as exc:
        ckpt.load(path, key="checkpoint")
    _one_line(str(exc.value))
    assert "older ppo-fabric (format 1)" in str(exc.value) and "start a new run" in str(exc.value)


def test_checkpoint_is_plain_data(tiny_run: Path) -> None:
    """What training writes loads with the restricted unpickler, snapshot signed and spaces readable."""
    state = torch.load(_last(tiny_run), map_location="cpu", weights_only=True)
    assert state["format"] == ckpt.FORMAT_VERSION
    snapshot = state["ranks"][0]["envs"]
    assert snapshot["pickle"].dtype == torch.uint8 and len(snapshot["hmac"]) == 64
    env = gym.make("CartPole-v1")
    assert ckpt.saved_spaces(state) == (env.observation_space, env.action_space)
    with pytest.raises(TypeError, match="cannot hold a Payload"):
        ckpt.to_plain({"x": [Payload(Path("unused"))]})


# ------------------------------------------------------------------------------------------------ key
def test_key_file_is_private_and_stable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "config" / "ppo-fabric" / "key"
    monkeypatch.delenv(signing.KEY_FILE_ENV)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    assert signing.key_path() == path
    first = signing.key()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(first) == 32
    assert signing.key() == first and signing.verify(b"x", signing.sign(b"x"))
    assert not signing.verify(b"y", signing.sign(b"x")) and not signing.verify(b"x", None)


def test_concurrent_creators_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks starting together: one creates the key (O_EXCL), the rest read it, all end with the same."""
    monkeypatch.setenv(signing.KEY_FILE_ENV, str(tmp_path / "key"))
    barrier, keys = threading.Barrier(8), []

    def create() -> None:
        barrier.wait()
        keys.append(signing.key())

    threads = [threading.Thread(target=create) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(keys) == 8 and len(set(keys)) == 1
    assert bytes.fromhex((tmp_path / "key").read_text()) == keys[0]


def test_reader_waits_for_a_key_being_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The O_EXCL loser may read the file between its creation and the write: it waits, then agrees."""
    path = tmp_path / "key"
    monkeypatch.setenv(signing.KEY_FILE_ENV, str(path))
    path.touch(mode=0o600)
    timer = threading.Timer(0.2, path.write_text, args=("ab" * 32,))
    timer.start()
    assert signing.key() == bytes.fromhex("ab" * 32)
    timer.join()


def test_broken_key_file_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "key"
    monkeypatch.setenv(signing.KEY_FILE_ENV, str(path))
    path.write_text("zz" * 32)
    with pytest.raises(ValueError, match="not a ppo-fabric key"):
        signing.key()


def test_a_key_file_of_other_bytes_is_refused_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random bytes raised UnicodeDecodeError at the run's first checkpoint: a traceback after the training,
    and no checkpoint written. Now the same line as for a wrong key, before the run starts."""
    path = tmp_path / "key"
    monkeypatch.setenv(signing.KEY_FILE_ENV, str(path))
    path.write_bytes(bytes(range(128, 160)))
    with pytest.raises(ValueError, match=r"key is not a ppo-fabric key \(64 hex digits\); delete it"):
        signing.key()
    with pytest.raises(ppo_fabric.ConfigError, match=r"key is not a ppo-fabric key \(64 hex digits\)"):
        ppo_fabric.run(["algo.total_steps=64", "logger=none", f"hydra.run.dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run" / "checkpoints").exists()


# --------------------------------------------------------------------------------------------- spaces
SPACES = [
    gym.spaces.Box(-np.inf, np.inf, (4,), np.float32),
    gym.spaces.Box(np.array([-1.0, 0.0]), np.array([1.0, 5.5]), dtype=np.float64),
    gym.spaces.Box(0, 255, (6, 5, 3), np.uint8),
    gym.spaces.Box(-3, 7, (2,), np.int64),
    gym.spaces.Discrete(5),
    gym.spaces.Discrete(3, start=-1),
    gym.spaces.MultiDiscrete([[2, 3], [4, 5]], start=[[0, 1], [-1, 2]]),
    gym.spaces.MultiDiscrete([3, 3], dtype=np.int32),
    gym.spaces.MultiBinary(3),
    gym.spaces.MultiBinary([2, 4]),
    gym.spaces.Dict({"pos": gym.spaces.Box(-1, 1, (2,)), "flag": gym.spaces.Discrete(2)}),
    gym.spaces.Tuple((gym.spaces.Discrete(4), gym.spaces.Dict({"a": gym.spaces.MultiBinary(2)}))),
]


@pytest.mark.parametrize("space", SPACES, ids=lambda s: type(s).__name__)
def test_space_round_trip(space: gym.Space, tmp_path: Path) -> None:
    torch.save(space_to_data(space), tmp_path / "s.pt")
    back = space_from_data(torch.load(tmp_path / "s.pt", weights_only=True))
    assert back == space and type(back) is type(space) and back.dtype == space.dtype
    if isinstance(space, gym.spaces.Dict):
        assert list(back.spaces) == list(space.spaces), "Dict keeps its key order"


def test_unknown_spaces_are_one_line() -> None:
    with pytest.raises(ValueError, match="a Text space cannot be stored in a checkpoint; supported: Box"):
        space_to_data(gym.spaces.Text(5))
    with pytest.raises(ValueError, match="not a stored gymnasium space"):
        space_from_data({"type": "Evil"})
    with pytest.raises(ValueError, match="a stored Box space is malformed"):
        space_from_data({"type": "Box", "low": 1})


@pytest.mark.slow  # seconds in process (a run, or every option composed): not the unit tier
def test_dict_observations_resume_exactly(tmp_path: Path) -> None:
    """The carried next observation of Dict spaces is saved as a dict of tensors and resumes bit-exactly."""
    base = ["env=gym", "env.id=tests.pixel_envs:DictPixels-v0", "env.num_envs=2", "algo.total_steps=128",
            "algo.rollout_steps=32", "algo.minibatch_size=32", "logger=none", "seed=5"]  # fmt: skip
    ppo_fabric.run([*base, f"hydra.run.dir={tmp_path / 'full'}"])
    ppo_fabric.run([*base, f"hydra.run.dir={tmp_path / 'part'}", "checkpoint.every=1", "checkpoint.keep=0"])
    middle = numbered_checkpoint(tmp_path / "part", 1)
    assert set(ckpt.load(middle)["ranks"][0]["carry"]["main"]["next_obs"]) == {"image", "vec"}
    ppo_fabric.run([*base, f"hydra.run.dir={tmp_path / 'resumed'}", f"resume={middle}"])
    full, resumed = (ckpt.load(_last(tmp_path / name))["agent"] for name in ("full", "resumed"))
    assert all(torch.equal(full[k], resumed[k]) for k in full)
