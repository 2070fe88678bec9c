"""`python -m ppo_fabric.evaluate checkpoint=PATH [key=value ...]`: see `ppo_fabric.policy.evaluate`."""

from ppo_fabric.policy.evaluate import main

if __name__ == "__main__":
    main()
