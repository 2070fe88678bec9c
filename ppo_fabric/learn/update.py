"""The PPO update: one policy on one batch, every trained policy of a run, the learning-rate schedule.

Both strategies call `update_policies` on the ranks that learn (every coupled rank, the decoupled
trainers); nothing here knows which role a rank plays. Anything that must agree across training ranks
(the target-KL stop) goes through the `mean_across` function the caller passes in.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from lightning_fabric import Fabric
from tensordict import TensorDict

from ppo_fabric.compat.private import fabric_inner_module
from ppo_fabric.config.faults import RunFault
from ppo_fabric.learn import graph as whole
from ppo_fabric.learn.accel import compiled, uses_cuda_graphs
from ppo_fabric.learn.advantages import gae
from ppo_fabric.learn.buffer import GAE_KEYS
from ppo_fabric.learn.learners import Learner, metric_name, trained
from ppo_fabric.learn.loss import (
    entropy_loss,
    importance_weights,
    masked_mean,
    normalize,
    policy_loss,
    value_loss,
)
from ppo_fabric.learn.optim import GradientStep, forward_module
from ppo_fabric.learn.schedule import LrSchedule
from ppo_fabric.learn.settings import LagSettings, LossCoefs, UpdateSettings
from ppo_fabric.wire.progress import PROGRESS

TRAIN_METRICS = (
    "loss/policy",
    "loss/value",
    "loss/entropy",
    "train/approx_kl",
    "train/clip_fraction",
    "train/explained_variance",
    "train/epochs",
    "train/skipped_steps",
)
LOSS_TERMS = ("loss/policy", "loss/value", "loss/entropy")  # the order of a minibatch step's `stats`


class UpdateDiverged(RunFault):
    """Consecutive updates whose minibatch steps had non-finite losses or gradients: the run ends."""


# Logged by the decoupled strategy, whose batches may come from an older policy version (policy lag):
# the mean importance weight applied and the fraction of steps whose weight was truncated (1 and 0 when
# the batch was on-policy or `algo.lag_objective=false`).
LAG_METRICS = ("train/is_weight_mean", "train/is_truncated")


def minibatch_losses(
    model: Any,
    obs: Any,
    actions: torch.Tensor,
    old_logp: torch.Tensor,
    old_values: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor | None,
    action_mask: torch.Tensor | None,
    state: torch.Tensor | None,
    starts: torch.Tensor | None,
    coefs: LossCoefs,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward pass and PPO losses of one minibatch: (total loss, [policy, value, entropy], new log-probs).

    The one definition of the step, run as it is (eager) or under `torch.compile` (`algo.compile`).
    `mask`: steps that hold a transition (multi-agent); `action_mask`: the masks the rollout sampled
    under; `state`/`starts`: recurrent sequences' initial states and episode starts. `weights`: the
    decoupled objective's importance weights, with `old_logp`/`old_values` then the proximal policy's
    (`proximal`); None for plain PPO.
    """
    if action_mask is not None:
        new_logp, entropy, new_values = model(obs, actions, state, starts, action_mask)
    elif state is not None:
        new_logp, entropy, new_values = model(obs, actions, state, starts)
    else:
        new_logp, entropy, new_values = model(obs, actions)
    adv = normalize(advantages, mask=mask) if coefs.norm_adv else advantages
    pg = policy_loss(new_logp, old_logp, adv, coefs.clip, mask, weights)
    vl = value_loss(new_values, old_values, returns, coefs.clip, coefs.clip_vloss, mask)
    el = entropy_loss(entropy, mask)
    loss = pg.add(vl, alpha=coefs.vf_coef).add(el, alpha=coefs.ent_coef)  # 2 autograd nodes instead of 4
    return loss, torch.stack((pg, vl, el)), new_logp


def step_function(model: Any, compile_step: bool) -> Callable[..., Any]:
    """The minibatch step to run: `minibatch_losses` itself, or compiled for this model."""
    return compiled(minibatch_losses, model) if compile_step else minibatch_losses


def lagged_batch(
    model: Any,
    behaviour: TensorDict,
    batch: TensorDict,
    lag: LagSettings,
    chunk: int,
    layout: tuple[int, int] | None,
) -> tuple[TensorDict, dict[str, float]]:
    """What a batch collected by an older policy is learnt from, and the logged weight statistics.

    One forward pass gives the proximal log-probs and values (the model as it is now), which replace the
    behaviour policy's `values` (the centre of the clipped value loss). `lag.objective`: the proximal
    log-probs replace the behaviour ones as the centre of the clip range, and `weights` holds each step's
    truncated importance weight. `lag.refresh` (feed-forward, unmasked batches whose `layout` is known):
    advantages and returns recomputed with the current critic, and with `lag.vtrace` each step's
    lambda-return cut by V-trace's truncated importance ratio of the next step's action (the return of the
    collector's later actions counts as far as the current policy would take them too). The caller's
    `behaviour` batch is left as it was."""
    prox_logp, prox_values = proximal(model, batch, chunk)
    mask = batch["mask"] if "mask" in batch.keys() else None  # noqa: SIM118
    out = batch.clone(recurse=False)
    out["values"] = prox_values
    stats = {LAG_METRICS[0]: 1.0, LAG_METRICS[1]: 0.0}
    ratio = (prox_logp - batch["logprobs"]).exp()  # pi_proximal / pi_behaviour
    if lag.objective:
        weights, cut = importance_weights(ratio, lag.weight_clip)
        figures = torch.stack((masked_mean(weights, mask), masked_mean(cut.to(weights.dtype), mask)))
        stats = dict(zip(LAG_METRICS, figures.tolist(), strict=True))  # one device sync, not two
        out["weights"], out["logprobs"] = weights, prox_logp
    refresh = lag.refresh and layout is not None and mask is None and prox_values.dim() == 1
    if refresh and GAE_KEYS[0] in behaviour.keys():  # noqa: SIM118
        segments, envs = layout
        rows = batch.batch_size[0] // envs
        if rows * envs == batch.batch_size[0] and rows % segments == 0:
            traces = None
            if lag.vtrace:  # step t's trace is the next step's ratio (the last row's is never used)
                traces = ratio.clamp(max=1.0).view(rows, envs).roll(-1, 0)
            adv, ret = recomputed_advantages(behaviour, prox_values, (rows, envs), segments, lag, traces)
            out["advantages"], out["returns"] = adv.reshape(-1), ret.reshape(-1)
    return out, stats


def recomputed_advantages(
    behaviour: TensorDict,
    values: torch.Tensor,
    shape: tuple[int, int],
    segments: int,
    lag: LagSettings,
    traces: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE of a flat batch laid out as `segments` time-major pieces of rollout of shape [rows, envs], with
    the current critic's `values`. A step bootstraps from the next row's value within its piece; where the
    next observation is not in the batch (episode ends, the last row of a piece) from the collector's
    bootstrap value (`next_values`), the one value here that stays the older critic's."""
    rows, envs = shape
    terminated = behaviour["terminated"].view(shape)
    cut = behaviour["truncated"].view(shape)
    if segments > 1:  # the last row of each piece but the last (that one bootstraps from `next_value`)
        cut = cut.clone()
        cut[rows // segments - 1 :: rows // segments] = True
    old_next = behaviour["next_values"].view(shape)
    return gae(
        behaviour["rewards"].view(shape),
        values.view(shape),
        terminated,
        cut,
        old_next,
        old_next[-1],
        lag.gamma,
        lag.gae_lambda,
        traces=traces,
    )


PROXIMAL_CHUNK_FLOATS = 1 << 22  # observation floats per forward pass of `proximal` (16 MiB of float32)


@torch.no_grad()
def proximal(model: Any, batch: TensorDict, minibatch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and values of the batch's actions under the model as it is now (the proximal policy of the
    decoupled objective), in as few forward passes as keep each chunk's observations within
    `PROXIMAL_CHUNK_FLOATS` floats, and never smaller than the update's minibatches (a CartPole batch is
    one pass, an Atari batch a few minibatches a pass)."""
    keys = batch.keys()
    obs = batch["obs"][:1]  # one unit: a step, or a recurrent sequence of them
    leaves = obs.values(True, True) if isinstance(obs, TensorDict) else (obs,)  # Dict observations
    unit_floats = max(1, sum(leaf.numel() for leaf in leaves))
    chunk = max(minibatch, PROXIMAL_CHUNK_FLOATS // unit_floats)
    n = batch.batch_size[0]
    logps, values = [], []
    for start in range(0, n, chunk):
        part = batch[start : start + chunk] if chunk < n else batch
        args = [part["obs"], part["actions"]]
        if "initial_state" in keys or "action_mask" in keys:
            recurrent = "initial_state" in keys
            args += [part["initial_state"], part["starts"]] if recurrent else [None, None]
            if "action_mask" in keys:
                args.append(part["action_mask"])
        logp, _, value = model(*args)
        logps.append(logp)
        values.append(value)
    return (logps[0], values[0]) if len(logps) == 1 else (torch.cat(logps), torch.cat(values))


def update_policy(
    fabric: Fabric,
    model: Any,
    optimizer: Any,
    batch: TensorDict,
    settings: UpdateSettings,
    *,
    mean_across_trainers: Callable[[torch.Tensor], torch.Tensor] | None = None,
    rank_minibatch: int | None = None,
    lagged: bool | None = None,
    layout: tuple[int, int] | None = None,
) -> dict[str, float]:
    """One PPO update: `update_epochs` passes over shuffled minibatches of this rank's batch.

    `settings`: the run's `algo` values (`UpdateSettings.of`, read once per run).
    `rank_minibatch` is this rank's share of `algo.minibatch_size` (all of it on a single rank), in steps.
    The batch's units are single steps, or for recurrent policies whole sequences (`initial_state`,
    `starts`), so a minibatch then holds `rank_minibatch / seq_len` sequences. A `mask` (multi-agent rows of
    agents that had left) keeps absent steps out of every mean; an `action_mask` restricts log-probs and
    entropies to the actions that were legal at each step.
    With `target_kl` set, the KL estimate is averaged over all training ranks (`mean_across_trainers`)
    before deciding to stop, so every rank runs the same number of backward passes (DDP would hang).

    `lagged` (None: a strategy that never lags, and no `LAG_METRICS`): the batch was collected by an older
    version of the policy than the model's (the decoupled pipeline), and `lagged_batch` corrects for it
    (recomputed advantages, the decoupled PPO objective centred on the proximal policy with truncated
    importance weights); otherwise, and for every on-policy batch, the update is plain PPO, bit for bit.
    `layout`: (segments, envs) when the flat batch is `segments` time-major pieces of rollout with `envs`
    steps per row, which lets `lagged_batch` recompute the advantages.
    """
    keys = batch.keys()
    seq_len = batch["starts"].shape[1] if "initial_state" in keys else 1
    mb = (settings.minibatch_size if rank_minibatch is None else rank_minibatch) // seq_len
    steps = MinibatchSteps(fabric, model, optimizer, settings)
    behaviour = batch
    batch = batch.exclude(*GAE_KEYS) if GAE_KEYS[0] in keys else batch  # used by `lagged_batch` only
    lag = settings.lag if lagged else None
    lag_stats = {LAG_METRICS[0]: 1.0, LAG_METRICS[1]: 0.0}
    if lag is not None and (lag.objective or lag.refresh):
        batch, lag_stats = lagged_batch(steps.net, behaviour, batch, lag, mb, layout)
    for _ in range(settings.update_epochs):
        approx_kl = steps.epoch(batch, mb)
        if settings.target_kl is not None:
            kl = approx_kl if mean_across_trainers is None else mean_across_trainers(approx_kl)
            if kl.item() > settings.target_kl:
                break
    stats = steps.statistics(behaviour)
    return stats | lag_stats if lagged is not None else stats


class MinibatchSteps:
    """The minibatch steps of one update and what they leave to report: the step (eager or compiled, called
    the same way whatever the batch holds), the gradient step after it, and per step its losses and whether
    it was skipped, per epoch the ratio statistics."""

    def __init__(self, fabric: Fabric, model: Any, optimizer: Any, settings: UpdateSettings) -> None:
        self.fabric, self.coefs = fabric, settings.loss
        self.step = step_function(model, settings.compile)
        self.graphs = self.step is not minibatch_losses and uses_cuda_graphs(model)
        # Eager steps call the module under Fabric's wrapper directly where the wrapper adds nothing (optim.py).
        self.net = forward_module(fabric, model) if self.step is minibatch_losses else model
        # Gradients are dropped by hand: `optimizer.zero_grad` spends ~40-100 us per call in its profiler and
        # torch.compile wrappers, 5-8% of a CleanRL-sized minibatch step, to do what the loop does in ~1 us.
        # Clipping and the Adam step skip Fabric's and torch's generic layers the same way (optim.py).
        self.finish = GradientStep(fabric, model, optimizer, settings.max_grad_norm)
        # DDP all-reduces the gradients inside the backward: a wait on the other training ranks, which a
        # stuck peer's own watchdog names (marked busy, this rank named itself stuck "in update").
        inner = fabric_inner_module(model)
        self.synced = isinstance(inner, torch.nn.parallel.DistributedDataParallel)
        # 1.0 per minibatch step skipped (a gradient norm not finite), 0.0 per step taken; the gradients are
        # all-reduced first, so every training rank decides alike.
        self.skips: list[torch.Tensor] = []
        self.losses: list[torch.Tensor] = []  # (policy, value, entropy) per minibatch
        self.ratio_stats: list[torch.Tensor] = []  # (approx KL, clip fraction) per epoch
        # `algo.compile=graph`: the whole step in one CUDA graph once this update has one (learn/graph.py)
        self.model, self.max_norm = model, settings.max_grad_norm
        self.graph_mode, self.whole, self.warmups = settings.graph, None, 0
        if self.graph_mode and (not self.finish.direct or self.net is model):
            raise RunFault(
                "algo.compile=graph records the direct minibatch step: torch's fused Adam at full precision "
                "(fabric.precision=32-true) on one training rank; set algo.compile=true or false"
            )

    def epoch(self, batch: TensorDict, mb: int) -> torch.Tensor:
        """One pass over `batch` shuffled, in minibatches of `mb` units; returns the epoch's approximate KL."""
        n = batch.batch_size[0]
        shuffled = batch[torch.randperm(n, device=batch.device)]
        columns = [shuffled.get(key, None) for key in STEP_COLUMNS]  # absent: None (no mask, no state, ...)
        weights = shuffled.get("weights", None)  # the decoupled objective's, on a lagged batch only
        new_logps = []
        for start in range(0, n, mb):
            PROGRESS.mark("update")  # the stall watchdog's heartbeat
            sl = slice(start, start + mb)
            part = [None if column is None else column[sl] for column in (*columns, weights)]
            graph = self.whole_step(part) if self.graph_mode else None
            if graph is not None:  # its outputs are its own, overwritten by the next replay: copied out
                stats, new_logp, skipped = (t.clone() for t in graph(part))
                self.skips.append(skipped)
                new_logps.append(new_logp)
                self.losses.append(stats)
                continue
            with whole.warmup_stream(self.finish.params[0].device) if self.graph_mode else nullcontext():
                self.eager_step(part, new_logps)
        # The ratio statistics of the whole epoch at once: a dozen small ops per epoch, not per minibatch.
        with torch.no_grad():
            masks = columns[STEP_COLUMNS.index("mask")]
            logratio = torch.cat(new_logps) - columns[STEP_COLUMNS.index("logprobs")]
            ratio = logratio.exp()
            approx_kl = masked_mean((ratio - 1) - logratio, masks)
            clipfrac = masked_mean(((ratio - 1).abs() > self.coefs.clip).float(), masks)
            self.ratio_stats.append(torch.stack((approx_kl, clipfrac)))
        return approx_kl

    def eager_step(self, part: list[Any], new_logps: list[torch.Tensor]) -> None:
        """One minibatch step as it runs eagerly or under `torch.compile`: losses, backward, clip and Adam."""
        *columns, weights = part
        if self.graphs:  # a new replay may overwrite the last one's outputs: they are copied out below
            torch.compiler.cudagraph_mark_step_begin()
        loss, stats, new_logp = self.step(
            self.net, *columns, self.coefs, *(() if weights is None else (weights,))
        )
        for p in self.finish.params:
            p.grad = None
        with PROGRESS.waiting_for("the other training ranks (gradients)") if self.synced else nullcontext():
            self.fabric.backward(loss)
        self.skips.append(self.finish())  # clip, then the optimiser step unless the norm is not finite
        self.warmups += 1
        new_logp, stats = new_logp.detach(), stats.detach()
        new_logps.append(new_logp.clone() if self.graphs else new_logp)
        self.losses.append(stats.clone() if self.graphs else stats)

    def whole_step(self, part: list[Any]) -> whole.WholeStepGraph | None:
        """The model's whole-step graph for this update: the one kept from an earlier update where it still
        fits (the same Adam state, the same columns), else a new one after `WARMUP_STEPS` eager steps of this
        update; None while the update is still warming up."""
        if self.whole is not None:
            return self.whole
        groups = self.finish.states()  # None until the first step has made Adam's state
        if groups is None:
            return None
        kept = whole.cached(self.model)
        if kept is not None and kept.fits(part, groups):
            self.whole = kept
        elif self.warmups >= whole.WARMUP_STEPS:
            graph = whole.WholeStepGraph(minibatch_losses, self.net, groups, self.max_norm, self.coefs, part)
            self.whole = whole.keep(self.model, graph)
        else:
            return None
        self.whole.set_lr()
        return self.whole

    def statistics(self, behaviour: TensorDict) -> dict[str, Any]:
        """`TRAIN_METRICS` of the update (with the cause and the step count when steps were skipped)."""
        stacked = torch.stack(self.losses)
        skipped = int(torch.stack(self.skips).sum().item())
        if skipped:  # the losses of the steps taken (those skipped may hold NaN/inf)
            finite = torch.isfinite(stacked).all(1)
            stacked = stacked[finite] if bool(finite.any()) else stacked
        pg_mean, vl_mean, el_mean = stacked.mean(0).tolist()
        kl_mean, clipfrac_mean = torch.stack(self.ratio_stats).mean(0).tolist()
        means = [pg_mean, vl_mean, -el_mean, kl_mean, clipfrac_mean]
        epochs = len(self.ratio_stats)
        stats = dict(
            zip(TRAIN_METRICS, [*means, explained_variance(behaviour), epochs, skipped], strict=True)
        )
        if skipped:
            stats["skip_cause"] = nonfinite_term(torch.stack(self.losses))
            stats["steps"] = len(self.skips)
        return stats


# The batch columns `minibatch_losses` takes, in its order (an absent one is passed as None).
STEP_COLUMNS = (
    "obs",
    "actions",
    "logprobs",
    "values",
    "advantages",
    "returns",
    "mask",
    "action_mask",
    "initial_state",
    "starts",
)


def explained_variance(behaviour: TensorDict) -> float:
    """1 - Var(returns - values) / Var(returns) over the steps that hold a transition (NaN: constant returns)."""
    values, returns = behaviour["values"], behaviour["returns"]
    if "mask" in behaviour.keys():  # noqa: SIM118
        values, returns = values[behaviour["mask"]], returns[behaviour["mask"]]
    var_returns = returns.var() if returns.numel() > 1 else returns.new_zeros(())
    return (1 - (returns - values).var() / var_returns).item() if var_returns > 0 else float("nan")


def nonfinite_term(losses: torch.Tensor) -> str:
    """The first loss term that was not finite in some minibatch step ([steps, 3] `stats`), else the
    gradient norm (finite losses whose gradients overflowed)."""
    bad = (~torch.isfinite(losses)).any(0).tolist()
    return next((name for name, b in zip(LOSS_TERMS, bad, strict=True) if b), "the gradient norm")


def check_magnitude(learner: Learner, limit: float, env_step: int) -> None:
    """A parameter beyond `limit` in magnitude (0: no limit) ends the run with `UpdateDiverged`: an update
    that diverged (`algo.lr=1e9`) can leave every value finite and the policy destroyed, which a check for
    NaN never sees. Healthy PPO networks keep their weights within a few hundred; the default limit is 1e6.
    Three ops and one host read per update (~35 us on CartPole's MLPs, against ~140 us for torch's
    `get_total_norm(..., inf)`, which reduces each parameter apart)."""
    if limit <= 0:
        return
    params = [p.detach().reshape(-1) for p in learner.policy.parameters()]
    peak = float(torch.cat(params).abs().max()) if params else 0.0
    if peak > limit or peak != peak:  # noqa: PLR0124 - NaN compares unequal to itself
        raise UpdateDiverged(
            f"policy {learner.spec.name!r}: the update on the rollout from env step {env_step:,} left a parameter of "
            f"magnitude {peak:.3g}, beyond algo.max_param_abs={limit:g}: the update diverged (a learning "
            "rate too high?); checkpoints keep their earlier values"
        )


def set_lr(optimizer: Any, lr: float) -> float:
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def update_policies(
    fabric: Fabric,
    learners: dict[str, Learner],
    batches: dict[str, TensorDict],
    *,
    settings: UpdateSettings,
    env_step: int,
    lr_schedule: LrSchedule,
    mean_across: Callable[[torch.Tensor], torch.Tensor] | None,
    rank_minibatch: int,
    policy_lag: float | None = None,
    layouts: dict[str, tuple[int, int]] | None = None,
) -> dict[str, float]:
    """One update of every trained policy on its batch, collected from `env_step`, at the learning rate
    `lr_schedule` gives there (`algo.lr` times its fraction; `anneal_lr=false` makes it 1).

    `policy_lag`: how many versions older than the learners' the batches' behaviour policy is (the
    decoupled strategy's `train/policy_lag`); None where the strategy never lags (coupled). `layouts`:
    per policy, how its flat batch lies in time (`update_policy`'s `layout`).

    `rank_minibatch` counts env steps: a policy acting for k agents per env copy takes k times as many
    samples per minibatch, so every policy makes the same number of gradient steps per update (and every
    rank too: DDP needs it).
    """
    metrics: dict[str, float] = {}
    for name in trained({n: learner.spec for n, learner in learners.items()}):
        learner = learners[name]
        lr = set_lr(learner.optimizer, learner.spec.lr * lr_schedule.fraction(env_step))
        stats = update_policy(
            fabric,
            learner.model,
            learner.optimizer,
            batches[name],
            settings,
            mean_across_trainers=mean_across,
            rank_minibatch=rank_minibatch * learner.spec.agents,
            lagged=None if policy_lag is None else policy_lag > 0,
            layout=None if layouts is None else layouts.get(name),
        )
        check_skips(learner, stats, settings.max_skipped_updates, env_step)
        check_magnitude(learner, settings.max_param_abs, env_step)
        metrics |= {metric_name(name, k): v for k, v in (stats | {"train/lr": lr}).items()}
    return metrics


def check_skips(learner: Learner, stats: dict[str, Any], limit: int, env_step: int) -> None:
    """Count the updates in a row with skipped (non-finite) minibatch steps; `limit` of them (0: never)
    end the run with `UpdateDiverged` naming the loss term. Removes the cause from `stats` (not a metric)."""
    cause, steps = stats.pop("skip_cause", None), stats.pop("steps", None)
    learner.skip_streak = learner.skip_streak + 1 if cause is not None else 0
    if cause is None or limit <= 0 or learner.skip_streak < limit:
        return
    raise UpdateDiverged(
        f"policy {learner.spec.name!r}: {learner.skip_streak} updates in a row had minibatch steps with "
        f"{cause} not finite ({int(stats['train/skipped_steps'])} of {steps} steps skipped in the last, at "
        f"env step {env_step:,}); parameters and checkpoints keep their last finite values "
        f"(algo.max_skipped_updates={limit})"
    )
