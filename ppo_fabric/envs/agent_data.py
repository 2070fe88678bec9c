"""What a PettingZoo env hands back, checked where its vector env stores it, so that a value the rollout
cannot use is one line naming the env copy and the agent, raised from the env's step (the run's line then
blames the env, not the package), and a value it could use but would learn wrong from (an agent that left
without an episode end) is refused rather than trained on.

Both vector envs (`multiagent.MultiAgentVectorEnv`, `turn_based.TurnBasedVectorEnv`) store through these.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ppo_fabric.envs.guard import flag_error, step_flag

NAN = math.nan


def agent_row(rows: dict[str, tuple[str, int]], agent: str, e: int) -> tuple[str, int]:
    """(policy, row) of `agent` in copy `e`: every agent the env names is one of its `possible_agents`,
    which fixed the rows. Before, an unknown name was the package's own `KeyError: 'ghost'`."""
    try:
        return rows[agent]
    except KeyError:
        known = ", ".join(repr(a) for a in rows)
        raise ValueError(
            f"env {e}: agent {agent!r} is not one of its possible_agents ({known}); PettingZoo envs "
            "list every agent that can appear in possible_agents"
        ) from None


def reward_value(value: Any, e: int, agent: str) -> float:
    """The float of an agent's reward. None becomes NaN, which the collector's finiteness check names
    ("reward holds NaN (or None ...)") as it does for a gymnasium env; a value that is not a number at all
    is named here, where before it was `float()`'s TypeError."""
    if value is None:
        return NAN
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"env {e}, agent {agent!r}: a reward of {value!r}, which is not a number") from None


def store_row(
    out: np.ndarray,
    row: int,
    value: Any,
    e: int,
    agent: str,
    what: str = "an observation",
    space: str = "observation_space",
) -> None:
    """`out[row] = value`, with NumPy's "could not broadcast ..." (which names neither the agent nor the
    space) replaced by a line that names both."""
    try:
        out[row] = value
    except (ValueError, TypeError) as exc:
        raise ValueError(
            f"env {e}, agent {agent!r}: {what} of shape {np.shape(value)} where its {space} has "
            f"{tuple(out.shape[1:])}"
        ) from exc


def reset_observations(result: Any, e: int) -> dict[str, Any]:
    """The observations of a Parallel env's `reset()`, which returns (observations, infos) since
    PettingZoo 1.23; an env written for the older API returns the observations alone, which gave
    `KeyError: 0`."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], dict):
        return result[0]
    got = type(result).__name__ if not isinstance(result, tuple) else f"a tuple of {len(result)}"
    raise ValueError(
        f"env {e}: reset() returned {got}, where PettingZoo's Parallel API returns (observations, infos) "
        "(since PettingZoo 1.23)"
    )


def step_result(
    rewards: dict[str, Any], terminations: dict[str, Any], truncations: dict[str, Any], agent: str, e: int
) -> tuple[float, bool, bool]:
    """(reward, terminated, truncated) of an agent that acted. A Parallel env's step returns all three for
    every agent that acted (PettingZoo's own API test reads them). A missing one had been taken as 0 or
    False: an agent whose episode ended there went on adding its return into the next episode, and the run
    ended with exit 0."""
    for name, values in (("rewards", rewards), ("terminations", terminations), ("truncations", truncations)):
        if agent not in values:
            raise ValueError(
                f"env {e}, agent {agent!r}: step() returned {name} without this agent, which acted; a "
                "Parallel env's step returns an entry for every agent in env.agents"
            )
    flags = []
    for name, values in (("terminations", terminations), ("truncations", truncations)):
        flag = step_flag(values[agent])
        if flag is None:
            raise ValueError(f"env {e}, agent {agent!r}: {flag_error(name, values[agent])}")
        flags.append(flag)
    return reward_value(rewards[agent], e, agent), flags[0], flags[1]


def departed_without_end(agent: str, e: int) -> ValueError:
    """The error for an agent gone from `env.agents` after a step that ended neither its episode by
    termination nor by truncation: its episode would never end in the rollout."""
    return ValueError(
        f"env {e}, agent {agent!r}: left env.agents after a step that set neither its termination nor its "
        "truncation; PettingZoo removes an agent only after one of them is True"
    )
