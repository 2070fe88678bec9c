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


def test_a_resumed_runs_line_says_its_option_came_from_its_first_command_line() -> None:
    """`resume=auto` alone printed "with exp=fast (chosen on the command line)", a command line with no
    exp= on it: the note is the run's own, saved with its config."""
    cfg = OmegaConf.create({"env": {"id": "CartPole-v1"}, "strategy": "coupled", "resume": "last.ckpt",
                            "tuning": "exp=fast (chosen on the command line)"})  # fmt: skip
    assert opening_lines(cfg, {}).splitlines() == [
        "ppo-fabric: CartPole-v1 with exp=fast (chosen on its first command line) (coupled)",
        "ppo-fabric: continuing from last.ckpt; nothing changed",
    ]
