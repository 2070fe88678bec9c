"""`torch_threads` limits NumPy's BLAS too: the NumPy rollout actor's matmuls must not take every core."""

from __future__ import annotations

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
    torch_before = torch.get_num_threads()
    with threadpool_limits(2, user_api="blas"):
        try:
            torch.set_num_threads(2)
            with pytest.raises(ConfigError, match="checked"):
                launch.train(OmegaConf.create({"torch_threads": 1}), lambda cfg: lambda *a: {}, "unused")
        finally:
            torch.set_num_threads(torch_before)
    assert seen == [1]
