"""`Midway`: the decoupled pipeline's early publication of the parameters (`algo.pipeline_lag` < 1) runs after
a fixed share of an update's gradient steps, counted before the update starts, once per update, and never
changes the update itself."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict

from ppo_fabric.envs.multiagent import SINGLE
from ppo_fabric.learn.buffer import training_batch
from ppo_fabric.learn.update import Midway, gradient_steps, update_policies
from tests.learn.test_ratio import (  # noqa: F401 (one_thread: the module's autouse fixture, as the CLI runs)
    algo_cfg,
    collect,
    fabric_learner,
    one_thread,
    params,
)


def _adam_steps(optimizer: torch.optim.Optimizer) -> int:
    """How many optimiser steps the parameters have taken (Adam's own count)."""
    steps = {int(state["step"]) for state in optimizer.state.values()}
    assert len(steps) == 1
    return steps.pop()


def _update(seed: int, fraction: float | None, **algo: object) -> tuple[list[tuple], list[torch.Tensor]]:
    """One update of 2 epochs x 4 minibatches (8 gradient steps); what `Midway` saw when it ran: the
    optimiser's step count and the parameters."""
    fabric, model, optimizer, agent = fabric_learner(seed=seed)
    spec = SimpleNamespace(lr=2.5e-4, agents=1, trained=True)
    learner = SimpleNamespace(model=model, optimizer=optimizer, spec=spec)
    batch = training_batch(collect(agent, seed=seed))
    seen: list[tuple] = []
    midway = None
    if fraction is not None:
        midway = Midway(fraction, lambda: seen.append((_adam_steps(optimizer), params(agent))))
    torch.manual_seed(seed + 100)
    cfg = algo_cfg(minibatch_size=32, update_epochs=2, anneal_lr=False, **algo)
    update_policies(fabric, {SINGLE: learner}, {SINGLE: batch}, cfg, 0, 10_000, None, 32, None, None, midway)
    return seen, params(agent)


@pytest.mark.parametrize(("fraction", "after"), [(0.5, 4), (0.25, 2), (0.8, 6), (0.01, 1), (0.99, 8)])
def test_runs_once_after_its_share_of_the_gradient_steps(fraction: float, after: int) -> None:
    """8 gradient steps: the point is round(fraction * 8), at least 1; the parameters it sees are the
    ones after that many steps (neither the first nor the last), and the update ends where it would have."""
    seen, final = _update(3, fraction)
    assert [count for count, _ in seen] == [after]
    _, plain = _update(3, None)
    assert all(torch.equal(a, b) for a, b in zip(final, plain, strict=True)), "Midway changed the update"
    if after < 8:
        assert any(not torch.equal(a, b) for a, b in zip(seen[0][1], final, strict=True))


def test_an_update_stopped_early_publishes_at_its_end() -> None:
    """target_kl stops after the first epoch (4 steps), before the point at 6: it runs then, once."""
    seen, _ = _update(3, 0.75, target_kl=1e-12)
    assert [count for count, _ in seen] == [4]


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.5, 1.5])
def test_fraction_must_lie_inside_the_update(fraction: float) -> None:
    with pytest.raises(ValueError, match="fraction"):
        Midway(fraction, lambda: None)


def test_gradient_steps_count_minibatches_of_units() -> None:
    """Steps: 128 rows in minibatches of 32, 3 epochs = 12; a last partial minibatch counts; recurrent
    batches count sequences (64 steps per minibatch of sequences of 8 = 8 sequences)."""
    flat = torch.zeros(128)
    assert gradient_steps(TensorDict({"obs": flat}, batch_size=[128]), 32, 3) == 12
    assert gradient_steps(TensorDict({"obs": flat}, batch_size=[128]), 48, 1) == 3
    seqs = TensorDict({"initial_state": torch.zeros(20, 4), "starts": torch.zeros(20, 8)}, batch_size=[20])
    assert gradient_steps(seqs, 64, 2) == 6  # 20 sequences, 8 per minibatch: 3 per epoch
