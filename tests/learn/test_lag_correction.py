"""The decoupled PPO objective that learns from a batch collected by an older policy (the pipelined
decoupled strategy's one-update lag): the loss against hand-computed values, and `update_policy` with a
lagged batch against the model's own outputs; an on-policy batch stays plain PPO, bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict

from ppo_fabric.learn.advantages import compute_advantages, gae
from ppo_fabric.learn.buffer import training_batch
from ppo_fabric.learn.loss import importance_weights, policy_loss
from ppo_fabric.learn.settings import UpdateSettings
from ppo_fabric.learn.update import LAG_METRICS, recomputed_advantages
from tests.conftest import update_with_config
from tests.learn.test_ratio import (  # noqa: F401 (one_thread: the module's autouse fixture, as the CLI runs)
    ENVS,
    KEYS,
    STEPS,
    algo_cfg,
    collect,
    fabric_learner,
    one_thread,
    params,
)

F64 = torch.float64


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=F64)


# ratios to the proximal policy 0.5, 1.1, 1.5 with A = 1, -2, 3 (test_losses.py): min terms 0.5, -2.2, 3.6;
# weights 0.5, 1, 2: 0.25 - 2.2 + 7.2 = 5.25, so the loss is -5.25 / 3 = -1.75
def test_weighted_policy_loss_by_hand() -> None:
    prox = t(-0.3, -1.2, -2.0)
    new = prox + t(0.5, 1.1, 1.5).log()
    loss = policy_loss(new, prox, t(1.0, -2.0, 3.0), 0.2, weights=t(0.5, 1.0, 2.0))
    assert loss.item() == pytest.approx(-1.75, abs=1e-12)
    # unit weights are plain PPO
    assert policy_loss(new, prox, t(1.0, -2.0, 3.0), 0.2, weights=t(1.0, 1.0, 1.0)).item() == pytest.approx(
        -1.9 / 3, abs=1e-12
    )


def test_weighted_policy_loss_gradient() -> None:
    """d loss / d new_logp = -w * A * ratio / n where the unclipped term is the minimum, 0 where clipped:
    the clip range is the proximal policy's, whatever the behaviour policy was."""
    prox = t(0.0, 0.0, 0.0, 0.0)
    new = (prox + t(0.5, 1.1, 1.5, 0.5).log()).requires_grad_(True)
    policy_loss(new, prox, t(1.0, -2.0, 3.0, -1.0), 0.2, weights=t(0.25, 0.5, 1.0, 1.0)).backward()
    expected = t(-0.25 * 1.0 * 0.5 / 4, 0.5 * 2.0 * 1.1 / 4, 0.0, 0.0)
    torch.testing.assert_close(new.grad, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "max_weight,weights,cut",
    [(1.0, (0.5, 1.0, 1.0), (False, False, True)), (2.0, (0.5, 1.0, 2.0), (False, False, True)),
     (4.0, (0.5, 1.0, 3.0), (False, False, False))],
)  # fmt: skip
def test_importance_weights_truncate(max_weight: float, weights: tuple, cut: tuple) -> None:
    """pi_proximal / pi_behaviour = 0.5, 1, 3, truncated at `max_weight`; `cut` marks the truncated steps."""
    w, truncated = importance_weights(t(0.5, 1.0, 3.0), max_weight)
    torch.testing.assert_close(w, t(*weights), rtol=0, atol=1e-12)
    assert truncated.tolist() == list(cut)


def _updated(seed: int, lagged: bool | None, **algo: object) -> tuple[dict[str, float], list[torch.Tensor]]:
    fabric, model, optimizer, agent = fabric_learner(seed=seed)
    storage = collect(agent, seed=seed)
    torch.manual_seed(seed + 100)  # the minibatch shuffles
    cfg = algo_cfg(minibatch_size=32, update_epochs=2, **algo)
    stats = update_with_config(fabric, model, optimizer, training_batch(storage), cfg, lagged=lagged)
    return stats, params(agent)


def test_on_policy_batches_are_plain_ppo_bit_for_bit() -> None:
    """lag 0 (`lagged=False`) and a strategy that never lags (`lagged=None`) take the same steps, to the
    bit; the decoupled strategy's lag metrics are then neutral, and a coupled run has none."""
    plain, plain_params = _updated(4, None)
    on_policy, on_policy_params = _updated(4, False)
    assert set(plain) == KEYS and set(on_policy) == KEYS | set(LAG_METRICS)
    assert on_policy["train/is_weight_mean"] == 1.0 and on_policy["train/is_truncated"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(plain_params, on_policy_params, strict=True))
    assert all(plain[k] == on_policy[k] for k in KEYS)
    # with the correction off, a lagged batch is plain PPO too
    _, off_params = _updated(4, True, lag_objective=False, lag_refresh_advantages=False)
    assert all(torch.equal(a, b) for a, b in zip(plain_params, off_params, strict=True))


def _lagged_batch(seed: int, shift: torch.Tensor, value_shift: float) -> tuple:
    """A batch whose behaviour log-probs and values differ from the model's own by known amounts."""
    fabric, model, optimizer, agent = fabric_learner(seed=seed)
    batch = training_batch(collect(agent, seed=seed))
    with torch.no_grad():
        prox_logp, _, prox_values = agent(batch["obs"], batch["actions"])
    stale = TensorDict(dict(batch.items()), batch_size=batch.batch_size).clone()
    stale["logprobs"] = prox_logp - shift  # pi_proximal / pi_behaviour = exp(shift)
    stale["values"] = prox_values + value_shift
    return fabric, model, optimizer, agent, stale, prox_logp, prox_values


def test_lagged_update_by_hand() -> None:
    """One epoch of one minibatch (the whole batch): the first forward pass is the proximal policy itself,
    so every ratio is 1 (no clipping, KL 0) although the behaviour log-probs are far off; the policy loss is
    -mean(w * A_norm) with w = min(exp(shift), 1), and the clipped value loss is centred on the proximal
    values (a plain clipped loss around values 5 off would be ~25 larger)."""
    n = 128
    shift = torch.linspace(-1.0, 1.0, n)  # half the steps have weight exp(shift) < 1, half are truncated
    fabric, model, optimizer, agent, stale, prox_logp, prox_values = _lagged_batch(5, shift, 5.0)
    weights = shift.exp().clamp(max=1.0)
    adv = stale["advantages"]
    adv_norm = (adv - adv.mean()) / (adv.std() + 1e-8)
    expected_pg = -(weights * adv_norm).mean().item()
    expected_vl = (prox_values - stale["returns"]).pow(2).mean().item()
    behaviour = stale.clone()

    algo = algo_cfg(minibatch_size=n, update_epochs=1, clip_vloss=True, lag_weight_clip=1.0)
    stats = update_with_config(fabric, model, optimizer, stale, algo, lagged=True)

    assert stats["train/clip_fraction"] == 0.0 and abs(stats["train/approx_kl"]) < 1e-7
    assert stats["train/is_weight_mean"] == pytest.approx(weights.mean().item(), rel=1e-5)
    assert stats["train/is_truncated"] == pytest.approx((shift > 0).float().mean().item())
    assert stats["loss/policy"] == pytest.approx(expected_pg, rel=1e-4, abs=1e-6)
    assert stats["loss/value"] == pytest.approx(expected_vl, rel=1e-5)
    assert all(math.isfinite(v) for v in stats.values())
    # the caller's batch still holds the behaviour policy's figures
    assert all(torch.equal(stale[k], behaviour[k]) for k in behaviour.keys())  # noqa: SIM118
    assert "weights" not in stale.keys()  # noqa: SIM118


def test_lag_correction_changes_the_step() -> None:
    """The same lagged batch learnt with and without the correction moves the parameters differently."""
    shift = torch.full(
        (128,), -0.7
    )  # every behaviour log-prob 0.7 above the proximal one: ratio 0.5 at start
    results = []
    for correct in (True, False):
        fabric, model, optimizer, agent, stale, *_ = _lagged_batch(6, shift, 0.0)
        algo = algo_cfg(minibatch_size=32, update_epochs=1, lag_objective=correct)
        stats = update_with_config(fabric, model, optimizer, stale, algo, lagged=True)
        results.append((stats, params(agent)))
    (corrected, p_corrected), (plain, p_plain) = results
    # plain PPO sees every step outside the clip range from the start; the correction none at first
    assert (
        plain["train/clip_fraction"] == 1.0 or plain["train/clip_fraction"] > corrected["train/clip_fraction"]
    )
    assert corrected["train/is_weight_mean"] == pytest.approx(math.exp(-0.7), rel=1e-5)
    assert plain["train/is_weight_mean"] == 1.0
    assert any(not torch.equal(a, b) for a, b in zip(p_corrected, p_plain, strict=True))


# ------------------------------------------------------------------------------- recomputed advantages
def _episodes(seed: int) -> tuple[torch.Tensor, ...]:
    """A [12, 3] rollout with terminations and time-limit truncations, and two critics' values."""
    g = torch.Generator().manual_seed(seed)
    shape = (12, 3)
    rewards = torch.randn(shape, generator=g, dtype=F64)
    terminated = torch.rand(shape, generator=g) < 0.15
    truncated = (torch.rand(shape, generator=g) < 0.1) & ~terminated
    final_values = torch.where(truncated, torch.randn(shape, generator=g, dtype=F64), 0.0)
    old, new = torch.randn(shape, generator=g, dtype=F64), torch.randn(shape, generator=g, dtype=F64)
    next_value = torch.randn(3, generator=g, dtype=F64)
    return rewards, terminated, truncated, final_values, old, new, next_value


def _storage(seed: int) -> tuple[TensorDict, torch.Tensor, torch.Tensor]:
    """`_episodes` as a rollout storage whose GAE the old critic computed (`compute_advantages`)."""
    rewards, term, trunc, final_values, old, new, next_value = _episodes(seed)
    storage = TensorDict(
        {"rewards": rewards, "terminated": term, "truncated": trunc, "final_values": final_values,
         "values": old, "advantages": torch.zeros_like(old), "returns": torch.zeros_like(old),
         "next_values": torch.zeros_like(old)},
        batch_size=old.shape,
    )  # fmt: skip
    compute_advantages(storage, next_value, 0.99, 0.95)
    return storage, new, next_value


def test_next_values_are_what_each_step_bootstraps_from() -> None:
    """By hand: the next row's value, V(final observation) at a time limit, 0 at a termination, the
    rollout's V(next observation) in the last row."""
    storage, _, next_value = _storage(0)
    values, term, trunc = storage["values"], storage["terminated"], storage["truncated"]
    for t in range(12):
        for e in range(3):
            if term[t, e]:
                expected = 0.0
            elif trunc[t, e]:
                expected = storage["final_values"][t, e].item()
            else:
                expected = (values[t + 1, e] if t < 11 else next_value[e]).item()
            assert storage["next_values"][t, e].item() == expected


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_recomputed_advantages_are_gae_with_the_new_critic(seed: int) -> None:
    """One piece of rollout, traces off: GAE over the rewards with the new critic's values (the bootstraps
    at time limits and after the rollout stay the old ones, the only values the batch cannot recompute)."""
    storage, new, next_value = _storage(seed)
    rewards, term, trunc, final_values = (
        storage[k] for k in ("rewards", "terminated", "truncated", "final_values")
    )
    lag = UpdateSettings.of(algo_cfg(gamma=0.99, gae_lambda=0.95)).lag
    adv, ret = recomputed_advantages(storage.reshape(-1), new.reshape(-1), (12, 3), 1, lag, None)
    expected_adv, expected_ret = gae(rewards, new, term, trunc, final_values, next_value, 0.99, 0.95)
    torch.testing.assert_close(adv, expected_adv, rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, expected_ret, rtol=0, atol=1e-12)


def test_recomputed_advantages_of_two_pieces() -> None:
    """Two pieces of rollout in one batch (two players, or the shards of two trainers): the last row of
    the first bootstraps from the old critic's value of the next row and carries nothing over."""
    storage, new, next_value = _storage(3)
    rewards, term, trunc, final_values = (
        storage[k] for k in ("rewards", "terminated", "truncated", "final_values")
    )
    lag = UpdateSettings.of(algo_cfg(gamma=0.99, gae_lambda=0.95)).lag
    adv, _ = recomputed_advantages(storage.reshape(-1), new.reshape(-1), (12, 3), 2, lag, None)
    bootstrap = torch.where(term[5], 0.0, torch.where(trunc[5], final_values[5], storage["values"][6]))
    first, _ = gae(rewards[:6], new[:6], term[:6], trunc[:6], final_values[:6], bootstrap, 0.99, 0.95)
    second, _ = gae(rewards[6:], new[6:], term[6:], trunc[6:], final_values[6:], next_value, 0.99, 0.95)
    torch.testing.assert_close(adv, torch.cat((first, second)), rtol=0, atol=1e-12)


def test_traces_by_hand() -> None:
    """One env, three steps, no episode end, gamma 0.5, lambda 1, V = 0 (so delta = reward):
    A2 = r2 + gamma * bootstrap, A1 = r1 + gamma * c2 * A2, A0 = r0 + gamma * c1 * A1."""
    rewards, values = t(1.0, 2.0, 4.0).view(3, 1), torch.zeros(3, 1, dtype=F64)
    no = torch.zeros(3, 1, dtype=torch.bool)
    traces = t(0.5, 0.25, 1.0).view(3, 1)  # c1 = 0.5 (weighs A1 into A0), c2 = 0.25
    adv, _ = gae(rewards, values, no, no, values, t(8.0), 0.5, 1.0, traces=traces)
    a2 = 4.0 + 0.5 * 8.0
    a1 = 2.0 + 0.5 * 0.25 * a2
    a0 = 1.0 + 0.5 * 0.5 * a1
    torch.testing.assert_close(adv.view(-1), t(a0, a1, a2), rtol=0, atol=1e-12)
    plain, _ = gae(rewards, values, no, no, values, t(8.0), 0.5, 1.0)
    ones, _ = gae(rewards, values, no, no, values, t(8.0), 0.5, 1.0, traces=torch.ones_like(traces))
    assert torch.equal(plain, ones)


def test_lagged_update_learns_from_recomputed_advantages() -> None:
    """`update_policy` with a lagged batch whose advantages came from a stale critic (the values 0.5 off):
    its first minibatch (the whole batch, ratio 1, so every trace is 1) sees the advantages of the model's
    own critic, so its value loss is mean(A_new^2) where A_new is GAE over the rewards with the model's
    values."""
    fabric, model, optimizer, agent = fabric_learner(seed=7)
    storage = collect(agent, seed=7)
    with torch.no_grad():
        new_values = agent.get_value(storage["obs"].reshape(STEPS * ENVS, -1)).view(STEPS, ENVS)
    next_value = torch.zeros(ENVS)
    ends = (storage["terminated"], storage["truncated"], storage["final_values"], next_value, 0.99, 0.95)
    storage["values"] = new_values + 0.5
    compute_advantages(storage, next_value, 0.99, 0.95)  # the stale critic's GAE, as a player computes it
    old_adv = storage["advantages"].clone()
    new_adv, _ = gae(storage["rewards"], new_values, *ends)
    algo = algo_cfg(minibatch_size=STEPS * ENVS, update_epochs=1, norm_adv=False, lag_objective=False)
    batch = training_batch(storage, gae_inputs=True)

    stats = update_with_config(fabric, model, optimizer, batch, algo, lagged=True, layout=(1, ENVS))

    assert stats["loss/value"] == pytest.approx(new_adv.pow(2).mean().item(), rel=1e-4)
    assert stats["loss/policy"] == pytest.approx(-new_adv.mean().item(), rel=1e-4, abs=1e-6)
    assert stats["train/is_weight_mean"] == 1.0  # no objective correction asked for
    # without the layout (how the batch lies in time) the stale advantages are learnt as they are
    fabric, model, optimizer, agent = fabric_learner(seed=7)
    stats = update_with_config(fabric, model, optimizer, batch, algo, lagged=True)
    assert stats["loss/policy"] == pytest.approx(-old_adv.mean().item(), rel=1e-4, abs=1e-6)


def test_only_a_pipeline_that_recomputes_sends_the_gae_inputs() -> None:
    """DATA carries rewards, episode ends and bootstrap values only where the trainers use them."""
    from omegaconf import OmegaConf

    from ppo_fabric.learn.buffer import GAE_KEYS
    from ppo_fabric.ppo_decoupled import gae_inputs

    storage, _, _ = _storage(0)
    storage["obs"], storage["actions"], storage["logprobs"] = (
        storage["values"],
        storage["values"],
        storage["values"],
    )
    assert set(GAE_KEYS) <= set(training_batch(storage, gae_inputs=True).keys())
    assert not set(GAE_KEYS) & set(training_batch(storage).keys())
    cfg = lambda pipeline, refresh: OmegaConf.create(  # noqa: E731
        {"algo": {"pipeline": pipeline, "lag_refresh_advantages": refresh}}
    )
    assert gae_inputs(cfg(True, True))
    assert not gae_inputs(cfg(False, True)) and not gae_inputs(cfg(True, False))
