"""Shared by the tests: one tiny trained run (never modified), the bad-input check, a CartPole env config,
the environment of `python -m ppo_fabric` subprocesses and the processes of a job."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from omegaconf import DictConfig, OmegaConf

import ppo_fabric
from ppo_fabric.config.defaults import with_defaults
from ppo_fabric.envs.multiagent import SINGLE
from ppo_fabric.learn.learners import Learner, PolicySpec, build_learners

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def signing_key_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Env snapshots are signed with a key file created on first use: the suite's goes to a temp dir, never
    into the home directory (subprocesses inherit the variable). Session-wide, so every test and session
    fixture (tiny_run) signs with the same key; a test wanting another key sets PPO_FABRIC_KEY_FILE itself."""
    path = tmp_path_factory.mktemp("signing") / "key"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PPO_FABRIC_KEY_FILE", str(path))
        yield path


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 512-step CartPole run (two updates, about a second): a real checkpoint, metrics.csv and plot.

    Session-scoped so the evaluate and export tests pay for one training run, not one per test.
    """
    run_dir = tmp_path_factory.mktemp("tiny_run")
    ppo_fabric.run(["algo.total_steps=512", "logger.tensorboard=false", f"hydra.run.dir={run_dir}"])
    return run_dir


def assert_cli_failure(
    capsys: pytest.CaptureFixture[str], main: Callable[[list[str]], Any], argv: list[str], fragment: str
) -> None:
    """Bad input exits 2 with exactly one `ppo-fabric: error:` line naming the problem."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ppo-fabric: error: "), err
    assert fragment in err, err


def env_section(**values: Any) -> DictConfig:
    """A hand-built `env` section completed as the package completes a config (`config.defaults`), without
    the normalisation warm-up unless asked: hand-computed statistics start from the reset states."""
    return OmegaConf.create(with_defaults({"env": {"normalize_warmup": 0, **values}})["env"])


def algo_section(**values: Any) -> DictConfig:
    """A hand-built `algo` section, every key it leaves out at its conf/algo/ppo.yaml default."""
    return OmegaConf.create(with_defaults({"algo": values})["algo"])


def cartpole_env_cfg(num_envs: int, max_episode_steps: int | None, **extra: Any) -> DictConfig:
    """conf/env/cartpole.yaml with sync envs and a short time limit, so rollouts hold truncations as well."""
    return env_section(id="CartPole-v1", num_envs=num_envs, vector="sync", action_repeat=1,
                       max_episode_steps=max_episode_steps, kwargs={}, **extra)  # fmt: skip


def single_learner(fabric: Any, cfg: DictConfig, obs_space: Any, action_space: Any) -> Learner:
    """The one learner of a single-agent run, as `ppo.main()` builds it, from `cfg.model` and `cfg.algo`."""
    spec = PolicySpec(SINGLE, obs_space, action_space, cfg.model, float(cfg.algo.lr), True, 1)
    return build_learners(fabric, {SINGLE: spec}, None, float(cfg.algo.adam_eps))[SINGLE]


def update_with_config(
    fabric: Any, model: Any, optimizer: Any, batch: Any, algo: DictConfig, *args: Any, **kwargs: Any
) -> dict[str, float]:
    """`update.update_policy` with the settings read from an `algo` config, as the strategies read them."""
    from ppo_fabric.learn.settings import UpdateSettings
    from ppo_fabric.learn.update import update_policy

    return update_policy(fabric, model, optimizer, batch, UpdateSettings.of(algo), *args, **kwargs)


def numbered_checkpoint(run_dir: Path, update: int) -> Path:
    """The numbered checkpoint a run wrote after `update` updates (files are named by env step and run id)."""
    from ppo_fabric.runs import checkpoint as ckpt

    found = [
        p
        for p in (run_dir / "checkpoints").glob("step_*.ckpt")
        if ckpt.load(p, env_state="fresh")["update"] == update
    ]
    assert len(found) == 1, f"{len(found)} checkpoints of update {update} in {run_dir}"
    return found[0]


def benchmark_script(monkeypatch: pytest.MonkeyPatch, name: str) -> Any:
    """`benchmarks/<name>.py` as a module (the scripts are not a package), registered in `sys.modules` for its
    dataclasses, with `benchmarks/` on the path for the `common` it imports; both undone after the test."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def fabric_run_port() -> str:
    """`--main-port=N` for a `fabric run` command: a port free now. torchrun's rendezvous listens on 29400 by
    default, so two `fabric run` tests on two workers at once failed with EADDRINUSE."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return f"--main-port={sock.getsockname()[1]}"


def job_env(supervisor: bool = True) -> dict[str, str]:
    """The environment `python -m ppo_fabric` subprocesses run in: this checkout's package, unbuffered
    output, and no `fabric run` marker inherited from the test process.

    `supervisor=False`: the command runs the job itself, without the supervising parent process (what a
    supervisor's relaunch runs), for tests of what the job does: a process and its imports fewer to start.
    The supervisor's own behaviour (checks, signals, restarts, exit codes) is tested with it on."""
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    for name in (
        "LT_CLI_USED",
        "PPO_FABRIC_SUPERVISED",
        "PPO_FABRIC_SUPERVISOR_PID",
        "PPO_FABRIC_OWN_RUN_DIR",
    ):
        env.pop(name, None)
    if not supervisor:
        env["PPO_FABRIC_SUPERVISED"] = "1"
    return env


def job_processes(run_dir: Path) -> list[int]:
    """Pids of the live processes of the job writing to `run_dir` (the supervisor passes every rank
    `hydra.run.dir=<run_dir>`), the supervisor's own included; zombies do not count. Linux (/proc) only."""
    wanted = f"hydra.run.dir={run_dir}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            state = (proc / "stat").read_bytes().rsplit(b")", 1)[1].split()[0]
            if state != b"Z" and wanted in (proc / "cmdline").read_bytes().split(b"\0"):
                found.append(int(proc.name))
    return found


TIERS = ("multiprocess", "slow", "gpu")
DURATIONS = Path(__file__).resolve().parent / "durations.json"


def _durations() -> dict[str, float]:
    """`durations.json`'s seconds per test; {} when it is missing or not such a mapping (a half-written or
    conflicted file only loses the order, never the run)."""
    try:
        data = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test no other tier claims is a `unit` test: `make test-fast` (`-m unit`) runs those.

    The long tiers run first, and within a tier the tests `durations.json` names longest first (the rest
    after them in collection order): the workers then end together on short tests, not one of them on a
    35-second study while the other cores have nothing left (xdist's worksteal takes from the end of a
    worker's queue). `tests/durations.py` rewrites the file from a run's `--durations` report."""
    for item in items:
        if not any(item.get_closest_marker(tier) for tier in TIERS):
            item.add_marker(pytest.mark.unit)
    rank = {"multiprocess": 0, "slow": 1, "gpu": 2}
    seconds = _durations()

    def key(item: pytest.Item) -> tuple[int, float]:
        tier = min((rank[m.name] for m in item.iter_markers() if m.name in rank), default=3)
        return tier, -seconds.get(item.nodeid, 0.0)

    items.sort(key=key)


def end_group(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL what is left of the process group of `proc` (a job a test started with
    `start_new_session=True`) and reap it, but only while `proc` is not yet reaped: once it is, its pid and
    group id are free, and with pid_max at 32768 a suite goes round them; `os.killpg` on a reaped leader's
    pid killed another test's job that had just been given it (an exit -9 with nothing said)."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def signal_when_ready(
    proc: subprocess.Popen[str], ready: Callable[[], bool], signum: int, wait_s: float = 120
) -> tuple[str, str]:
    """Send `signum` to `proc` once `ready()` holds (failing if it ended first or `wait_s` passed), wait
    for it to end (90 s at most) and return its (stdout, stderr); it is killed on the way out whatever
    happened."""
    try:
        deadline = time.monotonic() + wait_s
        while not ready():
            if proc.poll() is not None or time.monotonic() >= deadline:
                proc.kill()  # still running at the deadline: its output only once it has ended
                pytest.fail(f"never ready (exit {proc.poll()}): {proc.communicate(timeout=30)}")
            time.sleep(0.2)
        proc.send_signal(signum)
        return proc.communicate(timeout=90)
    finally:
        proc.kill()
