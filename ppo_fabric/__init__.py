"""ppo-fabric: PPO on Lightning Fabric, coupled or decoupled, configured by Hydra.

The public face: `run` trains, `load_policy` gives a trained policy to act with (`Policy.predict`);
`ConfigError` (a config that cannot run) and `RunFault` (a run that went wrong) are what `run` raises."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    from ppo_fabric.config.faults import RunFault
    from ppo_fabric.config.values import ConfigError
    from ppo_fabric.policy.trained import Policy

__version__ = "0.1.0"
__all__ = ["ConfigError", "Policy", "RunFault", "load_policy", "run"]


def run(overrides: list[str], env: Any = None) -> dict[str, Any]:
    """Train with Hydra-style overrides, e.g. `run(["env.id=Acrobot-v1", "algo.total_steps=1e5"])`; returns
    the run's summary (what `summary.json` holds). `env`: an env factory, a module-level function or class
    returning a gymnasium env (the same as `env.id=module:name`). A job of several processes
    (`fabric.devices=2`, `strategy=decoupled`) runs as `python -m ppo_fabric` in a child process.

    A config that cannot run raises `ConfigError` (a ValueError with a one-line message, raised from here:
    no traceback through the package); a run that goes wrong raises `RunFault`
    (bad env data, a diverged update, a checkpoint that could not be written), its message one line. With
    `resume=auto` and a fixed `hydra.run.dir` the call can be repeated: it continues the run, or returns the
    finished run's summary. SIGINT (Ctrl+C, a notebook's interrupt) stops a one-process run at its next
    update boundary with a checkpoint and raises KeyboardInterrupt here; SIGTERM raises SystemExit(143) (SIGHUP,
    SIGUSR1/2: 128 + N)."""
    from ppo_fabric.cli import run as _run
    from ppo_fabric.config.values import ConfigError

    try:
        return _run(overrides, env)
    except ConfigError as exc:
        raise ConfigError(str(exc)) from None


def load_policy(path: str | Path, policy: str | None = None) -> Policy:
    """A trained policy from a checkpoint or a run directory, ready to `predict`: see
    `ppo_fabric.policy.trained`. `policy=NAME` picks one policy of a multi-agent checkpoint."""
    from ppo_fabric.policy.trained import load_policy as _load

    return _load(path, policy)


def __getattr__(name: str) -> Any:
    if name == "Policy":  # imported on first use: `import ppo_fabric` stays light (no torch)
        from ppo_fabric.policy.trained import Policy

        return Policy
    if name == "ConfigError":
        from ppo_fabric.config.values import ConfigError

        return ConfigError
    if name == "RunFault":
        from ppo_fabric.config.faults import RunFault

        return RunFault
    raise AttributeError(f"module 'ppo_fabric' has no attribute {name!r}")
