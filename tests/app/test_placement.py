"""Where a job's processes run: the decoupled rank -> role map (pure, by hand), each role's device, the GPU
count checks made before any process starts (with the machine's CUDA devices faked), the small-model
warning, checkpoints holding CPU tensors, and a real two-node job on this machine whose players are spread
over both nodes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ppo_fabric import ppo
from ppo_fabric.app.launch import launch
from ppo_fabric.app.preflight import load
from ppo_fabric.config.values import ConfigError
from ppo_fabric.learn.learners import on_cpu
from ppo_fabric.wire import placement
from ppo_fabric.wire.placement import (
    SMALL_MODEL_PARAMETERS,
    Role,
    player_kind,
    players_of,
    role_device,
    role_map,
    small_model_warning,
    trainer_kind,
    trainers_of,
    trainers_per_node,
)

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------- role map
def _layout(roles: list[Role]) -> str:
    """P/T per rank, nodes separated by |: the map at a glance."""
    nodes = max(r.node for r in roles) + 1
    return "|".join("".join("P" if r.plays else "T" for r in roles if r.node == n) for n in range(nodes))


@pytest.mark.parametrize(
    ("world", "nodes", "players", "expected"),
    [
        (2, 1, 1, "PT"),
        (3, 1, 2, "PPT"),
        (3, 1, 1, "PTT"),
        (7, 1, 6, "PPPPPPT"),  # 1 GPU + 6 CPU players
        (16, 1, 8, "PPPPPPPPTTTTTTTT"),  # 8 GPUs + 8 players
        (4, 2, 2, "PT|PT"),  # players spread, not all on node 0
        (8, 2, 3, "PPTT|PTTT"),  # uneven: the first node takes the extra player
        (6, 3, 1, "PT|TT|TT"),
        (6, 3, 5, "PP|PP|PT"),
        (32, 4, 8, "PPTTTTTT|PPTTTTTT|PPTTTTTT|PPTTTTTT"),
    ],
)
def test_role_map_spreads_players_over_nodes(world: int, nodes: int, players: int, expected: str) -> None:
    roles = role_map(world, nodes, players)
    assert _layout(roles) == expected
    assert [r.rank for r in roles] == list(range(world))
    assert roles[0].plays, "rank 0 writes the logs and the summary: it must be a player"
    assert len(players_of(roles)) == players and len(trainers_of(roles)) == world - players
    per_node = world // nodes
    for r in roles:  # ranks numbered node by node, as torchrun and Fabric number them
        assert (r.node, r.local_rank) == divmod(r.rank, per_node)


def test_role_indices_count_within_the_node() -> None:
    """A trainer's index is its GPU: 0, 1, ... among its own node's trainers."""
    roles = role_map(8, 2, 3)  # PPTT|PTTT
    assert [(r.rank, r.index) for r in roles if not r.plays] == [(2, 0), (3, 1), (5, 0), (6, 1), (7, 2)]
    assert [(r.rank, r.index) for r in roles if r.plays] == [(0, 0), (1, 1), (4, 0)]
    assert trainers_per_node(roles) == [2, 3]


@pytest.mark.parametrize(("world", "nodes", "players"), [(3, 2, 1), (2, 1, 2), (2, 1, 0), (4, 0, 1)])
def test_role_map_refuses_impossible_layouts(world: int, nodes: int, players: int) -> None:
    with pytest.raises(ValueError):
        role_map(world, nodes, players)


# ------------------------------------------------------------------------------------------- devices
@pytest.mark.parametrize(
    ("setting", "accelerator", "cuda", "expected"),
    [
        ("auto", "cpu", True, "cpu"),
        ("auto", "gpu", False, "cuda"),  # asked for: preflight refuses it without a GPU
        ("auto", "cuda", True, "cuda"),
        ("auto", "auto", True, "cuda"),
        ("auto", "auto", False, "cpu"),
        ("cpu", "cuda", True, "cpu"),
        ("cuda", "cpu", True, "cuda"),  # CPU job (fabric=cpu), GPU trainers
    ],
)
def test_trainer_kind(setting: str, accelerator: str, cuda: bool, expected: str) -> None:
    assert trainer_kind(setting, accelerator, cuda) == expected


def test_role_devices() -> None:
    roles = role_map(8, 2, 3)  # PPTT|PTTT
    cuda = [str(role_device(r, roles, "cuda", 4)) for r in roles]
    # trainers: cuda:<index among the node's trainers>; players on CUDA: the GPUs after their node's trainers
    assert cuda == ["cuda:2", "cuda:3", "cuda:0", "cuda:1", "cuda:3", "cuda:0", "cuda:1", "cuda:2"]
    assert {str(role_device(r, roles, "cpu", 4)) for r in roles} == {"cpu"}
    assert player_kind("cpu", "cuda") == "cpu" and player_kind("auto", "cuda") == "cuda"
    with pytest.raises(ValueError, match="trainer 2 of its node, which has 2 GPU"):
        role_device(roles[7], roles, "cuda", 2)


# ------------------------------------------------------------------------------------- config checks
def _gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """This machine, as preflight sees it, with `count` CUDA devices (nothing touches them)."""
    monkeypatch.delenv("LT_CLI_USED", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


DECOUPLED = ["strategy=decoupled", "env.num_envs=4", "algo.rollout_steps=32", "algo.minibatch_size=64"]


@pytest.mark.multiprocess
def test_cpu_players_beside_one_gpu_trainer_are_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    """`fabric.devices` counts processes: 2 CPU players + 1 GPU trainer need one GPU, not three."""
    _gpus(monkeypatch, 1)
    _, _, facts = load(
        [*DECOUPLED, "fabric=gpu", "fabric.devices=3", "algo.players=2", "algo.player_device=cpu"]
    )
    assert facts["world_size"] == 3 and facts["train_device"] == "cuda"
    _, _, facts = load([*DECOUPLED, "fabric=cpu", "fabric.devices=7", "algo.players=6", "algo.trainer_device=cuda",
                        "algo.minibatch_size=128"])  # fmt: skip
    assert facts["train_device"] == "cuda"


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("gpus", "overrides", "message"),
    [
        (1, ["fabric=gpu", "fabric.devices=3"], r"2 trainer\(s\) on a node .* has 1 CUDA device\(s\)"),
        (
            2,
            [
                "fabric=cpu",
                "algo.trainer_device=cuda",
                "fabric.devices=4",
                "fabric.num_nodes=2",
                "algo.players=1",
            ],
            r"4 trainer\(s\) on a node",
        ),  # fmt: skip
        (0, ["fabric=cpu", "algo.trainer_device=cuda", "fabric.devices=2"], "no CUDA device is available"),
        (0, ["fabric=gpu", "fabric.devices=2"], "no CUDA device is available; use algo.trainer_device=cpu"),
    ],
    ids=["two-trainers-one-gpu", "per-node-count", "cuda-trainer-no-gpu", "gpu-job-no-gpu"],
)
def test_more_trainers_than_gpus_are_refused(
    gpus: int, overrides: list[str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _gpus(monkeypatch, gpus)
    with pytest.raises(ConfigError, match=message) as info:
        load([*DECOUPLED, *overrides])
    assert "\n" not in str(info.value)


@pytest.mark.multiprocess
def test_coupled_still_needs_a_gpu_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 1)
    with pytest.raises(ConfigError, match="fabric.devices=2 but this machine has 1 CUDA device"):
        load(["fabric=gpu", "fabric.devices=2"])


# ----------------------------------------------------------------------------------- small-model warning
def test_small_model_warning() -> None:
    assert small_model_warning(9_000, "cpu") is None
    assert small_model_warning(SMALL_MODEL_PARAMETERS, "cuda") is None
    line = small_model_warning(9_218, "cuda")
    assert line is not None and "\n" not in line and "9,218 parameters" in line and "fabric=cpu" in line


def test_facts_carry_what_the_warning_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    """CartPole's default MLP on a GPU is below the threshold; a coupled CPU run is never warned."""
    _gpus(monkeypatch, 1)
    _, _, facts = load(["fabric=gpu"])
    assert facts["train_device"] == "cuda" and 0 < facts["parameters"] < SMALL_MODEL_PARAMETERS
    assert small_model_warning(facts["parameters"], facts["train_device"]) is not None
    _, _, facts = load(["fabric=cpu"])
    assert facts["train_device"] == "cpu"
    assert placement.small_model_warning(facts["parameters"], facts["train_device"]) is None


def test_rank_0_prints_the_warning_once(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real (CPU) run told that it trains on CUDA: one warning line on stderr, and the run goes on."""
    monkeypatch.delenv("LT_CLI_USED", raising=False)
    cfg, run_dir, facts = load(["algo.total_steps=256", "logger=none", f"hydra.run.dir={tmp_path / 'run'}"])
    summary = launch(cfg, run_dir, facts | {"train_device": "cuda"}, ppo.main)
    assert summary["total_env_steps"] == 256
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("ppo-fabric: warning: the model has")]
    assert len(warnings) == 1, err


# ------------------------------------------------------------------------------------------ checkpoints
def test_on_cpu_copies_without_touching_the_optimiser() -> None:
    """The optimiser's state_dict shares its per-parameter dicts: moving a copy must leave them alone."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = opt.state_dict()
    moved = on_cpu({"agent": model.state_dict(), "optimizer": state})
    assert moved["optimizer"]["state"][0] is not state["state"][0]
    assert torch.equal(moved["optimizer"]["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
    assert hasattr(moved["agent"], "_metadata"), "a module state dict keeps its metadata"


# --------------------------------------------------------------------------------------------- two nodes
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.multiprocess
def test_two_node_job_spreads_players(tmp_path: Path) -> None:
    """2 nodes x 2 processes, 2 players, launched as a cluster would (one command per node, NODE_RANK): one
    player and one trainer on each node, the trainers' DDP across nodes, batches from a player whose rank
    comes after a trainer's, and every rank on the same parameters at the end. Both commands name one run
    directory (a shared file system), which only node 0's supervisor locks: node 1's, started first, took
    the lock and node 0's was refused as "in use", or node 1's was, while node 0 waited for it until
    `collectives.timeout`."""
    port = _free_port()
    overrides = ["strategy=decoupled", "fabric.devices=2", "fabric.num_nodes=2", "algo.players=2",
                 "logger.tensorboard=false", "logger.plot=false", "env.num_envs=4", "algo.rollout_steps=32", "algo.minibatch_size=64",
                 "algo.update_epochs=2", "algo.total_steps=1024", "collectives.timeout=60"]  # fmt: skip
    procs = []
    for node in (1, 0):
        env = dict(os.environ, PYTHONPATH=str(REPO), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   NODE_RANK=str(node))  # fmt: skip
        env.pop("LT_CLI_USED", None)
        cmd = [sys.executable, "-m", "ppo_fabric", *overrides, f"hydra.run.dir={tmp_path / 'run'}"]
        procs.append(
            subprocess.Popen(
                cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = [proc.communicate(timeout=180)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs[1][-2000:] + outputs[0][-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert [(r["rank"], r["role"]) for r in summary["roles"]] == [
        (0, "player"), (1, "trainer"), (2, "player"), (3, "trainer")
    ]  # fmt: skip
    assert summary["total_env_steps"] == 1024 and summary["ranks_in_sync"] is True
    assert not (tmp_path / "run" / "ppo-fabric.lock").exists()


@pytest.mark.multiprocess
def test_a_node_that_never_comes_is_named_then_the_job_ends(tmp_path: Path) -> None:
    """Node 0 of a 2-node job whose node 1 was never started: it says what it waits for (where, and that
    each node runs the command with its NODE_RANK) within a quarter of `collectives.timeout`, then ends
    with one line and exit 1 at the timeout. It waited in silence until then (180 s by default)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               NODE_RANK="0")  # fmt: skip
    env.pop("LT_CLI_USED", None)
    cmd = [sys.executable, "-m", "ppo_fabric", "fabric.num_nodes=2", "fabric.devices=1", "logger=none",
           "collectives.timeout=4", f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("ppo-fabric:")]
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert lines[-2] == (
        f"ppo-fabric: waiting for the job's 2 processes to meet at 127.0.0.1:{env['MASTER_PORT']}; each of "
        "the 2 nodes runs the command with its NODE_RANK (0-1); giving up after collectives.timeout=4 s"
    ), proc.stderr[-2000:]
    assert lines[-1].startswith("ppo-fabric: error: the job's 2 processes did not all meet within "), lines


@pytest.mark.multiprocess
def test_a_stop_signal_ends_a_job_waiting_for_its_peers_at_once(tmp_path: Path) -> None:
    """SIGTERM to a job whose processes are still meeting (node 1 never started): the wait is torch's, in C
    code, where Python runs no signal handler until it returns; the command ended only at
    `collectives.timeout` (here 60 s; 180 s by default), past a cluster's grace period, with the timeout's
    error. Now it ends at once with the start-up line and 143."""
    port = _free_port()
    env = dict(
        os.environ, PYTHONPATH=str(REPO), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0"
    )
    env.pop("LT_CLI_USED", None)
    cmd = [sys.executable, "-m", "ppo_fabric", "fabric.num_nodes=2", "fabric.devices=1", "logger=none",
           "collectives.timeout=60", f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:  # rank 0 listens on MASTER_PORT once it waits for the others
            assert proc.poll() is None and time.monotonic() < deadline, "the job never began to meet"
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143 and time.monotonic() - started < 10, err
    assert err.splitlines()[-1] == "ppo-fabric: stopped by SIGTERM during start-up, before training began", (
        err
    )


@pytest.mark.parametrize(
    ("nodes", "env", "refused"),
    [
        (2, {}, "set MASTER_ADDR and MASTER_PORT in every node's command"),
        (2, {"MASTER_ADDR": "node0"}, "set MASTER_PORT in every node's command"),
        (2, {"MASTER_ADDR": "node0", "MASTER_PORT": "29500"}, None),
        (2, {"SLURM_NTASKS": "2"}, None),  # the cluster's launcher says where they meet
        (1, {}, None),
    ],
)
def test_a_multi_node_command_needs_where_the_nodes_meet(
    monkeypatch: pytest.MonkeyPatch, nodes: int, env: dict[str, str], refused: str | None
) -> None:
    """`fabric.num_nodes=2` without MASTER_PORT: each node picked a free port of its own and waited alone
    until `collectives.timeout`; refused up front, in one line."""
    from omegaconf import OmegaConf

    from ppo_fabric.app.preflight import CLUSTER_MARKERS, check_nodes

    for name in ("MASTER_ADDR", "MASTER_PORT", "LT_CLI_USED", *CLUSTER_MARKERS):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cfg = OmegaConf.create({"fabric": {"num_nodes": nodes}})
    if refused is None:
        check_nodes(cfg)
        return
    with pytest.raises(ConfigError, match=refused) as info:
        check_nodes(cfg)
    assert str(info.value) == (
        f"fabric.num_nodes=2: {refused} (node 0's address and a free port on it), with its NODE_RANK (0-1); "
        "without them the nodes cannot meet"
    )
