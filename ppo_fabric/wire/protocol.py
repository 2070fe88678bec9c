"""Every torch.distributed call of ppo-fabric: the decoupled strategy's player <-> trainer protocol, and the
two collectives both strategies share (gathering objects, summing normaliser statistics).

Players and trainers are the ranks `placement.role_map` names (on one node: ranks `0..P-1` play, the
others train). One side's `PlayerLink` and the other's `TrainerLink`
have one method per message, in the order the messages happen:

    player p                                  trainers (first trainer t0)
    --------                                  ---------------------------
    receive_params()   <--- PARAMS v=0 ------ publish()            initial (or resumed) parameters
    loop:
      [agree with the other players: stop? time-based checkpoint due?]
      collect a rollout
      send_data()      ---- DATA v ---------> receive_data()       one message per trained policy,
                                                                   one shard per trainer
      receive_params() <--- PARAMS v+1 ------ publish()            parameters + the update's METRICS
                                                                   (+ a stop signal a trainer received)
      [gather()        <--- CHECKPOINT -----> gather()]            when a checkpoint is due: all ranks
    send_stop()        ---- STOP -----------> receive_data()       ends the trainers' loop (signum)
    [gather()          <--- CHECKPOINT -----> gather()]            stopped on a signal: the stop checkpoint
    gather()           <--- CHECKPOINT -----> gather()             end-of-run summaries

With `algo.pipeline=true` the player sends DATA of rollout k+1 before it waits for PARAMS of update k
(asynchronously, over another group, so the order cannot deadlock).

Every message carries a header (kind, update) that the receiver checks, so the two sides can never
silently disagree about what comes next (`ProtocolError`). Batches and parameters travel as CPU tensors
over gloo groups, so players may stay on the CPU while trainers train on CUDA (their DDP group then uses
NCCL); a CUDA trainer stages them in pinned host buffers (`HostStage`) and copies them to and from its
GPU without blocking. Every group has the bounded `collectives.timeout`: a dead peer ends the job with an error, never a
hang. Objects are pickled only for CHECKPOINT and summaries, never for batches or parameters.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.nn.utils import parameters_to_vector

from ppo_fabric.wire.progress import PROGRESS


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


# ----------------------------------------------------------------------------- shared by both strategies
def all_gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's `obj` (in rank order); a single-process run returns `[obj]`."""
    if not distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    with PROGRESS.waiting_for("the other ranks (gather)"):
        dist.all_gather_object(out, obj, group=group)
    return out


def sum_reduce(group: Any, device: Any) -> Callable[[np.ndarray], np.ndarray] | None:
    """Sum numpy arrays over a process group (normaliser statistics); None when there is nothing to sum."""
    if not distributed() or dist.get_world_size(group) == 1:
        return None

    def reduce(values: np.ndarray) -> np.ndarray:
        tensor = torch.from_numpy(values).to(device)
        with PROGRESS.waiting_for("the other ranks (sum)"):
            dist.all_reduce(tensor, group=group)
        return tensor.cpu().numpy()

    return reduce


def max_over(values: torch.Tensor, device: Any, group: Any = None) -> torch.Tensor:
    """Elementwise maximum over a process group (the ranks' stop and checkpoint flags), on the CPU."""
    if not distributed() or dist.get_world_size(group) == 1:
        return values
    out = values.to(device)
    with PROGRESS.waiting_for("the other ranks (update boundary)"):
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out.cpu()


def boundary_group(timeout_s: float) -> Any:
    """A gloo group of every rank for a coupled job's update-boundary agreement (`max_over`), whose wait
    may last `timeout_s`: rank 0 evaluates in place just before it while the others wait there, and an
    evaluation is progress its watchdog sees, not a stall (so the caller gives `collectives.timeout` +
    `stall_timeout`). None in a 1-process job. Every rank calls it, at the same point."""
    if not distributed() or dist.get_world_size() == 1:
        return None
    return dist.new_group(timeout=datetime.timedelta(seconds=timeout_s), backend="gloo")


def end_process_group() -> None:
    if distributed():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------- messages
class Kind(IntEnum):
    DATA = 1
    PARAMS = 2
    CHECKPOINT = 3
    STOP = 4


class ProtocolError(RuntimeError):
    """A message arrived that the receiver did not expect: the two sides disagree on the schedule."""


# PARAMS travels as one float32 tensor: [kind, update // 2**22, update % 2**22, signum, parameters...,
# metrics...]. float32 holds integers exactly only up to 2**24, so the update goes in two halves.
PARAMS_HEADER = 4
_HALF = 2**22


def _float_halves(value: int) -> tuple[float, float]:
    return float(value // _HALF), float(value % _HALF)


def _int_of(high: torch.Tensor, low: torch.Tensor) -> int:
    return int(high) * _HALF + int(low)


class Header(NamedTuple):
    """What every DATA/STOP message starts with: its kind, `update` (the update whose parameters collected
    the batch; STOP: the newest the player received), `checkpoint` (DATA: a checkpoint is to follow the update on this batch, a time-based one, which
    only the players' clocks know of) and `signum` (STOP: the signal that stopped the run, 0 at its
    planned end). On the wire the two share the third int64, read by the kind."""

    kind: Kind
    update: int
    checkpoint: bool = False
    signum: int = 0


_HEADER_BYTES = 24  # three int64


def _header(header: Header) -> torch.Tensor:
    third = header.signum if header.kind == Kind.STOP else int(header.checkpoint)
    return torch.tensor([int(header.kind), header.update, third], dtype=torch.int64).view(torch.uint8)


def _read_header(buf: torch.Tensor) -> Header:
    kind, update, third = buf[:_HEADER_BYTES].view(torch.int64).tolist()
    try:
        known = Kind(kind)
    except ValueError as exc:
        raise ProtocolError(f"unknown message kind {kind}") from exc
    if known == Kind.STOP:
        return Header(known, update, signum=third)
    return Header(known, update, checkpoint=bool(third))


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
    player_group: Any = None  # players, gloo (episode statistics, normalisers)
    everyone: Any = None  # all ranks, gloo (checkpoints, summary)

    @property
    def is_player(self) -> bool:
        return self.rank in self.players

    @property
    def first_trainer(self) -> int:
        return self.trainers[0]

    def gather(self, obj: Any, purpose: str) -> list[Any]:
        """CHECKPOINT state (`purpose` "checkpoint") and end-of-run parts ("end"): every rank's object, in
        rank order (pickled, rare). Every rank names what it gathers for, so a rank checkpointing while
        another ends is a ProtocolError naming both, not a KeyError in whoever reads the parts."""
        out = all_gather_objects((purpose, obj), group=self.everyone)
        purposes = [tag for tag, _ in out]
        if any(tag != purpose for tag in purposes):
            raise ProtocolError(
                f"rank {self.rank} gathered for {purpose!r} while the ranks gathered for {purposes} (rank order)"
            )
        return [payload for _, payload in out]


def setup_topology(players: list[int], timeout_s: float, trainer_backend: str = "gloo") -> Topology:
    """Create every group on every rank, in the same order (new_group is itself a collective).

    `players` are the playing ranks (placement.role_map), the others train; `trainer_backend` is the
    trainers' DDP group's: "nccl" when they train on CUDA, "gloo" on the CPU. Every other group is gloo:
    the job itself runs on the CPU, whatever device a role then takes.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    timeout = datetime.timedelta(seconds=timeout_s)
    trainers = [r for r in range(world) if r not in players]
    topo = Topology(rank, list(players), trainers, timeout)
    topo.trainer_group = dist.new_group(topo.trainers, timeout=timeout, backend=trainer_backend)
    for p in topo.players:
        topo.data_groups[p] = dist.new_group([p, *topo.trainers], timeout=timeout, backend="gloo")
    topo.param_group = dist.new_group([topo.first_trainer, *topo.players], timeout=timeout, backend="gloo")
    topo.player_group = dist.new_group(topo.players, timeout=timeout, backend="gloo")
    topo.everyone = dist.new_group(list(range(world)), timeout=timeout, backend="gloo")
    return topo


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

    def pack(self, batch: TensorDict, header: Header) -> list[torch.Tensor]:
        """One buffer per trainer: header + that trainer's rows."""
        rows = torch.cat(
            [batch[k].reshape(self.samples, -1).cpu().view(torch.uint8) for k, _, _ in self.layout], 1
        )
        head = _header(header)
        return [torch.cat((head, shard.reshape(-1))) for shard in rows.split(self.shard_samples)]

    def empty(self, header: Header) -> list[torch.Tensor]:
        buf = torch.zeros(self.shard_bytes, dtype=torch.uint8)
        buf[:_HEADER_BYTES] = _header(header)
        return [buf] * self.trainers

    def unpack(
        self, buf: torch.Tensor, device: torch.device, non_blocking: bool = False
    ) -> tuple[Header, TensorDict]:
        """The header, and the rows as a TensorDict on `device`: the bytes go over in one copy (from a pinned
        `buf`, without blocking) and are cut into tensors there.

        The TensorDict says it is on `device`, as a coupled rank's storage does: the update shuffles with
        `torch.randperm(n, device=batch.device)`, which without a device would draw the permutation on the
        CPU and copy it to a CUDA trainer's GPU once per key and epoch, each copy waiting for the GPU."""
        header = _read_header(buf)
        rows = buf[_HEADER_BYTES:].to(device, non_blocking=non_blocking).view(self.shard_samples, -1)
        out, col = TensorDict(batch_size=[self.shard_samples], device=device), 0
        for (key, shape, dtype), width in zip(self.layout, self.row_bytes, strict=True):
            out.set(
                key, rows[:, col : col + width].contiguous().view(dtype).reshape(self.shard_samples, *shape)
            )
            col += width
        return header, out


class HostStage:
    """The host side of a device's messages: page-locked (pinned) buffers when the device is CUDA, reused
    from message to message, so the copies to and from the GPU run asynchronously; plain fresh buffers on
    the CPU, where there is nothing to copy (and a message may keep views of its buffer)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._buffers: dict[Any, torch.Tensor] = {}

    def buffer(self, key: Any, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if not self.pinned:
            return torch.empty(numel, dtype=dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() != numel or buf.dtype != dtype:
            buf = self._buffers[key] = torch.empty(numel, dtype=dtype, pin_memory=True)
        return buf

    def fence(self) -> None:
        """Wait for the copies in flight: before a pinned buffer is written again or sent."""
        if self.pinned:
            torch.cuda.current_stream(self.device).synchronize()


class _InFlight:
    """A DATA message still being sent; keeps its buffers alive until `wait()` returns."""

    def __init__(self, work: Any, buffers: list[torch.Tensor]) -> None:
        self.work, self.buffers = work, buffers

    def wait(self) -> None:
        self.work.wait()
        self.buffers = []


# ------------------------------------------------------------------------------------------- the sides
class PlayerLink:
    """A player's end of the protocol: its methods are the messages it sends and receives, in order.

    `codecs` has one entry per trained policy, in the order the DATA messages go (both sides build the
    same dict from the same config); `num_params`/`num_metrics` size the PARAMS message.
    """

    def __init__(
        self,
        topo: Topology,
        codecs: dict[str, BatchCodec],
        num_params: int,
        num_metrics: int,
        first_update: int,
    ) -> None:
        self.topo, self.codecs = topo, codecs
        self.num_params, self.num_metrics = num_params, num_metrics
        self.next_update = first_update  # the trainers publish the first (or resumed) update, then each next
        self._in_transit: list[_InFlight] = []

    def receive_params(self) -> tuple[int, torch.Tensor, torch.Tensor, int]:
        """PARAMS: (the update they come from, flat parameters, the update's metrics averaged over trainers,
        the signal that asked a trainer to stop: 0 for none; only players agree on stopping, so a signal
        that reached only trainers comes to them this way). The update must be the next one: parameters of
        another would train on and log under the wrong update without a word."""
        buf = torch.empty(PARAMS_HEADER + self.num_params + self.num_metrics)
        with PROGRESS.waiting_for("parameters from the trainers"):
            dist.broadcast(buf, self.topo.first_trainer, group=self.topo.param_group)
        kind, update, signum = int(buf[0]), _int_of(buf[1], buf[2]), int(buf[3])
        if kind != Kind.PARAMS:
            raise ProtocolError(f"player {self.topo.rank} expected PARAMS, got message kind {kind}")
        if update != self.next_update:
            raise ProtocolError(
                f"player {self.topo.rank} expected the parameters of update {self.next_update}, got update {update}"
            )
        self.next_update = update + 1
        body = buf[PARAMS_HEADER:]
        return update, body[: self.num_params], body[self.num_params :], signum

    def send_data(
        self, batches: dict[str, TensorDict], update: int, asynchronous: bool, checkpoint_after: bool
    ) -> None:
        """DATA: each trained policy's batch, collected with the parameters of `update`, one shard per trainer;
        `checkpoint_after` asks for a checkpoint once the trainers have updated on it.

        Asynchronous sends return at once (the pipelined player then waits for PARAMS); the previous
        rollout's sends are finished first, so at most one rollout is in transit.
        """
        self.wait_sent()
        header = Header(Kind.DATA, update, checkpoint=checkpoint_after)
        for name, codec in self.codecs.items():
            sent = self._scatter(codec, codec.pack(batches[name], header), asynchronous)
            if sent is not None:
                self._in_transit.append(sent)

    def send_stop(self, update: int, signum: int = 0) -> None:
        """STOP: the trainers leave their loop (one message, shaped like the first policy's DATA), at the
        planned end or, with `signum`, because the players agreed to stop on that signal."""
        self.wait_sent()
        codec = next(iter(self.codecs.values()))
        self._scatter(codec, codec.empty(Header(Kind.STOP, update, signum=signum)), asynchronous=False)

    def wait_sent(self) -> None:
        with PROGRESS.waiting_for("the trainers to take the last batch"):
            for message in self._in_transit:
                message.wait()
        self._in_transit = []

    def sum_over_players(self, values: torch.Tensor) -> torch.Tensor:
        """Episode statistics of every player (in place)."""
        with PROGRESS.waiting_for("the other players (episode statistics)"):
            dist.all_reduce(values, group=self.topo.player_group)
        return values

    def _scatter(self, codec: BatchCodec, shards: list[torch.Tensor], asynchronous: bool) -> _InFlight | None:
        mine = torch.empty(codec.shard_bytes, dtype=torch.uint8)  # scatter gives the source a piece too
        group = self.topo.data_groups[self.topo.rank]
        # Scatter lists follow the group's rank order, which is the members' global order: across nodes a
        # player may come after some trainers. Trainer k (in `topo.trainers` order) gets shard k.
        to = {trainer: shard for trainer, shard in zip(self.topo.trainers, shards, strict=True)}
        pieces = [to.get(r, mine) for r in dist.get_process_group_ranks(group)]
        with PROGRESS.waiting_for("the trainers to take a batch"):
            work = dist.scatter(mine, pieces, src=self.topo.rank, group=group, async_op=asynchronous)
        return _InFlight(work, [mine, *shards]) if asynchronous else None


class TrainerLink:
    """A trainer's end of the protocol; only the first trainer publishes parameters."""

    def __init__(self, topo: Topology, codecs: dict[str, BatchCodec], device: torch.device) -> None:
        self.topo, self.codecs = topo, codecs
        self.publishes = topo.rank == topo.first_trainer
        self.stage = HostStage(device)

    def publish(
        self, params: list[torch.nn.Parameter], metrics: torch.Tensor, update: int, signum: int = 0
    ) -> None:
        """PARAMS: the flat float32 parameters after `update`, then its METRICS, to every player, with
        `signum`, a stop signal a trainer received (0: none)."""
        if not self.publishes:
            return
        flat = parameters_to_vector(params).detach().float()
        n, m = flat.numel(), metrics.numel()
        message = self.stage.buffer("params", PARAMS_HEADER + n + m, torch.float32)
        high, low = _float_halves(update)
        message[0], message[1], message[2], message[3] = float(Kind.PARAMS), high, low, float(signum)
        body = message[PARAMS_HEADER:]
        body[:n].copy_(flat, non_blocking=self.stage.pinned)
        body[n:].copy_(metrics.float(), non_blocking=self.stage.pinned)
        self.stage.fence()
        with PROGRESS.waiting_for("the players to take the parameters"):
            dist.broadcast(message, self.topo.first_trainer, group=self.topo.param_group)

    def receive_data(self, device: torch.device) -> tuple[list[Header], dict[str, TensorDict]]:
        """DATA from every player for every trained policy, concatenated per policy; or STOP (no batches).

        Returns every player's header (kind, the update whose parameters it collected with, `checkpoint` or
        `signum`) and the batches by policy. The players agree on those and on stopping, so the headers
        differ only in update.
        """
        batches: dict[str, TensorDict] = {}
        headers: list[Header] = []
        self.stage.fence()  # the last batch's copies out of the reused buffers are done
        for name, codec in self.codecs.items():
            headers, batch = self._receive(codec, device)
            if headers[0].kind == Kind.STOP:
                return headers, {}
            batches[name] = batch
        return headers, batches

    def _receive(self, codec: BatchCodec, device: torch.device) -> tuple[list[Header], TensorDict]:
        headers, parts = [], []
        for player in self.topo.players:
            buf = self.stage.buffer((id(codec), player), codec.shard_bytes, torch.uint8)
            with PROGRESS.waiting_for(f"a batch from player rank {player}"):
                dist.scatter(buf, None, src=player, group=self.topo.data_groups[player])
            header, part = codec.unpack(buf, device, non_blocking=self.stage.pinned)
            headers.append(header)
            parts.append(part)
        first = headers[0]
        if first.kind not in (Kind.DATA, Kind.STOP) or any(
            h._replace(update=0) != first._replace(update=0) for h in headers
        ):
            raise ProtocolError(
                f"trainer {self.topo.rank} expected the same DATA or STOP from every player, got {headers}"
            )
        return headers, torch.cat(parts) if first.kind == Kind.DATA else parts[0]

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """Average over all trainers (the target-KL decision, the logged metrics)."""
        if len(self.topo.trainers) == 1:
            return values
        out = values.clone()
        with PROGRESS.waiting_for("the other trainers (mean)"):
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.topo.trainer_group)
        return out / len(self.topo.trainers)
