"""What the PPO update reads from `cfg.algo`, as typed plain values read once per run.

A DictConfig attribute read costs ~7-9 us (2 cores): the update used to make ~20 of them per update, about
1% of a CleanRL CartPole update, and every reader converted with `int()`/`float()` where it stood. The
strategies build `UpdateSettings.of(cfg.algo)` once, after the config was validated
(`config.values.validate`), and hand it to `update.update_policies`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from omegaconf import DictConfig


class LossCoefs(NamedTuple):
    """The loss settings: a compiled minibatch step specialises on constants, and a tuple of them is
    guarded by value, once per call."""

    clip: float
    clip_vloss: bool
    norm_adv: bool
    vf_coef: float
    ent_coef: float


class LagSettings(NamedTuple):
    """The lag correction's settings (`update.lagged_batch`), and the discounting it recomputes GAE with."""

    refresh: bool
    vtrace: bool
    objective: bool
    weight_clip: float
    gamma: float
    gae_lambda: float


@dataclass(frozen=True)
class UpdateSettings:
    """Every `algo` key the update reads. `of` is the one place that reads them, from a complete config
    (`config.defaults`: what a checkpoint of an earlier release lacks takes its default when it loads)."""

    minibatch_size: int
    update_epochs: int
    max_grad_norm: float
    target_kl: float | None
    compile: bool  # algo.compile=true: the forward and losses under torch.compile
    graph: bool  # algo.compile=graph: the whole minibatch step in one CUDA graph (learn/graph.py)
    loss: LossCoefs
    lag: LagSettings
    max_skipped_updates: int  # updates in a row with non-finite minibatch steps that end the run
    max_param_abs: float  # a parameter beyond this magnitude after an update ends the run (0: off)

    @classmethod
    def of(cls, algo: DictConfig) -> UpdateSettings:
        return cls(
            minibatch_size=int(algo.minibatch_size),
            update_epochs=int(algo.update_epochs),
            max_grad_norm=float(algo.max_grad_norm),
            target_kl=None if algo.target_kl is None else float(algo.target_kl),
            compile=algo.compile is True,
            graph=algo.compile == "graph",
            loss=LossCoefs(
                float(algo.clip_coef),
                bool(algo.clip_vloss),
                bool(algo.norm_adv),
                float(algo.vf_coef),
                float(algo.ent_coef),
            ),
            lag=LagSettings(
                bool(algo.lag_refresh_advantages),
                bool(algo.lag_vtrace),
                bool(algo.lag_objective),
                float(algo.lag_weight_clip),
                float(algo.gamma),
                float(algo.gae_lambda),
            ),
            max_skipped_updates=int(algo.max_skipped_updates),
            max_param_abs=float(algo.max_param_abs),
        )
