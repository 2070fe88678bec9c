"""Where each process of a job runs: the decoupled strategy's rank -> role map, each role's device, and the
warning for a model too small to gain from a GPU. Pure functions of the layout, so every rank computes the
same answer without a collective, and the config checks can use them before any process starts.

Decoupled roles. Every process is launched as a CPU process (gloo), `fabric.devices` per node, ranks
numbered node by node (global rank = node * devices + local rank, as torchrun and Fabric number them).
Players are spread over the nodes, the first nodes taking one more when they do not divide evenly; on each
node the first local ranks play and the others train. Rank 0 always plays (it writes the run's logs and
summary). Trainers then take their device: `cuda:<index of the trainer among its node's trainers>` (NCCL
allows one rank per GPU, so a node needs as many GPUs as it has trainers) or the CPU. Players act on the
CPU with `algo.player_device=cpu`; with `auto` they take the trainers' kind of device, on CUDA the GPU after
their node's trainers' (wrapping round), as players never join an NCCL group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TRAINER_DEVICES = ("auto", "cpu", "cuda")
# A policy this small is bound by kernel launches on a GPU: CartPole `exp=fast` (64 envs, a 9k-parameter
# MLP) ran at 24.0k SPS on the CPU and 17.6k on an H100 of the same machine. The crossover was not
# measured, so the warning stays well above that model and below the ~1.7M parameters of the Nature CNN,
# which does gain from the GPU.
SMALL_MODEL_PARAMETERS = 100_000


@dataclass(frozen=True)
class Role:
    """One rank's place in a decoupled job."""

    rank: int
    node: int
    local_rank: int
    plays: bool
    index: int  # among the ranks of the same role on the same node (a trainer's GPU index)


def players_on_node(players: int, num_nodes: int, node: int) -> int:
    """How many of `players` the node hosts: an even share, the first nodes one more when it does not divide."""
    return players // num_nodes + (1 if node < players % num_nodes else 0)


def role_map(world: int, num_nodes: int, players: int) -> list[Role]:
    """Every rank's role, in rank order. Needs `world` divisible by `num_nodes` and 1 <= players < world."""
    if num_nodes < 1 or world % num_nodes:
        raise ValueError(f"{world} processes cannot be spread evenly over {num_nodes} node(s)")
    if not 1 <= players < world:
        raise ValueError(f"algo.players={players} must leave at least one of {world} processes to train")
    per_node = world // num_nodes
    roles = []
    for node in range(num_nodes):
        here = players_on_node(players, num_nodes, node)
        for local in range(per_node):
            plays = local < here
            roles.append(Role(node * per_node + local, node, local, plays, local if plays else local - here))
    return roles


def players_of(roles: list[Role]) -> list[int]:
    return [r.rank for r in roles if r.plays]


def check_local_rank(role: Role, local_rank: int) -> None:
    """The launcher numbered the ranks as the map assumes (node by node), so `role.index`, which picks a
    trainer's GPU, counts the ranks of this rank's own node. Otherwise (SLURM's cyclic distribution, say)
    two trainers of one node could take the same GPU, which NCCL refuses only at the first collective, or
    a trainer a GPU its node does not have; raises ValueError naming both numbers."""
    if role.local_rank != local_rank:
        raise ValueError(
            f"rank {role.rank} is local rank {local_rank} of its node, but strategy=decoupled numbers ranks "
            f"node by node and expects local rank {role.local_rank}; launch with consecutive ranks on each "
            "node (torchrun and Fabric do; SLURM: --distribution=block)"
        )


def trainers_of(roles: list[Role]) -> list[int]:
    return [r.rank for r in roles if not r.plays]


def trainers_per_node(roles: list[Role]) -> list[int]:
    nodes = max(r.node for r in roles) + 1
    return [sum(1 for r in roles if r.node == n and not r.plays) for n in range(nodes)]


def trainer_kind(setting: str, accelerator: str, cuda_available: bool) -> str:
    """`algo.trainer_device`: `cpu` or `cuda`; `auto` follows the job's accelerator (`fabric.accelerator`,
    or `fabric run --accelerator`), `auto` there meaning CUDA when there is one."""
    if setting != "auto":
        return setting
    if accelerator in ("cuda", "gpu"):
        return "cuda"
    return "cuda" if accelerator == "auto" and cuda_available else "cpu"


def player_kind(setting: str, trainer: str) -> str:
    """`algo.player_device`: `cpu`, or `auto`: the trainers' kind."""
    return "cpu" if setting == "cpu" else trainer


def role_device(role: Role, roles: list[Role], kind: str, gpus: int) -> torch.device:
    """The device `role` works on, given its role's kind of device and the GPUs its node sees."""
    if kind == "cpu":
        return torch.device("cpu")
    if gpus < 1:
        raise ValueError(f"rank {role.rank} is to use CUDA but its node has no CUDA device")
    if not role.plays:
        if role.index >= gpus:
            raise ValueError(
                f"trainer rank {role.rank} is trainer {role.index} of its node, which has {gpus} GPU(s)"
            )
        return torch.device("cuda", role.index)
    local_trainers = trainers_per_node(roles)[role.node]
    return torch.device("cuda", (local_trainers + role.index) % gpus)


def small_model_warning(parameters: int, device: str) -> str | None:
    """One line when a model this small is put on a GPU, where the CPU is faster; None otherwise."""
    if device != "cuda" or parameters >= SMALL_MODEL_PARAMETERS:
        return None
    return (
        f"warning: the model has {parameters:,} parameters, and a model under "
        f"{SMALL_MODEL_PARAMETERS:,} trains faster on the CPU than on a GPU (CartPole exp=fast: 24.0k SPS on "
        "the CPU, 17.6k on an H100 of the same machine); consider fabric=cpu (strategy=decoupled: "
        "algo.trainer_device=cpu)"
    )
