"""Layer 2: environments: construction and seeding (`make`), the backends (gymnasium vector envs, EnvPool),
Atari preprocessing, normalisation, spaces as data, PettingZoo multi-agent and turn-based adapters, and the
toy multi-agent envs the tests and docs use."""
