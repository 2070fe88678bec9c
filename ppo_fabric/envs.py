"""Environment construction shared by every strategy: single envs, wrappers, vector envs, seeding."""

from __future__ import annotations

import difflib
import importlib
import re
from collections.abc import Callable
from functools import partial
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv, VectorEnv
from omegaconf import DictConfig, OmegaConf

from ppo_fabric import atari
from ppo_fabric.normalize import (
    NormalizeObservation,
    NormalizeReward,
    Reduce,
    discard_pending,
    first_observations,
    normalizers,
    warm_up,
)

# Which pip extra provides the simulator behind an env id, so a missing one is named in the error.
_EXTRA_BY_PREFIX = {
    "ALE/": "atari",
    "LunarLander": "box2d",
    "BipedalWalker": "box2d",
    "CarRacing": "box2d",
    "HalfCheetah": "mujoco",
    "Hopper": "mujoco",
    "Walker2d": "mujoco",
    "Ant": "mujoco",
    "Humanoid": "mujoco",
    "Swimmer": "mujoco",
    "Reacher": "mujoco",
    "Pusher": "mujoco",
    "InvertedPendulum": "mujoco",
    "InvertedDoublePendulum": "mujoco",
}


class EnvError(ValueError):
    """An environment that cannot be built from the config; the message is one line for the user."""


class ActionRepeat(gym.Wrapper):
    """Repeat each action `repeat` times and sum the rewards, stopping early when the episode ends."""

    def __init__(self, env: gym.Env, repeat: int) -> None:
        super().__init__(env)
        self.repeat = repeat

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        total = 0.0
        for _ in range(self.repeat):
            obs, reward, terminated, truncated, info = self.env.step(action)
            total += float(reward)
            if terminated or truncated:
                break
        return obs, total, terminated, truncated, info


# `env.mask_velocity`: the observation indices kept per env name (the id without "module:" or "-vN"). What
# is dropped is every velocity, so the policy must infer them from consecutive observations: a memory task.
VELOCITY_FREE_INDICES: dict[str, tuple[int, ...]] = {
    "CartPole": (0, 2),  # cart position, pole angle (drops cart velocity, pole angular velocity)
    "Pendulum": (0, 1),  # cos and sin of the angle (drops the angular velocity)
    "MountainCar": (0,),  # position (drops the velocity)
    "MountainCarContinuous": (0,),
    "LunarLander": (0, 1, 4, 6, 7),  # x, y, angle, leg contacts (drops x/y velocity, angular velocity)
}


def env_name(env_id: str) -> str:
    """`CartPole` for `CartPole-v1`, `my.module:CartPole-v1` or `CartPole`: the id without module or version."""
    return re.sub(r"-v\d+$", "", env_id.split(":")[-1])


class MaskVelocity(gym.ObservationWrapper):
    """Keep only the position-like entries of a known env's observation (`VELOCITY_FREE_INDICES`).

    The observation space becomes a Box of the kept entries' bounds, so the model is built for them.
    Raises EnvError for an env that is not in the table.
    """

    def __init__(self, env: gym.Env, env_id: str | None = None) -> None:
        super().__init__(env)
        env_id = env_id if env_id is not None else (env.spec.id if env.spec is not None else "")
        indices = VELOCITY_FREE_INDICES.get(env_name(env_id))
        space = env.observation_space
        if indices is None:
            supported = ", ".join(VELOCITY_FREE_INDICES)
            raise EnvError(f"env.mask_velocity=true supports only {supported}, not env.id={env_id!r}")
        if not isinstance(space, gym.spaces.Box) or len(space.shape) != 1 or max(indices) >= space.shape[0]:
            raise EnvError(f"env.mask_velocity=true: env.id={env_id!r} has an unexpected observation space")
        self.indices = np.asarray(indices, dtype=np.int64)
        self.observation_space = gym.spaces.Box(
            space.low[self.indices], space.high[self.indices], (len(indices),), space.dtype
        )

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return np.asarray(observation)[self.indices]


def extra_for(env_id: str) -> str | None:
    name = env_id.split(":")[-1]
    return next((extra for prefix, extra in _EXTRA_BY_PREFIX.items() if name.startswith(prefix)), None)


def _import_env_module(env_id: str) -> None:
    if ":" in env_id:
        module = env_id.split(":", 1)[0]
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise EnvError(f"env.id={env_id!r}: cannot import module {module!r} ({exc})") from exc
    if env_id.split(":")[-1].startswith("ALE/"):
        try:
            import ale_py

            gym.register_envs(ale_py)
        except ImportError as exc:
            raise EnvError(f"env.id={env_id!r} needs Atari: pip install 'ppo-fabric[atari]'") from exc


def make_env(env_cfg: DictConfig, render_mode: str | None = None) -> gym.Env:
    """One environment with the configured wrappers; raises EnvError with a one-line reason."""
    env_id = str(env_cfg.id)
    preprocess = _preprocess(env_cfg)
    _import_env_module(env_id)
    kwargs: dict[str, Any] = dict(OmegaConf.to_container(env_cfg.kwargs, resolve=True) or {})
    if preprocess == "atari":
        kwargs = atari.gym_make_kwargs(kwargs)
    if env_cfg.max_episode_steps is not None:
        kwargs["max_episode_steps"] = int(env_cfg.max_episode_steps)
    if render_mode is not None:
        kwargs["render_mode"] = render_mode
    try:
        env = gym.make(env_id, **kwargs)
    except gym.error.DependencyNotInstalled as exc:
        extra = extra_for(env_id)
        hint = f"pip install 'ppo-fabric[{extra}]'" if extra else str(exc).splitlines()[0]
        raise EnvError(f"env.id={env_id!r} needs an optional dependency: {hint}") from exc
    except (gym.error.NameNotFound, gym.error.VersionNotFound, gym.error.UnregisteredEnv) as exc:
        close = difflib.get_close_matches(env_id.split(":")[-1], list(gym.registry), n=3, cutoff=0.75)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see gymnasium.pprint_registry()"
        raise EnvError(f"env.id={env_id!r} is not a registered gymnasium environment{hint}") from exc
    except gym.error.Error as exc:
        raise EnvError(f"env.id={env_id!r}: {str(exc).splitlines()[0]}") from exc
    except TypeError as exc:
        raise EnvError(f"env.id={env_id!r} rejected env.kwargs: {str(exc)[:120]}") from exc
    if env_cfg.get("mask_velocity", False):
        try:
            env = MaskVelocity(env, env_id)
        except EnvError:
            env.close()
            raise
    if preprocess == "atari":
        try:
            env = atari.wrap_atari(env)
        except (ValueError, gym.error.DependencyNotInstalled) as exc:
            env.close()
            raise EnvError(
                f"env.id={env_id!r} with env.preprocess=atari: {str(exc).splitlines()[0]}"
            ) from exc
    if int(env_cfg.action_repeat) > 1:
        env = ActionRepeat(env, int(env_cfg.action_repeat))
    return env


def _preprocess(env_cfg: DictConfig) -> str:
    """`env.preprocess` (absent in hand-built configs: none), checked here so a typo fails at validation."""
    preprocess = str(env_cfg.get("preprocess", "none") or "none")
    if preprocess not in atari.PREPROCESSORS:
        raise EnvError(f"env.preprocess={preprocess!r} is not one of {', '.join(atari.PREPROCESSORS)}")
    return preprocess


def env_seeds(seed: int, rank: int, num_envs: int) -> list[int]:
    """Distinct, reproducible seeds for the envs of one rank, derived from `seed + rank`."""
    seq = np.random.SeedSequence(seed + rank)
    return [int(s) for s in seq.generate_state(num_envs, dtype=np.uint32)]


def make_vector_env(
    env_cfg: DictConfig, seed: int, rank: int, gamma: float = 0.99, reduce: Reduce | None = None
) -> tuple[VectorEnv, Any]:
    """The rank's vector env, already reset; returns (envs, first observation).

    With `env.normalize_obs` / `env.normalize_reward`, normalisation wraps the episode statistics (which
    therefore report raw returns); `reduce` sums their statistics over the collecting ranks and `gamma`
    discounts the returns whose spread scales the rewards.

    Autoreset is SAME_STEP so that the final observation of a truncated episode arrives with the step that
    ended it: the rollout bootstraps from its value, which NEXT_STEP autoreset would hide one step later.
    Episode statistics wrap the vector env before any later normalisation so they report raw returns.

    With a normaliser and `env.normalize_warmup` > 0 the envs first take that many random vector steps (not
    training steps: no counter sees them) whose statistics are merged over the ranks through `reduce`, then
    reset with the same seeds. Every build does it, resumed runs too: they replace these statistics with the
    checkpoint's (unpickled envs, or `load_normalizer_state`), which keeps exact resume exact.
    """
    # partial, not a lambda: the vector env keeps its factories, and checkpoints pickle the vector env.
    fns: list[Callable[[], gym.Env]] = [partial(make_env, env_cfg) for _ in range(int(env_cfg.num_envs))]
    cls = AsyncVectorEnv if env_cfg.vector == "async" else SyncVectorEnv
    envs = cls(fns, autoreset_mode=AutoresetMode.SAME_STEP)
    envs = atari.wrap_vector(envs, _preprocess(env_cfg))  # episode statistics (Atari: whole games)
    if env_cfg.get("normalize_obs", False):
        envs = NormalizeObservation(envs)
    if env_cfg.get("normalize_reward", False):
        envs = NormalizeReward(envs, gamma)
    seeds = env_seeds(seed, rank, int(env_cfg.num_envs))
    obs, _ = envs.reset(seed=seeds)
    warmup = int(env_cfg.get("normalize_warmup", 0) or 0)  # hand-built configs without the key: none
    if warmup > 0 and normalizers(envs):
        warm_up(envs, warmup, warmup_seed(seed, rank), reduce)
        # The same seeds again: the run's episodes start exactly where a run without warm-up starts them.
        obs, _ = envs.reset(seed=seeds)
        discard_pending(envs)  # these reset observations were counted by the warm-up already
    envs.action_space.seed(seeds[0])
    return envs, first_observations(envs, obs, reduce)


def warmup_seed(seed: int, rank: int) -> int:
    """The seed of the normalisation warm-up's random actions: reproducible per run and rank, and a stream
    apart from `env_seeds` (a child of the same seed sequence)."""
    child = np.random.SeedSequence(seed + rank).spawn(1)[0]
    return int(child.generate_state(1, dtype=np.uint32)[0])


def probe_spaces(env_cfg: DictConfig) -> tuple[gym.Space, gym.Space]:
    """Build one env to validate the id and read its spaces before any process or vector env starts."""
    env = make_env(env_cfg)
    try:
        return env.observation_space, env.action_space
    finally:
        env.close()


def check_normalizable(env_cfg: DictConfig, obs_space: gym.Space) -> None:
    """`env.normalize_obs=true` needs observations with one shape that are stored as floats: the rollout
    keeps pixels (uint8 Boxes of rank 2 or 3, `agent.is_image_space`) as uint8, where normalised values
    would be truncated to garbage, and Dict observations have no single shape for the running statistics.
    Raises EnvError, one line naming the key."""
    if not env_cfg.get("normalize_obs", False):
        return
    parts = obs_space.spaces.values() if isinstance(obs_space, gym.spaces.Dict) else [obs_space]
    if any(isinstance(s, gym.spaces.Box) and s.dtype == np.uint8 and len(s.shape) in (2, 3) for s in parts):
        raise EnvError(
            "env.normalize_obs=true on uint8 image observations would write normalised floats into uint8 "
            "storage; images are scaled by the CNN, set env.normalize_obs=false"
        )
    if obs_space.shape is None:
        raise EnvError(
            f"env.normalize_obs=true needs an array observation space, not {type(obs_space).__name__}; "
            "set env.normalize_obs=false"
        )
