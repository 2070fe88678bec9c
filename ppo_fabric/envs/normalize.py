"""Observation and reward normalisation with statistics that are identical on every collecting rank.

Each vector-env wrapper normalises with *global* running statistics and adds what it sees to *pending*
sums (sum, sum of squares, count). At every rollout boundary `sync_normalizers` all-reduces the pending
sums over the collecting ranks and merges them into the global statistics the same way on every rank,
so all ranks always normalise alike and no data is counted twice. Values are clipped to +-10 after
normalising (as Stable-Baselines3's VecNormalize and CleanRL do).

The observation wrapper also normalises `info["final_obs"]` (same-step autoreset), so a truncated
episode bootstraps from the value of a normalised final observation like every other step.

Statistics of the reset observations alone are far too narrow (every CartPole reset lies within +-0.05),
so the first rollout of a fresh run would be mostly clipped. `warm_up` therefore steps the envs with
random actions before the first rollout, merges what it saw over the ranks, and the run proper then starts
from the same reset as it would without it (`envs.make_vector_env`); those steps are not training steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import VectorEnv, VectorWrapper

from ppo_fabric.envs.guard import EnvFault

CLIP = 10.0
EPS = 1e-8
Reduce = Callable[[np.ndarray], np.ndarray]  # sums a float64 vector over the collecting ranks


class RunningMoments:
    """Global mean/var/count plus the pending moments (count, mean, sum of squared deviations) of data not
    yet merged. Deviations, not raw sums of squares: the variance as mean of squares minus squared mean lost
    every digit of a dimension with a large offset (a timestamp, an absolute coordinate: N(1e9, 1) read as a
    variance of 114, and a normalised standard deviation of 0.1)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.mean = np.zeros(shape, np.float64)
        self.var = np.ones(shape, np.float64)
        self.count = 0.0
        self._reset_pending()

    def _reset_pending(self) -> None:
        self.p_mean = np.zeros_like(self.mean)
        self.p_m2 = np.zeros_like(self.mean)
        self.p_count = 0.0

    def observe(self, batch: np.ndarray) -> None:
        batch = np.asarray(batch, np.float64).reshape(-1, *self.mean.shape)
        n = batch.shape[0]
        if n == 0:
            return
        total = self.p_count + n
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow: `commit` ends the run in one line
            b_mean = batch.mean(0)
            delta = b_mean - self.p_mean
            self.p_m2 = (
                self.p_m2 + np.square(batch - b_mean).sum(0) + np.square(delta) * (self.p_count * n / total)
            )
            self.p_mean = self.p_mean + delta * (n / total)
        self.p_count = total

    def commit(self, reduce: Reduce | None) -> None:
        """Merge every rank's pending data into the global statistics (Chan et al.'s parallel update). Over
        ranks in two sums: the counts and sums first, for the mean of all the pending data; then each rank's
        squared deviations from that mean, so that no large offset is squared."""
        size, shape = self.mean.size, self.mean.shape
        n_here, mean_here, m2_here = self.p_count, self.p_mean, self.p_m2
        self._reset_pending()
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused below, in one line
            if reduce is None:
                n, b_mean, b_m2 = n_here, mean_here, m2_here
            else:
                sums = reduce(np.concatenate(((mean_here * n_here).ravel(), [n_here])))
                n = sums[-1]
                if n <= 0:
                    return
                b_mean = (sums[:size] / n).reshape(shape)
                b_m2 = reduce((m2_here + np.square(mean_here - b_mean) * n_here).ravel()).reshape(shape)
            if n <= 0:
                return
            total = self.count + n
            delta = b_mean - self.mean
            m2 = self.var * self.count + b_m2 + np.square(delta) * self.count * n / total
            mean, var = self.mean + delta * n / total, m2 / total
        if not (np.isfinite(mean).all() and np.isfinite(var).all()):  # finite values beyond ~1e154: their
            raise FloatingPointError("its running mean or variance overflowed")  # squares are inf in float64
        self.mean, self.var, self.count = mean, var, total

    def discard_pending(self) -> None:
        """Forget data observed since the last commit (the warm-up's second reset repeats its first)."""
        self._reset_pending()

    def normalize(self, x: np.ndarray) -> np.ndarray:
        return np.clip((x - self.mean) / np.sqrt(self.var + EPS), -CLIP, CLIP).astype(np.float32)

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean.copy(), "var": self.var.copy(), "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Accepts numpy arrays or the tensors a checkpoint stores them as (it holds no numpy objects)."""
        self.mean, self.var = (_float64(state[k]) for k in ("mean", "var"))
        self.count = float(state["count"])
        self._reset_pending()


def _float64(values: Any) -> np.ndarray:
    """A float64 copy of a numpy array or of the tensor a checkpoint stores it as."""
    return np.array(values.numpy() if hasattr(values, "numpy") else values, dtype=np.float64)


class NormalizeObservation(VectorWrapper):
    def __init__(self, env: VectorEnv) -> None:
        super().__init__(env)
        # The observation space stays the env's own: checkpoints and exported policies describe raw inputs.
        self.moments = RunningMoments(env.single_observation_space.shape)

    def reset(self, **kwargs: Any) -> tuple[np.ndarray, dict[str, Any]]:
        obs, info = self.env.reset(**kwargs)
        self.moments.observe(obs)
        self.last_reset = obs  # raw, so the first observations can be normalised again once synced
        return self.moments.normalize(obs), info

    def step(self, actions: Any) -> tuple[np.ndarray, Any, Any, Any, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(actions)
        self.moments.observe(obs)
        if "final_obs" in info:
            final = info["final_obs"].copy()
            for i in np.flatnonzero(info["_final_obs"]):
                final[i] = self.moments.normalize(final[i])
            info = {**info, "final_obs": final}
        return self.moments.normalize(obs), reward, terminated, truncated, info


class NormalizeReward(VectorWrapper):
    """Scales rewards by the running std of the discounted return (the reward, not its mean, is scaled)."""

    def __init__(self, env: VectorEnv, gamma: float) -> None:
        super().__init__(env)
        self.gamma = gamma
        self.moments = RunningMoments(())
        self.returns = np.zeros(env.num_envs, np.float64)

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        self.returns[:] = 0.0  # every episode starts again: no return carries over (the warm-up resets)
        return self.env.reset(**kwargs)

    def step(self, actions: Any) -> tuple[Any, np.ndarray, Any, Any, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(actions)
        self.returns = self.returns * self.gamma + reward
        self.moments.observe(self.returns)
        self.returns[terminated | truncated] = (
            0.0  # same-step autoreset: the next reward starts a new episode
        )
        scaled = np.clip(reward / np.sqrt(self.moments.var + EPS), -CLIP, CLIP)
        return obs, scaled.astype(np.float32), terminated, truncated, info


def normalizers(envs: Any) -> list[NormalizeObservation | NormalizeReward]:
    """The normalisation wrappers in a vector env's wrapper chain, outermost first."""
    found = []
    while isinstance(envs, VectorWrapper):
        if isinstance(envs, (NormalizeObservation, NormalizeReward)):
            found.append(envs)
        envs = envs.env
    return found


def sync_normalizers(envs: Any, reduce: Reduce | None) -> None:
    """Merge the pending statistics of every collecting rank (call on all of them at the same point)."""
    for wrapper in normalizers(envs):
        try:
            wrapper.moments.commit(reduce)
        except FloatingPointError as exc:  # the same on every rank: they all merged the same sums
            obs = isinstance(wrapper, NormalizeObservation)
            what, key = ("observations", "env.normalize_obs") if obs else ("returns", "env.normalize_reward")
            raise EnvFault(
                f"the env's {what} are too large to normalise ({exc}, values beyond ~1e154): scale them in "
                f"the env, or set {key}=false"
            ) from None


def warm_up(
    envs: Any,
    steps: int,
    action_seed: int,
    reduce: Reduce | None,
    masks: Callable[[], np.ndarray] | None = None,
) -> None:
    """Step `envs` `steps` times with random actions and merge what the normalisers saw over the ranks.

    Call on every collecting rank at the same point (the merge is a collective); the caller resets the
    envs afterwards. The actions come from the vector action space seeded with `action_seed`, so a run
    warms up the same way every time. With `masks` (the copies' current action masks, [E, width]) each
    action is drawn among the legal ones: an env that refuses an illegal move would fail the run before it
    starts, and one that plays it would seed the statistics with states training never reaches.
    """
    if steps <= 0 or not normalizers(envs):
        return
    envs.action_space.seed(action_seed)
    rng = np.random.default_rng(action_seed)
    for _ in range(steps):
        envs.step(envs.action_space.sample() if masks is None else legal_actions(envs, masks(), rng))
    sync_normalizers(envs, reduce)


def legal_actions(envs: Any, masks: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One uniformly random legal action per copy of a Discrete or MultiDiscrete vector env, from its flat
    `masks` [E, width] (a copy or action dimension with none legal draws among all)."""
    space = envs.single_action_space
    nvec = [int(space.n)] if isinstance(space, gym.spaces.Discrete) else [int(n) for n in space.nvec.ravel()]
    start = np.asarray(space.start).ravel()
    bounds = np.cumsum(nvec)[:-1]
    rows = []
    for mask in masks:
        picks = []
        for n, part in zip(nvec, np.split(mask, bounds), strict=True):
            legal = np.flatnonzero(part)
            picks.append(int(rng.choice(legal)) if legal.size else int(rng.integers(n)))
        rows.append(np.asarray(picks) + start)
    actions = np.stack(rows)
    return actions[:, 0] if isinstance(space, gym.spaces.Discrete) else actions.reshape(-1, *space.nvec.shape)


def discard_pending(envs: Any) -> None:
    for wrapper in normalizers(envs):
        wrapper.moments.discard_pending()


def first_observations(envs: Any, obs: np.ndarray, reduce: Reduce | None) -> np.ndarray:
    """After the first reset: merge every rank's initial observations, then normalise them with that."""
    sync_normalizers(envs, reduce)
    return renormalized_reset(envs, obs)


def renormalized_reset(envs: Any, obs: Any) -> Any:
    """The last reset's observations normalised with the statistics as they are now (`obs` unchanged when
    observations are not normalised): after merging, or after loading a checkpoint's statistics."""
    obs_norm = next((w for w in normalizers(envs) if isinstance(w, NormalizeObservation)), None)
    return obs if obs_norm is None else obs_norm.moments.normalize(obs_norm.last_reset)


def normalizer_state(envs: Any) -> dict[str, Any]:
    return {type(w).__name__: w.moments.state_dict() for w in normalizers(envs)}


def load_normalizer_state(envs: Any, state: dict[str, Any]) -> None:
    """Replace the statistics (those of the warm-up, in a freshly built env) with saved ones."""
    for wrapper in normalizers(envs):
        if type(wrapper).__name__ in state:
            wrapper.moments.load_state_dict(state[type(wrapper).__name__])
