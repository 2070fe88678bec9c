"""GAE against a scalar reference loop and hand-worked numbers; `compute_advantages` writes in place."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch import Tensor

from ppo_fabric.learn.advantages import compute_advantages, gae, reverse_scan
from ppo_fabric.learn.buffer import rollout_storage


def reference_gae(
    rewards: list[list[float]],
    values: list[list[float]],
    terminated: list[list[bool]],
    truncated: list[list[bool]],
    final_values: list[list[float]],
    next_value: list[float],
    gamma: float,
    lam: float,
) -> tuple[list[list[float]], list[list[float]]]:
    """Per env, reversed time, plain floats: the definition of GAE with two kinds of episode end."""
    steps, envs = len(rewards), len(rewards[0])
    adv = [[0.0] * envs for _ in range(steps)]
    for e in range(envs):
        running = 0.0
        for t in reversed(range(steps)):
            if terminated[t][e]:
                bootstrap = 0.0
            elif truncated[t][e]:
                bootstrap = final_values[t][e]
            elif t == steps - 1:
                bootstrap = next_value[e]
            else:
                bootstrap = values[t + 1][e]
            delta = rewards[t][e] + gamma * bootstrap - values[t][e]
            if terminated[t][e] or truncated[t][e]:
                running = delta  # nothing flows back across an episode end
            else:
                running = delta + gamma * lam * running
            adv[t][e] = running
    returns = [[adv[t][e] + values[t][e] for e in range(envs)] for t in range(steps)]
    return adv, returns


def random_rollout(steps: int, envs: int, seed: int, dtype: torch.dtype) -> dict[str, Tensor]:
    """Random rewards/values and distinct flags, forcing the edge cases the semantics single out."""
    g = torch.Generator().manual_seed(seed)
    terminated = torch.rand(steps, envs, generator=g) < 0.2
    truncated = torch.rand(steps, envs, generator=g) < 0.2
    terminated[-1, 0], truncated[-1, 0] = True, False  # termination at the last step
    if envs > 1:
        terminated[-1, 1], truncated[-1, 1] = False, True  # truncation at the last step
    if envs > 2:
        terminated[-1, 2], truncated[-1, 2] = False, False  # unfinished tail: next_value
    if steps > 1:
        terminated[0, 0], truncated[0, 0] = True, True  # both flags on one step
    return {
        "rewards": torch.randn(steps, envs, generator=g, dtype=dtype),
        "values": torch.randn(steps, envs, generator=g, dtype=dtype),
        "terminated": terminated,
        "truncated": truncated,
        # non-zero everywhere, so using it where it should not be used changes the result
        "final_values": torch.randn(steps, envs, generator=g, dtype=dtype) + 3.0,
        "next_value": torch.randn(envs, generator=g, dtype=dtype) - 3.0,
    }


def run_reference(r: dict[str, Tensor], gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    adv, ret = reference_gae(
        r["rewards"].tolist(),
        r["values"].tolist(),
        r["terminated"].tolist(),
        r["truncated"].tolist(),
        r["final_values"].tolist(),
        r["next_value"].tolist(),
        gamma,
        lam,
    )
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(ret, dtype=torch.float64)


@pytest.mark.parametrize("shape", [(1, 1), (1, 3), (5, 1), (7, 3), (16, 4), (33, 8)])
@pytest.mark.parametrize(
    "gamma,lam", [(0.99, 0.95), (0.0, 0.95), (0.9, 0.0), (1.0, 1.0), (0.0, 0.0), (0.97, 1.0)]
)
def test_gae_matches_reference_loop(shape: tuple[int, int], gamma: float, lam: float) -> None:
    """The vectorised GAE must equal the per-env scalar definition for every flag pattern and coefficient."""
    steps, envs = shape
    r = random_rollout(steps, envs, seed=steps * 100 + envs, dtype=torch.float64)
    adv, ret = gae(
        r["rewards"],
        r["values"],
        r["terminated"],
        r["truncated"],
        r["final_values"],
        r["next_value"],
        gamma,
        lam,
    )
    exp_adv, exp_ret = run_reference(r, gamma, lam)
    assert adv.shape == ret.shape == (steps, envs)
    torch.testing.assert_close(adv, exp_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, exp_ret, rtol=1e-12, atol=1e-12)


def test_gae_float32_matches_reference() -> None:
    """The float32 path used in training agrees with the float64 reference to float32 precision."""
    r = random_rollout(64, 4, seed=7, dtype=torch.float32)
    adv, ret = gae(
        r["rewards"],
        r["values"],
        r["terminated"],
        r["truncated"],
        r["final_values"],
        r["next_value"],
        0.99,
        0.95,
    )
    exp_adv, exp_ret = run_reference(r, 0.99, 0.95)
    assert adv.dtype == ret.dtype == torch.float32
    torch.testing.assert_close(adv.double(), exp_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret.double(), exp_ret, rtol=1e-5, atol=1e-5)


def test_reference_sees_every_flag_pattern() -> None:
    """Guard on the test data itself: each bootstrap case occurs, so the comparison above can fail."""
    r = random_rollout(16, 4, seed=1604, dtype=torch.float64)
    term, trunc = r["terminated"], r["truncated"]
    assert (term & trunc).any() and (term & ~trunc).any() and (trunc & ~term).any()
    assert (~term & ~trunc).any()
    assert term[-1, 0] and trunc[-1, 1] and not (term[-1, 2] or trunc[-1, 2])


# Hand-worked: rewards [1, 2, 3], values [0.5, 1.0, 1.5], gamma 0.9, lambda 0.8, next_value 2.0.
# Truncated at t=1 with V(final obs) = 4.0:
#   t=2: delta = 3 + 0.9*2.0 - 1.5 = 3.3                 A2 = 3.3
#   t=1: delta = 2 + 0.9*4.0 - 1.0 = 4.6 (episode end)   A1 = 4.6
#   t=0: delta = 1 + 0.9*1.0 - 0.5 = 1.4                 A0 = 1.4 + 0.72*4.6 = 4.712
# Terminated at t=1 (final_values ignored):
#   t=1: delta = 2 + 0 - 1.0 = 1.0                       A1 = 1.0
#   t=0: A0 = 1.4 + 0.72*1.0 = 2.12
# Both flags at t=1: as terminated. No flags: A1 = (2 + 0.9*1.5 - 1) + 0.72*3.3 = 2.35 + 2.376 = 4.726,
#   A0 = 1.4 + 0.72*4.726 = 4.80272.
@pytest.mark.parametrize(
    "term1,trunc1,expected",
    [
        (False, True, [4.712, 4.6, 3.3]),
        (True, False, [2.12, 1.0, 3.3]),
        (True, True, [2.12, 1.0, 3.3]),
        (False, False, [4.80272, 4.726, 3.3]),
    ],
)
def test_gae_by_hand(term1: bool, trunc1: bool, expected: list[float]) -> None:
    """A T=3, E=1 rollout whose advantages were worked out on paper."""
    rewards = torch.tensor([[1.0], [2.0], [3.0]], dtype=torch.float64)
    values = torch.tensor([[0.5], [1.0], [1.5]], dtype=torch.float64)
    terminated = torch.tensor([[False], [term1], [False]])
    truncated = torch.tensor([[False], [trunc1], [False]])
    final_values = torch.tensor([[0.0], [4.0], [0.0]], dtype=torch.float64)
    next_value = torch.tensor([2.0], dtype=torch.float64)
    adv, ret = gae(rewards, values, terminated, truncated, final_values, next_value, 0.9, 0.8)
    exp = torch.tensor(expected, dtype=torch.float64).unsqueeze(1)
    torch.testing.assert_close(adv, exp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, exp + values, rtol=0, atol=1e-12)


def test_compute_advantages_fills_storage_in_place() -> None:
    """The rollout storage's own `advantages`/`returns` tensors receive GAE; nothing else is touched."""
    steps, envs = 9, 3
    storage = rollout_storage(
        steps, envs, gym.spaces.Box(-1, 1, (4,), np.float32), gym.spaces.Discrete(2), "cpu"
    )
    r = random_rollout(steps, envs, seed=3, dtype=torch.float32)
    for key in ("rewards", "values", "terminated", "truncated", "final_values"):
        storage[key].copy_(r[key])
    adv_buf, ret_buf = storage["advantages"], storage["returns"]
    ptrs = (adv_buf.data_ptr(), ret_buf.data_ptr())
    before = {k: storage[k].clone() for k in ("rewards", "values", "terminated", "truncated", "final_values")}

    compute_advantages(storage, r["next_value"], 0.95, 0.9)

    exp_adv, exp_ret = run_reference(r, 0.95, 0.9)
    assert (storage["advantages"].data_ptr(), storage["returns"].data_ptr()) == ptrs
    torch.testing.assert_close(adv_buf.double(), exp_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret_buf.double(), exp_ret, rtol=1e-5, atol=1e-5)
    assert adv_buf.abs().sum() > 0
    for key, tensor in before.items():
        assert torch.equal(storage[key], tensor), key


@pytest.mark.parametrize("steps", [1, 2, 3, 5, 8, 129])
def test_reverse_scan_matches_the_step_loop(steps: int) -> None:
    """The log-depth scan is the recurrence A[t] = delta[t] + carry[t] * A[t+1] for any length, episode
    ends (zero carries) included."""
    g = torch.Generator().manual_seed(steps)
    deltas = torch.randn(steps, 3, generator=g, dtype=torch.float64)
    carry = torch.rand(steps, 3, generator=g, dtype=torch.float64) * (torch.rand(steps, 3, generator=g) > 0.2)
    expected, last = torch.zeros_like(deltas), torch.zeros(3, dtype=torch.float64)
    for t in range(steps - 1, -1, -1):
        last = deltas[t] + carry[t] * last
        expected[t] = last
    torch.testing.assert_close(reverse_scan(deltas, carry), expected, rtol=0, atol=1e-12)
