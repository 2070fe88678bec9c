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
