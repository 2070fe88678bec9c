"""Experiment recipes (conf/exp/) hold the values they claim to.

A recipe is a promise ("CleanRL's continuous workload"); a typo in it would silently change a benchmark.
Composition needs no env, so these run without the optional simulators; the full validation (which builds
one env to read its spaces) runs only where the extra is installed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ppo_fabric.app.preflight import check as validate
from ppo_fabric.config.values import compose


def test_mujoco_recipe_is_cleanrls_continuous_workload() -> None:
    """ppo_continuous_action.py's defaults: 1 env x 2048 steps, 32 minibatches of 64, 10 epochs, ..."""
    cfg, _ = compose(["exp=mujoco"])
    assert cfg.env.id == "HalfCheetah-v5"
    assert cfg.env.num_envs == 1
    a = cfg.algo
    batch = a.rollout_steps * cfg.env.num_envs
    assert (batch, batch // a.minibatch_size, a.minibatch_size, a.update_epochs) == (2048, 32, 64, 10)
    assert (a.lr, a.anneal_lr, a.gamma, a.gae_lambda) == (3e-4, True, 0.99, 0.95)
    assert (a.clip_coef, a.ent_coef, a.vf_coef, a.max_grad_norm) == (0.2, 0.0, 0.5, 0.5)
    assert (a.norm_adv, a.target_kl, a.total_steps) == (True, None, 1_000_000)
    assert list(cfg.model.actor_hidden) == list(cfg.model.critic_hidden) == [64, 64]
    assert cfg.model.activation == "tanh"


def test_mujoco_recipe_validates_with_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mujoco", reason="the mujoco extra")
    monkeypatch.chdir(tmp_path)  # MuJoCo writes its warnings to MUJOCO_LOG.TXT in the working directory
    cfg, _ = compose(["exp=mujoco"])
    facts = validate(cfg)  # builds one env: the id, the spaces and the batch arithmetic are accepted
    assert isinstance(facts, dict)


@pytest.mark.parametrize("recipe", ["tictactoe", "connect_four"])
def test_board_game_recipes_are_self_play(recipe: str) -> None:
    """The recipes turn self-play on (a config group, so they can) and validate: AEC detected, masks on."""
    cfg, _ = compose([f"exp={recipe}"])
    assert cfg.env.id == f"pettingzoo.classic.{recipe}_v3" and cfg.selfplay.enabled is True
    assert cfg.selfplay.sampling == "uniform" and cfg.selfplay.random_prob > 0
    facts = validate(cfg)
    assert facts["action_space"]["shared"].n == (9 if recipe == "tictactoe" else 7)
