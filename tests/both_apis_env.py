"""A PettingZoo env module offering both APIs, as MPE's do: `parallel_env()` (simultaneous moves) and
`env()` (the same game turned into an AEC env). Training steps the Parallel one, so evaluation must too."""

from typing import Any

from pettingzoo.utils.conversions import parallel_to_aec

from ppo_fabric.envs.toy_multiagent import teams_v0

parallel_env = teams_v0


def env(**kwargs: Any) -> Any:
    return parallel_to_aec(teams_v0(**kwargs))
