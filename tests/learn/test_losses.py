"""PPO losses against numbers worked out by hand (clip coefficient 0.2 throughout)."""

from __future__ import annotations

import math

import pytest
import torch

from ppo_fabric.learn.loss import entropy_loss, normalize, policy_loss, value_loss

F64 = torch.float64


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=F64)


# ratio 0.5 (below 1-eps), A=+1:  min(0.5, 0.8)      = 0.5   (unclipped term chosen: gradient flows)
# ratio 1.1 (inside),      A=-2:  min(-2.2, -2.2)    = -2.2
# ratio 1.5 (above 1+eps), A=+3:  min(4.5, 3.6)      = 3.6   (clipped: no gradient)
# loss = -(0.5 - 2.2 + 3.6) / 3 = -1.9/3
# ratio 0.5, A=-1: min(-0.5, -0.8) = -0.8 (clipped); ratio 1.5, A=-1: min(-1.5, -1.2) = -1.5 (unclipped);
# ratio 1.0, A=+2: 2.0; loss = -(-0.8 - 1.5 + 2.0) / 3 = 0.1
@pytest.mark.parametrize(
    "ratios,advantages,expected",
    [
        ((0.5, 1.1, 1.5), (1.0, -2.0, 3.0), -1.9 / 3),
        ((0.5, 1.5, 1.0), (-1.0, -1.0, 2.0), 0.1),
        ((1.0, 1.0, 1.0), (1.0, -2.0, 4.0), -1.0),
    ],
)
def test_policy_loss_by_hand(
    ratios: tuple[float, ...], advantages: tuple[float, ...], expected: float
) -> None:
    """Pessimistic clipped surrogate, negated, for ratios inside and outside [0.8, 1.2] and both signs of A."""
    old = t(-0.3, -1.2, -2.0)
    new = old + t(*ratios).log()
    loss = policy_loss(new, old, t(*advantages), 0.2)
    assert loss.shape == ()
    assert loss.item() == pytest.approx(expected, abs=1e-12)


def test_policy_loss_gradient_vanishes_only_where_clipped() -> None:
    """d loss / d new_logp = -A * ratio / n where the unclipped term is the minimum, 0 where clipping wins."""
    old = t(0.0, 0.0, 0.0, 0.0)
    new = (old + t(0.5, 1.1, 1.5, 0.5).log()).requires_grad_(True)
    adv = t(1.0, -2.0, 3.0, -1.0)
    policy_loss(new, old, adv, 0.2).backward()
    expected = t(-1.0 * 0.5 / 4, 2.0 * 1.1 / 4, 0.0, 0.0)
    torch.testing.assert_close(new.grad, expected, rtol=0, atol=1e-12)


def test_policy_loss_respects_clip_coef() -> None:
    """A different clip coefficient changes which elements are clipped: 0.6 admits ratio 1.5 unclipped."""
    old = t(0.0, 0.0, 0.0)
    new = t(0.5, 1.1, 1.5).log()
    # clip 0.6 -> [0.4, 1.6]: nothing clipped, min picks surrogate everywhere: -(0.5 - 2.2 + 4.5)/3
    assert policy_loss(new, old, t(1.0, -2.0, 3.0), 0.6).item() == pytest.approx(-2.8 / 3, abs=1e-12)


# new [1, 2, 3], old [1.5, 1.5, 1.5], returns [0, 2.5, 2]
#   unclipped: (1-0)^2 + (2-2.5)^2 + (3-2)^2 = 1 + 0.25 + 1 = 2.25            -> 0.75
#   clipped to old +- 0.2 = [1.3, 1.7, 1.7]: 1.69, 0.64, 0.09
#   the larger of each pair: 1.69 + 0.64 + 1 = 3.33                           -> 3.33/3
@pytest.mark.parametrize("clip_vloss,expected", [(False, 0.75), (True, 3.33 / 3)])
def test_value_loss_by_hand(clip_vloss: bool, expected: float) -> None:
    """Plain MSE, or per step the larger of it and the MSE of the prediction clamped to within clip_coef
    of the rollout's value (PPO2 / CleanRL)."""
    loss = value_loss(t(1.0, 2.0, 3.0), t(1.5, 1.5, 1.5), t(0.0, 2.5, 2.0), 0.2, clip_vloss)
    assert loss.shape == ()
    assert loss.item() == pytest.approx(expected, abs=1e-12)


def test_clipped_value_loss_still_pulls_back_a_prediction_that_moved_too_far() -> None:
    """Clamping alone would give a prediction beyond old +- clip no gradient; the max form keeps it."""
    new = t(3.0).requires_grad_()
    value_loss(new, t(1.5), t(0.0), 0.2, True).backward()
    assert new.grad.item() == pytest.approx(6.0)  # d/dnew (new - 0)^2 = 2 * 3


def test_value_loss_clip_is_identity_inside_the_range() -> None:
    """Predictions within clip_coef of the old values give the same loss clipped or not."""
    new, old, ret = t(1.0, 2.1, -0.4), t(1.1, 2.0, -0.3), t(0.0, 3.0, 1.0)
    # (1.0)^2 + (0.9)^2 + (1.4)^2 = 1 + 0.81 + 1.96 = 3.77
    for clip_vloss in (False, True):
        assert value_loss(new, old, ret, 0.2, clip_vloss).item() == pytest.approx(3.77 / 3, abs=1e-12)


def test_entropy_loss_by_hand() -> None:
    """Negated mean entropy: -(0.5 + 1.0 + 1.5)/3 = -1."""
    assert entropy_loss(t(0.5, 1.0, 1.5)).item() == pytest.approx(-1.0, abs=1e-12)
    assert entropy_loss(t(0.2, 0.1, 0.0)).item() == pytest.approx(-0.1, abs=1e-12)


def test_normalize_by_hand() -> None:
    """Zero mean, unit (Bessel-corrected) standard deviation."""
    torch.testing.assert_close(normalize(t(1.0, 2.0, 3.0)), t(-1.0, 0.0, 1.0), rtol=0, atol=1e-7)
    # [2, 4, 6, 8]: mean 5, sample variance (9 + 1 + 1 + 9) / 3 = 20/3
    std = math.sqrt(20 / 3)
    expected = t(-3 / std, -1 / std, 1 / std, 3 / std)
    torch.testing.assert_close(normalize(t(2.0, 4.0, 6.0, 8.0)), expected, rtol=0, atol=1e-7)


def test_normalize_constant_input_is_finite_zero() -> None:
    """The eps keeps a zero-variance minibatch finite instead of dividing 0 by 0."""
    out = normalize(t(5.0, 5.0, 5.0))
    torch.testing.assert_close(out, t(0.0, 0.0, 0.0), rtol=0, atol=0)
