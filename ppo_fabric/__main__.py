"""`python -m ppo_fabric [overrides]`."""

from ppo_fabric.cli import console_main

if __name__ == "__main__":
    console_main()
