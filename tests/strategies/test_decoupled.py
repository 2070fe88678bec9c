"""The decoupled strategy with real processes on CPU (gloo): player/trainer layouts, learning, failures,
resume and the config checks that refuse impossible layouts before any process starts.

Each process start costs a few seconds of imports on a small machine, so every run here is tiny and does
double duty where it can: the probe run that checks learning also checks the 1 player + 2 trainers
layout, and the first half of the resume test also covers the `fabric run` launch path.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import ppo_fabric
from ppo_fabric.app.preflight import load
from ppo_fabric.config.values import ConfigError
from ppo_fabric.models.agent import ActorCritic
from ppo_fabric.policy.evaluate import evaluate
from ppo_fabric.runs import checkpoint as ckpt
from ppo_fabric.runs.checkpoint import saved_spaces
from ppo_fabric.runs.metrics_file import read_rows, series
from tests.conftest import end_group, fabric_run_port, job_env, job_processes, numbered_checkpoint

REPO = Path(__file__).resolve().parents[2]
FABRIC = Path(sys.executable).parent / "fabric"
DECOUPLED_SCRIPT = REPO / "ppo_fabric" / "ppo_decoupled.py"
# 4 envs x 32 steps = 128 samples per player per update; the minibatch (over all trainers) divides it in
# every layout here. CartPole's tuned config trains 20 epochs; 4 keep the runs short.
SMALL = [
    "logger.tensorboard=false",
    "logger.plot=false",
    "eval.every=0",  # no evaluator process where a test does not evaluate (tests that do set it)
    "env.num_envs=4",
    "algo.rollout_steps=32",
    "algo.minibatch_size=64",
    "algo.update_epochs=4",
]
TIMEOUT = 20  # collectives.timeout for the failure tests: a lost peer must end the job well within it


def _env() -> dict[str, str]:
    return job_env()


def _python_m(devices: int, *overrides: str) -> list[str]:
    """`python -m ppo_fabric`: Fabric launches the other ranks as children of this process."""
    return [sys.executable, "-m", "ppo_fabric", "strategy=decoupled", f"fabric.devices={devices}", *overrides]


def _fabric_run(devices: int, *overrides: str) -> list[str]:
    """`fabric run`: torchrun starts every rank and the script must join them, not launch again. With
    `--strategy=ddp`, which Fabric gets as LT_STRATEGY: the job must still build its own group DDP
    (tests/strategies/test_distributed.py runs `fabric run` without the flag)."""
    return [
        str(FABRIC),
        "run",
        "--accelerator=cpu",
        "--strategy=ddp",
        f"--devices={devices}",
        fabric_run_port(),
        str(DECOUPLED_SCRIPT),
        *overrides,
    ]


def _run(cmd: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """A run that must succeed, as the job runs it (its supervisor is tested in tests/app)."""
    proc = subprocess.run(
        cmd, cwd=cwd, env=job_env(supervisor=False), capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ppo-fabric: decoupled") == 1, "only rank 0 prints the summary line"
    return proc


def _single_run_dir(cwd: Path) -> Path:
    """The default run dir is timestamped per process; rank 0's choice must be the only one used."""
    dirs = [p for p in (cwd / "runs").glob("*/*") if p.is_dir()]
    assert len(dirs) == 1, f"ranks wrote to several run directories: {dirs}"
    return dirs[0]


def _check_summary(run_dir: Path, players: int, trainers: int, pipeline: bool, total_steps: int) -> dict:
    """The fields a user reads to know what ran; `ranks_in_sync` covers players as well as trainers."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["strategy"] == "decoupled"
    assert (summary["players"], summary["trainers"]) == (players, trainers)
    assert summary["world_size"] == players + trainers
    assert summary["pipeline"] is pipeline
    assert summary["total_env_steps"] == total_steps
    assert summary["ranks_in_sync"] is True, "players and trainers ended with different parameters"
    assert summary["episodes"] > 0 and summary["final_mean_return"] is not None
    assert set(summary["time_split"]) == {"player", "trainer"}
    roles = ["player"] * players + ["trainer"] * trainers  # one node: the first ranks play
    assert [(r["role"], r["device"]) for r in summary["roles"]] == [(role, "cpu") for role in roles]
    assert (run_dir / "checkpoints" / "last.ckpt").is_file() and (run_dir / "config.yaml").is_file()
    return summary


def _metrics(run_dir: Path) -> list[dict[str, str]]:
    """metrics.csv rows that carry training metrics, in step order."""
    rows = [row for row in read_rows(run_dir / "metrics.csv") if row.get("train/policy_lag")]
    return sorted(rows, key=lambda row: int(row["step"]))


def _check_policy_lag(run_dir: Path, pipeline: bool, updates: int) -> None:
    """With the pipeline every update after the first learns from data one version old; without, none."""
    rows = _metrics(run_dir)
    assert len(rows) == updates, f"expected one metrics row per update, got {len(rows)}"
    lags = [float(row["train/policy_lag"]) for row in rows]
    assert lags[0] == 0.0, "the first rollout is collected with the trainers' initial parameters"
    assert lags[1:] == [1.0 if pipeline else 0.0] * (updates - 1)
    # the decoupled objective's weights (truncated at 1) apply to the lagged batches only
    weights = [float(row["train/is_weight_mean"]) for row in rows]
    truncated = [float(row["train/is_truncated"]) for row in rows]
    for lag, weight, cut in zip(lags, weights, truncated, strict=True):
        if lag == 0:
            assert (weight, cut) == (1.0, 0.0)
        else:
            assert 0.0 < weight <= 1.0 and 0.0 <= cut <= 1.0
    if pipeline:  # the trainers' policy moved between versions: some steps weigh less than 1
        assert any(w < 1.0 for w in weights[1:]) and any(c > 0.0 for c in truncated[1:])
    walls = [float(row["time/wall_s"]) for row in rows]
    assert walls == sorted(walls) and walls[0] > 0


def _agent(path: Path) -> ActorCritic:
    """Rebuild the policy from a checkpoint the way a user would."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    model = ActorCritic(*saved_spaces(state), OmegaConf.create(state["config"]).model)
    model.load_state_dict(state["agent"])
    return model.eval()


# ---------------------------------------------------------------------------------------------- layouts
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("players", "devices", "pipeline"),
    [(1, 2, True), (2, 3, False)],
    ids=["1player-1trainer-pipeline", "2players-1trainer-no-pipeline"],
)
def test_layout_runs_to_the_end(tmp_path: Path, players: int, devices: int, pipeline: bool) -> None:
    """Each layout finishes its schedule with every rank on the same parameters, in one run directory,
    and the policy lag shows whether collection really overlapped training."""
    total = 4096
    overrides = [*SMALL, f"algo.total_steps={total}", f"algo.players={players}", f"algo.pipeline={pipeline}",
                 "eval.every=2048", "eval.episodes=3"]  # fmt: skip
    _run(_python_m(devices, *overrides), tmp_path)
    run_dir = _single_run_dir(tmp_path)
    summary = _check_summary(run_dir, players, devices - players, pipeline, total)
    _check_policy_lag(run_dir, pipeline, total // (128 * players))
    if not pipeline:  # the last row's mean of the last 20 episodes is every player's, as the summary's
        last = [row for row in read_rows(run_dir / "metrics.csv") if row.get("rollout/return_mean20")][-1]
        assert float(last["rollout/return_mean20"]) == pytest.approx(summary["final_mean_return"], rel=1e-9)
    # the first player evaluates the parameters it received at each due update, on envs of its own, on a
    # thread (off the critical path: the run waits only for the final one)
    rows = read_rows(run_dir / "evaluations.csv")
    evaluated = [s for s, _ in series(rows, "eval/return_mean")]
    assert evaluated == [2048, 4096] and summary["evaluation"]["last"]["env_step"] == 4096
    assert all(float(r["time/eval_background_s"]) > 0 for r in rows if r.get("eval/return_mean"))
    # best.ckpt holds the parameters the evaluator scored best: replayed on its seeds, they score the same
    best = run_dir / "checkpoints" / "best.ckpt"
    again = evaluate(checkpoint=str(best), episodes=3, seed=summary["evaluation"]["seed"])
    record = summary["evaluation"]["best"]
    assert again["env_step"] == record["env_step"] and again["mean_return"] == pytest.approx(
        record["return_mean"]
    )
    with pytest.raises(ValueError, match="holds a policy .*not a state to resume"):
        ckpt.load(best)


@pytest.mark.multiprocess
def test_a_rows_episodes_are_those_collected_up_to_its_env_step(tmp_path: Path) -> None:
    """A row at env step s holds the episodes that ended up to s, as a coupled run's does: the pipelined
    player receives update k while rollout k is collected, and its rows counted that rollout's episodes too
    (one rollout early on the x-axis). Each one-step episode of the clock env returns how many steps its
    env had taken, so a row's mean return says which rollout its episodes came from."""
    envs, steps, updates = 2, 8, 5
    overrides = ["logger.tensorboard=false", "logger.plot=false", "env=gym", "env.id=tests.clock_env:make", f"env.num_envs={envs}",
                 f"algo.rollout_steps={steps}", "algo.minibatch_size=8", f"algo.total_steps={envs * steps * updates}",
                 "eval.every=0"]  # fmt: skip
    # update u learnt from rollout u - 1: each env's steps (u - 1) * steps + 1 .. u * steps
    expected = [(u * envs * steps, (u - 1) * steps + (steps + 1) / 2) for u in range(1, updates + 1)]
    coupled = tmp_path / "coupled"
    ppo_fabric.run([*overrides, f"hydra.run.dir={coupled}"])
    for run_dir in (coupled, None):
        if run_dir is None:
            _run(_python_m(2, *overrides, "algo.pipeline=true"), tmp_path)
            run_dir = _single_run_dir(tmp_path)
        rows = [row for row in read_rows(run_dir / "metrics.csv") if row.get("train/approx_kl")]
        got = [(int(row["step"]), float(row["rollout/episode_return"])) for row in rows]
        assert got == expected, run_dir


@pytest.mark.multiprocess
def test_probe_learned_with_two_ddp_trainers(tmp_path: Path) -> None:
    """1 player + 2 trainers with the pipeline: DDP among the trainers and the lagged data still learn.

    ProbeObsAndAction needs both actor and critic to read the observation. The settings are the coupled
    probe test's: the minibatch of 64 is split over the trainers (32 each), so each gradient step sees the
    same samples as one coupled rank would.
    """
    overrides = [
        "env=gym", "env.id=tests.probe_envs:ProbeObsAndAction-v0", "env.num_envs=8", "algo.rollout_steps=16",
        "algo.minibatch_size=64", "algo.total_steps=4096", "algo.lr=2e-3", "seed=0", "logger.tensorboard=false", "logger.plot=false",
    ]  # fmt: skip
    _run(_python_m(3, *overrides), tmp_path)
    run_dir = _single_run_dir(tmp_path)
    summary = _check_summary(run_dir, players=1, trainers=2, pipeline=True, total_steps=4096)
    assert summary["episodes"] == 4096, "every probe episode is one step: one episode per env step"
    _check_policy_lag(run_dir, pipeline=True, updates=32)

    model = _agent(run_dir / "checkpoints" / "last.ckpt")
    observations = torch.tensor([[-1.0], [1.0]])
    with torch.no_grad():
        features = model.actor_body(model.encoder(observations))
        p_right = [model.head.log_prob_entropy(features[i : i + 1], torch.tensor([i]))[0].exp().item()
                   for i in (0, 1)]  # fmt: skip  # action 0 for obs -1, action 1 for obs +1
        value = model.get_value(observations).tolist()
    assert min(p_right) > 0.9, f"P(right action) = {p_right}"
    assert value == pytest.approx([1.0, 1.0], abs=0.1)


# ----------------------------------------------------------------------------------------------- resume
def test_a_trainer_continues_its_own_rng_unless_the_seed_or_the_trainers_changed() -> None:
    """The k-th trainer takes the checkpoint's k-th trainer's RNG (players' parts, which hold envs, skipped);
    a resume with a new seed, or another number of trainers, keeps the RNG as seeded from the new config."""
    from ppo_fabric.ppo_decoupled import saved_trainer_rng

    resume = {"config": {"seed": 7}, "ranks": [{"num_envs": 4, "rng": "p0"}, {"rng": "t0"}, {"rng": "t1"}]}
    assert saved_trainer_rng(resume, 7, [1, 2], 1) == "t0"
    assert saved_trainer_rng(resume, 7, [1, 2], 2) == "t1"
    assert saved_trainer_rng(resume, 7, [2, 3], 3) == "t1"  # another layout with as many trainers
    assert saved_trainer_rng(resume, 8, [1, 2], 1) is None  # resume_overrides=allow seed=8
    assert saved_trainer_rng(resume, 7, [1], 1) is None  # two trainers' states cannot be one trainer's
    assert saved_trainer_rng(None, 7, [1, 2], 1) is None


@pytest.mark.multiprocess
def test_fabric_run_then_exact_resume(tmp_path: Path) -> None:
    """`fabric run` launch path, 1+1 without pipeline; then resume from a numbered checkpoint.

    Without the pipeline, a checkpoint is taken exactly between two updates, so a resumed run must
    retrace the original one: its update-8 parameters equal the original's (the lr is constant so the
    schedule does not depend on total_steps).
    """
    common = [
        *SMALL,
        "algo.pipeline=false",
        "algo.anneal_lr=false",
        "checkpoint.every=2",
        "checkpoint.keep=0",
    ]
    _run(_fabric_run(2, *common, "algo.total_steps=1024"), tmp_path)
    first = _single_run_dir(tmp_path)
    _check_summary(first, players=1, trainers=1, pipeline=False, total_steps=1024)
    _check_policy_lag(first, pipeline=False, updates=8)
    numbered = sorted(int(p.name.split("_")[1]) for p in (first / "checkpoints").glob("step_*.ckpt"))
    assert numbered == [i * 128 for i in (2, 4, 6, 8)]

    resumed = tmp_path / "resumed"
    source = numbered_checkpoint(first, 4)
    _run(
        _python_m(2, *common, "algo.total_steps=1280", f"resume={source}", f"hydra.run.dir={resumed}"),
        tmp_path,
    )  # a longer run than the original: the constant lr keeps update 8 where it was
    summary = _check_summary(resumed, players=1, trainers=1, pipeline=False, total_steps=1280)
    assert summary["steps_this_run"] == 1280 - 4 * 128
    assert summary["resumed_from"] == str(source)
    assert [int(row["step"]) for row in _metrics(resumed)] == list(range(5 * 128, 1280 + 1, 128))
    original = _agent(numbered_checkpoint(first, 8)).state_dict()
    again = _agent(numbered_checkpoint(resumed, 8)).state_dict()
    for key, value in original.items():
        torch.testing.assert_close(again[key], value, rtol=0, atol=0, msg=f"{key} differs after resume")

    # A decoupled checkpoint cannot continue as coupled (its learner/collector state is split differently).
    with pytest.raises(ConfigError, match="strategy") as info:
        load(["strategy=coupled", f"resume={source}", "algo.total_steps=4096", *SMALL])
    assert "\n" not in str(info.value)


@pytest.mark.multiprocess
def test_pipelined_resume_is_exact(tmp_path: Path) -> None:
    """With the pipeline a checkpoint falls while the next rollout is in flight: it must hold the player's
    state from before that rollout and the parameters it was collected with, so the resumed run retraces
    the original one (same parameters at later checkpoints, same number of episodes). The original
    evaluates during training (its evaluator process) and the resumed run does not: evaluation must leave
    training as it was. On tictactoe self-play, a snapshot every update into a pool of 3: the snapshot of
    the update a checkpoint names joins the pool after the state it holds was taken, so the resumed run
    must add it where the original did (it was lost for good), and snapshots leave the pool with games
    still being played against them (their weights travel with the checkpoint)."""
    common = [
        "env=pettingzoo", "env.id=pettingzoo.classic.tictactoe_v3", "strategy=decoupled", "fabric.devices=2",
        "env.num_envs=4", "algo.rollout_steps=16", "algo.minibatch_size=32", "algo.update_epochs=2",
        "logger.tensorboard=false", "logger.plot=false", "selfplay.enabled=true", "selfplay.snapshot_every=1", "selfplay.pool_size=3",
        "algo.pipeline=true", "checkpoint.every=2", "checkpoint.keep=0", "algo.total_steps=512",
    ]  # fmt: skip
    evaluated = ["eval.every=128", "eval.episodes=2"]
    env = job_env(supervisor=False)
    # the resume names none of the run's options, strategy included: it continues the checkpoint's config
    # (it once took the default strategy's main and trained on as coupled)
    resumed = ["eval.every=0", f"resume={tmp_path / 'middle.ckpt'}"]
    for name, given in (("a", [*common, *evaluated]), ("b", resumed)):
        cmd = [sys.executable, "-m", "ppo_fabric", *given, f"hydra.run.dir={tmp_path / name}"]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        if (
            name == "a"
        ):  # the evaluator skips a due evaluation while it plays the last: only the final is certain
            assert [r["step"] for r in read_rows(tmp_path / "a" / "evaluations.csv")][-1:] == ["512"], (
                "evaluated"
            )
            (tmp_path / "middle.ckpt").write_bytes(numbered_checkpoint(tmp_path / "a", 4).read_bytes())
    for name in (6, 8):
        original, again = (ckpt.load(numbered_checkpoint(tmp_path / d, name)) for d in ("a", "b"))
        for key, value in original["agent"]["shared"].items():
            torch.testing.assert_close(
                again["agent"]["shared"][key], value, rtol=0, atol=0, msg=f"{name}: {key}"
            )
        pools = [state["ranks"][0]["selfplay"]["pool"] for state in (original, again)]
        assert [s["update"] for s in pools[0]["snapshots"]] == [s["update"] for s in pools[1]["snapshots"]]
        # a snapshot lost by the resume shifts every later id (6: the initial weights and updates 1-5, as
        # update 6 joins after its checkpoint; the last checkpoint is written after update 8 joined)
        assert pools[0]["next_id"] == pools[1]["next_id"] == {6: 6, 8: 9}[name], pools[1]["next_id"]
    assert original["action_masks"] == {"shared": 9}, "a loader reads the mask width, never builds the game"
    episodes = [json.loads((tmp_path / d / "summary.json").read_text())["episodes"] for d in ("a", "b")]
    assert episodes[0] == episodes[1]


@pytest.mark.multiprocess
def test_coupled_checkpoint_refused_by_decoupled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A coupled checkpoint has one learner per rank and no player/trainer split: refuse it up front."""
    monkeypatch.delenv("LT_CLI_USED", raising=False)
    summary = ppo_fabric.run(
        ["algo.total_steps=256", *SMALL, "logger=none", "algo.update_epochs=1", f"hydra.run.dir={tmp_path}"]
    )
    assert summary["strategy"] == "coupled"
    with pytest.raises(ConfigError, match="strategy") as info:
        load(["strategy=decoupled", "fabric.devices=2", f"resume={summary['checkpoint']}",
              "algo.total_steps=4096", *SMALL])  # fmt: skip
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------------------------- failures
def _children(pid: int) -> list[int]:
    """Direct children of `pid` (Linux /proc): the ranks the launcher started."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                found.append(int(stat.parent.name))
    return found


def _rank_of(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            if item.startswith(b"LOCAL_RANK="):
                return int(item.split(b"=", 1)[1])
    return None


def _assert_job_gone(run_dir: Path, within: float) -> None:
    """No process of the job may outlive it (a rank stuck in a collective would): the supervisor, its job's
    process group, or the processes of `fabric run`."""
    deadline = time.monotonic() + within
    while job_processes(run_dir):
        if time.monotonic() > deadline:
            pytest.fail(f"a process of the job was still alive {within:.0f} s after the job ended")
        time.sleep(0.2)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("players", "devices", "victim"),
    [(1, 2, 1), (2, 3, 1), (1, 3, 0)],
    ids=["kill-trainer-of-1+1", "kill-player-1-of-2+1", "kill-launcher-player-0-of-1+2"],
)
def test_killed_rank_ends_the_job(tmp_path: Path, players: int, devices: int, victim: int) -> None:
    """SIGKILL on one rank: every peer must notice and exit within the collectives timeout, instead of
    waiting forever for its next message. Rank 0 is the supervisor's one child, the other ranks are its
    children; with rank 0 gone, the two trainers (blocked waiting for data) must not be left behind."""
    run_dir = tmp_path / "run"
    cmd = _python_m(devices, f"algo.players={players}", "algo.total_steps=100000000", "logger=none",
                    f"collectives.timeout={TIMEOUT}", f"hydra.run.dir={run_dir}")  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while not (run_dir / "config.yaml").exists():  # rank 0 got past the process groups' set-up
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the run never started"
            time.sleep(0.2)
        time.sleep(0.5)
        (rank0,) = _children(proc.pid)
        children = _children(rank0)
        assert len(children) == devices - 1, f"expected {devices - 1} child ranks, found {children}"
        pid = rank0 if victim == 0 else next((p for p in children if _rank_of(p) == victim), None)
        assert pid is not None, f"no child with LOCAL_RANK={victim} among {children}"
        os.kill(pid, signal.SIGKILL)
        try:  # returns once every rank has closed the inherited stderr pipe, i.e. has exited
            _, stderr = proc.communicate(timeout=TIMEOUT + 10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job outlived its killed rank {victim} by more than {TIMEOUT + 10} s")
        assert proc.returncode != 0, stderr[-2000:]
        _assert_job_gone(run_dir, within=TIMEOUT + 10)
    finally:
        end_group(proc)


@pytest.mark.multiprocess
@pytest.mark.parametrize("launcher", [_python_m, _fabric_run], ids=["python-m", "fabric-run"])
def test_failing_player_ends_the_job(tmp_path: Path, launcher: Callable[..., list[str]]) -> None:
    """A player raising in env.step: its rank is named, and the trainer waiting for data exits too,
    whether Fabric launched the processes or `fabric run` (torchrun) did."""
    cmd = launcher(2, "env.id=tests.failing_env:FailingCartPole-v0", "+env.kwargs.fail_rank=0",
                    "+env.kwargs.fail_after=50", "algo.total_steps=100000000", "logger=none",
                    f"collectives.timeout={TIMEOUT}", f"hydra.run.dir={tmp_path / 'run'}")  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        try:
            _, stderr = proc.communicate(timeout=60)  # start-up takes ~10 s; the failure comes right after
        except subprocess.TimeoutExpired:
            pytest.fail("the job did not end within 60 s although its player failed after 50 steps")
        assert proc.returncode != 0
        assert "error: player rank 0: env.step raised RuntimeError: probe failure" in stderr, stderr[-2000:]
        _assert_job_gone(tmp_path / "run", within=TIMEOUT + 10)
    finally:
        end_group(proc)


# ------------------------------------------------------------------------------------------- bad input
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["fabric.devices=1"], "strategy=decoupled needs at least 2 processes"),
        (["fabric.devices=2", "algo.players=2"], "algo.players=2 leaves no trainer among 2 processes"),
        (
            ["fabric.devices=3", "env.num_envs=3", "algo.rollout_steps=5"],
            "batch of 15 samples .* cannot be split evenly over 2 trainers",
        ),
        (  # 20 samples split 10 + 10: no whole time rows of 4 envs, so no advantage refresh
            ["fabric.devices=3", "env.num_envs=4", "algo.rollout_steps=5", "algo.minibatch_size=10"],
            "algo.rollout_steps=5 does not split into equal time rows over 2 trainers.*e.g. 6",
        ),
    ],
    ids=["one-process", "no-trainer", "batch-not-splittable", "rows-not-splittable-for-the-refresh"],
)
def test_impossible_layouts_are_refused(
    overrides: list[str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused before any process starts, with one line naming the fix, not a hang or a shape error."""
    monkeypatch.delenv("LT_CLI_USED", raising=False)
    with pytest.raises(ConfigError, match=message) as info:
        load(["strategy=decoupled", *overrides])
    assert "\n" not in str(info.value)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("minibatch", "message"),
    [
        (63, "minibatch_size=63 is the minibatch over all 2 training ranks"),
        (96, "minibatch_size=96 does not divide the batch of 128 samples per update"),
        (256, "minibatch_size=256 does not divide the batch of 128 samples per update"),
        (2, "gives 1 sample.* per training rank"),
    ],
    ids=["not-split-over-trainers", "not-dividing-batch", "larger-than-batch", "one-sample-per-trainer"],
)
def test_bad_minibatch_for_the_layout_is_refused(
    minibatch: int, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1 player + 2 trainers, 128 samples per update. The minibatch is per gradient step over all
    trainers: it must split evenly over them and divide the batch, or trainers would run different
    numbers of steps (a DDP hang) or normalise advantages over a single sample."""
    monkeypatch.delenv("LT_CLI_USED", raising=False)
    with pytest.raises(ConfigError, match=message) as info:
        load(["strategy=decoupled", "fabric.devices=3", "env.num_envs=4", "algo.rollout_steps=32",
              f"algo.minibatch_size={minibatch}"])  # fmt: skip
    assert "\n" not in str(info.value)


@pytest.mark.multiprocess
def test_rows_that_do_not_split_are_fine_without_the_refresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LT_CLI_USED", raising=False)
    for off in ("algo.lag_refresh_advantages=false", "algo.pipeline=false"):
        load(["strategy=decoupled", "fabric.devices=3", "env.num_envs=4", "algo.rollout_steps=5",
              "algo.minibatch_size=10", off])  # fmt: skip
    if importlib.util.find_spec("envpool") is not None:  # an async pool's batches are never refreshed
        load(["strategy=decoupled", "fabric.devices=3", "env.num_envs=4", "algo.rollout_steps=5",
              "algo.minibatch_size=10", "env.backend=envpool", "env.envpool.batch_size=2"])  # fmt: skip


@pytest.mark.multiprocess
def test_minibatch_counts_every_players_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    """With 2 players the update's batch is both players' samples (256), so a minibatch of 256 is fine."""
    monkeypatch.delenv("LT_CLI_USED", raising=False)
    load(["strategy=decoupled", "env.num_envs=4", "algo.rollout_steps=32", "fabric.devices=3",
          "algo.players=2", "algo.minibatch_size=256"])  # fmt: skip
