"""Layer 9 (the highest): `python -m ppo_fabric.tune`, hyperparameter search with Optuna (`study`), its
settings, search space, trials and report."""
