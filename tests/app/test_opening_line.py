"""The run's first line: the env, whose tuned values it trains with, and what the command line sets over
them (a run told "tuned values for CartPole-v1" trained with the user's own rollout and minibatch sizes)."""

from __future__ import annotations

from omegaconf import OmegaConf

from ppo_fabric.app.launch import opening_lines, set_on_top


def test_the_command_lines_values_over_the_tuned_ones_are_named() -> None:
    overrides = ["env=pendulum", "env.id=Pendulum-v1", "algo.lr=1e-4", "+env.kwargs.g=9.8", "seed=3",
                 "hydra.run.dir=runs/x", "model.activation=relu", "algo.lr=1e-4", "tuning='a note'",
                 "algo.rollout_steps=64", "env.num_envs=4"]  # fmt: skip
    assert set_on_top(overrides) == [
        "algo.lr=1e-4", "env.kwargs.g=9.8", "model.activation=relu", "algo.rollout_steps=64", "env.num_envs=4"
    ]  # fmt: skip
    cfg = OmegaConf.create(
        {"env": {"id": "Pendulum-v1"}, "strategy": "coupled", "tuning": "env=pendulum, tuned", "resume": None}
    )
    assert opening_lines(cfg, None, set_on_top(overrides)) == (
        "ppo-fabric: Pendulum-v1 with env=pendulum, tuned, and from the command line algo.lr=1e-4, "
        "env.kwargs.g=9.8, model.activation=relu, algo.rollout_steps=64 and 1 more (coupled)"
    )
    assert opening_lines(cfg, None, []) == "ppo-fabric: Pendulum-v1 with env=pendulum, tuned (coupled)"
    resumed = opening_lines(cfg.copy(), {}, set_on_top(overrides)).splitlines()[0]  # the second line says it
    assert resumed == "ppo-fabric: Pendulum-v1 with env=pendulum, tuned (coupled)"
