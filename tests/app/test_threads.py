"""`torch_threads` limits NumPy's BLAS too: the NumPy rollout actor's matmuls must not take every core."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from threadpoolctl import threadpool_info, threadpool_limits

from ppo_fabric.app.launch import set_threads


def blas_threads() -> list[int]:
    np.ones((2, 2)) @ np.ones((2, 2))  # NumPy's BLAS is loaded
    return [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]


def test_torch_threads_sets_numpys_blas_threads_too() -> None:
    if not blas_threads():
        pytest.skip("NumPy reports no BLAS library to threadpoolctl here")
    torch_before = torch.get_num_threads()
    with threadpool_limits(2, user_api="blas"):  # restored afterwards, with torch's below
        try:
            assert set(blas_threads()) == {2} or max(blas_threads()) < 2  # a 1-core machine stays at 1
            set_threads(1)
            assert torch.get_num_threads() == 1
            assert set(blas_threads()) == {1}
        finally:
            torch.set_num_threads(torch_before)


@pytest.fixture
def two_threads() -> Iterator[None]:
    """torch and NumPy's BLAS at 2 threads for the test, and as they were after it."""
    torch_before = torch.get_num_threads()
    with threadpool_limits(2, user_api="blas"):
        torch.set_num_threads(2)
        try:
            yield
        finally:
            torch.set_num_threads(torch_before)


@pytest.mark.usefixtures("two_threads")
def test_torch_threads_hold_for_the_checks_every_process_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each process of a job checks the config by building the env and the model; fifteen processes each
    taking every core for that oversubscribed a 16-core node for ~100 s before training. The limit is set
    before those checks."""
    from omegaconf import OmegaConf

    from ppo_fabric.app import launch
    from ppo_fabric.config.values import ConfigError

    seen: list[int] = []

    def prepare(cfg: object, run_dir: str, *_: object) -> dict:
        seen.append(torch.get_num_threads())
        raise ConfigError("checked")

    monkeypatch.setattr(launch, "prepare", prepare)
    with pytest.raises(ConfigError, match="checked"):
        launch.train(OmegaConf.create({"torch_threads": 1}), lambda cfg: lambda *a: {}, "unused")
    assert seen == [1]


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("ends", ["returns", "raises"])
def test_a_python_api_run_gives_its_caller_the_process_back_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ends: str
) -> None:
    """`ppo_fabric.run()` in a notebook or script: the run's one torch and BLAS thread (`torch_threads=1`),
    its seeded random generators, its float32 default dtype, its one-line warning format and its quieter
    Lightning logs stay the run's. The caller's own torch and NumPy work ran on one core after it, a random
    search drawing values between runs of one seed drew the same values after each, and a caller's float64
    default dtype failed the run at its first forward."""
    import logging
    import os
    import random
    import warnings

    import ppo_fabric
    from ppo_fabric.app import launch
    from ppo_fabric.config.values import ConfigError

    if ends == "raises":  # a failure once the threads are set: the checks refuse the config

        def prepare(*_: object) -> dict:
            raise ConfigError("refused by the checks")

        monkeypatch.setattr(launch, "prepare", prepare)
    logging.getLogger("lightning_fabric").setLevel(logging.DEBUG)
    torch.set_default_dtype(torch.float64)
    try:

        def state() -> tuple:
            drawn = (
                random.getstate(),
                np.random.get_state()[1].tolist(),
                torch.random.get_rng_state().tolist(),
            )
            threads = torch.get_num_threads(), blas_threads()
            return (*threads, *drawn, torch.get_default_dtype(), os.environ.get("PL_GLOBAL_SEED"))

        before = (*state(), warnings.formatwarning, list(warnings.filters))
        overrides = ["algo.total_steps=128", "env.num_envs=2", "algo.rollout_steps=64", "algo.minibatch_size=64",
                     "eval.every=0", "logger=none", f"hydra.run.dir={tmp_path}"]  # fmt: skip
        if ends == "returns":
            assert ppo_fabric.run(overrides)["total_env_steps"] == 128
        else:
            with pytest.raises(ConfigError, match="refused by the checks"):
                ppo_fabric.run(overrides)
        assert (*state(), warnings.formatwarning, list(warnings.filters)) == before
        assert logging.getLogger("lightning_fabric").level == logging.DEBUG
    finally:
        logging.getLogger("lightning_fabric").setLevel(logging.NOTSET)
        torch.set_default_dtype(torch.float32)
