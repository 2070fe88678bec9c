"""Layer 8: starting runs: the Hydra app, preflight checks, the launcher, the supervisor, jobs and sweeps."""
