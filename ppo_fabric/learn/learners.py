"""The policies a run learns and their optimisers, for both strategies: one (`main`) for a gymnasium env,
one per entry of `multiagent.policies` for a PettingZoo env. Each has its own spaces, model config, optimiser and learning
rate, and acts for every agent mapped to it; policies outside `multiagent.policies_to_train` act but
never change. Single-agent runs are the one-policy case of the same code, not a separate path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import gymnasium as gym
import torch
from omegaconf import DictConfig, OmegaConf

from ppo_fabric.compat.private import copy_state_dict_metadata
from ppo_fabric.config.values import sequence_length
from ppo_fabric.envs.make import ACTION_MASK, EnvError, probe_env, probing
from ppo_fabric.envs.multiagent import (
    SINGLE,
    group_spaces,
    is_multiagent,
    is_turn_based,
    make_parallel_env,
    policy_mapping,
    policy_settings,
    trained_policies,
)
from ppo_fabric.games.selfplay import check_selfplay
from ppo_fabric.models.agent import ActorCritic

if TYPE_CHECKING:
    from lightning_fabric import Fabric


@dataclass
class PolicySpec:
    name: str
    obs_space: gym.Space
    action_space: gym.Space
    model: DictConfig
    lr: float
    trained: bool
    agents: int  # agents per env copy that act with it (1 for gymnasium envs)
    action_mask: int | None = None  # the width of the env's action masks (None: the env has none, or off)

    @property
    def seq_len(self) -> int:
        return sequence_length(self.model)

    @property
    def state_shape(self) -> tuple[int, ...] | None:
        """What `ActorCritic.state_shape` will be, without building the model."""
        lstm = self.model.get("lstm")
        if lstm is None or int(lstm.hidden_size) == 0:
            return None
        cores = 1 if lstm.get("shared", False) else 2
        return (2 * cores, int(lstm.num_layers), int(lstm.hidden_size))


def policy_specs(cfg: DictConfig) -> dict[str, PolicySpec]:
    """Build one env to read the spaces (and, multi-agent, the agent -> policy mapping)."""
    mask_mode = str(cfg.algo.action_mask)
    if not is_multiagent(cfg.env):
        obs_space, action_space, width = probe_env(cfg.env, mask_mode)
        if width is not None and int(cfg.env.action_repeat) > 1:  # the repeats would replay illegal moves
            raise EnvError(
                f"env.action_repeat={cfg.env.action_repeat} cannot be used with action masks (a mask holds for "
                "the first step of the repeat only); set env.action_repeat=1, or algo.action_mask=off"
            )
        lr = float(cfg.algo.lr)
        single = {SINGLE: PolicySpec(SINGLE, obs_space, action_space, cfg.model, lr, True, 1, width)}
        check_selfplay(cfg, single, False)
        return single
    ma = cfg.multiagent
    with probing(cfg.env):  # the env's own failure: one line naming it
        env = make_parallel_env(cfg.env)
    try:
        groups = policy_mapping(list(env.possible_agents), ma, strict=True)
        spaces = group_spaces(env, groups, masked=mask_mode == "auto")
        turns = is_turn_based(env)
    finally:
        with probing(cfg.env):
            env.close()
    if mask_mode == "auto" and not turns:
        for name, (obs_space, _, _) in spaces.items():
            if isinstance(obs_space, gym.spaces.Dict) and ACTION_MASK in obs_space.spaces:
                raise EnvError(
                    f"policy {name!r} observes an action_mask: action masks for PettingZoo Parallel envs are "
                    "not supported yet; set algo.action_mask=off (the mask is then an ordinary observation key)"
                )
    trained = trained_policies(ma)
    specs = {}
    settings = policy_settings(ma)
    for name, agents in groups.items():
        own = settings[name]
        unknown = set(own) - {"model", "lr"}
        if unknown:
            raise EnvError(f"multiagent.policies.{name} has unknown keys {sorted(unknown)}; use model and lr")
        lr = own.get("lr")
        if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0):
            raise EnvError(f"multiagent.policies.{name}.lr={lr} must be a positive number")
        model = OmegaConf.merge(cfg.model, own.get("model") or {})
        lr = float(lr if lr is not None else cfg.algo.lr)
        obs_space, action_space, width = spaces[name]
        specs[name] = PolicySpec(
            name, obs_space, action_space, model, lr, name in trained, len(agents), width
        )
    if turns and any(spec.state_shape is not None for spec in specs.values()):
        # a waiting agent's state would advance on moves it did not make
        raise EnvError("turn-based (AEC) envs take feed-forward policies only; drop model=lstm")
    check_selfplay(cfg, specs, turns)
    return specs


def spaces_of(specs: dict[str, PolicySpec]) -> tuple[Any, Any]:
    """(observation, action) space as checkpoints record them: the spaces of a single-agent run, dicts of
    them per policy for a multi-agent one."""
    if list(specs) == [SINGLE]:
        return specs[SINGLE].obs_space, specs[SINGLE].action_space
    return {n: s.obs_space for n, s in specs.items()}, {n: s.action_space for n, s in specs.items()}


# ------------------------------------------------------------------------------------------- learners
@dataclass
class Learner:
    """The model as the update sees it (Fabric-wrapped, DDP when several ranks) and as rollouts see it."""

    model: Any
    optimizer: Any
    policy: ActorCritic
    spec: PolicySpec
    skip_streak: int = 0  # updates in a row with skipped minibatch steps (`update.check_skips`)


def fused_adam_ok(fabric: Fabric) -> bool:
    """Fused Adam supports float32/bf16 parameters on CPU and CUDA; other set-ups keep the default."""
    return fabric.device.type in ("cpu", "cuda") and str(fabric.strategy.precision.precision) in (
        "32-true",
        "bf16-mixed",
    )


def build_learners(
    fabric: Fabric, specs: dict[str, PolicySpec], resume: dict | None, adam_eps: float
) -> dict[str, Learner]:
    """Each policy's model and (trained ones) optimiser on this rank's device, from `resume` if given.

    Optimiser state is loaded after `fabric.setup` has moved the parameters, so `load_state_dict` puts it
    on their device: a checkpoint written on another device (CPU <-> CUDA) resumes as it is.
    """
    multi = list(specs) != [SINGLE]
    learners = {}
    for name, spec in specs.items():
        agent = ActorCritic(spec.obs_space, spec.action_space, spec.model)
        saved = None if resume is None else (resume["agent"][name] if multi else resume["agent"])
        if saved is not None:
            agent.load_state_dict(saved)
        # Moved here, not by Fabric: a decoupled trainer's device is its role's (GroupDDPStrategy.take_device)
        # while the job's accelerator stays the CPU one, whose device check refuses `cuda` in `to_device`.
        agent = agent.to(fabric.device)
        if not spec.trained:  # acts only: no optimiser, no DDP
            learners[name] = Learner(agent, None, agent, spec)
            continue
        # fused: one kernel for all parameters instead of ~10 ops per tensor (2.6x faster update step on CPU)
        optimizer = torch.optim.Adam(
            agent.parameters(), lr=spec.lr, eps=adam_eps, fused=fused_adam_ok(fabric)
        )
        model, wrapped = fabric.setup(agent, optimizer, move_to_device=False)
        streak = 0
        if resume is not None:
            optimizer.load_state_dict(resume["optimizer"][name] if multi else resume["optimizer"])
            streak = int((resume.get("skip_streaks") or {}).get(name, 0))  # none before this key: 0
        learners[name] = Learner(model, wrapped, model.module, spec, streak)
    return learners


def on_cpu(tree: Any) -> Any:
    """A copy of `tree` with every tensor on the CPU (a state dict keeps its type and metadata); `tree`
    itself is left alone: an optimiser's state_dict() shares its per-parameter dicts with the optimiser.

    A checkpoint holds CPU tensors only: it loads on any machine, and a GPU trainer's part can be handed to
    a CPU player (which writes the file) without the player touching a GPU."""
    if isinstance(tree, torch.Tensor):
        return tree.cpu()
    if isinstance(tree, dict):
        out = type(tree)((key, on_cpu(value)) for key, value in tree.items())
        copy_state_dict_metadata(tree, out)
        return out
    if isinstance(tree, (list, tuple)):
        return type(tree)(on_cpu(v) for v in tree)
    return tree


def learners_state(cfg: DictConfig, learners: dict[str, Learner]) -> dict[str, Any]:
    """The learning side of a checkpoint: the run's config, spaces, parameters and optimiser states, on the
    CPU whatever device they train on."""
    specs = {n: lr.spec for n, lr in learners.items()}
    obs_space, action_space = spaces_of(specs)
    state = {
        "config": OmegaConf.to_container(cfg, resolve=True),
        "observation_space": obs_space,
        "action_space": action_space,
        # updates in a row with skipped steps: a resume goes on counting toward algo.max_skipped_updates
        # (restarted from 0, a run that skipped every step ended only if one session held the whole streak)
        "skip_streaks": {n: lr.skip_streak for n, lr in learners.items()},
    }
    if list(learners) == [SINGLE]:
        only = learners[SINGLE]
        if only.spec.action_mask is not None:  # evaluation rebuilds the env's mask from it
            state["action_mask"] = only.spec.action_mask
        return state | on_cpu({"agent": only.policy.state_dict(), "optimizer": only.optimizer.state_dict()})
    return state | on_cpu(
        {
            "multiagent": True,
            "action_masks": {n: lr.spec.action_mask for n, lr in learners.items()},  # None: no masks
            "agent": {n: lr.policy.state_dict() for n, lr in learners.items()},
            "optimizer": {
                n: None if lr.optimizer is None else lr.optimizer.state_dict() for n, lr in learners.items()
            },
        }
    )


def policies_of(learners: dict[str, Learner]) -> dict[str, ActorCritic]:
    return {n: lr.policy for n, lr in learners.items()}


def trained(specs: dict[str, PolicySpec]) -> list[str]:
    return [n for n, spec in specs.items() if spec.trained]


def all_parameters(policies: dict[str, ActorCritic]) -> list[torch.nn.Parameter]:
    """Every policy's parameters in one fixed order (players receive them as one flat vector)."""
    return [p for name in sorted(policies) for p in policies[name].parameters()]


def metric_name(policy: str, key: str) -> str:
    """Single-agent runs keep plain names; each policy of a multi-agent run gets its own prefix."""
    return key if policy == SINGLE else f"{policy}/{key}"
