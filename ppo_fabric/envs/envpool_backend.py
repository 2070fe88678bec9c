"""EnvPool as a collection backend (`env.backend=envpool`): C++ envs stepped on their own threads, seen by the
rest of the package exactly as the gymnasium vector env of `envs.make_vector_env`.

What the rollout relies on and how the pool is made to give it:

- **Same-step autoreset.** EnvPool resets an env on the step *after* it ended (next-step autoreset: that
  step's action is ignored, its reward is 0). The rollout bootstraps a truncated episode from
  `info["final_obs"]` of the step that ended it and expects the returned observation to be the next
  episode's first one, so `EnvPoolVectorEnv.step` steps the ended envs once more at once (`env_id` = the
  ended ones), returns their reset observations and puts the last ones in `final_obs` / `_final_obs`.
  That extra step is EnvPool's own reset, so for Atari a lost life continues the game and only game over
  restarts it, as with our gymnasium wrappers.
- **Episode statistics.** Classic control and MuJoCo: gymnasium's vector `RecordEpisodeStatistics` wraps
  this env as it wraps the gymnasium one. Atari: whole games with the raw score, accumulated here from
  EnvPool's unclipped `info["reward"]` until `info["terminated"]` (game over) or truncation, the length
  being the game's agent steps (`info["elapsed_step"]`).
- **Seeding.** EnvPool seeds its envs when the pool is built (`reset(seed=...)` cannot re-seed it), so the
  pool is built on the first seeded reset with `envs.env_seeds(seed, rank, n)` as per-env seeds, and rebuilt
  when a later seeded reset must start over (the normalisation warm-up's second reset): the run then starts
  exactly where a run without warm-up starts, as with the gymnasium backend.
- **Atari preprocessing** is EnvPool's own, configured to match `atari.wrap_atari` (`atari_options`).

Async pools (`env.envpool.batch_size` B below `env.num_envs` E, which B must divide): `AsyncEnvPoolVectorEnv`
keeps the E-row vector API, and one vector step (a *tick*) is one `send` of the B ready envs' actions and as
many `recv`s as it takes to have B envs ready again; only those act at the next tick (`info["alive"]`). An
env's result reaches the rollout at the tick its `recv` arrives, like a turn-based player's outcome after
the opponent's move (`rollout.credit_waiting`), and the same rules hold per env: same-step autoreset (an
ended env's reset is sent at once and it acts again from the next episode's first observation), the final
observation in `final_obs`, episode statistics of its own (per env, only for received steps).

The pool cannot be pickled, so a checkpoint holds no env state and a resumed run starts fresh episodes
(normalisation statistics are restored). Single envs (evaluation) are one-env pools: `PoolEnv`.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from collections import deque
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space
from omegaconf import DictConfig, OmegaConf

from ppo_fabric.config.values import acting_envs
from ppo_fabric.envs.guard import check_step, error_line
from ppo_fabric.envs.traits import ASYNC_POOL, GYMNASIUM

BACKENDS = ("gymnasium", "envpool")
INSTALL_HINT = "pip install 'ppo-fabric[envpool]'"
SEED_MASK = 0x7FFFFFFF  # EnvPool takes int32 seeds; env_seeds draws uint32


class EnvPoolError(ValueError):
    """A setting the EnvPool backend cannot serve; the message is one line for the user."""


def backend(env_cfg: DictConfig) -> str:
    """`env.backend`, checked so a typo fails at validation."""
    name = str(env_cfg.backend)
    if name not in BACKENDS:
        raise EnvPoolError(f"env.backend={name!r} is not one of {', '.join(BACKENDS)}")
    return name


def installed() -> bool:
    """Whether EnvPool can be looked for here (found: `import_envpool` says why it fails, if it does)."""
    return importlib.util.find_spec("envpool") is not None


def import_envpool() -> Any:
    """EnvPool, or one line saying whether it is missing or installed without a dependency of its own (a
    wheel copied to an offline machine without dm-env or optree is found, then fails to import)."""
    try:
        return importlib.import_module("envpool")
    except ImportError as exc:
        if getattr(exc, "name", None) not in (None, "envpool"):
            raise EnvPoolError(
                f"env.backend=envpool: EnvPool is installed but does not import ({exc}); {INSTALL_HINT}"
            ) from exc
        raise EnvPoolError(f"env.backend=envpool needs EnvPool: {INSTALL_HINT}") from exc


def task_id(env_id: str) -> str:
    """EnvPool's name for a gymnasium id: `ALE/Pong-v5` -> `Pong-v5`, others unchanged."""
    return env_id[len("ALE/") :] if env_id.startswith("ALE/") else env_id


def is_atari(env_id: str) -> bool:
    return env_id.startswith("ALE/")


def _settings(env_cfg: DictConfig) -> dict[str, Any]:
    return dict(OmegaConf.to_container(env_cfg.envpool, resolve=True) or {})


def check_settings(env_cfg: DictConfig) -> None:
    """Refuse what the backend cannot do, one line each, before any pool is built."""
    env_id = str(env_cfg.id)
    num_envs = int(env_cfg.num_envs)
    batch = _settings(env_cfg).get("batch_size")
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0):
        raise EnvPoolError(f"env.envpool.batch_size={batch!r} must be a whole number > 0 (or null)")
    if batch is not None and batch > num_envs:
        raise EnvPoolError(f"env.envpool.batch_size={batch} exceeds env.num_envs={num_envs}")
    if batch is not None and batch < num_envs:
        _check_async(env_cfg, batch, num_envs)
    threads = _settings(env_cfg)["num_threads"]
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise EnvPoolError(f"env.envpool.num_threads={threads!r} must be a whole number >= 0 (0: EnvPool's)")
    if ":" in env_id:
        raise EnvPoolError(
            f"env.id={env_id!r} is a Python module's env; env.backend=envpool has only its own"
        )
    preprocess = str(env_cfg.preprocess)
    if is_atari(env_id) and preprocess != "atari":
        raise EnvPoolError(
            f"env.id={env_id!r} with env.backend=envpool always preprocesses; set env.preprocess=atari"
        )
    if preprocess == "atari" and not is_atari(env_id):
        raise EnvPoolError("env.preprocess=atari needs an ALE environment (env.id=ALE/<Game>-v5)")
    for key, off in (("action_repeat", 1), ("mask_velocity", False), ("observation_noise", 0.0)):
        if env_cfg.get(key, off) not in (off, None):
            raise EnvPoolError(f"env.{key}={env_cfg.get(key)} is not supported with env.backend=envpool")
    envpool = import_envpool()
    if task_id(env_id) not in envpool.list_all_envs():
        raise EnvPoolError(
            f"env.id={env_id!r} is not available with env.backend=envpool; use env.backend=gymnasium for it "
            "(envpool.list_all_envs() lists EnvPool's)"
        )


def _check_async(env_cfg: DictConfig, batch: int, num_envs: int) -> None:
    """What an async pool needs: B dividing E, so that a `recv` (which waits for B envs) always has at
    least B envs in flight; no normalisers, whose statistics would count the rows that did not step."""
    if num_envs % batch:
        raise EnvPoolError(
            f"env.envpool.batch_size={batch} must divide env.num_envs={num_envs} for async collection "
            f"(each recv waits for {batch} envs); use e.g. env.num_envs={2 * batch}"
        )
    for key in ("normalize_obs", "normalize_reward"):
        if env_cfg.get(key, False):
            raise EnvPoolError(
                f"env.{key}=true is not supported with async collection (env.envpool.batch_size={batch} < "
                f"env.num_envs={num_envs}); set env.{key}=false or env.envpool.batch_size=null"
            )


def is_async(env_cfg: DictConfig) -> bool:
    """Whether the run collects from an async pool (only `env.envpool.batch_size` envs act per step)."""
    return acting_envs(env_cfg) < int(env_cfg.num_envs)


def atari_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """EnvPool's Atari options equal to `atari.wrap_atari` on ALE v5: sticky actions 0.25, up to 30 no-op
    resets, frame skip 4 with max-pooling (EnvPool always max-pools the last two frames), a lost life ends
    the learner's episode, FIRE on reset, 84x84 grayscale by area interpolation, rewards clipped to their
    sign (raw ones in `info["reward"]`), 4 stacked frames, 27,000 agent steps (ALE's 108,000 frames).
    `env.kwargs` override them (e.g. repeat_action_probability=0 for the v4 dynamics)."""
    from ppo_fabric.envs import atari

    base = {
        "repeat_action_probability": 0.25,
        "noop_max": 30,
        "frame_skip": 4,
        "episodic_life": True,
        "use_fire_reset": True,
        "img_height": atari.SCREEN_SIZE,
        "img_width": atari.SCREEN_SIZE,
        "gray_scale": True,
        "use_inter_area_resize": True,
        "reward_clip": True,
        "stack_num": atari.FRAME_STACK,
        "zero_discount_on_life_loss": False,
        "max_episode_steps": 27_000,
    }
    return base | kwargs


def pool_kwargs(env_cfg: DictConfig) -> dict[str, Any]:
    """`envpool.make` arguments besides the seeds: the mapped Atari options, `env.kwargs`, the limits."""
    kwargs: dict[str, Any] = dict(OmegaConf.to_container(env_cfg.kwargs, resolve=True) or {})
    if is_atari(str(env_cfg.id)):
        kwargs = atari_options(kwargs)
    if env_cfg.max_episode_steps is not None:
        kwargs["max_episode_steps"] = int(env_cfg.max_episode_steps)
    threads = int(env_cfg.envpool.num_threads or 0)
    if threads:
        kwargs["num_threads"] = threads
    return kwargs


def make_pool(
    env_cfg: DictConfig, num_envs: int, seeds: list[int] | None, batch_size: int | None = None
) -> Any:
    """A gymnasium-API pool, sync unless `batch_size` < `num_envs`; raises EnvPoolError naming the id and
    the backend."""
    envpool = import_envpool()
    env_id = str(env_cfg.id)
    kwargs = pool_kwargs(env_cfg)
    if seeds is not None:
        kwargs["env_seed"] = [int(s) & SEED_MASK for s in seeds]
    try:
        with warnings.catch_warnings():  # EnvPool's float64 bounds cast to float32 Boxes: nothing to act on
            warnings.simplefilter("ignore", UserWarning)
            pool = envpool.make(
                task_id(env_id),
                env_type="gymnasium",
                num_envs=num_envs,
                batch_size=batch_size or num_envs,
                **kwargs,
            )
            pool.observation_space, pool.action_space  # noqa: B018 (built and cached here, warnings muted)
            return pool
    except (
        Exception
    ) as exc:  # EnvPool raises assorted types (AssertionError, KeyError, TypeError) for bad kwargs
        raise EnvPoolError(
            f"env.id={env_id!r} with env.backend=envpool rejected its options: {error_line(exc)}"
        ) from exc


def probe(env_cfg: DictConfig) -> tuple[gym.Space, gym.Space]:
    """Check the settings and read one env's spaces: gymnasium's own where it can build the env and they
    have the pool's shapes (so checkpoints move between backends, and bounds EnvPool gets wrong, such as
    LunarLander's, are right), else the pool's with Box actions as float32 (gymnasium's convention)."""
    check_settings(env_cfg)
    pool = make_pool(env_cfg, 1, None)
    try:
        obs_space, act_space = pool.observation_space, pool.action_space
    finally:
        pool.close()
    reference = _gymnasium_spaces(env_cfg)
    if (
        reference is not None
        and _same_layout(reference[0], obs_space)
        and _same_layout(reference[1], act_space)
    ):
        return reference
    if isinstance(act_space, gym.spaces.Box) and act_space.dtype == np.float64:
        act_space = gym.spaces.Box(
            act_space.low.astype(np.float32), act_space.high.astype(np.float32), act_space.shape, np.float32
        )
    return obs_space, act_space


def _gymnasium_spaces(env_cfg: DictConfig) -> tuple[gym.Space, gym.Space] | None:
    """The spaces gymnasium gives the same id and kwargs (not for Atari: the preprocessing makes its
    spaces, which EnvPool's equal), or None where gymnasium cannot build it here."""
    env_id = str(env_cfg.id)
    if is_atari(env_id):
        return None
    kwargs = dict(OmegaConf.to_container(env_cfg.kwargs, resolve=True) or {})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            env = gym.make(env_id, **kwargs)
    except Exception:  # not registered, a missing simulator, kwargs gymnasium names otherwise: use EnvPool's
        return None
    try:
        return env.observation_space, env.action_space
    finally:
        env.close()


def _same_layout(a: gym.Space, b: gym.Space) -> bool:
    """Same kind of space and shape (Discrete: same n); bounds and float widths may differ."""
    if type(a) is not type(b) or a.shape != b.shape:
        return False
    return not isinstance(a, gym.spaces.Discrete) or a.n == b.n


class EnvPoolVectorEnv(VectorEnv):
    """A sync EnvPool behind gymnasium's VectorEnv API with same-step autoreset (module docstring)."""

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}

    def __init__(self, env_cfg: DictConfig) -> None:
        check_settings(env_cfg)
        self.env_cfg = env_cfg
        self.num_envs = int(env_cfg.num_envs)
        self.games = is_atari(str(env_cfg.id))  # report whole games with the raw score
        obs_space, act_space = probe(env_cfg)
        self.single_observation_space = obs_space
        self.single_action_space = act_space
        self.observation_space = batch_space(obs_space, self.num_envs)
        self.action_space = batch_space(act_space, self.num_envs)
        self.pool: Any = None
        self.seeds: list[int] | None = None
        self.stepped = False  # whether the pool was reset or stepped since it was built (a seeded reset then
        # rebuilds it: EnvPool cannot re-seed a pool)
        self.game_returns = np.zeros(self.num_envs, dtype=np.float64)
        self._reset_action = np.zeros((self.num_envs, *act_space.shape), dtype=act_space.dtype)

    batch_size: int | None = None  # envs per recv: None (all) for this sync pool
    traits = GYMNASIUM  # every env acts at every step (`AsyncEnvPoolVectorEnv`: only some)

    def _build(self, seeds: list[int] | None) -> None:
        if self.pool is not None:
            self.pool.close()
        self.pool = make_pool(self.env_cfg, self.num_envs, seeds, self.batch_size)
        self.seeds = seeds
        self.stepped = False

    def _seeded_pool(self, seed: int | list[int] | None, rebuild: bool = False) -> None:
        """A seed (a list: one per env; an int: seed + i) rebuilds the pool seeded so, unless it was just
        built with those seeds and has not moved since; `rebuild`: rebuild it in any case once it moved."""
        seeds = None
        if isinstance(seed, (list, tuple)):
            seeds = [int(s) for s in seed]
        elif seed is not None:
            seeds = [int(seed) + i for i in range(self.num_envs)]
        moved = self.stepped and (seeds is not None or rebuild)
        if self.pool is None or (seeds is not None and seeds != self.seeds) or moved:
            self._build(seeds if seeds is not None else self.seeds if rebuild else None)

    def reset(
        self, *, seed: int | list[int] | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Reset every env (`_seeded_pool` says when the pool is rebuilt)."""
        self._seeded_pool(seed)
        obs, _ = self.pool.reset()
        self.stepped = True  # a second reset of the same pool would not repeat this one
        self.game_returns[:] = 0.0
        obs = self._as_space(obs)
        check_step(obs, np.zeros(self.num_envs), {})
        return obs, {}

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        obs, rewards, terminated, truncated, info = self.pool.step(np.asarray(actions))
        terminated = np.asarray(terminated, dtype=bool)
        truncated = np.asarray(truncated, dtype=bool)
        out: dict[str, Any] = {}
        if self.games:
            self._count_games(info, truncated, out)
        done = terminated | truncated
        if done.any():
            ids = np.flatnonzero(done).astype(np.int32)
            final = np.empty(self.num_envs, dtype=object)
            obs = np.array(obs)  # our own copy: the ended rows are replaced below
            for j in ids:
                final[j] = obs[j].copy()
            # EnvPool resets an ended env on its next step (the action is ignored): take that step now.
            reset_obs, _, _, _, reset_info = self.pool.step(self._reset_action[: ids.size], ids)
            order = np.asarray(reset_info["env_id"])
            obs[order] = reset_obs
            if (
                self.games
            ):  # a soft reset after a lost life may press FIRE: its raw reward belongs to the game
                self.game_returns[order] += np.asarray(reset_info["reward"], dtype=np.float64)
            out["final_obs"] = final
            out["_final_obs"] = done
        obs, rewards = self._as_space(obs), np.asarray(rewards, dtype=np.float64)
        check_step(obs, rewards, out)  # raw values, before any normalisation (envs/guard.py)
        return obs, rewards, terminated, truncated, out

    def _as_space(self, obs: np.ndarray) -> np.ndarray:
        """Observations in the dtype of the space the policy was built for (no copy when it is the pool's)."""
        return obs.astype(self.single_observation_space.dtype, copy=False)

    def _count_games(self, info: dict[str, Any], truncated: np.ndarray, out: dict[str, Any]) -> None:
        """Whole games with the raw score as `info["episode"]` / `info["_episode"]`."""
        self.game_returns += np.asarray(info["reward"], dtype=np.float64)
        over = np.asarray(info["terminated"], dtype=bool) | truncated
        if over.any():
            lengths = np.asarray(info["elapsed_step"], dtype=np.int64)
            out["episode"] = {
                "r": np.where(over, self.game_returns, 0.0),
                "l": np.where(over, lengths, 0),
                "t": np.zeros(self.num_envs),
            }
            out["_episode"] = over
            self.game_returns[over] = 0.0

    def close_extras(self, **kwargs: Any) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("an EnvPool cannot be pickled; resumed runs start fresh episodes")


class AsyncEnvPoolVectorEnv(EnvPoolVectorEnv):
    """An async EnvPool (B = `env.envpool.batch_size` of E = `env.num_envs` envs per `recv`) behind the
    E-row vector API, one step per *tick* (module docstring).

    `step` takes actions for all E rows and uses those of the `alive` rows only (B of them, the ones that
    were ready longest); every returned array has E rows, and a row holds a result only where that env's
    `recv` arrived during this tick. What each row means after a step:

    - `obs`: the env's latest observation (the next episode's first one after an end); stale for envs in
      flight, which do not act until their result arrives.
    - rewards / terminated / truncated: the result of the env's last action where it arrived at this tick
      (EnvPool's own reset steps are not transitions: reward 0, not counted, as the sync pool's).
    - `info["alive"]`: the B envs that act at the next tick; `info["settled"]`: envs whose latest
      observation is known (not in flight), which the rollout's tail bootstraps from;
      `info["final_obs"]` / `info["episode"]` as the sync pool gives them, per env.

    A `recv` returns B envs; an ended env's reset step is sent at once and it is ready again when that
    arrives, so a tick may `recv` more than once and envs may be ready beyond the B that act next (they
    wait, oldest first). With B dividing E, fewer than B envs are ready whenever a `recv` is due, so at
    least E - B + 1 >= B are in flight and the `recv` returns. The order in which envs come back depends on
    the threads' timing: an async run is not reproducible step for step, unlike a sync one.
    """

    traits = ASYNC_POOL

    def __init__(self, env_cfg: DictConfig) -> None:
        super().__init__(env_cfg)
        self.batch_size = acting_envs(env_cfg)
        n, space = self.num_envs, self.single_observation_space
        self.obs = np.zeros((n, *space.shape), dtype=space.dtype)  # each env's latest observation
        self.alive = np.zeros(n, dtype=bool)  # envs that act at the next step
        self.settled = np.zeros(n, dtype=bool)  # envs not in flight
        self.resetting = np.zeros(n, dtype=bool)  # envs in flight with EnvPool's reset step
        self.ready: deque[int] = deque()  # settled envs that do not act next, oldest first
        self.returns = np.zeros(n, dtype=np.float64)  # the running episode's return and length per env
        self.lengths = np.zeros(n, dtype=np.int64)

    def reset(
        self, *, seed: int | list[int] | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Reset every env and wait for the first B. A pool that has moved is rebuilt (envs in flight
        cannot be called back), with the given seeds or, unseeded, its previous ones."""
        self._seeded_pool(seed, rebuild=True)
        self.pool.async_reset()
        self.stepped = True
        for array in (self.obs, self.alive, self.settled, self.resetting, self.returns, self.lengths):
            array[...] = 0
        self.resetting[:] = True  # every env's first observation comes back as a reset step's
        self.game_returns[:] = 0.0
        self.ready.clear()
        self._receive(_Results(self.num_envs))
        obs = self._as_space(self.obs.copy())
        check_step(obs, np.zeros(self.num_envs), {})
        return obs, self._info({})

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        acting = np.flatnonzero(self.alive).astype(np.int32)
        self.pool.send(np.asarray(actions)[acting], acting)
        self.settled[acting] = False
        self.alive[acting] = False
        results = _Results(self.num_envs)
        self._receive(results)
        out: dict[str, Any] = {}
        if results.ended.any():
            out["final_obs"], out["_final_obs"] = results.final_obs, results.ended
        if results.finished.any():
            out["episode"] = {"r": results.ep_r, "l": results.ep_l, "t": np.zeros(self.num_envs)}
            out["_episode"] = results.finished
        obs = self._as_space(self.obs.copy())
        check_step(obs, results.rewards, out)
        return obs, results.rewards, results.terminated, results.truncated, self._info(out)

    def _info(self, out: dict[str, Any]) -> dict[str, Any]:
        return out | {"alive": self.alive.copy(), "settled": self.settled.copy()}

    def _receive(self, results: _Results) -> None:
        """`recv` until B envs are ready, then the B that were ready longest act next."""
        while len(self.ready) < self.batch_size:
            obs, rewards, terminated, truncated, info = self.pool.recv()
            self._take(np.asarray(info["env_id"]), obs, rewards, terminated, truncated, info, results)
        for _ in range(self.batch_size):
            self.alive[self.ready.popleft()] = True

    def _take(
        self,
        ids: np.ndarray,
        obs: np.ndarray,
        rewards: np.ndarray,
        terminated: np.ndarray,
        truncated: np.ndarray,
        info: dict[str, Any],
        results: _Results,
    ) -> None:
        """One `recv`'s envs: record the results of their actions, send the ended ones' reset steps."""
        terminated = np.asarray(terminated, dtype=bool)
        truncated = np.asarray(truncated, dtype=bool)
        stepped = ~self.resetting[ids]  # the others return from a reset step: a first observation
        self.resetting[ids] = False
        self.obs[ids] = obs
        if self.games:  # a soft reset after a lost life may press FIRE: its raw reward belongs to the game
            self.game_returns[ids] += np.asarray(info["reward"], dtype=np.float64)
        ended = stepped & (terminated | truncated)
        rows = ids[stepped]
        results.rewards[rows] = np.asarray(rewards, dtype=np.float64)[stepped]
        results.terminated[rows] = terminated[stepped]
        results.truncated[rows] = truncated[stepped]
        if self.games:
            over = stepped & (np.asarray(info["terminated"], dtype=bool) | truncated)
            lengths = np.asarray(info["elapsed_step"], dtype=np.int64)
            for j in np.flatnonzero(over):
                results.finish(int(ids[j]), self.game_returns[ids[j]], int(lengths[j]))
                self.game_returns[ids[j]] = 0.0
        else:
            self.returns[rows] += results.rewards[rows]
            self.lengths[rows] += 1
            for e in ids[ended]:
                results.finish(int(e), self.returns[e], int(self.lengths[e]))
                self.returns[e], self.lengths[e] = 0.0, 0
        for j in np.flatnonzero(ended):
            results.final_obs[ids[j]] = self._as_space(obs[j].copy())
            results.ended[ids[j]] = True
        done = ids[ended].astype(np.int32)
        if done.size:  # EnvPool resets an ended env on its next step (the action is ignored): send it now
            self.pool.send(self._reset_action[: done.size], done)
            self.resetting[done] = True
        back = ids[~ended]
        self.settled[back] = True
        self.ready.extend(int(e) for e in back)


class _Results:
    """What reached one tick's envs, E rows (`AsyncEnvPoolVectorEnv.step`)."""

    def __init__(self, n: int) -> None:
        self.rewards = np.zeros(n, dtype=np.float64)
        self.terminated = np.zeros(n, dtype=bool)
        self.truncated = np.zeros(n, dtype=bool)
        self.ended = np.zeros(n, dtype=bool)
        self.final_obs = np.empty(n, dtype=object)
        self.finished = np.zeros(n, dtype=bool)
        self.ep_r = np.zeros(n, dtype=np.float64)
        self.ep_l = np.zeros(n, dtype=np.int64)

    def finish(self, env: int, ret: float, length: int) -> None:
        self.finished[env], self.ep_r[env], self.ep_l[env] = True, ret, length


class PoolEnv(gym.Env):
    """One env of a one-env sync pool behind gymnasium's `Env` API: what `make_env` builds for a run on
    `env.backend=envpool` (its evaluation, `evaluate`, `Policy.make_env`), so an evaluation plays the
    simulator, the options (`+env.kwargs`) and the time limit training played, EnvPool-only ids included.

    `reset(seed=s)` starts from a pool seeded with `s`; `reset()` after a step that ended an episode goes on
    from the observation the pool's own reset gave (Atari: after a lost life the game goes on). Atari games
    report themselves as the gymnasium chain does (`whole_games`): a lost life ends the learner's episode,
    and the step that ends the game carries `info["episode"]` with its raw score and length."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, env_cfg: DictConfig) -> None:
        one = OmegaConf.merge(env_cfg, {"num_envs": 1, "envpool": {"batch_size": None}})
        self.pool = EnvPoolVectorEnv(one)
        self.observation_space = self.pool.single_observation_space
        self.action_space = self.pool.single_action_space
        self.whole_games = self.pool.games
        self._next: Any = None  # the observation the pool's reset gave after the last episode ended

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict]:
        if seed is None and self._next is not None:
            obs, self._next = self._next, None
            return obs, {}
        obs, _ = self.pool.reset(seed=None if seed is None else [int(seed)])
        self._next = None
        return obs[0], {}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        obs, rewards, terminated, truncated, info = self.pool.step(np.asarray(action)[None])
        out: dict[str, Any] = {}
        if info.get("_episode") is not None and info["_episode"][0]:
            out["episode"] = {"r": float(info["episode"]["r"][0]), "l": int(info["episode"]["l"][0])}
        ended = bool(terminated[0] or truncated[0])
        if ended:
            self._next = obs[0]
        last = info["final_obs"][0] if ended else obs[0]
        return last, float(rewards[0]), bool(terminated[0]), bool(truncated[0]), out

    def close(self) -> None:
        self.pool.close()


def make_vector(env_cfg: DictConfig) -> VectorEnv:
    """The pool wrapped with episode statistics (Atari: its own whole-game statistics, no wrapper; an async
    pool: its own per-env statistics, since gymnasium's wrapper would count rows that did not step)."""
    if is_async(env_cfg):
        return AsyncEnvPoolVectorEnv(env_cfg)
    envs = EnvPoolVectorEnv(env_cfg)
    if envs.games:
        return envs
    return gym.wrappers.vector.RecordEpisodeStatistics(envs, buffer_length=1)
