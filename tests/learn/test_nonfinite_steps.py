"""A minibatch step whose loss or gradient is not finite is skipped, parameters and optimiser state left
exactly as they were (on the direct fused path and on Fabric's layered path); an update counts its skips
(`train/skipped_steps`), and updates in a row with skips, or a parameter blown past `algo.max_param_abs`,
end the run with `UpdateDiverged` naming the cause."""

from __future__ import annotations

import copy

import pytest
import torch
from lightning_fabric import Fabric
from torch import nn

from ppo_fabric.learn.learners import Learner
from ppo_fabric.learn.optim import GradientStep
from ppo_fabric.learn.update import UpdateDiverged, check_magnitude, check_skips, nonfinite_term

pytestmark = pytest.mark.unit


def _setup() -> tuple[Fabric, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    return fabric, *fabric.setup(model, opt)


def _step(fabric: Fabric, model: nn.Module, finish: GradientStep, poison: float | None) -> torch.Tensor:
    """One minibatch step; `poison` (NaN, inf) multiplies the loss."""
    for p in model.parameters():
        p.grad = None
    loss = model(torch.randn(16, 4)).pow(2).mean()
    if poison is not None:
        loss = loss * poison
    fabric.backward(loss)
    return finish()


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
@pytest.mark.parametrize("path", ["direct", "layered"])
def test_a_nonfinite_step_leaves_parameters_and_adam_untouched(poison: float, path: str) -> None:
    fabric, model, opt = _setup()
    finish = GradientStep(fabric, model, opt, max_norm=0.5)
    if path == "direct":  # the first step creates Adam's state (layered); later ones go direct
        assert float(_step(fabric, model, finish, None)) == 0.0
        finish = GradientStep(fabric, model, opt, max_norm=0.5)
        finish._groups = finish.states()
        assert finish.direct and finish._groups is not None
    before = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.optimizer.state_dict())
    # a twin that never sees the skipped step: plain torch, from the same parameters and Adam state
    twin = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    twin.load_state_dict({k.removeprefix("_forward_module."): v for k, v in model.state_dict().items()})
    twin_opt = torch.optim.Adam(twin.parameters(), lr=1e-2, fused=True)
    twin_opt.load_state_dict(copy.deepcopy(state))
    assert float(_step(fabric, model, finish, poison)) == 1.0  # skipped
    for a, p in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, p.detach())
    after = opt.optimizer.state_dict()
    assert after["state"].keys() == state["state"].keys()
    for k, s in state["state"].items():
        for key, value in s.items():
            assert torch.equal(value, after["state"][k][key]), (k, key)
    # the next finite step is taken as if the skipped one had never been tried: Adam's bias correction
    # counts the steps taken (the direct path once counted the skipped one until the update's end)
    torch.manual_seed(1)
    assert float(_step(fabric, model, finish, None)) == 0.0
    torch.manual_seed(1)
    twin(torch.randn(16, 4)).pow(2).mean().backward()
    torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.5)
    twin_opt.step()
    assert not all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters(), strict=True))
    for t, p in zip(twin.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), t.detach(), rtol=0, atol=1e-7)


def test_nonfinite_term_names_the_first_bad_loss() -> None:
    ok = torch.tensor([[0.1, 0.2, -0.5]])
    assert nonfinite_term(torch.cat([ok, torch.tensor([[0.1, float("nan"), float("inf")]])])) == "loss/value"
    assert nonfinite_term(torch.cat([ok, torch.tensor([[float("inf"), 0.0, 0.0]])])) == "loss/policy"
    assert nonfinite_term(ok) == "the gradient norm"


def _learner(model: nn.Module) -> Learner:
    from types import SimpleNamespace

    return Learner(model, None, model, SimpleNamespace(name="main"))  # type: ignore[arg-type]


def test_updates_in_a_row_with_skips_end_the_run() -> None:
    learner = _learner(nn.Linear(2, 2))
    skipped = {"train/skipped_steps": 4, "skip_cause": "loss/value", "steps": 8}
    check_skips(learner, dict(skipped), 3, 1000)
    check_skips(learner, {"train/skipped_steps": 0}, 3, 2000)  # a clean update resets the count
    check_skips(learner, dict(skipped), 3, 3000)
    check_skips(learner, dict(skipped), 3, 4000)
    with pytest.raises(UpdateDiverged, match=r"3 updates in a row .* loss/value not finite \(4 of 8 steps"):
        check_skips(learner, dict(skipped), 3, 5000)
    check_skips(_learner(nn.Linear(2, 2)), dict(skipped), 0, 0)  # 0: never


def test_a_parameter_past_the_limit_ends_the_run() -> None:
    model = nn.Linear(3, 2)
    check_magnitude(_learner(model), 1e6, 0)
    with torch.no_grad():
        model.weight[1, 2] = -3e7
    with pytest.raises(UpdateDiverged, match=r"magnitude 3e\+07, beyond algo.max_param_abs=1e\+06"):
        check_magnitude(_learner(model), 1e6, 0)
    check_magnitude(_learner(model), 0, 0)  # 0: off
    with torch.no_grad():
        model.bias[0] = float("nan")
    with pytest.raises(UpdateDiverged, match="magnitude nan"):
        check_magnitude(_learner(model), 1e6, 0)


def test_an_update_on_a_poisoned_batch_skips_every_step_and_names_the_term() -> None:
    """update_policy's wiring: every minibatch step of a batch whose returns are NaN is skipped, counted,
    blamed on the value loss; the parameters are those before the update."""
    from omegaconf import OmegaConf

    from ppo_fabric.envs.make import make_vector_env
    from ppo_fabric.learn.buffer import training_batch
    from tests.conftest import single_learner
    from tests.conftest import update_with_config as train
    from tests.learn.test_ratio import N, algo_cfg, collect, env_cfg, model_cfg

    fabric = Fabric(accelerator="cpu", devices=1)
    algo = algo_cfg(minibatch_size=N // 4, update_epochs=2)
    torch.manual_seed(0)
    envs, _ = make_vector_env(env_cfg(), 0, 0)
    cfg = OmegaConf.create({"model": model_cfg(), "algo": algo})
    learner = single_learner(fabric, cfg, envs.single_observation_space, envs.single_action_space)
    envs.close()
    storage = collect(learner.policy)
    batch = training_batch(storage, 1)
    batch["returns"][:] = float("nan")
    before = [p.detach().clone() for p in learner.policy.parameters()]
    stats = train(fabric, learner.model, learner.optimizer, batch, algo)
    assert stats["train/skipped_steps"] == 8 and stats["steps"] == 8
    assert stats["skip_cause"] == "loss/value"
    for a, p in zip(before, learner.policy.parameters(), strict=True):
        assert torch.equal(a, p.detach())


def test_the_streak_of_updates_with_skips_goes_on_across_a_resume() -> None:
    """A checkpoint holds each policy's streak, and a resume goes on counting from it: restarted from 0, a
    run that skipped every step, stopped and resumed (or relaunched by `restarts=N`) more often than
    `algo.max_skipped_updates`, never ended."""
    from ppo_fabric.config.values import compose
    from ppo_fabric.learn.learners import build_learners, learners_state, policy_specs

    cfg, _ = compose([])
    fabric, specs = Fabric(accelerator="cpu", devices=1), policy_specs(cfg)
    learners = build_learners(fabric, specs, None, 1e-5)
    learners["main"].skip_streak = 2
    state = learners_state(cfg, learners)
    assert state["skip_streaks"] == {"main": 2}
    resumed = build_learners(fabric, specs, state, 1e-5)
    assert resumed["main"].skip_streak == 2
    skipped = {"train/skipped_steps": 4, "skip_cause": "loss/value", "steps": 8}
    with pytest.raises(UpdateDiverged, match="3 updates in a row"):
        check_skips(resumed["main"], skipped, 3, 5000)
    del state["skip_streaks"]  # a checkpoint from before the key: 0
    assert build_learners(fabric, specs, state, 1e-5)["main"].skip_streak == 0
