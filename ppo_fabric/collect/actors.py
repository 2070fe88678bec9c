"""How a group's rows choose their actions during one rollout: one small interface, one class per way.

The rollout loop (`rollout.RolloutCollector.collect`) asks each group's actor for step t's env actions and
hands it the storage at the end; it does not know which actor it holds. `acting_for` picks one per group and
rollout, in this order:

| actor | when | how |
|---|---|---|
| `ReadyRowsActor` | an async EnvPool | only the envs that are ready act; the others' rows get zeros (`mask` hides them) |
| `NumpyRolloutActor` | a plain CPU feed-forward MLP with `algo.numpy_rollout` | NumPy on views of the parameters, straight into the storage |
| `TorchActor` | everything else | `ActorCritic.sample`: masks, recurrent state, pixels, GPUs |

"Plain" rows act at every step with no action mask and no self-play opponents, from observations held in one
host array that is the CPU storage. Where the rows are plain, both the NumPy and the torch actor sample with
the rollout's noise drawn ahead (`models.agent.rollout_noise`), so `algo.numpy_rollout` changes the speed,
never the actions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from tensordict import TensorDict
from torch import Tensor

from ppo_fabric.collect import numpy_actor
from ppo_fabric.learn.buffer import STATE_KEY
from ppo_fabric.models.agent import ActorCritic, rollout_noise

if TYPE_CHECKING:
    from ppo_fabric.models.agent import Obs


class Actor(Protocol):
    """One group's actions over one rollout."""

    reads_host: bool  # acts on the host observation rows itself: the loop keeps no tensor of them

    def act(
        self, t: int, obs: Obs, mask: Tensor | None, state: Tensor | None
    ) -> tuple[np.ndarray, Tensor | None]:
        """Step t's env actions (NumPy, not yet clipped) and the recurrent state after it (None if none)."""
        ...

    def store(self, storage: TensorDict) -> None:
        """Write the rollout's actions, log-probs and recurrent states into `storage`."""
        ...


class TorchActor:
    """`ActorCritic.sample` per step; the outputs are kept per step and written with one stack per key
    (cheaper than T indexed writes)."""

    reads_host = False

    def __init__(self, policy: ActorCritic, noise: Iterator[np.ndarray] | None) -> None:
        self.policy, self.noise = policy, noise
        self.actions: list[Tensor] = []
        self.logprobs: list[Tensor] = []
        self.states: list[Tensor] = []

    def act(
        self, t: int, obs: Obs, mask: Tensor | None, state: Tensor | None
    ) -> tuple[np.ndarray, Tensor | None]:
        if mask is None:
            noise = None if self.noise is None else torch.from_numpy(next(self.noise))
            action, logprob, next_state = self.policy.sample(obs, state, noise=noise)
        else:
            action, logprob, next_state = self.policy.sample(obs, state, False, mask)
        self.actions.append(action)
        self.logprobs.append(logprob)
        if state is not None:
            self.states.append(state)
        return action.cpu().numpy(), next_state

    def store(self, storage: TensorDict) -> None:
        torch.stack(self.actions, out=storage["actions"])
        torch.stack(self.logprobs, out=storage["logprobs"])
        if self.states:
            torch.stack(self.states, out=storage[STATE_KEY])


class ReadyRowsActor(TorchActor):
    """An async pool's step: the policy acts for the rows that are ready only (feed-forward policies: the
    config refuses recurrent ones); the other rows get zeros, which the env ignores and `mask` hides."""

    def __init__(self, policy: ActorCritic, ready: Callable[[], np.ndarray]) -> None:
        super().__init__(policy, None)
        self.ready = ready  # the rows ready to act now

    def act(
        self, t: int, obs: Obs, mask: Tensor | None, state: Tensor | None
    ) -> tuple[np.ndarray, Tensor | None]:
        rows = self.ready()
        index = torch.from_numpy(np.flatnonzero(rows)).to(obs.device)
        action, logprob, _ = self.policy.sample(obs[index], None)
        actions = action.new_zeros((rows.size, *action.shape[1:]))
        logprobs = logprob.new_zeros(rows.size)
        actions[index], logprobs[index] = action, logprob
        self.actions.append(actions)
        self.logprobs.append(logprobs)
        return actions.cpu().numpy(), None


class NumpyRolloutActor:
    """`numpy_actor.NumpyActor` on the storage's own host arrays: it reads step t's observations there and
    writes the actions and log-probs there, so nothing is left to store at the end."""

    reads_host = True

    def __init__(
        self, policy: ActorCritic, storage: TensorDict, obs: np.ndarray, noise: Iterator[np.ndarray]
    ) -> None:
        self.policy = numpy_actor.NumpyActor(policy)
        self.obs, self.noise = obs, noise
        self.actions, self.logprobs = storage["actions"].numpy(), storage["logprobs"].numpy()

    def act(
        self, t: int, obs: Obs, mask: Tensor | None, state: Tensor | None
    ) -> tuple[np.ndarray, Tensor | None]:
        action, self.logprobs[t] = self.policy.sample(self.obs[t], next(self.noise))
        self.actions[t] = action
        return action, None

    def store(self, storage: TensorDict) -> None:
        pass


def acting_for(
    policy: ActorCritic,
    storage: TensorDict,
    host_obs: np.ndarray | dict,
    plain: bool,
    numpy_rollout: bool,
    ready: Callable[[], np.ndarray] | None,
) -> Actor:
    """The actor of one group for one rollout. `plain`: the group's rows act plainly (module docstring),
    and `host_obs`, its observations' host array, is the CPU storage's; `ready`: an async pool's rows that
    act at the current step (None for every other env)."""
    if ready is not None:
        return ReadyRowsActor(policy, ready)
    if not plain:
        return TorchActor(policy, None)
    steps, rows = storage.batch_size
    noise = rollout_noise(policy.head, steps, rows)
    if numpy_rollout:
        return NumpyRolloutActor(policy, storage, host_obs, noise)
    return TorchActor(policy, noise)
