"""The player <-> trainer protocol of the decoupled strategy: process groups, named messages, timeouts.

Ranks `0..P-1` are players, the others trainers. Every exchange is one of the messages below, each
carrying a header (kind, version) that the receiver checks, so both sides can never silently disagree
about what comes next:

- DATA / STOP (player -> every trainer, `scatter` over the group {player} + trainers): the player's
  flat rollout batch, packed into one uint8 row per sample and cut into one shard per trainer. STOP has
  the same shape and ends the trainers' loop.
- PARAMS (first trainer -> every player, `broadcast` over {first trainer} + players): the flat parameter
  vector after an update, followed by the update's METRICS averaged over all trainers.
- CHECKPOINT (everyone, `all_gather_object` over a gloo group): learner and per-rank state, written by
  rank 0. Objects are pickled only here, never for batches or parameters.

Batches and parameters travel as CPU tensors over gloo groups, so players may stay on the CPU while
trainers train on CUDA (their DDP group then uses NCCL). Every group has the bounded
`collectives.timeout`: a dead peer ends the job with an error, never a hang.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.strategies import DDPStrategy
from tensordict import TensorDict
from torch.nn.parallel import DistributedDataParallel


class GroupDDPStrategy(DDPStrategy):
    """Fabric's DDP over a sub-group of the job chosen after launch: the decoupled trainers.

    Players never join the group. A group of one trainer gets no DDP wrapper at all: it has nothing to
    synchronise, and DDP's forward/backward hooks would still cost ~120 us per minibatch step.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.module_group: Any = None
        self.module_group_size = 0

    def use_group(self, group: Any, size: int) -> None:
        self.module_group, self.module_group_size = group, size

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.module_group is None:
            return super().setup_module(module)
        if self.module_group_size == 1:
            return module
        device = self.root_device
        device_ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=device_ids, process_group=self.module_group)


class Kind(IntEnum):
    DATA = 1
    PARAMS = 2
    CHECKPOINT = 3
    STOP = 4


class ProtocolError(RuntimeError):
    """A message arrived that the receiver did not expect: the two sides disagree on the schedule."""


_HEADER_BYTES = 16  # two int64: kind, version


@dataclass
class Topology:
    """Who plays, who trains, and the process groups between them (created identically on every rank)."""

    rank: int
    players: list[int]
    trainers: list[int]
    timeout: datetime.timedelta
    trainer_group: Any = None  # DDP among trainers (the accelerator's backend)
    data_groups: dict[int, Any] = field(default_factory=dict)  # player -> {player} + trainers, gloo
    param_group: Any = None  # {first trainer} + players, gloo
    player_group: Any = None  # players, gloo (episode statistics)
    everyone: Any = None  # all ranks, gloo (checkpoints, summary)

    @property
    def is_player(self) -> bool:
        return self.rank in self.players

    @property
    def first_trainer(self) -> int:
        return self.trainers[0]


def setup_topology(num_players: int, timeout_s: float) -> Topology:
    """Create every group on every rank, in the same order (new_group is itself a collective)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    timeout = datetime.timedelta(seconds=timeout_s)
    topo = Topology(rank, list(range(num_players)), list(range(num_players, world)), timeout)
    topo.trainer_group = dist.new_group(topo.trainers, timeout=timeout)
    for p in topo.players:
        topo.data_groups[p] = dist.new_group([p, *topo.trainers], timeout=timeout, backend="gloo")
    topo.param_group = dist.new_group([topo.first_trainer, *topo.players], timeout=timeout, backend="gloo")
    topo.player_group = dist.new_group(topo.players, timeout=timeout, backend="gloo")
    topo.everyone = dist.new_group(list(range(world)), timeout=timeout, backend="gloo")
    return topo


def _header(kind: Kind, version: int) -> torch.Tensor:
    return torch.tensor([int(kind), version], dtype=torch.int64).view(torch.uint8)


def _read_header(buf: torch.Tensor) -> tuple[Kind, int]:
    kind, version = buf[:_HEADER_BYTES].view(torch.int64).tolist()
    try:
        return Kind(kind), version
    except ValueError as exc:
        raise ProtocolError(f"unknown message kind {kind}") from exc


# ---------------------------------------------------------------------------------------------- batches
class BatchCodec:
    """Packs a flat TensorDict batch into bytes and back, with a layout both sides derive from a template.

    One uint8 row per sample keeps shards contiguous: shard k is rows [k*n/K, (k+1)*n/K).
    """

    def __init__(self, template: TensorDict, num_trainers: int) -> None:
        # Leaves, so a nested entry (Dict observations: ("obs", key)) is packed like any other tensor.
        leaves = template.items(include_nested=True, leaves_only=True)
        self.layout = [(k, v.shape[1:], v.dtype) for k, v in sorted(leaves, key=lambda kv: str(kv[0]))]
        self.row_bytes = [int(torch.empty(s, dtype=d).numel() * d.itemsize) for _, s, d in self.layout]
        self.samples = template.batch_size[0]
        self.trainers = num_trainers
        self.shard_samples = self.samples // num_trainers
        self.shard_bytes = _HEADER_BYTES + self.shard_samples * sum(self.row_bytes)

    def pack(self, batch: TensorDict, kind: Kind, version: int) -> list[torch.Tensor]:
        """One buffer per trainer: header + that trainer's rows."""
        rows = torch.cat(
            [batch[k].reshape(self.samples, -1).cpu().view(torch.uint8) for k, _, _ in self.layout], 1
        )
        header = _header(kind, version)
        return [torch.cat((header, shard.reshape(-1))) for shard in rows.split(self.shard_samples)]

    def empty(self, kind: Kind, version: int) -> list[torch.Tensor]:
        buf = torch.zeros(self.shard_bytes, dtype=torch.uint8)
        buf[:_HEADER_BYTES] = _header(kind, version)
        return [buf] * self.trainers

    def unpack(self, buf: torch.Tensor, device: torch.device) -> tuple[Kind, int, TensorDict]:
        kind, version = _read_header(buf)
        rows = buf[_HEADER_BYTES:].view(self.shard_samples, -1)
        out, col = TensorDict(batch_size=[self.shard_samples]), 0
        for (key, shape, dtype), width in zip(self.layout, self.row_bytes, strict=True):
            out.set(
                key, rows[:, col : col + width].contiguous().view(dtype).reshape(self.shard_samples, *shape)
            )
            col += width
        return kind, version, out.to(device)


class InFlight:
    """A DATA message still being sent; keeps its buffers alive until `wait()` returns."""

    def __init__(self, work: Any, buffers: list[torch.Tensor]) -> None:
        self.work, self.buffers = work, buffers

    def wait(self) -> None:
        self.work.wait()
        self.buffers = []


def send_batch(
    topo: Topology, codec: BatchCodec, batch: TensorDict | None, version: int, async_op: bool = False
) -> InFlight | None:
    """Player: DATA (or STOP when `batch` is None) to every trainer, one shard each.

    With `async_op`, returns at once: the pipelined player sends a batch and then waits for the parameters
    of the previous update, so the batch is already in flight when the trainers ask for it. (The two use
    different groups, so the order cannot deadlock.)
    """
    shards = codec.empty(Kind.STOP, version) if batch is None else codec.pack(batch, Kind.DATA, version)
    mine = torch.empty(codec.shard_bytes, dtype=torch.uint8)  # scatter gives the source a piece too
    work = dist.scatter(
        mine, [mine, *shards], src=topo.rank, group=topo.data_groups[topo.rank], async_op=async_op
    )
    return InFlight(work, [mine, *shards]) if async_op else None


def recv_batches(
    topo: Topology, codec: BatchCodec, device: torch.device
) -> tuple[Kind, list[int], TensorDict]:
    """Trainer: one shard from every player, concatenated; returns (DATA or STOP, versions, batch)."""
    kinds, versions, parts = [], [], []
    for player in topo.players:
        buf = torch.empty(codec.shard_bytes, dtype=torch.uint8)
        dist.scatter(buf, None, src=player, group=topo.data_groups[player])
        kind, version, part = codec.unpack(buf, device)
        kinds.append(kind)
        versions.append(version)
        parts.append(part)
    if len(set(kinds)) != 1 or kinds[0] not in (Kind.DATA, Kind.STOP):
        raise ProtocolError(f"trainer {topo.rank} expected DATA or STOP from every player, got {kinds}")
    return kinds[0], versions, torch.cat(parts) if kinds[0] == Kind.DATA else parts[0]


# ------------------------------------------------------------------------------------------- parameters
def broadcast_params(topo: Topology, params: torch.Tensor, metrics: torch.Tensor, version: int) -> None:
    """First trainer: PARAMS (flat float32 parameters + METRICS) to every player."""
    header = torch.tensor([float(Kind.PARAMS), float(version)])
    dist.broadcast(torch.cat((header, params.detach().float().cpu(), metrics.float().cpu())), topo.first_trainer,
                   group=topo.param_group)  # fmt: skip


def recv_params(topo: Topology, num_params: int, num_metrics: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Player: wait for PARAMS; returns (version, flat parameters, metrics)."""
    buf = torch.empty(2 + num_params + num_metrics)
    dist.broadcast(buf, topo.first_trainer, group=topo.param_group)
    kind, version = int(buf[0]), int(buf[1])
    if kind != Kind.PARAMS:
        raise ProtocolError(f"player {topo.rank} expected PARAMS, got message kind {kind}")
    return version, buf[2 : 2 + num_params], buf[2 + num_params :]


# --------------------------------------------------------------------------------- checkpoint, summary
def gather_objects(topo: Topology, obj: Any) -> list[Any]:
    """CHECKPOINT and end-of-run summaries: every rank's object, in rank order (pickled, rare)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, (int(Kind.CHECKPOINT), obj), group=topo.everyone)
    if any(kind != Kind.CHECKPOINT for kind, _ in out):
        raise ProtocolError("a rank sent something other than CHECKPOINT state")
    return [payload for _, payload in out]


def mean_over_trainers(topo: Topology, values: torch.Tensor) -> torch.Tensor:
    """Average a metrics vector over all trainers (not one trainer's view)."""
    if len(topo.trainers) == 1:
        return values
    out = values.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=topo.trainer_group)
    return out / len(topo.trainers)
