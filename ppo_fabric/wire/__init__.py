"""Layer 1: the player <-> trainer wire: every collective call (`protocol`) and where each rank runs
(`placement`). Imports nothing else of ppo_fabric."""
