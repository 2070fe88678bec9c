"""Layer 2: the actor-critic networks: encoders, bodies, action heads and the critic."""
