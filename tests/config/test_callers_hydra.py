"""ppo-fabric's config composes in a process whose own code used Hydra first (a notebook that composed its
own config, a `@hydra.main` app calling `ppo_fabric.run()`): Hydra lists its plugins once a process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
from hydra import compose, initialize
from ppo_fabric.config.values import compose as compose_ours
with initialize(version_base=None, config_path="conf"):
    compose(config_name="mine")
cfg, _ = compose_ours(["env.id=Acrobot-v1"])
print("composed", cfg.env.id)
"""


@pytest.mark.multiprocess
def test_our_config_composes_after_the_callers_own_hydra(tmp_path: Path) -> None:
    """As the package is installed (`pip install -e .`), from a directory of the user's own (not the
    checkout, whose `hydra_plugins` the current directory would make importable) and without PYTHONPATH:
    composing failed with "hydra/launcher=ppo_fabric not found ... reinstall the package" for the rest of
    the process, since Hydra had listed its plugins before ours were on sys.path."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "mine.yaml").write_text("lr: 0.1\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "composed Acrobot-v1"
