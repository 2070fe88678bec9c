"""The decoupled strategy's CUDA paths, checked on the CPU: CUDA is faked where a path only asks about it
(device counts, `set_device`, DDP's constructor), and the pinned staging of a CUDA trainer is replaced by a
recording stand-in, so the order of its fences, receives and sends is visible without a GPU.

What a real GPU must still prove (NCCL, pinned memory, non-blocking copies) is `benchmarks/gpu_check.py`.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any

import pytest
import torch
from lightning_fabric import Fabric
from lightning_fabric.plugins.precision import MixedPrecision
from lightning_fabric.strategies import DDPStrategy
from tensordict import TensorDict

from ppo_fabric.app import launch as launch_module
from ppo_fabric.app.launch import GroupDDPStrategy, build_fabric
from ppo_fabric.app.preflight import load
from ppo_fabric.config.values import compose, requested
from ppo_fabric.envs.multiagent import SINGLE
from ppo_fabric.learn.learners import build_learners, policy_specs
from ppo_fabric.runs import checkpoint as ckpt
from ppo_fabric.wire.placement import check_local_rank, role_map, trainer_kind
from ppo_fabric.wire.protocol import (
    BatchCodec,
    Header,
    HostStage,
    Kind,
    PlayerLink,
    ProtocolError,
    Topology,
    TrainerLink,
)

DECOUPLED = ["strategy=decoupled", "env.num_envs=4", "algo.rollout_steps=32", "algo.minibatch_size=64"]


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


# ----------------------------------------------------------------------------- which device a role takes
def test_fabric_run_accelerator_still_places_the_trainers(monkeypatch: pytest.MonkeyPatch) -> None:
    """`fabric run --accelerator=cuda` with `algo.trainer_device=auto`: the job is built on the CPU, yet
    the trainers go where the checks before launch said (CUDA), not onto the CPU Fabric was built with."""
    _fake_gpus(monkeypatch, 2)
    for name, value in {"LT_CLI_USED": "1", "LT_ACCELERATOR": "cuda", "LT_DEVICES": "1", "LT_NUM_NODES": "1",
                        "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    cfg, _, facts = load([*DECOUPLED, "fabric.devices=3", "algo.players=1"])  # 1 player + 2 trainers
    assert facts["train_device"] == "cuda"
    fabric = build_fabric(cfg, 1)  # one process here: no process group to start
    assert fabric.device == torch.device("cpu")  # the job itself is a CPU job
    assert os.environ["LT_ACCELERATOR"] == "cuda"
    # what ppo_decoupled.main decides for the trainers once Fabric exists
    assert trainer_kind(str(cfg.algo.trainer_device), requested(cfg, "accelerator"), True) == "cuda"
    monkeypatch.delenv("LT_ACCELERATOR")
    build_fabric(cfg, 1)
    assert "LT_ACCELERATOR" not in os.environ  # an unset variable is left unset


@pytest.mark.parametrize("strategy", ["coupled", "decoupled"])
@pytest.mark.parametrize("flag", ["ddp", "auto"])
def test_fabric_run_strategy_ddp_keeps_the_collectives_timeout(
    monkeypatch: pytest.MonkeyPatch, strategy: str, flag: str
) -> None:
    """`fabric run --strategy=ddp` (or auto) reaches Fabric as LT_STRATEGY, which wins over a strategy
    passed in: the job's own DDP, with `collectives.timeout`, must still be the one Fabric gets (Lightning's
    own waits 30 minutes on a stuck peer, and the decoupled strategy needs its group DDP). Fabric is
    recorded, not built: under `fabric run` building it joins the process group."""
    seen: list[tuple[Any, str | None]] = []
    monkeypatch.setattr(
        launch_module,
        "Fabric",
        lambda **kwargs: seen.append((kwargs.get("strategy"), os.environ.get("LT_STRATEGY"))),
    )
    for name, value in {"LT_CLI_USED": "1", "LT_ACCELERATOR": "cpu", "LT_DEVICES": "2", "LT_NUM_NODES": "1",
                        "LT_STRATEGY": flag}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    overrides = DECOUPLED if strategy == "decoupled" else ["env.num_envs=4", "algo.rollout_steps=32"]
    cfg, _, _ = load([*overrides, "fabric.devices=2", "collectives.timeout=17"])
    build_fabric(cfg, 2)
    [(built, variable)] = seen
    assert isinstance(built, GroupDDPStrategy if strategy == "decoupled" else DDPStrategy)
    assert built._timeout == datetime.timedelta(seconds=17)  # noqa: SLF001 (no public reader)
    assert variable is None  # hidden while Fabric is built, or Fabric would build "ddp" from it instead
    assert os.environ["LT_STRATEGY"] == flag  # and back afterwards


def test_lightning_still_prefers_the_strategy_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why `build_fabric` hides LT_STRATEGY: Fabric takes the variable over a strategy object passed in.
    If Lightning stops doing so, this fails and the hiding can go."""
    monkeypatch.setenv("LT_STRATEGY", "ddp")
    ours = DDPStrategy(timeout=datetime.timedelta(seconds=17))
    assert Fabric(accelerator="cpu", devices=1, strategy=ours).strategy is not ours


def test_ranks_numbered_otherwise_are_refused() -> None:
    """A trainer's GPU is its index among its node's trainers, which holds only when the launcher numbers
    ranks node by node: 2 nodes x 4, rank 5 is local rank 1 of node 1."""
    roles = role_map(8, 2, 2)
    check_local_rank(roles[5], 1)
    with pytest.raises(ValueError, match="rank 5 is local rank 2 of its node.*expects local rank 1"):
        check_local_rank(roles[5], 2)  # SLURM cyclic: rank 5 would be local rank 2 of node 1


def _cpu_job(precision: str = "bf16-mixed") -> tuple[Fabric, GroupDDPStrategy]:
    strategy = GroupDDPStrategy(timeout=datetime.timedelta(seconds=30))
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, precision=precision)  # not launched
    return fabric, strategy


def test_trainer_takes_its_gpu_and_autocasts_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """`take_device`: the current CUDA device is set (before any NCCL group or CUDA tensor), Fabric's
    device follows, and mixed precision autocasts on CUDA, not on the CPU Fabric was built for."""
    selected: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", selected.append)
    fabric, strategy = _cpu_job()
    assert fabric.strategy.precision.device == "cpu"
    strategy.take_device(fabric, torch.device("cuda", 1), "bf16-mixed")
    assert selected == [torch.device("cuda", 1)]
    assert fabric.device == torch.device("cuda", 1)
    precision = fabric.strategy.precision
    assert isinstance(precision, MixedPrecision) and precision.device == "cuda"
    assert fabric._precision is precision  # Fabric's own reference, used by setup() and autocast()


def test_trainer_builds_its_model_on_a_device_the_cpu_job_refuses() -> None:
    """A trainer that took a device other than the CPU job's gets its model and optimiser there: Fabric's
    own module move (`fabric.to_device`, and `fabric.setup` by default) asks the job's CPU accelerator,
    which raised "Device should be CPU, got cuda:0" on the first real GPU trainer. The meta device stands
    in for CUDA: the CPU accelerator refuses it the same way, and moving a model there needs no GPU."""
    # The launch below sets MASTER_PORT, WORLD_SIZE, LOCAL_RANK, ... in this process; left behind, they would
    # make every later job this test process starts believe it is one of its ranks already (1/2 clients joined).
    environment = dict(os.environ)
    strategy = GroupDDPStrategy(timeout=datetime.timedelta(seconds=30))
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, precision="32-true")
    fabric.launch()  # a job of one process: a gloo group of one, in this process
    try:
        strategy.use_group(torch.distributed.group.WORLD, 1)  # one trainer: no DDP wrapper
        strategy.take_device(fabric, torch.device("meta"), "32-true")
        with pytest.raises(ValueError, match="Device should be CPU"):  # what Fabric's own move does
            fabric.to_device(torch.nn.Linear(2, 2))
        cfg, _ = compose(DECOUPLED)
        learner = build_learners(fabric, policy_specs(cfg), None, 1e-5)[SINGLE]
        assert {p.device.type for p in learner.policy.parameters()} == {"meta"}
        assert learner.optimizer.param_groups[0]["params"][0].device.type == "meta"
        specs = policy_specs(cfg)
        specs[SINGLE] = dataclasses.replace(specs[SINGLE], trained=False)  # a policy that only acts
        acting = build_learners(fabric, specs, None, 1e-5)[SINGLE]
        assert next(acting.policy.parameters()).device.type == "meta"
    finally:
        torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environment)


@pytest.mark.filterwarnings("ignore:.*GradScaler is enabled, but CUDA is not available")
@pytest.mark.parametrize(
    ("given", "mixed"),
    [("bf16", "bf16-mixed"), ("16-mixed", "16-mixed"), ("16", "16-mixed"), ("32-true", None)],
)
def test_every_name_of_a_mixed_precision_autocasts_on_cuda(
    monkeypatch: pytest.MonkeyPatch, given: str, mixed: str | None
) -> None:
    """`fabric run --precision` also takes Lightning's short names and passes them on as typed
    (LT_PRECISION=bf16): those too autocast on the trainer's GPU, and fp16 gets its loss scaler. Full
    precision keeps Fabric's plugin."""
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    fabric, strategy = _cpu_job()  # the plugin Fabric built for the CPU job (CPU autocast)
    before = fabric.strategy.precision
    strategy.take_device(fabric, torch.device("cuda", 0), given)
    plugin = fabric.strategy.precision
    if mixed is None:
        assert plugin is before
        return
    assert isinstance(plugin, MixedPrecision) and fabric._precision is plugin
    assert (plugin.precision, plugin.device) == (mixed, "cuda")
    assert (plugin.scaler is not None) == (mixed == "16-mixed")


def test_cpu_role_touches_no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(_: Any) -> None:
        raise AssertionError("a CPU role must not select a CUDA device")

    monkeypatch.setattr(torch.cuda, "set_device", refuse)
    fabric, strategy = _cpu_job()
    strategy.take_device(fabric, torch.device("cpu"), "bf16-mixed")
    assert fabric.device == torch.device("cpu") and fabric.strategy.precision.device == "cpu"


def test_trainers_ddp_is_on_their_gpu_and_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several trainers: DDP over the trainers' group with `device_ids` = the trainer's GPU; one trainer:
    no wrapper at all."""
    built: list[dict[str, Any]] = []

    def fake_ddp(module: torch.nn.Module, **kwargs: Any) -> str:
        built.append(kwargs)
        return "ddp"

    monkeypatch.setattr(torch.cuda, "set_device", lambda _: None)
    monkeypatch.setattr(launch_module, "DistributedDataParallel", fake_ddp)
    fabric, strategy = _cpu_job("32-true")
    strategy.take_device(fabric, torch.device("cuda", 3), "32-true")
    group = object()
    strategy.use_group(group, 2)
    assert strategy.setup_module(torch.nn.Linear(2, 2)) == "ddp"
    assert built == [{"device_ids": [3], "process_group": group}]
    strategy.use_group(group, 1)
    module = torch.nn.Linear(2, 2)
    assert strategy.setup_module(module) is module


# ---------------------------------------------------------------------------- pinned staging, fenced
class RecordingStage(HostStage):
    """A CUDA trainer's staging as the protocol sees it (reused buffers, non-blocking copies), on the CPU,
    recording when it is fenced."""

    def __init__(self, log: list[Any]) -> None:
        super().__init__(torch.device("cpu"))
        self.pinned, self.log = True, log

    def buffer(self, key: Any, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(numel, dtype=dtype)
        return buf

    def fence(self) -> None:
        self.log.append("fence")


def _template(samples: int, offset: float = 0.0) -> TensorDict:
    return TensorDict(
        {
            "obs": torch.arange(samples * 3, dtype=torch.float32).view(samples, 3) + offset,
            "actions": torch.arange(samples, dtype=torch.int64),
            "mask": torch.arange(samples) % 2 == 0,
        },
        batch_size=[samples],
    )


def test_trainer_fences_before_reusing_its_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bytes of a player's batch land in a reused host buffer and are copied to the device without
    blocking: the next message may overwrite that buffer only after a fence. Parameters are copied into
    their buffer without blocking too, and fenced before they are broadcast."""
    log: list[Any] = []
    topo = Topology(2, [0, 1], [2], datetime.timedelta(seconds=5), data_groups={0: None, 1: None})
    codec = BatchCodec(_template(4), 1)
    link = TrainerLink(topo, {"main": codec}, torch.device("cpu"))
    link.stage = RecordingStage(log)
    sent: dict[int, TensorDict] = {}
    into: dict[int, int] = {}

    def scatter(tensor: torch.Tensor, scatter_list: Any = None, src: int = 0, **_: Any) -> None:
        log.append(("scatter", src))
        into.setdefault(src, tensor.data_ptr())
        assert tensor.data_ptr() == into[src]  # the same buffer, message after message
        tensor.copy_(codec.pack(sent[src], Header(Kind.DATA, 7))[0])

    monkeypatch.setattr(torch.distributed, "scatter", scatter)
    for round_ in range(2):
        sent = {p: _template(4, offset=10.0 * p + round_) for p in (0, 1)}
        headers, batches = link.receive_data(torch.device("cpu"))
        assert [h.update for h in headers] == [7, 7]
        batch = batches["main"]
        assert batch.device == torch.device("cpu")  # the update shuffles on the batch's device
        assert torch.equal(batch["obs"], torch.cat([sent[0]["obs"], sent[1]["obs"]]))
        assert torch.equal(batch["mask"], torch.cat([sent[0]["mask"], sent[1]["mask"]]))
    assert log == ["fence", ("scatter", 0), ("scatter", 1)] * 2

    log.clear()
    monkeypatch.setattr(
        torch.distributed, "broadcast", lambda t, src, group=None: log.append(("broadcast", t))
    )
    params = list(torch.nn.Linear(2, 1).parameters())
    link.publish(params, torch.tensor([0.5]), 3, signum=15)
    assert log[0] == "fence" and log[1][0] == "broadcast"
    message = log[1][1]
    assert message[:4].tolist() == [float(Kind.PARAMS), 0.0, 3.0, 15.0] and message[-1].item() == 0.5


def test_parameters_carry_their_exact_update_and_come_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """PARAMS is one float32 tensor: an update past 2**24 (which float32 rounds: 16,777,217 -> 16,777,216)
    arrives exact, and a player refuses parameters that are not the next update's (it would train on and
    log them under the wrong update without a word)."""
    timeout = datetime.timedelta(seconds=5)
    params = list(torch.nn.Linear(2, 1).parameters())
    on_wire: list[torch.Tensor] = []
    monkeypatch.setattr(torch.distributed, "broadcast", lambda t, src, group=None: on_wire.append(t.clone()))
    trainer = TrainerLink(Topology(1, [0], [1], timeout), {}, torch.device("cpu"))
    first = 2**24 + 1
    for update in (first, first + 1, first + 3):
        trainer.publish(params, torch.tensor([0.25]), update, signum=2)

    def receive(t: torch.Tensor, src: int, group: Any = None) -> None:
        t.copy_(on_wire.pop(0))

    monkeypatch.setattr(torch.distributed, "broadcast", receive)
    player = PlayerLink(Topology(0, [0], [1], timeout), {}, num_params=3, num_metrics=1, first_update=first)
    update, flat, metrics, signum = player.receive_params()
    assert (update, signum, metrics.tolist()) == (first, 2, [0.25])
    assert torch.equal(flat, torch.nn.utils.parameters_to_vector(params).detach())
    assert player.receive_params()[0] == first + 1
    with pytest.raises(
        ProtocolError, match=rf"expected the parameters of update {first + 2}, got update {first + 3}"
    ):
        player.receive_params()


# --------------------------------------------------------------------------------------- RNG with CUDA
def test_cuda_rng_states_restore_only_onto_as_many_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint keeps every visible GPU's generator; they are restored where the run sees as many
    GPUs, and skipped elsewhere (a GPU checkpoint resumed on a CPU machine, or on another GPU count)."""
    restored: list[list[torch.Tensor]] = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [torch.zeros(16, dtype=torch.uint8)] * 2)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    _fake_gpus(monkeypatch, 2)
    state = ckpt.rng_state()
    assert len(state["cuda"]) == 2
    ckpt.set_rng_state(state)
    assert len(restored) == 1
    _fake_gpus(monkeypatch, 1)
    ckpt.set_rng_state(state)
    _fake_gpus(monkeypatch, 0)
    ckpt.set_rng_state(state)
    assert len(restored) == 1


@pytest.mark.parametrize(
    "header",
    [
        Header(Kind.DATA, 7),
        Header(Kind.DATA, 8, checkpoint=True),
        Header(Kind.STOP, 9),
        Header(Kind.STOP, 9, signum=15),
    ],
)
def test_a_header_says_one_thing_per_field_and_survives_the_wire(header: Header) -> None:
    """DATA's `checkpoint` and STOP's `signum` share the header's third int64 on the wire; each comes back
    in its own field, the other at its default."""
    codec = BatchCodec(_template(4), 1)
    message = codec.empty(header)[0] if header.kind == Kind.STOP else codec.pack(_template(4), header)[0]
    assert codec.unpack(message, torch.device("cpu"))[0] == header


def test_a_rank_gathering_for_another_purpose_is_a_protocol_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoints and the run's end are both gathers over every rank: a trainer checkpointing while a
    player ends would pair the two and fail later in whoever reads the parts (a KeyError naming neither).
    Each rank says what it gathers for, and a mismatch names both."""
    from ppo_fabric.wire import protocol

    topo = Topology(2, [0, 1], [2], datetime.timedelta(seconds=5))
    answers = {"agree": [("end", {"a": 0}), ("end", {"a": 1}), ("end", {"a": 2})],
               "differ": [("end", {}), ("end", {}), ("checkpoint", {"rank_state": {}})]}  # fmt: skip
    for case, out in answers.items():
        monkeypatch.setattr(protocol, "all_gather_objects", lambda obj, group=None, out=out: out)
        if case == "agree":
            assert topo.gather({"a": 2}, "end") == [{"a": 0}, {"a": 1}, {"a": 2}]
        else:
            with pytest.raises(protocol.ProtocolError, match=r"rank 2 gathered for 'end' while the ranks "
                               r"gathered for \['end', 'end', 'checkpoint'\]"):  # fmt: skip
                topo.gather({}, "end")
