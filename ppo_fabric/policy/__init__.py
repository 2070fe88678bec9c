"""Layer 7: acting with a trained policy: loading it, evaluating it (also against game opponents) and
exporting it."""
