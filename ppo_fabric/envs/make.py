"""Environment construction shared by every strategy: single envs, wrappers, vector envs, seeding."""

from __future__ import annotations

import contextlib
import difflib
import importlib
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.envs.registration import EnvSpec
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv, VectorEnv
from omegaconf import DictConfig, OmegaConf

from ppo_fabric.config.tuned import KNOWN_ENV_PACKAGES
from ppo_fabric.envs import atari, envpool_backend
from ppo_fabric.envs.guard import (
    ASYNC_POOLS,
    LOST_WORKER,
    ON_ERROR,
    EnvFault,
    FiniteCheck,
    StepFlags,
    built_in_worker,
    error_line,
    restartable,
    worker_build_failures,
)
from ppo_fabric.envs.normalize import (
    NormalizeObservation,
    NormalizeReward,
    Reduce,
    discard_pending,
    first_observations,
    normalizers,
    warm_up,
)
from ppo_fabric.wire.progress import PROGRESS

# Which pip extra provides the simulator behind an env id, so a missing one is named in the error.
_EXTRA_BY_PREFIX = {
    "ALE/": "atari",
    "MinAtar/": "minatar",
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


MASK_MODES = ("drop", "zero")  # env.mask_velocity: true is "drop"


def mask_velocity_mode(value: Any) -> str | None:
    """`env.mask_velocity` as a mode: None (false), "drop" (true or "drop") or "zero"; EnvError otherwise."""
    if value is None or value is False:
        return None
    if value is True:
        return "drop"
    if isinstance(value, str) and value in MASK_MODES:
        return value
    raise EnvError(f"env.mask_velocity={value!r}: choose false, true (drop), drop or zero")


class MaskVelocity(gym.ObservationWrapper):
    """Hide the velocities of a known env's observation (`VELOCITY_FREE_INDICES` lists what stays).

    `mode="drop"`: the observation keeps the position-like entries only, and the space becomes a Box of
    their bounds, so the model is built for them. `mode="zero"`: the observation keeps its shape and the
    velocity entries read 0 (a network that was built for the full observation sees constant inputs there).
    Raises EnvError for an env that is not in the table.
    """

    def __init__(self, env: gym.Env, env_id: str | None = None, mode: str = "drop") -> None:
        super().__init__(env)
        env_id = env_id if env_id is not None else (env.spec.id if env.spec is not None else "")
        indices = VELOCITY_FREE_INDICES.get(env_name(env_id))
        space = env.observation_space
        if indices is None:
            supported = ", ".join(VELOCITY_FREE_INDICES)
            raise EnvError(f"env.mask_velocity supports only {supported}, not env.id={env_id!r}")
        if not isinstance(space, gym.spaces.Box) or len(space.shape) != 1 or max(indices) >= space.shape[0]:
            raise EnvError(f"env.mask_velocity: env.id={env_id!r} has an unexpected observation space")
        self.indices = np.asarray(indices, dtype=np.int64)
        self.mode = mode
        if mode == "zero":
            self.keep = np.zeros(space.shape, dtype=space.dtype)
            self.keep[self.indices] = 1
            low, high = np.where(self.keep, space.low, 0), np.where(self.keep, space.high, 0)
            self.observation_space = gym.spaces.Box(low, high, space.shape, space.dtype)
        else:
            self.observation_space = gym.spaces.Box(
                space.low[self.indices], space.high[self.indices], (len(indices),), space.dtype
            )

    def observation(self, observation: np.ndarray) -> np.ndarray:
        if self.mode == "zero":
            return np.asarray(observation) * self.keep
        return np.asarray(observation)[self.indices]


class ObservationNoise(gym.ObservationWrapper):
    """Gaussian noise of standard deviation `std` added to every entry of a flat Box observation, drawn
    from the env's own generator, so a seeded run repeats. A partially observed task of a third kind (after
    dropped and zeroed velocities): a memory helps to average the noise out. The space widens to the reals."""

    def __init__(self, env: gym.Env, std: float) -> None:
        super().__init__(env)
        space = env.observation_space
        if not isinstance(space, gym.spaces.Box) or not np.issubdtype(space.dtype, np.floating):
            raise EnvError(f"env.observation_noise needs a float Box observation space, got {space}")
        if not std > 0:
            raise EnvError(f"env.observation_noise={std}: a standard deviation > 0 (0 turns it off)")
        self.std = float(std)
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, space.shape, space.dtype)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        obs = np.asarray(observation)
        return (obs + self.np_random.normal(0.0, self.std, obs.shape)).astype(obs.dtype)


ACTION_MASK = "action_mask"  # the Dict observation key and the info key the conventions use


def action_mask_width(action_space: gym.Space) -> int | None:
    """Entries of a flat action mask for this action space (Discrete: n, MultiDiscrete: sum(nvec)); None
    for spaces that cannot be masked."""
    if isinstance(action_space, gym.spaces.Discrete):
        return int(action_space.n)
    if isinstance(action_space, gym.spaces.MultiDiscrete) and action_space.nvec.ndim == 1:
        return int(action_space.nvec.sum())
    return None


def _mask_method(env: gym.Env) -> Any:
    try:
        method = env.get_wrapper_attr("action_masks")
    except AttributeError:
        return None
    return method if callable(method) else None


def detect_action_mask(env: gym.Env) -> int | None:
    """The mask width when `env` provides action masks by one of the conventions, else None: an
    `action_mask` key of a Dict observation (PettingZoo), an `action_masks()` method (sb3-contrib's
    MaskablePPO), or `info["action_mask"]` from reset (the env is reset once to look)."""
    width = action_mask_width(env.action_space)
    if width is None:
        return None
    space = env.observation_space
    if isinstance(space, gym.spaces.Dict) and ACTION_MASK in space.spaces:
        return width
    if _mask_method(env) is not None:
        return width
    _, info = env.reset()
    return width if ACTION_MASK in info else None


class ActionMaskInfo(gym.Wrapper):
    """Whatever convention the env follows, its action mask arrives as `info["action_mask"]`, a flat bool
    array of `width` entries for the observation returned with it (after reset and every step).

    Sources, first found wins: the Dict observation's `action_mask` key (removed from the observation: the
    policy sees the other keys, a single remaining key as its own space), the env's `info["action_mask"]`,
    its `action_masks()` method. A step without any is all legal.
    """

    def __init__(self, env: gym.Env, width: int) -> None:
        super().__init__(env)
        self.width = width
        space = env.observation_space
        self.from_obs = isinstance(space, gym.spaces.Dict) and ACTION_MASK in space.spaces
        self.only_key: str | None = None
        if self.from_obs:
            rest = {k: sub for k, sub in space.spaces.items() if k != ACTION_MASK}
            if not rest:
                raise EnvError("the Dict observation holds only an action_mask; nothing is left to observe")
            self.only_key = next(iter(rest)) if len(rest) == 1 else None
            self.observation_space = rest[self.only_key] if self.only_key else gym.spaces.Dict(rest)
        self.method = None if self.from_obs else _mask_method(env)
        self.mask = np.ones(width, dtype=bool)

    def _with_mask(self, obs: Any, info: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        if self.from_obs:
            mask = obs[ACTION_MASK]
            obs = obs[self.only_key] if self.only_key else {k: v for k, v in obs.items() if k != ACTION_MASK}
        elif ACTION_MASK in info:
            mask = info[ACTION_MASK]
        elif self.method is not None:
            mask = self.method()
        else:
            mask = np.ones(self.width, dtype=bool)
        mask = np.asarray(mask).reshape(-1).astype(bool)
        if mask.shape[0] != self.width:
            raise EnvError(
                f"the env's action mask has {mask.shape[0]} entries; its action space needs {self.width}"
            )
        self.mask = mask
        return obs, {**info, ACTION_MASK: mask}

    def current_action_mask(self) -> np.ndarray:
        """The mask of the last observation returned (vector envs read it with `call`)."""
        return self.mask

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        return self._with_mask(*self.env.reset(**kwargs))

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        obs, info = self._with_mask(obs, info)
        return obs, reward, terminated, truncated, info


def extra_for(env_id: str) -> str | None:
    name = env_id.split(":")[-1]
    return next((extra for prefix, extra in _EXTRA_BY_PREFIX.items() if name.startswith(prefix)), None)


_MUJOCO_SAID: set[str] | None = None  # MuJoCo's warnings this process has printed (None: its hook not set)


def mujoco_warnings_once() -> None:
    """MuJoCo's warnings (`mujoco.set_mju_user_warning`), each printed once a process, as MuJoCo words them:
    gymnasium's own model files compile with a deprecated attribute, and `exp=mujoco` printed the same
    two-line warning for every env it built (24 over a run's envs and evaluation), nothing the user can change."""
    global _MUJOCO_SAID
    if _MUJOCO_SAID is not None:
        return
    try:
        import mujoco
    except ImportError:  # gym.make says which extra is missing
        return
    said: set[str] = set()

    def once(message: str) -> None:
        if message not in said:
            said.add(message)
            print(f"WARNING: {message}", file=sys.stderr, flush=True)

    mujoco.set_mju_user_warning(once)
    _MUJOCO_SAID = said


# ppo-fabric's own env modules, by full name: the rest of the package holds callables that build whatever env
# their arguments name (`ppo_fabric.policy.evaluate:main` with a checkpoint's `env.kwargs` would run another
# checkpoint's env), so the package as a whole is not a known env package.
KNOWN_ENV_MODULES = ("ppo_fabric.envs.toy_multiagent",)


def module_named(env_id: str) -> str | None:
    """The module building `env_id` imports (and whose callable it may call with `env.kwargs`): `module` of
    gymnasium's `module:name`, or a PettingZoo-style dotted path; None for a registered id (`CartPole-v1`,
    `ALE/Pong-v5`)."""
    if ":" in env_id:
        return env_id.partition(":")[0]
    return env_id if "." in env_id and "/" not in env_id else None


def foreign_module(env_id: str) -> str | None:
    """`module_named(env_id)` when it lies outside `KNOWN_ENV_PACKAGES` and `KNOWN_ENV_MODULES`: code that
    only the config names."""
    module = module_named(env_id)
    if module is None or module.split(".")[0] in KNOWN_ENV_PACKAGES or module in KNOWN_ENV_MODULES:
        return None
    return module


def trust_override(env_id: Any) -> str:
    """` env.id=ID` for the resume command a line suggests when the run's env id names a module outside the
    known env packages (a resume builds such an env only when its command names the id: the suggested
    command was refused), else ""."""
    return f" env.id={env_id}" if isinstance(env_id, str) and foreign_module(env_id) else ""


def _import_env_module(env_id: str) -> Any:
    """Import the module of a `module:name` id (gymnasium's convention: the module registers `name`).
    Returns the module's callable `name` when no env of that name is registered: `module:factory`,
    an env that is not registered at all, built by calling the factory with `env.kwargs`."""
    factory = None
    if ":" in env_id:
        module_name, _, attr = env_id.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise EnvError(
                f"env.id={env_id!r}: cannot import module {module_name!r} ({error_line(exc)})"
            ) from exc
        except Exception as exc:  # the module itself fails: a SyntaxError, an error at import time
            raise EnvError(
                f"env.id={env_id!r}: cannot import module {module_name!r}, it raised "
                f"{type(exc).__name__}: {error_line(exc)}"
            ) from exc
        candidate = getattr(module, attr, None)
        if callable(candidate) and attr not in gym.registry:
            factory = candidate
        elif not _registered(attr):
            _refuse_missing_callable(env_id, module, attr, candidate)
    if env_id.split(":")[-1].startswith("ALE/"):
        try:
            import ale_py

            gym.register_envs(ale_py)
        except ImportError as exc:
            raise EnvError(f"env.id={env_id!r} needs Atari: pip install 'ppo-fabric[atari]'") from exc
    if env_id.split(":")[-1].startswith("MinAtar/") and env_id.split(":")[-1] not in gym.registry:
        try:  # MinAtar registers its ids through an entry point that gymnasium 1.x no longer loads
            from minatar.gym import register_envs
        except ImportError as exc:
            raise EnvError(f"env.id={env_id!r} needs MinAtar: pip install 'ppo-fabric[minatar]'") from exc
        register_envs()
    return factory


def _registered(name: str) -> bool:
    """Whether gymnasium knows `name` as an id, or as an env name in any version (`CartPole`)."""
    return name in gym.registry or any(spec.name == name for spec in gym.registry.values())


def _refuse_missing_callable(env_id: str, module: Any, attr: str, candidate: Any) -> None:
    """EnvError for `module:attr` whose `attr` is no callable of the module and no env it registered, when
    `attr` reads as a Python name (`make_envv`); an id-like `attr` (`MyEnv-v0`) is left to gymnasium's
    registry, whose error names the closest registered ids."""
    if not attr.isidentifier():
        return
    where = f"env.id={env_id!r}: module {module.__name__!r}"
    if candidate is not None:
        raise EnvError(f"{where} has {attr!r}, but it is not callable ({type(candidate).__name__})")
    names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n, None))]
    close = difflib.get_close_matches(attr, names, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise EnvError(f"{where} has no attribute {attr!r} (no callable, no registered env of that name){hint}")


class _GymnasiumFactory:
    """`factory` as a gymnasium entry point that refuses anything but a gymnasium env in one line. A class,
    not a closure: the entry point is in every sub-env's spec, and a closure cannot be pickled, so the
    checkpoint of a `module:factory` env held no env state and its resume was never exact."""

    def __init__(self, env_id: str, factory: Callable[..., Any]) -> None:
        self.env_id, self.factory = env_id, factory

    def __call__(self, **kwargs: Any) -> gym.Env:
        env = self.factory(**kwargs)
        if not isinstance(env, gym.Env):
            kind = (
                "a PettingZoo env: add env=pettingzoo"
                if hasattr(env, "possible_agents")
                else type(env).__name__
            )
            raise EnvError(f"env.id={self.env_id!r} returned {kind}, not a gymnasium.Env")
        return env


def make_env(env_cfg: DictConfig, render_mode: str | None = None, action_mask: int | None = None) -> gym.Env:
    """One environment with the configured wrappers; raises EnvError with a one-line reason. With
    `action_mask` (the mask width `detect_action_mask` found) the env's mask arrives in its infos."""
    env_id = str(env_cfg.id)
    if render_mode is None and _backend(env_cfg) == "envpool" and envpool_backend.installed():
        # the simulator and options it trained on; without EnvPool here (a checkpoint evaluated on another
        # machine) and for frames (EnvPool draws none), the gymnasium env of the same id
        if action_mask is not None:
            raise EnvError("action masks are not supported with env.backend=envpool")
        return _envpool_call(envpool_backend.PoolEnv, env_cfg)
    preprocess = _preprocess(env_cfg)
    factory = _import_env_module(env_id)
    if extra_for(env_id) == "mujoco":
        mujoco_warnings_once()
    # An unregistered `module:factory` goes through gym.make too (as a spec of its own), so it gets the
    # same time limit, render mode and env checker as a registered id.
    target: Any = (
        env_id if factory is None else EnvSpec(id=env_id, entry_point=_GymnasiumFactory(env_id, factory))
    )
    kwargs: dict[str, Any] = dict(OmegaConf.to_container(env_cfg.kwargs, resolve=True) or {})
    if preprocess == "atari":
        kwargs = atari.gym_make_kwargs(kwargs)
    limit = None if env_cfg.max_episode_steps is None else int(env_cfg.max_episode_steps)
    if limit is not None and preprocess != "atari":  # Atari's counts agent steps: `wrap_atari` sets it
        kwargs["max_episode_steps"] = limit
    if render_mode is not None:
        kwargs["render_mode"] = render_mode
    try:
        env = gym.make(target, **kwargs)
    except gym.error.DependencyNotInstalled as exc:
        extra = extra_for(env_id)
        hint = f"pip install 'ppo-fabric[{extra}]'" if extra else error_line(exc)
        raise EnvError(f"env.id={env_id!r} needs an optional dependency: {hint}") from exc
    except (gym.error.NameNotFound, gym.error.VersionNotFound, gym.error.UnregisteredEnv) as exc:
        close = difflib.get_close_matches(env_id.split(":")[-1], list(gym.registry), n=3, cutoff=0.75)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see gymnasium.pprint_registry()"
        raise EnvError(f"env.id={env_id!r} is not a registered gymnasium environment{hint}") from exc
    except gym.error.Error as exc:
        raise EnvError(f"env.id={env_id!r}: {error_line(exc)}") from exc
    except EnvError:
        raise  # a factory's result refused in one line already (_GymnasiumFactory)
    except TypeError as exc:
        raise EnvError(f"env.id={env_id!r} rejected env.kwargs: {error_line(exc)}") from exc
    except (ValueError, AssertionError) as exc:  # a value the env refuses (LunarLander's gravity=5)
        if not env_cfg.kwargs:
            raise  # the env's own failure, not the user's kwargs: its traceback is what helps
        given = OmegaConf.to_container(env_cfg.kwargs, resolve=True)
        raise EnvError(
            f"env.id={env_id!r} with env.kwargs={given}: {type(exc).__name__}: {error_line(exc)}"
        ) from exc
    env = StepFlags(env)  # below ActionRepeat, which ends its repeats on them
    try:
        mode = mask_velocity_mode(env_cfg.mask_velocity)
        if mode is not None:
            env = MaskVelocity(env, env_id, mode)
        noise = float(env_cfg.observation_noise or 0.0)
        if noise != 0.0:
            env = ObservationNoise(env, noise)
    except EnvError:
        env.close()
        raise
    if preprocess == "atari":
        try:
            env = atari.wrap_atari(env, limit)
        except (ValueError, gym.error.DependencyNotInstalled) as exc:
            env.close()
            raise EnvError(
                f"env.id={env_id!r} with env.preprocess=atari: {str(exc).splitlines()[0]}"
            ) from exc
    if int(env_cfg.action_repeat) > 1:
        env = ActionRepeat(env, int(env_cfg.action_repeat))
    if action_mask is not None:
        env = ActionMaskInfo(env, action_mask)
    return env


def _preprocess(env_cfg: DictConfig) -> str:
    """`env.preprocess`, checked here so a typo fails at validation."""
    preprocess = str(env_cfg.preprocess)
    if preprocess not in atari.PREPROCESSORS:
        raise EnvError(f"env.preprocess={preprocess!r} is not one of {', '.join(atari.PREPROCESSORS)}")
    return preprocess


def rank_seed(seed: int, rank: int) -> int:
    """The seed of one rank of a run seeded `seed`: `seed` itself for rank 0, for a later rank one drawn
    from (seed, rank). Never `seed + rank`: rank 1 of seed 1 would be rank 0 of seed 2, and runs over
    seeds 1-10 with several ranks would share envs and action noise."""
    if rank == 0:
        return seed
    return int(np.random.SeedSequence([seed, rank]).generate_state(1, dtype=np.uint32)[0])


def env_seeds(seed: int, rank: int, num_envs: int) -> list[int]:
    """Distinct, reproducible seeds for the envs of one rank, derived from `rank_seed(seed, rank)`."""
    seq = np.random.SeedSequence(rank_seed(seed, rank))
    return [int(s) for s in seq.generate_state(num_envs, dtype=np.uint32)]


def make_vector_env(
    env_cfg: DictConfig,
    seed: int,
    rank: int,
    gamma: float = 0.99,
    reduce: Reduce | None = None,
    action_mask: int | None = None,
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

    With `action_mask` (a width) every env copy reports its mask in the infos (`ActionMaskInfo`); the mask
    of the first observations is `current_action_masks(envs)`.
    """
    envs = _backend_vector_env(env_cfg, action_mask)  # with episode statistics (Atari: whole games)
    if env_cfg.normalize_obs:
        envs = NormalizeObservation(envs)
    if env_cfg.normalize_reward:
        envs = NormalizeReward(envs, gamma)
    seeds = env_seeds(seed, rank, int(env_cfg.num_envs))
    obs, _ = envs.reset(seed=seeds)
    warmup = int(env_cfg.normalize_warmup or 0)
    if warmup > 0 and normalizers(envs):
        masks = (lambda: current_action_masks(envs)) if action_mask is not None else None
        warm_up(envs, warmup, warmup_seed(seed, rank), reduce, masks)
        # The same seeds again: the run's episodes start exactly where a run without warm-up starts them.
        if _preprocess(env_cfg) == "atari" and _backend(env_cfg) == "gymnasium":
            # a game mid-way resets for real (not a lost life's no-op), seed and all
            envs.unwrapped.call("end_game")
        obs, _ = envs.reset(seed=seeds)
        discard_pending(envs)  # these reset observations were counted by the warm-up already
    envs.action_space.seed(seeds[0])
    return envs, first_observations(envs, obs, reduce)


def _backend_vector_env(env_cfg: DictConfig, action_mask: int | None) -> VectorEnv:
    """The vector env of `env.backend`, same-step autoreset, wrapped with its episode statistics."""
    if _backend(env_cfg) == "envpool":
        if action_mask is not None:
            raise EnvError("action masks are not supported with env.backend=envpool")
        return _envpool_call(envpool_backend.make_vector, env_cfg)
    # partial, not a lambda: the vector env keeps its factories, and checkpoints pickle the vector env.
    args = (env_cfg,) if action_mask is None else (env_cfg, None, action_mask)
    fns: list[Callable[[], gym.Env]] = [partial(make_env, *args) for _ in range(int(env_cfg.num_envs))]
    if on_error(env_cfg) == "restart":  # each sub-env rebuilt from its factory when it fails (guard.py)
        fns = [partial(restartable, fn) for fn in fns]
    if env_cfg.vector == "async":
        fns = [partial(built_in_worker, fn, os.getpid()) for fn in fns]
        try:
            vector: VectorEnv = AsyncVectorEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP)
        except LOST_WORKER:  # gymnasium asks every worker for its spaces as it starts them
            causes = worker_build_failures(len(fns))
            if not causes:
                raise
            raise EnvFault(
                f"env.vector=async: the env could not be built in {len(causes)} of its {len(fns)} worker "
                f"processes (it was in the run's own): {causes[0]}; env.vector=sync builds every env in the "
                "run's process"
            ) from None
    else:
        vector = SyncVectorEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP)
    if isinstance(vector, AsyncVectorEnv):
        ASYNC_POOLS.add(vector)
    # Raw values are checked below everything else, normalisation included (guard.py); EnvPool's vector
    # envs check their own.
    return atari.wrap_vector(FiniteCheck(vector), _preprocess(env_cfg))


def end_env_workers() -> None:
    """Kill the worker processes of this process's async vector envs, on the way out of a run that failed:
    left behind, each found its pipe closed and printed an EOFError and a BrokenPipeError traceback under
    the run's one line. SIGKILL: a forked worker inherited the run's SIGTERM handler, which only asks the
    run to stop. Never raises."""
    for vector in list(ASYNC_POOLS):
        for process in vector.processes:
            with contextlib.suppress(Exception):
                if process.is_alive():
                    process.kill()
        # closed as far as gymnasium knows: its __del__ no longer waits on the dead workers' pipes (a
        # "pending call to step" warning and an EOFError traceback when the caller's interpreter exits)
        vector.closed = True


def on_error(env_cfg: DictConfig) -> str:
    """`env.on_error`, checked."""
    value = str(env_cfg.on_error)
    if value not in ON_ERROR:
        raise EnvError(f"env.on_error={value!r} is not one of {', '.join(ON_ERROR)}")
    return value


def restart_note(env_cfg: DictConfig, multiagent: bool = False) -> str | None:
    """The start-up line of a run that asked for `env.on_error=restart` on a backend that cannot rebuild one
    env of its vector env (EnvPool's pool, the PettingZoo vector envs); None where restarts work."""
    if on_error(env_cfg) != "restart":
        return None
    if multiagent:
        return (
            "env.on_error=restart: PettingZoo training envs are not rebuilt one at a time; an env error "
            "in training ends the run (one in an evaluation leaves that evaluation out)"
        )
    if _backend(env_cfg) == "envpool":
        return "env.on_error=restart: EnvPool cannot rebuild one env of its pool; an env error ends the run"
    return None


def _backend(env_cfg: DictConfig) -> str:
    return _envpool_call(envpool_backend.backend, env_cfg)


def _envpool_call(fn: Callable[..., Any], *args: Any) -> Any:
    """EnvPool's errors as EnvError, so config checks turn them into one line and exit 2."""
    try:
        return fn(*args)
    except envpool_backend.EnvPoolError as exc:
        raise EnvError(str(exc)) from exc


def warmup_seed(seed: int, rank: int) -> int:
    """The seed of the normalisation warm-up's random actions: reproducible per run and rank, and a stream
    apart from `env_seeds` (a child of the same seed sequence)."""
    child = np.random.SeedSequence(rank_seed(seed, rank)).spawn(1)[0]
    return int(child.generate_state(1, dtype=np.uint32)[0])


def probe_spaces(env_cfg: DictConfig) -> tuple[gym.Space, gym.Space]:
    """Build one env to validate the id and read its spaces before any process or vector env starts."""
    with probing(env_cfg):
        env = make_env(env_cfg)
        try:
            return env.observation_space, env.action_space
        finally:
            env.close()


def probe_env(env_cfg: DictConfig, action_mask: str = "auto") -> tuple[gym.Space, gym.Space, int | None]:
    """`probe_spaces`, and the action mask width with `algo.action_mask=auto` when the env provides masks
    (None otherwise); the observation space is then the one the policy sees (a Dict observation's
    `action_mask` key removed). With `env.backend=envpool` the spaces are the pool's (no action masks)."""
    if _backend(env_cfg) == "envpool":
        return (*_envpool_call(envpool_backend.probe, env_cfg), None)
    with probing(env_cfg):
        env = make_env(env_cfg)
        try:
            width = detect_action_mask(env) if action_mask == "auto" else None
            obs_space = (
                env.observation_space if width is None else ActionMaskInfo(env, width).observation_space
            )
            return obs_space, env.action_space, width
        finally:
            env.close()


@contextmanager
def probing(env_cfg: DictConfig) -> Iterator[None]:
    """The env's own failure while it is built, read or closed before the run (a RuntimeError of its
    constructor, an OSError of its `close`) as one line naming it, as its failures during the run are;
    PPO_FABRIC_TRACEBACK=1 lets it through with its traceback."""
    try:
        yield
    except EnvError:
        raise
    except Exception as exc:
        if os.environ.get("PPO_FABRIC_TRACEBACK"):
            raise
        raise EnvError(
            f"env.id={env_cfg.id!r} raised {type(exc).__name__}: {error_line(exc)} while it was built, read "
            "or closed for the checks (PPO_FABRIC_TRACEBACK=1 shows where)"
        ) from exc


def close_envs(envs: Any, what: str = "the envs") -> None:
    """Close a run's envs at its end or stop, its results already written: an env whose `close` raises
    costs a warning line, not the run's summary (Hydra printed a traceback and the summary was lost)."""
    PROGRESS.mark(f"closing {what}")
    try:
        envs.close()
    except Exception as exc:
        warnings.warn(
            f"ppo-fabric: closing {what} raised {type(exc).__name__}: {error_line(exc)}", stacklevel=2
        )


def current_action_masks(envs: Any) -> np.ndarray:
    """[E, width] masks of the vector env's current observations (its copies wrapped in ActionMaskInfo)."""
    return np.stack(envs.unwrapped.call("current_action_mask")).astype(bool)


def check_normalizable(env_cfg: DictConfig, obs_space: gym.Space) -> None:
    """`env.normalize_obs=true` needs observations with one shape that are stored as floats: the rollout
    keeps pixels (uint8 Boxes of rank 2 or 3, `agent.is_image_space`) as uint8, where normalised values
    would be truncated to garbage, and Dict observations have no single shape for the running statistics.
    Raises EnvError, one line naming the key."""
    if not env_cfg.normalize_obs:
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


def env_action(action: np.ndarray) -> Any:
    """One agent's action as PettingZoo envs expect it: a Python int for a discrete action (some games
    compare it with `in range(...)` or index lists with it), the array otherwise."""
    return (
        int(action)
        if np.ndim(action) == 0 and np.issubdtype(np.asarray(action).dtype, np.integer)
        else action
    )


def in_space_dtype(actions: np.ndarray, dtype: np.dtype | None) -> np.ndarray:
    """`actions` in the action space's `dtype` (None: as they are), in training, evaluation and `predict`.
    Sampled as int64 or float32, they were refused by an env checking `action_space.contains`
    (Discrete(3, dtype=int32), a float16 Box), and one that does not check got actions outside its space.
    (An integer Box, whose float actions a cast would truncate, is refused before a run: `check`.)"""
    if dtype is None or actions.dtype == dtype:
        return actions
    return actions.astype(dtype, copy=False)
