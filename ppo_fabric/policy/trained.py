"""A trained policy to act with from Python: `ppo_fabric.load_policy(path)` and `Policy.predict`.

    policy = ppo_fabric.load_policy("runs/2026-11-26/12-00-00")      # a run dir or a .ckpt file
    action, state = policy.predict(obs)                                # one observation or a batch

`predict` has Stable-Baselines3's shape so code written against SB3 acts with ours unchanged: NumPy in and
out, the recurrent state carried by the caller (`episode_start` marks the rows whose episode just began),
`deterministic=True` by default. What training did between the env and the network is done here too, so a
caller feeds the observations of the env as the run built it (`Policy.make_env`, with the run's wrappers)
and gets env actions: observations are normalised with the run's frozen statistics (`env.normalize_obs`),
action masks are honoured, and Box actions are clipped to the action space as the rollout clips them before
`env.step`. Evaluation acts through the same method, so what a user
scores and what `python -m ppo_fabric.evaluate` scores cannot diverge.

Loading never runs code from the file: checkpoints are read with `torch.load(weights_only=True)`
(`runs.checkpoint.load`) and the model is rebuilt from the config stored beside its weights.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict

from ppo_fabric.envs.guard import find_nonfinite
from ppo_fabric.envs.make import in_space_dtype
from ppo_fabric.envs.normalize import RunningMoments
from ppo_fabric.models.agent import ActorCritic, float32_calls
from ppo_fabric.runs import checkpoint as ckpt


class Policy:
    """One policy of a checkpoint, in eval mode on the CPU.

    Attributes: `name` (`main` for a single-agent run, else the multi-agent policy's name), `model` (the
    `ActorCritic`), `observation_space` and `action_space` (what the policy was trained on, before
    normalisation), `mask_width` (None when trained without action masks), `recurrent`, `config` (the run's
    config as a plain dict).
    """

    def __init__(
        self,
        model: ActorCritic,
        observation_space: gym.Space,
        action_space: gym.Space,
        *,
        name: str = "main",
        obs_normalization: dict[str, Any] | None = None,
        mask_width: int | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.model = model.eval()
        self.name = name
        self.observation_space = observation_space
        self.action_space = action_space
        self.mask_width = mask_width
        self.config = config or {}
        self.recurrent = model.core is not None
        self._moments: RunningMoments | None = None
        if obs_normalization is not None:
            self._moments = RunningMoments(observation_space.shape)
            self._moments.load_state_dict(obs_normalization)
        box = isinstance(action_space, gym.spaces.Box)
        self._clip = (action_space.low, action_space.high) if box else None
        self._dtype = (
            None if action_space.dtype is None else np.dtype(action_space.dtype)
        )  # as the env gets them
        # The shapes an observation is checked against in `predict` (a tuple comparison per call).
        dict_space = isinstance(observation_space, gym.spaces.Dict)
        subspaces = observation_space.spaces.items() if dict_space else ()
        self._shapes: dict[str, tuple[int, ...]] = {k: tuple(sub.shape or ()) for k, sub in subspaces}
        self._shape = tuple(observation_space.shape or ())

    def __repr__(self) -> str:
        return (
            f"Policy(name={self.name!r}, observation_space={self.observation_space}, "
            f"action_space={self.action_space}, recurrent={self.recurrent}, mask_width={self.mask_width})"
        )

    def make_env(self, render_mode: str | None = None, trust_env: bool = False) -> gym.Env:
        """The env this policy was trained on, built from the run's config with its wrappers (velocity
        masking, observation noise, action repeat, Atari preprocessing, the action mask in the infos), as
        `python -m ppo_fabric.evaluate` builds it: the observations `predict` expects. A bare `gym.make` of
        the same id lacks those wrappers; a run on `env.backend=envpool` gets a one-env pool of its options
        (`envpool_backend.PoolEnv`) where EnvPool is installed and no `render_mode` is asked for. An env id
        naming a module outside the known env packages runs that module's code with the run's `env.kwargs`,
        so it is built only with `trust_env=True`."""
        from omegaconf import OmegaConf

        from ppo_fabric.envs.make import foreign_module, make_env

        env_cfg = (self.config or {}).get("env")
        if not env_cfg or self.name != "main":
            raise ValueError(
                "Policy.make_env builds the env of a single-agent run's policy; a multi-agent policy acts in "
                "a PettingZoo env you build, or through python -m ppo_fabric.evaluate"
            )
        module = foreign_module(str(env_cfg["id"]))
        if module is not None and not trust_env:
            raise ValueError(
                f"Policy.make_env: env.id={env_cfg['id']!r} would import and run module {module!r}; "
                "pass trust_env=True if you trust this checkpoint"
            )
        return make_env(OmegaConf.create(env_cfg), render_mode=render_mode, action_mask=self.mask_width)

    def greedy_actor(self) -> Callable[[np.ndarray], np.ndarray] | None:
        """`predict(batch, deterministic=True)` for a batch of array observations, in NumPy on views of the
        parameters (`collect.numpy_actor`: no torch call, ~1/7 of `predict`'s ~140 us on a batch of 10 on 2
        cores): what evaluation during training steps its episodes with. None where the policy needs torch
        (recurrent, masked, Dict observations, a CNN or an activation without a NumPy twin)."""
        from ppo_fabric.collect.numpy_actor import NumpyActor, unsupported

        dict_obs = isinstance(self.observation_space, gym.spaces.Dict)
        if self.recurrent or self.mask_width is not None or dict_obs or unsupported(self.model) is not None:
            return None
        actor, moments, clip, dtype = NumpyActor(self.model), self._moments, self._clip, self._dtype

        def act(batch: np.ndarray) -> np.ndarray:
            x = np.asarray(batch)
            if moments is not None:
                x = moments.normalize(x)
            actions, _ = actor.sample(
                x, np.zeros((x.shape[0], actor.width), np.float32)
            )  # no noise: the mode
            actions = np.clip(actions, *clip) if clip is not None else actions
            return in_space_dtype(actions, dtype)

        return act

    @float32_calls
    def initial_state(self, batch: int = 1) -> np.ndarray | None:
        """The recurrent state a fresh episode starts from, [batch, *state_shape] (None: feed-forward)."""
        state = self.model.initial_state(batch)
        return None if state is None else state.numpy()

    @float32_calls
    def predict(
        self,
        observation: Any,
        state: np.ndarray | None = None,
        episode_start: np.ndarray | None = None,
        deterministic: bool = True,
        action_mask: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """(action, next state) for one observation or a batch of them.

        `observation`: one env observation (an array of the observation space's shape, or a dict of them
        for a Dict space) or a batch with a leading dimension. `state`: what the previous call returned
        (None: a fresh episode; always None for a feed-forward policy). `episode_start` [batch] of bools:
        rows whose episode just began start again from the initial state. `action_mask` [n] or
        [batch, n], True where an action is legal. The action comes back as the env takes it: Box actions
        clipped to the space; one observation in gives one action out (no batch dimension). The state keeps
        its batch dimension ([1, ...] for one observation), as SB3's does.
        """
        batch, single = self._batch(observation)
        n = next(iter(batch.values())).shape[0] if isinstance(batch, TensorDict) else batch.shape[0]
        torch_state = None
        if self.recurrent:
            torch_state = self.model.initial_state(n) if state is None else torch.as_tensor(state)
            fresh = self.model.initial_state(n)
            if torch_state.shape != fresh.shape:
                raise ValueError(
                    f"Policy.predict: state of shape {tuple(torch_state.shape)} does not fit {n} observation(s): "
                    f"give the state the previous call returned, {tuple(fresh.shape)} (None: a fresh episode)"
                )
            if episode_start is not None:
                starts = torch.as_tensor(np.asarray(episode_start, dtype=bool).reshape(-1))
                if starts.numel() != n:
                    raise ValueError(
                        f"Policy.predict: episode_start has {starts.numel()} entries for {n} observation(s)"
                    )
                torch_state = torch.where(
                    starts.view(-1, *([1] * (torch_state.dim() - 1))),
                    torch.zeros_like(torch_state),
                    torch_state,
                )
        masks: tuple[torch.Tensor, ...] = ()
        if action_mask is not None:
            masks = (self._mask(action_mask, n, single),)
        with torch.inference_mode():
            action, _, _, next_state = self.model.act_with_state(batch, torch_state, deterministic, *masks)
        out = action.numpy()
        if self._clip is not None:
            out = np.clip(out, *self._clip)
        out = in_space_dtype(out, self._dtype)
        if single:
            out = out[0]
        new_state = None if next_state is None else next_state.numpy()
        return out, new_state

    def _mask(self, action_mask: Any, n: int, single: bool) -> torch.Tensor:
        """`action_mask` as [n, width], checked: the policy's own width, one row per observation, and a
        legal action in every row (with none, the policy would return an illegal one; training refuses it)."""
        mask = torch.as_tensor(np.asarray(action_mask, dtype=bool))
        if mask.dim() == 1:
            mask = mask.unsqueeze(0)
        width = self.mask_width if self.mask_width is not None else maskable_width(self.action_space)
        if width is None:
            raise ValueError(
                f"Policy.predict: an action_mask was given, but this policy's {type(self.action_space).__name__} "
                "actions cannot be masked (Discrete and MultiDiscrete can)"
            )
        if mask.dim() != 2 or mask.shape != (n, width):
            one = f"[{width}]" if single else f"[{n}, {width}]"
            raise ValueError(
                f"Policy.predict: action_mask of shape {tuple(np.shape(action_mask))} does not fit {n} "
                f"observation(s) of this policy's {width} actions: give {one}"
            )
        starts = [0]  # each action dimension's first column: every dimension needs a legal sub-action
        if isinstance(self.action_space, gym.spaces.MultiDiscrete):
            starts = np.concatenate([[0], np.cumsum(self.action_space.nvec.ravel())[:-1]]).tolist()
        legal = np.logical_or.reduceat(mask.numpy(), starts, axis=1)  # [n, dimensions]
        if not legal.all():
            row, dim = (int(i[0]) for i in np.nonzero(~legal))
            which = f" in action dimension {dim}" if len(starts) > 1 else ""
            raise ValueError(f"Policy.predict: action_mask row {row} allows no action{which}")
        return mask

    def _batch(self, observation: Any) -> tuple[torch.Tensor | TensorDict, bool]:
        """(the observation as the model's batch, whether it was a single observation)."""
        if isinstance(self.observation_space, gym.spaces.Dict):
            return self._dict_batch(observation)
        if isinstance(observation, Mapping) and "observation" in observation:  # a PettingZoo game's own dict
            raise ValueError(
                "Policy.predict: give the game's observation['observation'], with "
                "action_mask=observation['action_mask'], not the dict"
            )
        if isinstance(observation, torch.Tensor):  # a tensor with a grad or on a GPU: NumPy refused it
            observation = observation.detach().cpu()
        array = np.asarray(observation)
        single = array.shape == self._shape
        if single:
            array = array[None]
        elif array.shape[1:] != self._shape:
            raise ValueError(
                f"Policy.predict: observation of shape {array.shape} does not fit the observation space of "
                f"shape {self._shape}: give one observation {self._shape} or a batch {_batched(self._shape)}"
            )
        _refuse_nonfinite(array, single)
        if self._moments is not None:
            array = self._moments.normalize(array)
        return torch.as_tensor(array, dtype=torch.float32), single

    def _dict_batch(self, observation: Any) -> tuple[TensorDict, bool]:
        """`_batch` for a Dict observation space: every key of the space, all one observation or all a
        batch of the same size."""
        if not isinstance(observation, Mapping) or self._shapes.keys() - observation.keys():
            given = sorted(observation) if isinstance(observation, Mapping) else type(observation).__name__
            raise ValueError(
                f"Policy.predict: the observation space is a Dict of {sorted(self._shapes)}, given {given}"
            )
        arrays = {k: np.asarray(observation[k]) for k in self._shapes}
        single = all(arrays[k].shape == shape for k, shape in self._shapes.items())
        if single:
            arrays = {k: v[None] for k, v in arrays.items()}
        else:
            for key, shape in self._shapes.items():
                if arrays[key].shape[1:] != shape:
                    raise ValueError(
                        f"Policy.predict: observation[{key!r}] of shape {arrays[key].shape} does not fit the "
                        f"observation space's {shape}: give one observation {shape} or a batch "
                        f"{_batched(shape)}, for every key alike"
                    )
            sizes = {k: v.shape[0] if v.ndim else None for k, v in arrays.items()}
            if len(set(sizes.values())) != 1:
                raise ValueError(
                    f"Policy.predict: the keys of a batch of observations differ in size: {sizes}"
                )
        _refuse_nonfinite(arrays, single)
        n = next(iter(arrays.values())).shape[0]
        parts = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in arrays.items()}
        return TensorDict(parts, batch_size=[n]), single


def _refuse_nonfinite(batch: Any, single: bool) -> None:
    """A NaN or inf observation is refused, as training refuses it: the network turned it into an action
    without a word (NaN logits give action 0), which a deployed policy then took."""
    found = find_nonfinite(batch, np.zeros(1))
    if found is not None:
        row, what = found
        raise ValueError(f"Policy.predict: the {what}" + ("" if single else f" in row {row} of the batch"))


def _batched(shape: tuple[int, ...]) -> str:
    """`(n, 4)` for the shape (4,): how a batch of observations of `shape` reads in a message."""
    return f"({', '.join(('n', *map(str, shape)))})"


def load_policies(path: str | Path) -> dict[str, Policy]:
    """Every policy of a checkpoint (or a run directory's `checkpoints/last.ckpt`), by name: `main` for a
    single-agent run. Raises ValueError (one line) for a file that is not a readable checkpoint."""
    return checkpoint_policies(path)[1]


def checkpoint_policies(path: str | Path) -> tuple[dict[str, Any], dict[str, Policy]]:
    """(the checkpoint, its policies by name): for tools that also read the run's config or counters."""
    state, models = ckpt.load_policies(path)
    obs_spaces, action_spaces = ckpt.saved_spaces(state)
    norm = ckpt.observation_normalization(state)
    multi = bool(state.get("multiagent"))
    policies = {}
    for name, model in models.items():
        policies[name] = Policy(
            model,
            obs_spaces[name] if multi else obs_spaces,
            action_spaces[name] if multi else action_spaces,
            name=name,
            obs_normalization=None if multi else norm,
            mask_width=ckpt.mask_width(state, name if multi else None),
            config=state["config"],
        )
    return state, policies


def load_policy(path: str | Path, policy: str | None = None) -> Policy:
    """The policy of a checkpoint or a run directory, ready to `predict`.

    A multi-agent checkpoint holds several: name one with `policy=` (a checkpoint with a single policy
    needs none). Raises ValueError with a one-line message naming what is wrong.
    """
    policies = load_policies(path)
    if policy is None:
        if len(policies) > 1:
            raise ValueError(
                f"{path} holds the policies of a multi-agent run ({', '.join(policies)}); "
                "choose one with load_policy(path, policy=NAME)"
            )
        return next(iter(policies.values()))
    if policy not in policies:
        raise ValueError(f"policy={policy!r} is not in {path} (it has {', '.join(policies)})")
    return policies[policy]


def maskable_width(space: gym.Space) -> int | None:
    """The width of an action mask over `space` (one flag per action, MultiDiscrete: per sub-action), for a
    policy that trained without masks and is given one; None where actions cannot be masked."""
    if isinstance(space, gym.spaces.Discrete):
        return int(space.n)
    if isinstance(space, gym.spaces.MultiDiscrete):
        return int(np.sum(space.nvec))
    return None
