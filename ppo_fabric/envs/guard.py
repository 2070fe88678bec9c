"""What arrives from an env is checked at the boundary: finite observations and rewards, and (with
`env.on_error=restart`) a sub-env that fails is recreated instead of ending the run.

A NaN observation or an inf reward does not crash anything by itself: it flows into the advantages, the
losses and the parameters, and the run ends "successfully" with every checkpoint NaN. So every vector step
is checked once, vectorised, on the raw values (below any normalisation, which would turn an inf into a
NaN or clip it away): `FiniteCheck` for gymnasium and EnvPool vector envs, `nonfinite_rows` for the
PettingZoo vector envs' per-policy arrays. A failing check raises `NonFiniteData`; the collector, which
knows the rank, the role and the env step, turns it into the one-line `EnvFault` the run ends with.

`RecreateOnError` wraps each gymnasium sub-env when the user asked for recovery: an exception from `step`
or `reset`, or a non-finite value, closes the env, builds a fresh one from the same factory and ends the
episode as truncated (reward 0, the last good observation as its final one), so the bad transition never
reaches training. The fresh env's first reset reports `env_restart` in its info: the collector counts it.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import tempfile
import time
import traceback
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import VectorWrapper

from ppo_fabric.config.faults import RunFault

ON_ERROR = ("raise", "restart")
RESTART_INFO = "env_restart"  # info key of a reset that followed a restart: the cause, one line
RESET_TRIES = 3  # a recreated env that fails its reset this many times in a row ends the run


class NonFiniteData(Exception):  # noqa: N818 - a finding handed up, made into an EnvFault by the collector
    """`what` (`observation["pos"] holds NaN`, `reward holds +inf`) was found at env `index` of a step."""

    def __init__(self, index: int, what: str) -> None:
        super().__init__(f"env {index}: {what}")
        self.index, self.what = index, what


class EnvFault(RunFault):
    """An env sent bad data, failed, or failed too often to be restarted: the run ends with this line."""


# The rollout stores observations and rewards as float32: a finite float64 beyond its range (a reward of
# 1e200) becomes inf there, and the update, not the env, was then blamed for the NaN losses that followed.
F32_MAX = float(np.finfo(np.float32).max)


def _kind(values: np.ndarray) -> str:
    """`NaN`, `+inf`, `-inf` or the finite value beyond float32's range: the first bad value."""
    bad = values[~_good(values)]
    v = bad.flat[0]
    if np.isfinite(v):
        return f"{float(v):.3g}, beyond float32's range (the rollout stores float32)"
    return "NaN" if np.isnan(v) else ("+inf" if v > 0 else "-inf")


def _good(array: np.ndarray) -> np.ndarray:
    """Finite, and within float32's range for wider floats."""
    good = np.isfinite(array)
    if array.dtype.kind == "f" and array.dtype.itemsize > 4:
        good &= np.abs(np.where(good, array, 0.0)) <= F32_MAX
    return good


def _bad_rows(values: Any) -> np.ndarray | None:
    """Rows (first axis) holding a non-finite value (or one beyond float32's range), or None when every
    value is good (or integer)."""
    array = np.asarray(values)
    if array.dtype.kind not in "fc":  # uint8 pixels, int positions: nothing to check
        return None
    good = _good(array)
    if good.all():  # the common case
        return None
    flat = good.reshape(array.shape[0], -1) if array.ndim > 1 else good.reshape(-1, 1)
    return np.flatnonzero(~flat.all(1))


def nonfinite_rows(obs: Any, rewards: Any) -> tuple[int, str] | None:
    """(first row, what) of a vector step's observations (an array or a dict of arrays) and rewards that
    holds a non-finite value; None when every value is finite."""
    parts = (
        [(f'observation["{k}"]', v) for k, v in obs.items()]
        if isinstance(obs, dict)
        else [("observation", obs)]
    )
    found: tuple[int, str] | None = None
    for name, values in [*parts, ("reward", rewards)]:
        rows = _bad_rows(values)
        if rows is not None and (found is None or rows[0] < found[0]):
            what = f"{name} holds {_kind(np.asarray(values)[rows[0]])}"
            if what == "reward holds NaN":  # the vector env's float array stores a reward of None so
                what += " (or None, which the vector env stores as NaN)"
            found = (int(rows[0]), what)
    return found


def nonfinite_value(obs: Any, reward: Any = 0.0) -> str | None:
    """What is not finite in one env's observation and reward (`observation holds NaN`), or None."""
    if isinstance(obs, dict):
        batch: Any = {k: np.asarray(v)[None] for k, v in obs.items()}
    else:
        batch = np.asarray(obs)[None]
    found = nonfinite_rows(batch, np.asarray([reward], dtype=np.float64))
    return None if found is None else found[1]


# A value whose square is beyond float range (1e200) overflows the quick test's dot product: that only sends
# the caller to the exact check, which names the value; NumPy's warning printed above the run's one line.
# A filter for this module's line alone: `np.errstate` around the product doubled the check's ~0.8 us.
warnings.filterwarnings("ignore", "overflow encountered in matmul", RuntimeWarning, __name__)


def surely_finite(values: Any) -> bool:
    """True when every value is finite, found in one BLAS call: the dot product of the values with
    themselves is finite exactly when they all are (short of a square beyond float range, ~1e19 in float32,
    which only sends the caller to the exact check). Integer arrays (pixels) are finite. ~1.5 us for a
    vector step's observations, a third of `np.isfinite(...).all()` with its temporary."""
    if isinstance(values, dict):
        return all(surely_finite(v) for v in values.values())
    array = np.asarray(values)
    if array.dtype.kind != "f":
        return array.dtype.kind != "c" or bool(np.isfinite(array).all())
    flat = array.reshape(-1)
    square = flat @ flat
    # a wider float whose squares sum past float32's range squared may hold a value float32 cannot
    return math.isfinite(square) and (array.dtype.itemsize <= 4 or square <= F32_MAX * F32_MAX)


def find_nonfinite(obs: Any, rewards: Any) -> tuple[int, str] | None:
    """`nonfinite_rows`, searched only when the quick test (`surely_finite`) finds something."""
    if surely_finite(obs) and surely_finite(rewards):
        return None
    return nonfinite_rows(obs, rewards)


def check_step(obs: Any, rewards: Any, info: dict[str, Any]) -> None:
    """Raise `NonFiniteData` for a vector step (or reset, with zero rewards) whose observations, rewards
    or truncated episodes' final observations hold a NaN or an inf. Rows are env indices (gymnasium's
    vector envs, and EnvPool's, whose async pool keeps a row per env too). The common case, all finite,
    costs one dot product per array; only a suspect step is searched row by row."""
    found = find_nonfinite(obs, rewards)
    if found is None and "_final_obs" in info:
        found = nonfinite_final(info["final_obs"], info["_final_obs"])
    if found is not None:
        raise NonFiniteData(*found)


def step_flag(value: Any) -> bool | None:
    """A step's `terminated` or `truncated` as a bool; None for anything but a bool or one number 0 or 1
    (an int, a float, or an array or tensor of one element: gymnasium warns of those and stores them).
    The vector env stores it with NumPy, which reads any non-empty string (`"False"`), NaN and 0.5 as True:
    every step then ended an episode, nothing was learnt, and the run ended with exit 0."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if value is None or isinstance(value, (str, bytes)):
        return None
    try:
        array = np.asarray(value)
    except Exception:  # an object NumPy cannot take: not a flag either
        return None
    if array.size != 1 or array.dtype.kind not in "biuf":
        return None
    item = array.item()
    return bool(item) if item in (0, 1) else None


def flag_error(name: str, value: Any) -> str:
    """What is wrong with a `terminated` or `truncated` that `step_flag` refused."""
    return (
        f"step() returned {name}={value!r} ({type(value).__name__}), where gymnasium's API returns a bool; "
        "NumPy would read it as True or False by its type, not its meaning"
    )


class StepFlags(gym.Wrapper):
    """Each gymnasium sub-env's `terminated` and `truncated` checked as bools (`step_flag`): what the
    vector env would store wrong is one `EnvFault` line. The common case, two Python bools, costs two type
    checks a step."""

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        if type(terminated) is not bool or type(truncated) is not bool:
            flags = [step_flag(terminated), step_flag(truncated)]
            for name, value, flag in zip(
                ("terminated", "truncated"), (terminated, truncated), flags, strict=True
            ):
                if flag is None:
                    raise EnvFault(flag_error(name, value))
            terminated, truncated = flags
        return obs, reward, terminated, truncated, info


def nonfinite_final(finals: Any, rows: Any) -> tuple[int, str] | None:
    """(row, what) of the first final observation (`finals[j]`, for each row `j` that `rows` marks) holding
    a NaN or an inf: a truncated episode bootstraps from its value."""
    for j in np.flatnonzero(rows):
        final = finals[j]
        if final is not None and not surely_finite(final):
            what = nonfinite_value(final)
            if what is not None:
                return int(j), what.replace("observation", "final observation", 1)
    return None


def misshapen(obs: Any, space: gym.Space) -> str | None:
    """What differs between the shape of one env's observation and its `space`'s (a Box, or a Dict of
    them; other spaces are not checked), or None. A vector env stacking an observation of another shape
    raises in its own code, far from the env: checked here, inside the sub-env, the restart can rebuild the
    env that sent it."""
    if isinstance(space, gym.spaces.Dict) and isinstance(obs, dict):
        for key, sub in space.spaces.items():
            if key not in obs:
                return f'observation["{key}"] missing'
            found = misshapen(obs[key], sub)
            if found is not None:
                return found.replace("observation", f'observation["{key}"]', 1)
        return None
    if isinstance(space, gym.spaces.Box) and np.shape(obs) != space.shape:
        return f"observation of shape {np.shape(obs)} where observation_space has {space.shape}"
    return None


class FiniteCheck(VectorWrapper):
    """`check_step` on every step and reset of a gymnasium vector env (EnvPool's call it themselves)."""

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        obs, info = self.env.reset(**kwargs)
        check_step(obs, np.zeros(self.num_envs), info)
        return obs, info

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        obs, rewards, terminated, truncated, info = self.env.step(actions)
        check_step(obs, rewards, info)
        return obs, rewards, terminated, truncated, info


class RecreateOnError(gym.Wrapper):
    """One sub-env that is rebuilt from `factory` when it raises or returns a non-finite value.

    The failing step ends the episode as truncated with reward 0 and the last good observation as its
    final observation (what the rollout bootstraps from); the vector env then resets the new env as it
    resets any env whose episode ended, and that reset's info carries the cause under `RESTART_INFO`.
    A reset that fails is retried with a fresh env up to `RESET_TRIES` times, then raises `EnvFault`.
    """

    def __init__(self, factory: Callable[[], gym.Env]) -> None:
        super().__init__(factory())
        self.factory = factory
        self.last_obs: Any = None
        self.pending: str | None = None  # the cause of a restart not yet reported

    def _recreate(self, cause: str) -> None:
        with contextlib.suppress(Exception):  # a broken env may fail to close too
            self.env.close()
        try:
            self.env = self.factory()
        except USER_CODE_FAILURES as exc:  # named as the rebuild's, after the failure that asked for it
            raise EnvFault(f"{cause}; rebuilding the env then raised {_one_line(exc)}") from exc
        self.pending = cause if self.pending is None else self.pending

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        for attempt in range(RESET_TRIES):
            try:
                obs, info = self.env.reset(**kwargs)
                what = misshapen(obs, self.observation_space) or nonfinite_value(obs)
                if what is None:
                    break
                cause = f"reset returned bad data ({what})"
            except USER_CODE_FAILURES as exc:  # any failure of user code is what this recovers from
                cause = f"reset raised {_one_line(exc)}"
            if attempt + 1 == RESET_TRIES:
                raise EnvFault(f"{cause}, {RESET_TRIES} times in a row with a recreated env")
            self._recreate(cause)
            kwargs.pop("seed", None)  # the fresh env draws its own seed
        self.last_obs = obs
        if self.pending is not None:
            info = {**info, RESTART_INFO: self.pending}
            self.pending = None
        return obs, info

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        try:
            obs, reward, terminated, truncated, info = self.env.step(action)
            what = misshapen(obs, self.observation_space) or nonfinite_value(obs, reward)
        except EnvFault:  # a flag of the wrong type (StepFlags): every fresh env would send it again
            raise
        except USER_CODE_FAILURES as exc:  # see reset
            self._recreate(f"step raised {_one_line(exc)}")
            return self.last_obs, 0.0, False, True, {}
        if what is not None:
            self._recreate(f"step returned bad data ({what})")
            return self.last_obs, 0.0, False, True, {}
        self.last_obs = obs
        return obs, reward, terminated, truncated, info


ASYNC_POOLS: weakref.WeakSet[Any] = weakref.WeakSet()  # this process's async vector envs (`make`)
# What the pipe to an async env's worker raises once that process has ended
LOST_WORKER = (EOFError, BrokenPipeError, ConnectionResetError)

# What the user's env code may raise that the run reports as the env's fault: SystemExit too (a `sys.exit`
# in an env), which passed every `except Exception` and ended the run with exit 0 and no line, and
# KeyboardInterrupt, which a run's Ctrl+C never raises there (its handler asks for a stop at the next
# update): one from an env's code ended the run as "interrupted", exit 130, never restarted.
USER_CODE_FAILURES: tuple[type[BaseException], ...] = (Exception, SystemExit, KeyboardInterrupt)


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0] if text else type(exc).__name__


def error_line(exc: BaseException, limit: int = 300) -> str:
    """The first non-empty line of `exc`'s message (its type name when it has none), whole: one longer than
    `limit` characters is cut at the last space before it, with "...", never inside a word."""
    line = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
    if len(line) <= limit:
        return line
    cut = line[: limit - 3].rstrip()
    space = cut.rfind(" ")
    return (cut[:space].rstrip() if space > 0 else cut) + "..."


# What NumPy says when gymnasium's vector env stacks observations of another shape than the env's
# observation_space into its buffer (all of them, or only some): the user's env is at fault, not the library.
_WRONG_SHAPE = (
    "Output array is the wrong shape",
    "all input arrays must have the same shape",
    "Output array has wrong dimensionality",  # an observation of shape (1, 3) for a space of (3,)
)
# What NumPy says when the vector env stores a step's reward, terminated or truncated that is not one number
# (a reward of shape (1,)) into its array of one per env: sync, then async
_NOT_SCALAR = ("setting an array element with a sequence", "non-broadcastable output operand")
# what pickle says of an object it cannot take ("Can't pickle local object ...", "cannot pickle '_thread.lock'")
_UNPICKLABLE = ("can't pickle", "cannot pickle")


def env_error_text(exc: BaseException) -> str:
    """`Type: first line` of an exception from the user's env code, and for an observation stacked into a
    buffer of another shape, what that means (NumPy's own words name no env and no space)."""
    text = f"{type(exc).__name__}: {error_line(exc)}" if str(exc).strip() else type(exc).__name__
    if isinstance(exc, SystemExit):
        text = f"SystemExit({exc.code!r}) (the env called sys.exit)"
    elif isinstance(exc, KeyboardInterrupt):
        text = "KeyboardInterrupt (raised by the env's own code: a Ctrl+C stops a run at its next update)"
    elif isinstance(exc, LOST_WORKER) and (ended := ended_workers()):
        text = (
            f"{text} ({ended}; env.on_error=restart rebuilds an env whose code raises, not a process that "
            "ended: restarts=N relaunches the run from its last checkpoint)"
        )
    elif any(words in str(exc) for words in _WRONG_SHAPE):
        text += " (an observation's shape differs from the env's observation_space)"
    elif any(words in str(exc) for words in _NOT_SCALAR):
        text += " (a step's reward, terminated or truncated is not one number: a reward of shape (1,)?)"
    elif any(words in str(exc).lower() for words in _UNPICKLABLE):  # the worker sending the step back
        text += (
            " (an async env's worker sends each step's observation and info back pickled: one of them does "
            "not pickle; keep such objects out of info, or use env.vector=sync)"
        )
    return text


# The exit status of an async env's worker whose env could not be built (`built_in_worker`)
WORKER_BUILD_FAILED = 3


def _build_cause_path(owner: int, worker: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"ppo-fabric-{owner}-env-worker-{worker}.txt")


def built_in_worker(factory: Callable[[], gym.Env], owner: int) -> gym.Env:
    """`factory()` in an async env's worker process, whose failure is handed to `owner` (the process that
    made the vector env) in one line: gymnasium builds the env outside its worker's error handling, so an
    env that could be built in the main process but not in a worker (a licence, a display or a GPU the
    worker lacks, a module-level state the fork did not carry) printed a ~25-line traceback per worker
    while the run named only the closed pipe ("ConnectionResetError ... at its first reset"). In `owner`
    itself (gymnasium builds one env there for the spaces) the error propagates as it is."""
    try:
        return factory()
    except USER_CODE_FAILURES as exc:
        if os.getpid() == owner:
            raise
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        where = f" ({os.path.basename(frame.filename)}:{frame.lineno}, in {frame.name})"
        with contextlib.suppress(OSError), open(_build_cause_path(owner, os.getpid()), "w") as fh:
            fh.write(f"{env_error_text(exc)}{where}")
        raise SystemExit(WORKER_BUILD_FAILED) from None  # multiprocessing ends the worker without a traceback


def worker_build_failures(workers: int, wait_s: float = 1.0) -> list[str]:
    """The causes this process's async env workers (`workers` of them) left when their env could not be
    built, waiting up to `wait_s` for each to write its own (the first one's closed pipe was what the
    caller saw); each is read once: the files are removed."""
    folder, prefix = tempfile.gettempdir(), f"ppo-fabric-{os.getpid()}-env-worker-"

    def written() -> list[str]:
        with contextlib.suppress(OSError):
            return sorted(n for n in os.listdir(folder) if n.startswith(prefix))
        return []

    deadline = time.monotonic() + wait_s
    while written() and len(written()) < workers and time.monotonic() < deadline:
        time.sleep(0.02)
    causes = []
    for name in written():
        path = os.path.join(folder, name)
        with contextlib.suppress(OSError):
            with open(path) as fh:
                causes.append(fh.read().strip())
            os.unlink(path)
    return causes


def ended_workers(wait_s: float = 1.0) -> str:
    """What ended this process's async env workers that are gone ("" when none is): the pipe's EOFError
    said nothing of a worker killed by a C crash (SIGSEGV), `os._exit` or `sys.exit` in its env. Waits up
    to `wait_s` for one to be reaped: its pipe closes as it exits, a moment before."""
    processes = [p for vector in list(ASYNC_POOLS) for p in getattr(vector, "processes", [])]
    deadline = time.monotonic() + wait_s
    while processes and all(p.exitcode is None for p in processes) and time.monotonic() < deadline:
        time.sleep(0.01)
    ended = []
    for vector in list(ASYNC_POOLS):
        for index, process in enumerate(getattr(vector, "processes", [])):
            code = process.exitcode
            if code is None:
                continue
            how = f"exit status {code}"
            if code < 0:
                with contextlib.suppress(ValueError):
                    how = f"killed by {signal.Signals(-code).name}"
            ended.append(f"env {index}'s worker process ended, {how}")
    return "; ".join(ended)


def restartable(factory: Callable[[], gym.Env]) -> gym.Env:
    """`factory`'s env, rebuilt by `RecreateOnError` when it fails (a module-level function so that a
    `functools.partial` of it pickles, as checkpoints pickle the vector env's factories)."""
    return RecreateOnError(factory)
