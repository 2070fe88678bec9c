"""Layer 1: what the libraries and the platform do not offer publicly. Every private name of torch,
Lightning and Hydra that ppo_fabric uses, in one module (`private`), each with why it is used and a test
(tests/compat/) that fails loudly when a library release changes it; Linux's `prctl` (`linux`). Imports
nothing else of ppo_fabric."""
