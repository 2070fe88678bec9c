"""Layer 3: two-player games: playing matches (`play`), Elo ratings, and self-play against snapshots."""
