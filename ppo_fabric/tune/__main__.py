"""`python -m ppo_fabric.tune`: see `ppo_fabric.tune.study`."""

import sys

from ppo_fabric.tune.study import main

if __name__ == "__main__":
    sys.exit(main())
