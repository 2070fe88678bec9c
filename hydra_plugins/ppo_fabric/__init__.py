"""ppo-fabric's Hydra plugins: its config directory on every Hydra search path, and the launcher that runs
each multirun job as a process of its own. Hydra imports every module here when it looks for plugins, so
these modules import nothing heavy at import time."""
