"""Layer 1 (the lowest): the Hydra config, composed and checked (`values`), and the key=value arguments and
one-line failures of the tools (`arguments`). Imports nothing else of ppo_fabric."""
