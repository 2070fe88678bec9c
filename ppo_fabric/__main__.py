"""`python -m ppo_fabric [overrides]`."""

from ppo_fabric.cli import main

if __name__ == "__main__":
    main()
