"""Layer 6: a run's life: the session (run directory, logging, checkpoint rule), checkpoints and their
signatures, resume, metrics, trackers and the learning-curve plot."""
