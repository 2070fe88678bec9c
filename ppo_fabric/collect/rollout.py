"""The one rollout loop: act, step, store, bootstrap. Coupled ranks and decoupled players both run it.

`build_collector` makes a rank's envs and storage for it; `training_batches` turns what it collected into
each trained policy's batch.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import gymnasium as gym
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from tensordict import TensorDict

from ppo_fabric.collect.actors import Actor, acting_for
from ppo_fabric.collect.numpy_actor import unsupported
from ppo_fabric.config.faults import RunFault
from ppo_fabric.config.values import ConfigError
from ppo_fabric.envs.envpool_backend import is_async
from ppo_fabric.envs.guard import (
    RESTART_INFO,
    USER_CODE_FAILURES,
    EnvFault,
    NonFiniteData,
    env_error_text,
    find_nonfinite,
    nonfinite_final,
)
from ppo_fabric.envs.make import (
    ACTION_MASK,
    close_envs,
    current_action_masks,
    in_space_dtype,
    make_vector_env,
    on_error,
    restart_note,
)
from ppo_fabric.envs.multiagent import SINGLE, make_multiagent_vector_env
from ppo_fabric.envs.normalize import (
    NormalizeReward,
    Reduce,
    load_normalizer_state,
    normalizer_state,
    normalizers,
    renormalized_reset,
    sync_normalizers,
)
from ppo_fabric.envs.traits import traits_of
from ppo_fabric.games.selfplay import SelfPlay
from ppo_fabric.learn.advantages import compute_advantages
from ppo_fabric.learn.buffer import STATE_KEY, MultiAgentRolloutBuffer, rollout_storage, training_batch
from ppo_fabric.learn.learners import PolicySpec
from ppo_fabric.models.agent import ActorCritic
from ppo_fabric.wire.progress import PROGRESS

if TYPE_CHECKING:
    from ppo_fabric.models.agent import Obs


WINDOW = 512  # finished episodes an EpisodeLog keeps (`final_mean_return` reads the last 20 and their ties)


@dataclass
class EpisodeLog:
    """Finished episodes: a short window for `final_mean_return`, and what finished since the last read."""

    # (env step, return, length): the last 20 and those that ended with the earliest of them, for
    # `final_mean_return` (a multi-agent env's agents end together, as many as agents x envs at one step)
    window: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    returns: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    count: int = 0

    def add(self, step: int, ret: float, length: int) -> None:
        self.window.append((step, ret, length))
        self.returns.append(ret)
        self.lengths.append(length)
        self.count += 1

    def drain(self) -> tuple[list[float], list[int]]:
        """Episodes finished since the previous call (for logging)."""
        out = (self.returns, self.lengths)
        self.returns, self.lengths = [], []
        return out


HostArrays = np.ndarray | dict[str, "HostArrays"]


@dataclass
class Group:
    """The rows one policy acts for: every env copy (single agent), or every agent of every env copy that
    maps to the policy (multi-agent), with their storage, host arrays, next observation and state."""

    name: str
    storage: TensorDict
    host: dict[str, HostArrays]
    next_obs: Any
    obs_dtype: torch.dtype | None
    clip: tuple[np.ndarray, np.ndarray] | None
    episodes: EpisodeLog
    state: torch.Tensor | None = None  # recurrent policies: the state the next step starts from [R, ...]
    alive: np.ndarray | None = None  # multi-agent: rows whose agent is in the episode at the next step
    next_mask: torch.Tensor | None = None  # envs with action masks: the mask of `next_obs` [R, width]
    mask_starts: np.ndarray | None = None  # where each action dimension's entries start in a mask
    action_dtype: np.dtype | None = None  # the action space's: the env gets actions its space contains

    def to_tensor(self, obs: Any, device: torch.device) -> Obs:
        if isinstance(obs, dict):  # Dict observations: one tensor per key, with the storage's dtypes
            template = self.storage["obs"]
            parts = {k: torch.as_tensor(v, dtype=template[k].dtype, device=device) for k, v in obs.items()}
            rows = next(iter(parts.values())).shape[:1]  # every copy, or the few cut at a time limit
            return TensorDict(parts, batch_size=rows, device=device)
        return torch.as_tensor(obs, dtype=self.obs_dtype, device=device)


@dataclass
class Lane:
    """One group's way through a rollout: the policy acting for it and how it acts (`actors`), the
    observation and action mask it acts on next, the recurrent state its last action left, and for envs
    whose credit arrives later each row's last decision (-1: none) and the async envs not in flight."""

    group: Group
    policy: ActorCritic
    actor: Actor
    obs: Obs
    mask: torch.Tensor | None
    last: np.ndarray
    next_state: torch.Tensor | None = None
    settled: np.ndarray | None = None


class RolloutCollector:
    """Owns a rank's vector env and the observation it will act on next, so rollouts continue across
    updates (and across checkpoint/resume) instead of restarting episodes.

    Single-agent envs have one group of rows (the env copies); multi-agent envs (`multiagent.py`) have one
    per policy, each with its own storage, and every step acts with each group's policy before stepping
    all env copies once. The same loop serves both, feed-forward and recurrent policies alike.

    What the env returns (observations, rewards, flags) is written into numpy arrays on the host: views of
    the storage itself when it lives on the CPU (no copy at all), or staging arrays copied to the device
    once per rollout when it does not, instead of one small transfer per step and key.
    """

    _HOST_KEYS = ("obs", "rewards", "terminated", "truncated")
    VALUE_CHUNK = 4096  # rows per batched value forward after a rollout (bounds a CNN's activations)

    def __init__(
        self,
        envs: Any,
        first_obs: Any,
        storage: TensorDict | dict[str, TensorDict],
        gamma: float,
        gae_lambda: float,
        reduce: Reduce | None = None,
        env_id: str = "?",
        numpy_rollout: bool = True,
        selfplay: SelfPlay | None = None,
        label: str = "rank 0",
        max_restarts: int | None = None,
    ) -> None:
        """`numpy_rollout`: plain CPU MLP policies act through NumPy (`actors.NumpyRolloutActor`);
        `selfplay`: two-player games against a pool of snapshots (the learner takes one seat).
        `label` names this rank in the one-line faults (`player rank 1`); `max_restarts`: the sub-envs
        are rebuilt when they fail (`env.on_error=restart`), at most this many times in the run."""
        self.envs = envs
        self.label = label
        self.max_restarts = max_restarts
        self.restarts = 0  # sub-envs rebuilt so far in the run (carried over by checkpoints)
        self.env_id = env_id  # named by the error for a state without a legal action
        self.reduce = reduce  # merges normalisation statistics over the collecting ranks
        self.traits = traits_of(envs)
        self.multiagent = isinstance(storage, dict)
        storages = storage if self.multiagent else {SINGLE: storage}
        firsts = first_obs if self.multiagent else {SINGLE: first_obs}
        self.device = next(iter(storages.values())).device
        self.gamma = gamma
        self.gae_lambda = gae_lambda
        self._staged = self.device.type != "cpu"
        self.turn_based = self.traits.turn_based  # AEC games: one agent moves per step
        # An async EnvPool: only the ready envs act at a step, their results arrive at a later one
        self.asynchronous = self.traits.asynchronous
        self.groups = [self._group(name, stored, firsts[name]) for name, stored in storages.items()]
        # All episodes (every agent's, in multi-agent envs): what `final_mean_return` reports overall.
        self.episodes = self.groups[0].episodes if not self.multiagent else EpisodeLog()
        self.num_envs = int(envs.num_envs)
        # multi-agent: the per-agent view of the storages
        self.buffer = (
            MultiAgentRolloutBuffer(storages, envs.groups, self.num_envs, gamma) if self.multiagent else None
        )
        self.steps_per_tick = int(envs.batch_size) if self.asynchronous else self.num_envs  # env steps
        self.selfplay = selfplay
        self.numpy_rollout = numpy_rollout

    def _group(self, name: str, stored: TensorDict, first: Any) -> Group:
        """The group of rows `stored` holds, acting next on `first`: host arrays for what the env returns,
        the action bounds to clip to, and which rows act (multi-agent, async) and may do what (masks)."""
        present = stored.keys()
        keys = [*self._HOST_KEYS, *(k for k in ("mask", ACTION_MASK) if k in present)]
        space = self.envs.action_spaces[name] if self.multiagent else self.envs.single_action_space
        stored_obs = stored["obs"]  # a nested TensorDict for Dict observations
        group = Group(
            name=name,
            storage=stored,
            host={k: _host_arrays(stored[k], not self._staged) for k in keys},
            next_obs=None,
            obs_dtype=stored_obs.dtype if isinstance(stored_obs, torch.Tensor) else None,  # uint8 pixels
            clip=(space.low, space.high) if isinstance(space, gym.spaces.Box) else None,
            episodes=EpisodeLog(),
            action_dtype=None if space.dtype is None else np.dtype(space.dtype),
        )
        group.next_obs = group.to_tensor(first, self.device)
        if self.multiagent:
            group.alive = self.envs.alive[name].copy()  # rows whose agent is in the episode after reset
        elif self.asynchronous:
            group.alive = self.envs.alive.copy()  # an async pool's envs that act at the first step
        if ACTION_MASK in present:
            nvec = space.nvec.reshape(-1) if isinstance(space, gym.spaces.MultiDiscrete) else [space.n]
            group.mask_starts = np.cumsum([0, *nvec[:-1]]).astype(np.int64)
            group.next_mask = self._legal(group, self._current_masks(name), 0)
        return group

    @property
    def storage(self) -> TensorDict:
        """The single-agent storage (multi-agent: `storages`)."""
        return self.groups[0].storage

    @property
    def storages(self) -> dict[str, TensorDict]:
        return {g.name: g.storage for g in self.groups}

    @property
    def next_obs(self) -> Obs:
        return self.groups[0].next_obs

    def _current_masks(self, name: str) -> np.ndarray:
        return self.envs.action_masks[name] if self.multiagent else current_action_masks(self.envs)

    def _check_legal(self, g: Group, masks: np.ndarray, env_step: int) -> None:
        """Every env copy has a legal action in every action dimension; raises EnvFault (the run's one line,
        as for bad env data: an EnvError here ended a one-process run in a traceback) naming the env."""
        ok = np.logical_or.reduceat(masks, g.mask_starts, axis=1).all(1)
        if not ok.all():
            raise EnvFault(
                f"{self.label}, env {int(np.flatnonzero(~ok)[0])}: no legal action at env step {env_step:,} "
                f"(the action mask of env.id={self.env_id!r} is all False)"
            )

    def _legal(self, g: Group, masks: np.ndarray, env_step: int) -> torch.Tensor:
        """The checked masks [E, width] as a tensor on the device."""
        self._check_legal(g, masks, env_step)
        return torch.from_numpy(masks).to(self.device)

    def _info_masks(self, g: Group, info: dict[str, Any], env_step: int) -> np.ndarray:
        """The masks of the observations a vector step returned; copies that reported none: all legal."""
        masks = info.get(ACTION_MASK)
        if masks is None:
            return np.ones(g.host[ACTION_MASK].shape[1:], dtype=bool)
        masks = np.asarray(masks, dtype=bool)
        present = info.get("_" + ACTION_MASK)
        if present is not None and not present.all():
            masks = masks.copy()
            masks[~present] = True
        self._check_legal(g, masks, env_step)
        return masks

    def _step(self, actions: list[np.ndarray]) -> list[tuple[Any, ...]]:
        if self.multiagent:
            return self.envs.step(actions)
        return [self.envs.step(actions[0])]

    def _checked_step(self, actions: list[np.ndarray], at: int) -> list[tuple[Any, ...]]:
        """`_step`, with what went wrong in it as one `EnvFault` line naming this rank, the env and `at`,
        the env step the results belong to. Single-agent vector envs check their raw values themselves
        (`guard.FiniteCheck`); the PettingZoo vector envs' per-policy arrays are checked here."""
        try:
            results = self._step(actions)
        except NonFiniteData as bad:
            raise EnvFault(f"{self.label}, env {bad.index}: {bad.what} at env step {at:,}") from None
        except EnvFault as fault:
            raise EnvFault(f"{self.label}: {fault} (env step {at:,})") from None
        except USER_CODE_FAILURES as exc:  # the user's env code: its error, named, ends the run
            raise EnvFault(f"{self.label}: env.step raised {env_error_text(exc)} at env step {at:,}") from exc
        if self.multiagent:
            for g, (obs, rewards, _, truncated, info) in zip(self.groups, results, strict=True):
                found = find_nonfinite(obs, rewards)
                if found is None:  # a truncated agent's last observation: its value is bootstrapped
                    found = nonfinite_final(info["final_obs"], truncated)
                if found is not None:
                    agents = self.envs.groups[g.name]
                    row, what = found
                    where = f"env {row // len(agents)}, agent {agents[row % len(agents)]!r}"
                    raise EnvFault(f"{self.label}, {where}: {what} at env step {at:,}")
        return results

    def _count_restarts(self, info: dict[str, Any], at: int) -> None:
        """Sub-envs rebuilt at this step (`guard.RecreateOnError`): one line each; past `max_restarts` in
        the run the last cause ends it."""
        for j in np.flatnonzero(info["_" + RESTART_INFO]):
            self.restarts += 1
            cause = info[RESTART_INFO][j]
            where = f"{self.label}, env {j}: {cause} at env step {at:,}"
            if self.max_restarts is None or self.restarts > self.max_restarts:
                raise EnvFault(f"{where}; more than env.max_restarts={self.max_restarts} restarts in the run")
            print(
                f"ppo-fabric: {where}; env rebuilt (restart {self.restarts} of {self.max_restarts})",
                file=sys.stderr,
                flush=True,
            )

    @torch.inference_mode()
    def collect(self, policies: ActorCritic | Mapping[str, ActorCritic], env_step: int) -> int:
        """Fill the storage with T steps of every env, then compute GAE in it; returns env steps taken.

        Each step: every group's policy acts (`_act`), the envs step once, and every group records what
        came back (`_record`); at the end each group's values and advantages are computed (`_finish`).

        An async EnvPool acts with its `batch_size` ready envs per step (the others' rows are `mask` False
        there), so it takes T * batch_size env steps; the outcome of an env's action lands on the step it
        was taken at when its result arrives (`credit_waiting`), and an action still in flight at the end
        leaves training (`close_open_decisions`), as a turn-based player's move awaiting the reply.

        `policies` maps each group to the policy acting for it (a single policy for single-agent envs).
        `env_step` is the global env step count at the start, used to time-stamp finished episodes.
        """
        if not isinstance(policies, Mapping):
            policies = {SINGLE: policies}
        lanes = self._start(policies)
        num_steps = self.groups[0].storage.batch_size[0]
        mark = PROGRESS.mark  # the stall watchdog's heartbeat: one per step (runs/watchdog.py)
        for t in range(num_steps):
            actions = [self._act(lane, t) for lane in lanes]
            mark("env.step")
            at = env_step + (t + 1) * self.steps_per_tick  # the env step the results belong to
            results = self._checked_step(actions, at)
            for lane, result in zip(lanes, results, strict=True):
                self._record(lane, t, result, at, t + 1 == num_steps)
        for lane in lanes:
            self._finish(lane)
        sync_normalizers(self.envs, self.reduce)
        if self.buffer is not None:
            self.buffer.mark_collected(num_steps)
        return num_steps * self.steps_per_tick

    def _start(self, policies: Mapping[str, ActorCritic]) -> list[Lane]:
        """Each group's lane through this rollout, its first observation and mask in the host arrays."""
        if self.selfplay is not None:  # a fresh run's pool begins with the initial weights
            self.selfplay.start(policies[self.groups[0].name], 0)
        lanes = []
        for g in self.groups:
            policy = policies[g.name]
            g.storage["final_values"].zero_()
            if g.state is None and policy.recurrent:
                g.state = policy.initial_state(g.storage.batch_size[1], self.device)
            _put(g.host["obs"], 0, g.next_obs.cpu())
            if g.next_mask is not None:
                g.host[ACTION_MASK][0] = g.next_mask.cpu().numpy()
            last = np.full(g.storage.batch_size[1], -1)
            lanes.append(Lane(g, policy, self._actor(g, policy), g.next_obs, g.next_mask, last))
        return lanes

    def _act(self, lane: Lane, t: int) -> np.ndarray:
        """The group's env actions at step `t`; the policy's next recurrent state waits in the lane."""
        g, sp = lane.group, self.selfplay
        env_action, lane.next_state = lane.actor.act(t, lane.obs, lane.mask, g.state)
        if g.clip is not None:
            env_action = np.clip(env_action, *g.clip)
        if sp is not None:  # the opponents' seats play their snapshots' moves; only the learner trains
            env_action = sp.act(lane.obs, lane.mask, env_action, g.alive)
        env_action = in_space_dtype(env_action, g.action_dtype)
        if g.alive is not None:
            g.host["mask"][t] = g.alive if sp is None else g.alive & sp.learner_rows()
        return env_action

    def _record(self, lane: Lane, t: int, result: tuple[Any, ...], at: int, last_step: bool) -> None:
        """Store step `t`'s results for the group's rows (`at`: the env step they belong to), carry the
        recurrent state over, and ready the next step's observation and mask."""
        g, h = lane.group, lane.group.host
        next_obs, h["rewards"][t], h["terminated"][t], h["truncated"][t], info = result
        if RESTART_INFO in info:
            self._count_restarts(info, at)
        term, trunc = h["terminated"][t], h["truncated"][t]
        if trunc.any():
            self._bootstrap_cut(lane, t, np.flatnonzero(trunc & ~term), info)
        next_state = lane.next_state
        if next_state is not None:  # episodes that ended start the next one from zero state
            keep = torch.from_numpy(~(term | trunc)).to(self.device, next_state.dtype)
            g.state = next_state * keep.view(-1, *([1] * (next_state.dim() - 1)))
        if g.alive is not None:
            g.alive = info["alive"]
        lane.settled = info.get("settled")
        if self.traits.delayed:
            credit_waiting(h, g.storage["final_values"], t, lane.last)
        if "_episode" in info:
            self._episodes_ended(lane, info["_episode"], info["episode"], at)
        self._next_inputs(lane, t, next_obs, info, at, last_step)

    def _bootstrap_cut(self, lane: Lane, t: int, cut: np.ndarray, info: dict[str, Any]) -> None:
        """Rows whose episode a time limit cut at step `t`: GAE bootstraps from their final observation's
        value (with the recurrent state that observation was reached in)."""
        if cut.size:
            g = lane.group
            final_obs = g.to_tensor(_stack(info["final_obs"][cut]), self.device)
            rows = torch.from_numpy(cut).to(self.device)
            state = None if lane.next_state is None else lane.next_state[rows]
            g.storage["final_values"][t, rows] = lane.policy.get_value(final_obs, state)

    def _episodes_ended(self, lane: Lane, ended: np.ndarray, episode: dict[str, Any], at: int) -> None:
        """Log the episodes that ended (`ended`: the rows, `episode`: their returns and lengths). In self-play
        only the learner's seat: its opponents' (snapshots, scripted or random players) are not the policy
        learning, and a zero-sum game's two seats averaged 0 at every update."""
        for j in np.flatnonzero(ended):
            if self.selfplay is not None and j % 2 != self.selfplay.seat[j // 2]:
                continue
            ret, length = float(episode["r"][j]), int(episode["l"][j])
            lane.group.episodes.add(at, ret, length)
            if self.multiagent:
                self.episodes.add(at, ret, length)
        if self.traits.delayed:  # a new game: nothing later is credited to the old one's moves
            lane.last[ended] = -1
        if self.selfplay is not None:
            self.selfplay.episodes_ended(ended, episode["r"])

    def _next_inputs(
        self, lane: Lane, t: int, next_obs: Any, info: dict[str, Any], at: int, last: bool
    ) -> None:
        """What the group acts on at step `t + 1`: written into the host arrays, read back as views on the
        CPU; after the `last` step, tensors of their own (the next rollout's first observation and mask)."""
        h = lane.group.host
        if not last:
            _put(h["obs"], t + 1, next_obs)
            if not lane.actor.reads_host:
                lane.obs = _row(h["obs"], t + 1, self.device)  # a view on CPU: no copy
        else:
            lane.obs = lane.group.to_tensor(next_obs, self.device)
        if lane.mask is not None:
            masks = self._info_masks(lane.group, info, at)
            if not last:
                h[ACTION_MASK][t + 1] = masks
                lane.mask = _row(h[ACTION_MASK], t + 1, self.device)
            else:
                lane.mask = torch.from_numpy(masks).to(self.device)

    def _finish(self, lane: Lane) -> None:
        """The group's rollout is complete: the actor's outputs and the staged arrays into the storage, the
        values, the next rollout's carry, the decisions still open closed, and GAE."""
        g, s, policy = lane.group, lane.group.storage, lane.policy
        lane.actor.store(s)
        if self._staged:
            for key, host in g.host.items():
                _copy_in(s[key], host)
        s["values"].copy_(_values(policy, s, self.VALUE_CHUNK))
        g.next_obs = lane.obs
        if lane.mask is not None:  # a view of the host array on CPU, which the next rollout overwrites
            g.next_mask = lane.mask.clone()
        next_value = policy.get_value(lane.obs, g.state)
        if self.traits.delayed:
            # rows whose next observation is known bootstrap from it: a turn-based game's next movers, an
            # async pool's envs not in flight
            movers = g.alive if lane.settled is None else lane.settled
            if self.selfplay is not None:
                movers = movers & self.selfplay.learner_rows()
            close_open_decisions(s, next_value, lane.last, movers)
        compute_advantages(s, next_value, self.gamma, self.gae_lambda)

    def _plain(self, g: Group, policy: ActorCritic) -> bool:
        """Whether the group's rows act plainly, so the NumPy actor could act for them: every row at every
        step, no action mask, no self-play opponents, observations in one host array that is the CPU
        storage, and a policy the NumPy actor supports."""
        plain = not (
            self.asynchronous or self._staged or g.next_mask is not None or self.selfplay is not None
        )
        return plain and isinstance(g.host["obs"], np.ndarray) and unsupported(policy) is None

    def _actor(self, g: Group, policy: ActorCritic) -> Actor:
        """How the group's rows act in this rollout (`actors.acting_for`)."""
        ready = (lambda: g.alive) if self.asynchronous else None  # noqa: E731 (read at each step)
        plain = self._plain(g, policy)
        return acting_for(policy, g.storage, g.host["obs"], plain, self.numpy_rollout, ready)

    def after_update(self, policies: Mapping[str, ActorCritic], update: int) -> None:
        """The learner finished `update`: self-play takes a snapshot when one is due."""
        if self.selfplay is not None:
            self.selfplay.after_update(next(iter(policies.values())), update)

    # --------------------------------------------------------------------------------- its state
    def close(self) -> None:
        """Close the envs at the run's end or stop (a `close` that raises is a warning: the results are
        written)."""
        close_envs(self.envs)

    def state_dict(self) -> dict[str, Any]:
        """What this collector needs to continue its rollouts exactly, but its envs themselves (a checkpoint
        pickles and signs those, `runs.checkpoint.pickle_envs`): the normaliser statistics (also for envs
        that cannot be pickled, and for evaluation), the carry, the episode windows and counts, the env
        restarts and the self-play pool."""
        return {
            "num_envs": self.num_envs,
            "normalizers": normalizer_state(self.envs),
            "carry": self.carry(),  # next observations, recurrent states
            "episodes": list(self.episodes.window),
            "episode_count": self.episodes.count,
            "policy_episodes": {g.name: (list(g.episodes.window), g.episodes.count) for g in self.groups},
            "env_restarts": self.restarts,
        } | ({} if self.selfplay is None else {"selfplay": self.selfplay.state()})

    def load_state_dict(self, state: dict[str, Any], envs: gym.vector.VectorEnv | None) -> None:
        """Continue from `state_dict()`'s `state`. `envs`: the vector env restored from the same checkpoint,
        which replaces this collector's (closed by the caller) and goes on with its episodes; None when the
        checkpoint held none (async or unpicklable envs): the fresh envs keep their episodes and take the
        saved normaliser statistics."""
        if envs is not None:
            self.envs = envs
            self.restore_carry(state["carry"])
            for wrapper in normalizers(envs):  # the run's discount (resume_overrides=allow may change it),
                if isinstance(wrapper, NormalizeReward):  # not the one pickled with the envs
                    wrapper.gamma = self.gamma
        else:
            self._take_statistics(state)
        self._add_record(state)
        if self.selfplay is not None and "selfplay" in state:
            self.selfplay.load_state(state["selfplay"], exact=envs is not None)

    def carry_statistics(self, state: dict[str, Any]) -> None:
        """From a checkpoint of another layout (other ranks or envs): fresh envs and episodes, but the
        normaliser statistics (identical on every collecting rank) and the self-play pool carried over; the
        next observation is the fresh envs' first, normalised with the loaded statistics."""
        if self.selfplay is not None and "selfplay" in state:  # the pool, without per-copy seats
            self.selfplay.load_state(state["selfplay"], exact=False)
        self._take_statistics(state)

    def carry_episodes(self, states: list[dict[str, Any]]) -> None:
        """From every collecting rank of a checkpoint of another layout: the run's episode record (counts,
        recent windows, env restarts), which one rank of the new layout takes so that the run's totals (the
        summary's `episodes`) go on from the checkpoint's instead of counting this session alone."""
        for state in states:
            self._add_record(state)

    def _add_record(self, state: dict[str, Any]) -> None:
        """A saved rank's episode record (recent windows, counts, env restarts) added to this one's."""
        self.episodes.window.extend(state["episodes"])
        self.episodes.count += int(state["episode_count"])
        self.restarts += int(state.get("env_restarts", 0))
        if self.multiagent:
            for g in self.groups:
                window, count = state["policy_episodes"].get(g.name, ([], 0))
                g.episodes.window.extend(window)
                g.episodes.count += int(count)

    def _take_statistics(self, state: dict[str, Any]) -> None:
        """The saved normaliser statistics, and the fresh envs' first observation normalised with them (it
        was normalised with the warm-up's, which the first step would act on and store)."""
        load_normalizer_state(self.envs, state.get("normalizers", {}))
        first = renormalized_reset(self.envs, None)
        if first is not None and not self.multiagent:
            group = self.groups[0]
            group.next_obs = group.to_tensor(first, self.device)

    def carry(self) -> dict[str, Any]:
        """What continues from one rollout to the next besides the envs: each group's next observation, its
        recurrent state and (multi-agent) which rows are in an episode; on the CPU, for checkpoints."""
        carry = {
            g.name: {
                "next_obs": g.next_obs.cpu(),
                "state": None if g.state is None else g.state.cpu(),
                "alive": None if g.alive is None else g.alive.copy(),
            }
            for g in self.groups
        }
        for g in self.groups:
            if g.next_mask is not None:
                carry[g.name][ACTION_MASK] = g.next_mask.cpu()
        return carry

    def restore_carry(self, carry: dict[str, Any]) -> None:
        """Also takes `carry()` as a checkpoint stores it: Dict observations as dicts of tensors, `alive`
        as a tensor (checkpoints hold plain data only)."""
        for g in self.groups:
            saved = carry[g.name]
            g.next_obs = g.to_tensor(saved["next_obs"], self.device)
            g.state = None if saved["state"] is None else saved["state"].to(self.device)
            alive = saved["alive"]
            if isinstance(alive, torch.Tensor):
                alive = alive.numpy()
            g.alive = None if alive is None else np.array(alive, dtype=bool)
            if g.next_mask is not None:
                mask = saved.get(ACTION_MASK)
                mask = self._current_masks(g.name) if mask is None else np.asarray(mask, dtype=bool)
                g.next_mask = torch.from_numpy(mask).to(self.device)


def credit_waiting(host: dict[str, Any], final_values: torch.Tensor, t: int, last: np.ndarray) -> None:
    """Turn-based games: route step `t`'s results to each agent's own last decision.

    Rows that made a (trained) decision at `t` (`mask`) keep their reward and end flags there and `t`
    becomes their last decision. A row that waited gets what reached it during the others' moves
    (the reward of a game the opponent ended, the end itself, a truncation's final value) added to its
    last decision in this rollout; rewards of a decision made in an earlier rollout are dropped with it
    (`close_open_decisions` leaves such decisions out of training)."""
    decided = host["mask"][t]
    waiting = np.flatnonzero(~decided & (last >= 0))
    if waiting.size:
        at = last[waiting]
        host["rewards"][at, waiting] += host["rewards"][t, waiting]
        host["terminated"][at, waiting] |= host["terminated"][t, waiting]
        cut = host["truncated"][t, waiting] & ~host["terminated"][t, waiting]
        host["truncated"][at, waiting] |= cut
        if cut.any():
            rows = torch.from_numpy(waiting[cut]).to(final_values.device)
            steps = torch.from_numpy(at[cut]).to(final_values.device)
            final_values[steps, rows] = final_values[t, rows]
    last[decided] = t


def close_open_decisions(
    storage: TensorDict, next_value: torch.Tensor, last: np.ndarray, movers: np.ndarray
) -> None:
    """The rollout's tail in a turn-based game: an agent about to move bootstraps from V(its observation),
    its next decision's value. An agent waiting on the opponent has a last decision whose outcome is not
    known yet (the opponent's reply comes in the next rollout): that decision leaves training (`mask`
    False) and the decision before it bootstraps from its value, so every trained step's return is exact."""
    rows = np.flatnonzero(last >= 0)
    rows = rows[~movers[rows]]
    if not rows.size:
        return
    steps = torch.from_numpy(last[rows]).to(next_value.device)
    index = torch.from_numpy(rows).to(next_value.device)
    done = storage["terminated"][steps, index] | storage["truncated"][steps, index]
    steps, index = steps[~done], index[~done]
    storage["mask"][steps, index] = False
    next_value[index] = storage["values"][steps, index]


def _values(policy: ActorCritic, storage: TensorDict, chunk: int) -> torch.Tensor:
    """V(obs_t) for every stored step [T, E], from the state each step started with (recurrent), in
    batches of `chunk` rows: the same computation as the per-step critic, done once per rollout."""
    steps = storage.select("obs", *([STATE_KEY] if STATE_KEY in storage.keys(True) else [])).reshape(-1)
    state = steps.get(STATE_KEY, None)
    parts = [
        policy.get_value(steps["obs"][i : i + chunk], None if state is None else state[i : i + chunk])
        for i in range(0, steps.batch_size[0], chunk)
    ]
    return torch.cat(parts).view(storage.batch_size)


def _numpy_dtype(tensor: torch.Tensor) -> np.dtype:
    return torch.empty((), dtype=tensor.dtype).numpy().dtype


# Observations are an array per step, or (Dict spaces) a dict of arrays mirrored by a nested TensorDict in
# the storage; these helpers treat both alike so the loop above reads the same for either.


def _host_arrays(stored: torch.Tensor | TensorDict, on_cpu: bool) -> HostArrays:
    """Numpy views of the storage on the CPU, staging arrays of the same shape and dtype elsewhere."""
    if isinstance(stored, TensorDict):
        return {k: _host_arrays(v, on_cpu) for k, v in stored.items()}
    return stored.numpy() if on_cpu else np.zeros(stored.shape, dtype=_numpy_dtype(stored))


def _put(dst: HostArrays, t: int, src: Any) -> None:
    if isinstance(dst, dict):
        for k, sub in dst.items():
            _put(sub, t, src[k])
    else:
        dst[t] = src.numpy() if isinstance(src, torch.Tensor) else src


def _row(host: HostArrays, t: int, device: torch.device) -> Obs:
    if isinstance(host, dict):
        parts = {k: _row(sub, t, device) for k, sub in host.items()}
        return TensorDict(parts, batch_size=next(iter(parts.values())).shape[:1], device=device)
    return torch.from_numpy(host[t]).to(device)


def _stack(final_obs: np.ndarray) -> Any:
    """The vector env's object array of per-env final observations as one batch (dict for Dict spaces)."""
    if isinstance(final_obs[0], dict):
        return {k: np.stack([o[k] for o in final_obs]) for k in final_obs[0]}
    return np.stack(final_obs)


def _copy_in(stored: torch.Tensor | TensorDict, host: HostArrays) -> None:
    if isinstance(stored, TensorDict):
        for k, sub in host.items():
            _copy_in(stored[k], sub)
    else:
        stored.copy_(torch.from_numpy(host), non_blocking=True)


# ---------------------------------------------------------------------------------------------- set-up
def session_seed(seed: int, start_step: int) -> int:
    """The seed a session's envs are built from: the run's own at its start; a resumed session's its own
    (derived from the step it starts at), so that envs which start fresh (another layout, or envs a
    checkpoint cannot hold: EnvPool, async) do not replay the run's opening episodes at every requeue.
    Envs restored from the checkpoint replace these, so an exact resume stays exact."""
    if start_step == 0:
        return seed
    return int(np.random.SeedSequence([seed, start_step]).generate_state(1, dtype=np.uint32)[0])


@contextmanager
def first_reset_faults(label: str, env_cfg: DictConfig) -> Iterator[None]:
    """What goes wrong while a rank builds and first resets its envs, as one `EnvFault` line naming the rank
    (a traceback through Hydra's was ~50 lines); one-line faults and config errors pass as they are."""
    try:
        yield
    except NonFiniteData as bad:
        raise EnvFault(f"{label}, env {bad.index}: {bad.what} {_before_the_run(env_cfg)}") from None
    except EnvFault as fault:  # found while the envs were built (`make`): named with the rank here
        if str(fault).startswith(f"{label}:"):
            raise
        raise EnvFault(f"{label}: {fault}") from fault.__cause__
    except (RunFault, ConfigError):
        raise
    except USER_CODE_FAILURES as exc:  # the user's env code: its error, named, ends the run
        raise EnvFault(f"{label}: the envs raised {env_error_text(exc)} {_before_the_run(env_cfg)}") from exc


def _before_the_run(env_cfg: DictConfig) -> str:
    """Where bad data found while the envs are built came from: their first reset, and the normalisers'
    warm-up steps (random actions) when a normaliser is on."""
    normalising = env_cfg.get("normalize_obs") or env_cfg.get("normalize_reward")
    if normalising and env_cfg.get("normalize_warmup"):
        return (
            "at its first reset, or in the normalisers' warm-up steps before the run (env.normalize_warmup)"
        )
    return "at its first reset"


def build_collector(
    cfg: DictConfig,
    specs: dict[str, PolicySpec],
    rank: int,
    device: torch.device | str,
    reduce: Reduce | None,
    role: str = "rank",
    start_step: int = 0,
) -> RolloutCollector:
    """The rank's envs and rollout storage: [T, E] for a gymnasium env; for a PettingZoo env one storage
    per policy, [T, E * its agents per copy], with the `mask` of steps that hold a transition. `role` names
    the rank in fault lines (`player rank 1`). `start_step`: the env step a resumed session starts at,
    whose fresh envs get seeds of their own (`session_seed`)."""
    algo = cfg.algo
    steps, copies = int(algo.rollout_steps), int(cfg.env.num_envs)
    label = f"{role} {rank}"
    seed = session_seed(int(cfg.seed), start_step)
    single = list(specs) == [SINGLE]
    note = restart_note(cfg.env, multiagent=not single)
    if note is not None and rank == 0:
        print(f"ppo-fabric: {note}", file=sys.stderr, flush=True)
    restart = on_error(cfg.env) == "restart" and note is None
    with first_reset_faults(label, cfg.env):
        if single:
            width = specs[SINGLE].action_mask
            envs, first = make_vector_env(cfg.env, seed, rank, float(algo.gamma), reduce, width)
        else:
            masked = any(spec.action_mask is not None for spec in specs.values())
            opening = int(cfg.selfplay.opening_moves) if bool(cfg.selfplay.enabled) else 0
            envs, first = make_multiagent_vector_env(
                cfg.env, cfg.multiagent, seed, rank, masked, opening_moves=opening
            )
    if single:
        storage: Any = policy_storage(steps, copies, specs[SINGLE], device, is_async(cfg.env))
    else:
        storage = {name: policy_storage(steps, copies, spec, device) for name, spec in specs.items()}
    selfplay = None
    if bool(cfg.selfplay.enabled):
        spec = next(iter(specs.values()))
        selfplay = SelfPlay(cfg.selfplay, spec, envs.num_envs, torch.device(device), rank)
        if rank == 0 and bool(cfg.selfplay.elo):
            selfplay.rater = snapshot_rater(cfg, spec)
    gamma, lam = float(algo.gamma), float(algo.gae_lambda)
    numpy_rollout = bool(algo.numpy_rollout)
    max_restarts = int(cfg.env.max_restarts) if restart else None
    return RolloutCollector(
        envs,
        first,
        storage,
        gamma,
        lam,
        reduce,
        str(cfg.env.id),
        numpy_rollout,
        selfplay,
        label,
        max_restarts,
    )


def snapshot_rater(cfg: DictConfig, spec: PolicySpec) -> Any:
    """The Elo rater of a self-play run's snapshots: they play the game itself (PettingZoo's AEC env),
    one game at a time, on the CPU."""
    from ppo_fabric.games.elo import policy_rater
    from ppo_fabric.games.play import aec_env_factory

    kwargs = OmegaConf.to_container(cfg.env.kwargs, resolve=True) if cfg.env.get("kwargs") else {}
    factory = aec_env_factory(str(cfg.env.id), kwargs)
    masked = spec.action_mask is not None
    return policy_rater(factory, spec.obs_space, spec.action_space, spec.model, masked, seed=int(cfg.seed))


def policy_storage(
    rollout_steps: int,
    num_envs: int,
    spec: PolicySpec,
    device: torch.device | str,
    asynchronous: bool = False,
) -> TensorDict:
    """One policy's rollout storage on one collecting rank (trainers build it too, as the template of
    what players send). Multi-agent rows and an async pool's envs (`asynchronous`) do not all hold a
    transition at every step: their storage has a `mask`."""
    return rollout_storage(
        rollout_steps,
        num_envs * spec.agents,
        spec.obs_space,
        spec.action_space,
        device,
        spec.state_shape,
        masked=spec.name != SINGLE or asynchronous,
        action_mask=spec.action_mask,
    )


def training_batches(collector: RolloutCollector, specs: dict[str, PolicySpec]) -> dict[str, TensorDict]:
    """Each trained policy's batch from this rank's rollout (sequences for recurrent models)."""
    storages = collector.storages
    return {n: training_batch(storages[n], s.seq_len) for n, s in specs.items() if s.trained}
