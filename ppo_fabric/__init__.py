"""ppo-fabric: PPO on Lightning Fabric, coupled or decoupled, configured by Hydra."""

__version__ = "0.1.0"


def run(overrides: list[str]) -> dict:
    """Train with Hydra-style overrides, e.g. `run(["env.id=Acrobot-v1", "algo.total_steps=1e5"])`."""
    from ppo_fabric.cli import run as _run

    return _run(overrides)
