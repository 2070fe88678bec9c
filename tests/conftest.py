"""Shared fixtures: one tiny trained run that the evaluate and export tests read (never modify)."""

from __future__ import annotations

from pathlib import Path

import pytest

import ppo_fabric


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 512-step CartPole run (two updates, about a second): a real checkpoint, metrics.csv and plot.

    Session-scoped so the evaluate and export tests pay for one training run, not one per test.
    """
    run_dir = tmp_path_factory.mktemp("tiny_run")
    ppo_fabric.run(["algo.total_steps=512", "logger.tensorboard=false", f"hydra.run.dir={run_dir}"])
    return run_dir
