"""Trustworthy runs: resume with another layout (progress in env steps), checkpoint lineage and retention,
best.ckpt, time-based checkpoints, and SIGTERM/SIGINT stopping a multi-process run at an update boundary."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ppo_fabric
from ppo_fabric.collect.rollout import WINDOW
from ppo_fabric.runs import checkpoint as ckpt
from ppo_fabric.runs.metrics_file import read_rows
from ppo_fabric.runs.resume import newest_checkpoint
from ppo_fabric.runs.session import inherit_best
from tests.conftest import end_group, job_env, job_processes, numbered_checkpoint

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "logger.tensorboard=false",
    "eval.every=0",
    "env.num_envs=4",
    "algo.rollout_steps=64",
    "algo.minibatch_size=64",
]


def _env() -> dict[str, str]:
    return job_env(supervisor=False)  # the job's own resume and stop; the supervisor's are tests/app's


def _rows(run_dir: Path) -> list[dict[str, str]]:
    return read_rows(run_dir / "metrics.csv")


def _steps(ckpt_dir: Path) -> list[tuple[int, str]]:
    return sorted(ckpt.parse_numbered(p) for p in ckpt_dir.glob("step_*.ckpt"))  # type: ignore[type-var]


def test_the_kth_player_continues_the_checkpoints_kth_player(monkeypatch: pytest.MonkeyPatch) -> None:
    """Players are matched by their order, not their rank number: 2 nodes x 2 processes with 2 players put
    them on ranks 0 and 2, and the same job on 1 node x 4 on ranks 0 and 1, whose second player continues
    rank 2's part (not rank 1's, a trainer's: KeyError 'envs'). A change in the trainers alone keeps every
    player's envs, RNG and episode count (it restarted them, with the run's first seeds)."""
    from types import SimpleNamespace

    from ppo_fabric.runs import session
    from ppo_fabric.wire.placement import players_of, role_map

    restored: list[int] = []
    monkeypatch.setattr(session, "restore_collector", lambda _c, part, say=True: restored.append(part["id"]))
    collector = SimpleNamespace(num_envs=4, carry_statistics=lambda _part: restored.append(-1))

    def checkpoint(roles: list) -> dict:
        ranks = [{"id": r.rank, "num_envs": 4} if r.plays else {"id": r.rank} for r in roles]
        return {"ranks": ranks, "config": {"seed": 42}}

    two_nodes = checkpoint(role_map(4, 2, 2))
    one_node = role_map(4, 1, 2)
    assert players_of(role_map(4, 2, 2)) == [0, 2] and players_of(one_node) == [0, 1]
    for player in range(2):
        assert session.resume_collector(collector, two_nodes, player, 2, 42) is None
    assert restored == [0, 2]
    restored.clear()
    one_trainer = checkpoint(role_map(2, 1, 1))  # resumed with fabric.devices=3: two trainers
    assert session.resume_collector(collector, one_trainer, 0, 1, 42) is None and restored == [0]


@pytest.mark.multiprocess
def test_two_ranks_resumed_on_one_with_another_batch(tmp_path: Path) -> None:
    """2 ranks x 4 envs x 64 steps to half of 4096 env steps, resumed on 1 rank x 2 envs x 128 steps: the
    run ends at 4096 env steps, the learning rate continues from half and ends near 0, and the normaliser
    statistics carry over (the envs start fresh, said in one line)."""
    first = tmp_path / "first"
    common = [*TINY, "algo.total_steps=4096", "env.normalize_obs=true", "algo.lr=1e-3"]
    cmd = [sys.executable, "-m", "ppo_fabric", "fabric.devices=2", *common, "checkpoint.every=4",
           f"hydra.run.dir={first}", "collectives.timeout=30"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    source = numbered_checkpoint(first, 4)
    saved = ckpt.load(source)
    assert saved["env_step"] == 4 * 512 and len(saved["ranks"]) == 2

    second = tmp_path / "second"
    overrides = [
        *common,
        "env.num_envs=2",
        "algo.rollout_steps=128",
        "fabric.devices=1",  # the run's own config says 2
        "resume_overrides=allow",  # a new layout changes the experiment's batch: said explicitly
        f"resume={source}",
        f"hydra.run.dir={second}",
    ]
    summary = ppo_fabric.run(overrides)
    assert summary["total_env_steps"] == 4096 and summary["steps_this_run"] == 2048
    rows = _rows(second)
    assert [int(r["step"]) for r in rows] == list(range(2048 + 256, 4096 + 1, 256))
    lrs = [float(r["train/lr"]) for r in rows]
    assert lrs[0] == pytest.approx(1e-3 * (1 - 2048 / 4096))
    assert lrs[-1] == pytest.approx(1e-3 * 256 / 4096) and lrs[-1] < 0.1 * 1e-3
    carried = ckpt.load(second / "checkpoints" / "last.ckpt")["ranks"][0]["normalizers"][
        "NormalizeObservation"
    ]
    before = saved["ranks"][0]["normalizers"]["NormalizeObservation"]
    assert carried["count"] > before["count"], "the resumed run must continue the saved statistics"


@pytest.mark.slow
def test_resume_never_stops_short_with_a_larger_batch(tmp_path: Path) -> None:
    """3072 of 4096 env steps done, resumed with a 2048-step batch: one more update, ending past the target
    (the first update boundary at or past algo.total_steps), never short of it."""
    ppo_fabric.run([*TINY, "algo.total_steps=4096", "checkpoint.every=12", f"hydra.run.dir={tmp_path / 'a'}"])
    source = numbered_checkpoint(tmp_path / "a", 12)
    summary = ppo_fabric.run(
        [
            *TINY,
            "algo.total_steps=4096",
            "algo.rollout_steps=512",
            "resume_overrides=allow",
            f"resume={source}",
            f"hydra.run.dir={tmp_path / 'b'}",
        ]
    )
    assert summary["total_env_steps"] == 3072 + 2048


@pytest.mark.slow
def test_a_resume_with_another_seed_starts_fresh_envs_and_rng_from_it(tmp_path: Path) -> None:
    """`seed=7 resume_overrides=allow`: the envs and the RNG start fresh from the new seed (one line says
    so), so the rest of the run differs from the same resume with the saved seed (it was identical: the
    new seed was named in the config and summary but the restored envs and RNG trained on as before)."""
    ppo_fabric.run([*TINY, "algo.total_steps=1024", f"hydra.run.dir={tmp_path / 'a'}"])
    last = tmp_path / "a" / "checkpoints" / "last.ckpt"
    rows = {}
    for seed in (42, 7):
        out = tmp_path / f"seed{seed}"
        ppo_fabric.run([*TINY, "algo.total_steps=2048", f"seed={seed}", "resume_overrides=allow",
                        f"resume={last}", f"hydra.run.dir={out}"])  # fmt: skip
        rows[seed] = [r["rollout/episode_return"] for r in _rows(out)]
    assert len(rows[7]) == len(rows[42]) == 4 and rows[7] != rows[42]


@pytest.mark.slow
def test_a_resume_on_another_layout_goes_on_counting_the_runs_episodes(tmp_path: Path) -> None:
    """4 envs resumed on 2 (fresh envs): the summary's episodes are the run's, the checkpoint's count plus
    this session's (they were this session's alone), and the recent-episode window carries over."""
    ppo_fabric.run([*TINY, "algo.total_steps=1024", f"hydra.run.dir={tmp_path / 'a'}"])
    saved = ckpt.load(tmp_path / "a" / "checkpoints" / "last.ckpt")["ranks"][0]
    summary = ppo_fabric.run([*TINY, "algo.total_steps=1536", "env.num_envs=2", "resume_overrides=allow",
                              f"resume={tmp_path / 'a' / 'checkpoints' / 'last.ckpt'}",
                              f"hydra.run.dir={tmp_path / 'b'}"])  # fmt: skip
    state = ckpt.load(tmp_path / "b" / "checkpoints" / "last.ckpt")["ranks"][0]
    assert summary["episodes"] == state["episode_count"] > saved["episode_count"] > 0
    # the window: the saved run's recent episodes and this session's (all of them, under WINDOW)
    assert len(state["episodes"]) == min(state["episode_count"], WINDOW)
    assert [tuple(e) for e in state["episodes"][: len(saved["episodes"])]] == [
        tuple(e) for e in saved["episodes"]
    ]


def test_a_run_continued_in_a_new_directory_takes_its_best_checkpoint_along(
    tiny_run: Path, tmp_path: Path
) -> None:
    """`best.ckpt` is written when a session beats the run's best, so a run continued in a new directory
    that never did had none there: it takes the one beside the checkpoint it resumes from, when that one is
    of its lineage and not after the step it resumes from (another branch's future stays behind)."""
    last = tiny_run / "checkpoints" / "last.ckpt"
    resume = ckpt.load(last)
    best = tiny_run / "checkpoints" / "best.ckpt"
    assert ckpt.load(best)["env_step"] <= resume["env_step"]
    inherit_best(last, tmp_path / "b", resume)
    assert (tmp_path / "b" / "checkpoints" / "best.ckpt").read_bytes() == best.read_bytes()
    for name, other in (("future", {"env_step": 0}), ("other", {"lineage": [["elsewhere", 0]]})):
        inherit_best(last, tmp_path / name, resume | other)
        assert not (tmp_path / name / "checkpoints" / "best.ckpt").exists(), name
    (tmp_path / "b" / "checkpoints" / "best.ckpt").write_bytes(b"the branch's own")  # never overwritten
    inherit_best(last, tmp_path / "b", resume)
    assert (tmp_path / "b" / "checkpoints" / "best.ckpt").read_bytes() == b"the branch's own"


def test_a_resume_into_its_own_directory_moves_the_left_branchs_best_aside(
    tiny_run: Path, tmp_path: Path
) -> None:
    """Resumed from a checkpoint older than its best.ckpt into the same directory, the run kept the best of
    the branch it left: `load_policy(best.ckpt)` gave a policy from outside its timeline while summary.json
    named another best. It goes to best.dropped.ckpt, which resume=auto never takes for a checkpoint."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    last, best = run / "checkpoints" / "last.ckpt", run / "checkpoints" / "best.ckpt"
    resume, kept = ckpt.load(last), best.read_bytes()
    assert inherit_best(last, run, resume) is None and best.read_bytes() == kept  # the timeline's own
    line = inherit_best(last, run, resume | {"env_step": 0})  # resumed from before the best was written
    dropped = run / "checkpoints" / "best.dropped.ckpt"
    assert not best.exists() and dropped.read_bytes() == kept
    assert line == (f"ppo-fabric: {best} was the best of the branch this resume leaves: moved to "
                    "best.dropped.ckpt; best.ckpt is written again when this branch beats the timeline's best")  # fmt: skip
    last.write_bytes(b"torn")
    os.utime(dropped)  # the newest file there
    found = newest_checkpoint(run, on_skip=lambda *_: None)
    assert found is not None and found[0].name != "best.dropped.ckpt"


@pytest.mark.slow
def test_resume_then_prune_keeps_the_lineage_and_spares_other_branches(tmp_path: Path) -> None:
    """A run writes checkpoints at updates 2, 4, 6, 8; resumed from update 4 into the same directory with
    checkpoint.keep=1, the new branch keeps its newest file and the one it resumed from; the first run's
    later files (another branch) are left alone and nothing is overwritten."""
    run = [*TINY, "algo.total_steps=2048", "checkpoint.every=2", f"hydra.run.dir={tmp_path}"]
    ppo_fabric.run([*run, "checkpoint.keep=0"])
    first = _steps(tmp_path / "checkpoints")
    assert [s for s, _ in first] == [512, 1024, 1536, 2048]
    source = numbered_checkpoint(tmp_path, 4)
    ppo_fabric.run([*run, "checkpoint.keep=1", f"resume={source}"])
    after = _steps(tmp_path / "checkpoints")
    (_, old_id), new_ids = first[0], {rid for _, rid in after} - {first[0][1]}
    assert len(new_ids) == 1
    new_id = new_ids.pop()
    assert set(after) == {(1024, old_id), (1536, old_id), (2048, old_id), (2048, new_id)}
    lineage = ckpt.load(tmp_path / "checkpoints" / "last.ckpt")["lineage"]
    assert lineage == [[old_id, 0], [new_id, 1024]]


@pytest.mark.slow  # seconds in process (a run, or every option composed): not the unit tier
def test_best_and_time_based_checkpoints(tmp_path: Path) -> None:
    """checkpoint.every_minutes writes numbered checkpoints without checkpoint.every; with evaluation off,
    best.ckpt holds the best recent mean return seen at a checkpoint and evaluates like any checkpoint
    (with it on, the best evaluation's: tests/policy/test_periodic.py)."""
    summary = ppo_fabric.run(
        [
            *TINY,
            "algo.total_steps=2048",
            "eval.every=0",
            "checkpoint.every_minutes=1e-6",
            "checkpoint.keep=0",
            f"hydra.run.dir={tmp_path}",
        ]
    )
    assert [s for s, _ in _steps(tmp_path / "checkpoints")] == list(range(256, 2049, 256))
    best = ckpt.load(tmp_path / "checkpoints" / "best.ckpt")
    returns = [
        ckpt.load(p).get("best_return") for p in sorted((tmp_path / "checkpoints").glob("step_*.ckpt"))
    ]
    assert best["best_return"] == summary["best_mean_return"] == max(r for r in returns if r is not None)
    ckpt.load_policy(tmp_path / "checkpoints" / "best.ckpt")


# ----------------------------------------------------------------------------------------------- signals
def _start(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "ppo_fabric", *args]
    return subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip


def _wait_for_rows(run_dir: Path, proc: subprocess.Popen[str], rows: int, limit: float = 90) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the run ended early: {proc.communicate()[1][-2000:]}")
        with contextlib.suppress(FileNotFoundError):
            if len(_rows(run_dir)) >= rows:
                return
        time.sleep(0.2)
    pytest.fail("the run logged too few updates in time")


@pytest.mark.multiprocess
def test_a_signal_that_reaches_only_the_trainer_stops_the_run(tmp_path: Path) -> None:
    """SIGTERM to the decoupled job's trainer alone (a node of trainers preempted): it comes to the player
    with the next parameters, and the run stops as if every process had it, with a checkpoint."""
    run_dir = tmp_path / "run"
    args = [
        "strategy=decoupled",
        "fabric.devices=2",
        *TINY,
        "collectives.timeout=20",
        "algo.total_steps=1000000",
    ]
    proc = _start([*args, f"hydra.run.dir={run_dir}"], tmp_path)
    try:
        _wait_for_rows(run_dir, proc, rows=3)
        (trainer,) = [pid for pid in job_processes(run_dir)
                      if b"LOCAL_RANK=1\0" in Path(f"/proc/{pid}/environ").read_bytes()]  # fmt: skip
        os.kill(trainer, signal.SIGTERM)
        _, err = proc.communicate(timeout=40)
    finally:
        end_group(proc)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("ppo-fabric:")]
    assert len(lines) == 1 and "stopped by SIGTERM" in lines[0], err[-2000:]
    stopped = json.loads((run_dir / "summary.json").read_text())
    assert stopped["interrupted"] is True and stopped["stop_signal"] == "SIGTERM"
    assert ckpt.load(run_dir / "checkpoints" / "last.ckpt")["env_step"] == stopped["total_env_steps"]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("strategy", "extra", "signum"),
    [
        pytest.param("coupled", [], signal.SIGTERM, id="coupled-2-SIGTERM"),
        pytest.param(  # an evaluation every update, in the background while that update's checkpoint is written
            "decoupled",
            ["algo.pipeline=true", "eval.every=256", "eval.episodes=2", "checkpoint.every=1"],
            signal.SIGINT,
            id="decoupled-1+1-pipelined-SIGINT",
        ),  # fmt: skip
    ],
)
def test_signal_stops_every_rank_with_a_checkpoint(
    strategy: str, extra: list[str], signum: int, tmp_path: Path
) -> None:
    """The job (every process, as a cluster or a terminal sends it) gets the signal: the ranks agree to stop
    at the next update boundary, write last.ckpt, summary.json (interrupted) and the learning curve, and all
    exit with 128+signal and one line; the checkpoint continues to the planned end."""
    run_dir = tmp_path / "run"
    common = [f"strategy={strategy}", "fabric.devices=2", *TINY, "collectives.timeout=20", *extra]
    proc = _start([*common, "algo.total_steps=1000000", f"hydra.run.dir={run_dir}"], tmp_path)
    try:
        _wait_for_rows(run_dir, proc, rows=3)
        os.killpg(proc.pid, signum)
        _, err = proc.communicate(timeout=40)
    finally:
        end_group(proc)
    assert proc.returncode == 128 + signum, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("ppo-fabric:")]
    assert len(lines) == 1 and f"stopped by {signal.Signals(signum).name}" in lines[0], err[-2000:]
    deadline = time.monotonic() + 20  # collectives.timeout: every process of the job is gone by then
    while job_processes(run_dir):  # by its run directory: the reaped leader's group id may be reused
        if time.monotonic() > deadline:
            pytest.fail("a process of the job outlived the stop")
        time.sleep(0.2)
    state = ckpt.load(run_dir / "checkpoints" / "last.ckpt")
    assert state["env_step"] >= 3 * 256
    stopped_at = state["env_step"]
    # summary.json and the curve as at the end, marked interrupted, with every rank's part gathered
    stopped = json.loads((run_dir / "summary.json").read_text())
    assert stopped["interrupted"] is True and stopped["stop_signal"] == signal.Signals(signum).name
    assert stopped["total_env_steps"] == stopped_at and stopped["ranks_in_sync"] is True
    assert stopped["world_size"] == 2 and stopped["strategy"] == strategy
    assert (run_dir / "learning_curve.png").stat().st_size > 0
    # the checkpoint's evaluation record is the summary's, and best.ckpt the best it names (a background
    # evaluation still running when its update's checkpoint was written once stayed out of both)
    assert state.get("evaluation") == stopped.get("evaluation")
    best = (stopped.get("evaluation") or {}).get("best")
    if best is not None:
        kept = ckpt.load(run_dir / "checkpoints" / "best.ckpt", key="checkpoint", env_state="fresh")
        assert kept["env_step"] == best["env_step"], (kept["env_step"], best)
    total = stopped_at + 512
    owed = strategy == "decoupled"  # as if the run had died while its checkpoint's evaluation played
    if owed:
        record = state["evaluation"] | {"in_flight": stopped_at}
        ckpt.amend(run_dir / "checkpoints" / "last.ckpt", evaluation=record)
    proc = _start([*common, f"algo.total_steps={total}", f"hydra.run.dir={run_dir}", "resume=" + str(run_dir / "checkpoints" / "last.ckpt")], tmp_path)  # fmt: skip
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err[-2000:]
    if owed:  # the resumed run scored the checkpoint's own parameters first
        at_start = [r for r in read_rows(run_dir / "evaluations.csv") if int(r["step"]) == stopped_at]
        assert at_start and at_start[-1]["run_id"] != state["run_id"], at_start
    finished = json.loads((run_dir / "summary.json").read_text())
    assert finished["total_env_steps"] == total and finished["interrupted"] is False
