"""Layer 5: collection: the one rollout loop and the NumPy actor that samples its actions on the CPU."""
