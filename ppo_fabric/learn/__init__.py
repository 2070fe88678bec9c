"""Layer 4: the learner: rollout storage and batches, GAE, the PPO losses, the optimiser step, the update of
every trained policy, and the policies a run learns (`learners`)."""
