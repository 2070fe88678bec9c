"""ppo-fabric: PPO on Lightning Fabric, coupled or decoupled, configured by Hydra."""

__version__ = "0.1.0"
