"""The one rollout loop: act, step, store, bootstrap. Coupled ranks and decoupled players both run it."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector import VectorEnv
from tensordict import TensorDict

from ppo_fabric.advantages import compute_advantages
from ppo_fabric.agent import ActorCritic, Obs
from ppo_fabric.normalize import Reduce, sync_normalizers


@dataclass
class EpisodeLog:
    """Finished episodes: a short window for `final_mean_return`, and what finished since the last read."""

    window: deque = field(default_factory=lambda: deque(maxlen=20))  # (env step, return, length)
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


class RolloutCollector:
    """Owns a rank's vector env and the observation it will act on next, so rollouts continue across
    updates (and across checkpoint/resume) instead of restarting episodes.

    What the env returns (observations, rewards, flags) is written into numpy arrays on the host: views of
    the storage itself when it lives on the CPU (no copy at all), or staging arrays copied to the device
    once per rollout when it does not, instead of one small transfer per step and key.
    """

    _HOST_KEYS = ("obs", "rewards", "terminated", "truncated")

    def __init__(
        self,
        envs: VectorEnv,
        first_obs: Any,
        storage: TensorDict,
        gamma: float,
        gae_lambda: float,
        reduce: Reduce | None = None,
    ) -> None:
        self.envs = envs
        self.reduce = reduce  # merges normalisation statistics over the collecting ranks
        self.storage = storage
        self.device = storage.device
        self.gamma = gamma
        self.gae_lambda = gae_lambda
        on_cpu = self.device.type == "cpu"
        self.host = {k: _host_arrays(storage[k], on_cpu) for k in self._HOST_KEYS}
        stored_obs = storage["obs"]  # a nested TensorDict for Dict observations
        self._obs_dtype = stored_obs.dtype if isinstance(stored_obs, torch.Tensor) else None  # uint8 pixels
        self._staged = not on_cpu
        self.next_obs = self._to_tensor(first_obs)
        self.episodes = EpisodeLog()
        space = envs.single_action_space
        self._clip = (space.low, space.high) if isinstance(space, gym.spaces.Box) else None

    def _to_tensor(self, obs: Any) -> Obs:
        if isinstance(obs, dict):  # Dict observations: one tensor per key, with the storage's dtypes
            template = self.storage["obs"]
            parts = {
                k: torch.as_tensor(v, dtype=template[k].dtype, device=self.device) for k, v in obs.items()
            }
            return TensorDict(parts, batch_size=template.batch_size[1:], device=self.device)
        return torch.as_tensor(obs, dtype=self._obs_dtype, device=self.device)

    @torch.inference_mode()
    def collect(self, policy: ActorCritic, env_step: int) -> int:
        """Fill the storage with T steps of every env, then compute GAE in it; returns env steps taken.

        `env_step` is the global env step count at the start, used to time-stamp finished episodes.
        """
        s = self.storage
        obs_np, rew_np, term_np, trunc_np = (self.host[k] for k in self._HOST_KEYS)
        final_values = s["final_values"]
        final_values.zero_()
        num_steps, num_envs = s.batch_size
        # Policy outputs are kept per step and written with one stack per key: cheaper than T indexed writes.
        actions, logprobs, values = [], [], []
        obs = self.next_obs
        _put(obs_np, 0, obs.cpu())
        for t in range(num_steps):
            action, logprob, value = policy.act(obs)
            actions.append(action)
            logprobs.append(logprob)
            values.append(value)
            env_action = action.cpu().numpy()
            if self._clip is not None:
                env_action = np.clip(env_action, *self._clip)
            next_obs, rew_np[t], term_np[t], trunc_np[t], info = self.envs.step(env_action)
            if trunc_np[t].any():
                cut = np.flatnonzero(trunc_np[t] & ~term_np[t])
                if cut.size:
                    final_obs = self._to_tensor(_stack(info["final_obs"][cut]))
                    final_values[t, torch.from_numpy(cut).to(self.device)] = policy.get_value(final_obs)
            if "_episode" in info:
                ep = info["episode"]
                step = env_step + (t + 1) * num_envs
                for i in np.flatnonzero(info["_episode"]):
                    self.episodes.add(step, float(ep["r"][i]), int(ep["l"][i]))
            if t + 1 < num_steps:
                _put(obs_np, t + 1, next_obs)
                obs = _row(obs_np, t + 1, self.device)  # a view on CPU: no copy
            else:
                obs = self._to_tensor(next_obs)
        torch.stack(actions, out=s["actions"])
        torch.stack(logprobs, out=s["logprobs"])
        torch.stack(values, out=s["values"])
        if self._staged:
            for key in self._HOST_KEYS:
                _copy_in(s[key], self.host[key])
        self.next_obs = obs
        compute_advantages(s, policy.get_value(obs), self.gamma, self.gae_lambda)
        sync_normalizers(self.envs, self.reduce)
        return num_steps * num_envs


def _numpy_dtype(tensor: torch.Tensor) -> np.dtype:
    return torch.empty((), dtype=tensor.dtype).numpy().dtype


# Observations are an array per step, or (Dict spaces) a dict of arrays mirrored by a nested TensorDict in
# the storage; these helpers treat both alike so the loop above reads the same for either.
HostArrays = np.ndarray | dict[str, "HostArrays"]


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
