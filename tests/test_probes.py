"""End-to-end probe tests: train the real PPO loop on Andy Jones' probe environments, check the checkpoint.

Each probe has one known answer, so a failure names the broken piece (value regression, observation
input, discounting/bootstrapping, policy gradient, or actor and critic together) instead of just "the
agent does not learn". The runs go through `ppo_fabric.run`, the public API, and the assertions read
`last.ckpt` the way a user would, so config composition, the rollout, GAE, the update and checkpointing
are all covered. The settings are small enough for ~1 s per probe; every probe converges in fewer than
half the steps given (checked on seeds 0-2), so the tolerances below are far from the edge.
"""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import pytest
import torch
from gymnasium.utils.env_checker import check_env
from omegaconf import DictConfig, OmegaConf

import ppo_fabric
from ppo_fabric.agent import ActorCritic
from tests import probe_envs

# 8 envs x 16 steps = 128 samples per update, 2 minibatches x 4 epochs: 32 updates in 4096 steps. The
# probes need ~10 updates; the rest buys margin. lr 2e-3 (with the default linear annealing) is high for
# real tasks but the probes are tiny and deterministic, and annealing lets the values settle at the end.
FAST = [
    "env.num_envs=8",
    "algo.rollout_steps=16",
    "algo.minibatch_size=64",
    "algo.total_steps=4096",
    "algo.lr=2e-3",
    "algo.anneal_lr=true",
    "logger=none",
    "seed=0",
]
VALUE_TOL = 0.05  # converged values are within 1e-3; a broken piece is off by 0.5 or more
MIN_P_CORRECT = 0.95  # converged policies give >= 0.996 to the rewarded action


def train_probe(tmp_path: Path, name: str, *overrides: str) -> tuple[ActorCritic, DictConfig]:
    """Train on a probe and rebuild the agent from `last.ckpt`, exactly as a user would load it."""
    summary = ppo_fabric.run(
        ["env=gym", f"env.id=tests.probe_envs:{name}", *FAST, f"hydra.run.dir={tmp_path}", *overrides]
    )
    ckpt = Path(summary["checkpoint"])
    assert ckpt == tmp_path / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    cfg = OmegaConf.create(state["config"])
    model = ActorCritic(state["observation_space"], state["action_space"], cfg.model)
    model.load_state_dict(state["agent"])
    model.eval()
    return model, cfg


def obs(*values: float) -> torch.Tensor:
    """A batch of 1-D probe observations."""
    return torch.tensor([[v] for v in values], dtype=torch.float32)


@torch.no_grad()
def values(model: ActorCritic, *observations: float) -> list[float]:
    return model.get_value(obs(*observations)).tolist()


@torch.no_grad()
def action_probs(model: ActorCritic, observation: float) -> list[float]:
    """P(action) for every action of a Discrete head, via the same log-prob code the update uses."""
    features = model.actor_body(model.encoder(obs(observation)))
    n = model.head.nvec[0]
    return [model.head.log_prob_entropy(features, torch.tensor([a]))[0].exp().item() for a in range(n)]


@pytest.mark.parametrize("name", sorted(probe_envs.PROBES))
def test_probe_envs_follow_the_gymnasium_api(name: str) -> None:
    """The probes themselves must be right, or a failing training test would blame the learner wrongly."""
    env = gym.make(f"tests.probe_envs:{name}")
    check_env(env.unwrapped, skip_render_check=True)
    assert env.observation_space == gym.spaces.Box(-1.0, 1.0, (1,), "float32")
    first, _ = env.reset(seed=0)
    steps, terminated, truncated = 0, False, False
    while not (terminated or truncated):
        _, _, terminated, truncated, _ = env.step(env.action_space.sample())
        steps += 1
    assert terminated and not truncated  # bootstrapping must stop at the end, not continue from V(final)
    assert steps == (2 if name == "ProbeDiscounting-v0" else 1)
    assert first.dtype == "float32"


def test_probe1_constant_value(tmp_path: Path) -> None:
    """One action, obs 0, reward 1, one step: the critic regresses onto a constant return."""
    model, _ = train_probe(tmp_path, "ProbeConstant-v0")
    assert values(model, 0.0)[0] == pytest.approx(1.0, abs=VALUE_TOL)


def test_probe2_observation_dependent_value(tmp_path: Path) -> None:
    """Reward = observation ±1: the critic must read its input (a constant V would sit near 0)."""
    model, _ = train_probe(tmp_path, "ProbeObsDependent-v0")
    assert values(model, -1.0, 1.0) == pytest.approx([-1.0, 1.0], abs=VALUE_TOL)


def test_probe3_discounting(tmp_path: Path) -> None:
    """Obs 0 then obs 1, reward 1 at the end: V(second) = 1 and V(first) = gamma.

    The tolerance on V(first) is tighter than 1 - gamma = 0.01, so a learner that ignores the discount
    (V(first) = 1) fails, as does one that bootstraps from the wrong step or across the episode end.
    """
    model, cfg = train_probe(tmp_path, "ProbeDiscounting-v0")
    gamma = float(cfg.algo.gamma)
    assert gamma == pytest.approx(0.99)  # the default; the test is about the default discount
    first, second = values(model, 0.0, 1.0)
    assert second == pytest.approx(1.0, abs=VALUE_TOL)
    assert first == pytest.approx(gamma, abs=0.003)
    assert second - first == pytest.approx(1.0 - gamma, abs=0.003)


def test_probe4_action_dependent_reward(tmp_path: Path) -> None:
    """Obs 0, reward +1 for action 1 and -1 for action 0: the policy gradient alone must find action 1."""
    model, _ = train_probe(tmp_path, "ProbeActionDependent-v0")
    assert action_probs(model, 0.0)[1] > MIN_P_CORRECT
    action, _, _ = model.act(obs(0.0), deterministic=True)
    assert action.tolist() == [1]
    assert values(model, 0.0)[0] == pytest.approx(1.0, abs=VALUE_TOL)  # V follows the improved policy


def test_probe5_observation_and_action(tmp_path: Path) -> None:
    """Reward +1 when the action matches the sign of a random ±1 observation: act on the input; V = 1."""
    model, _ = train_probe(tmp_path, "ProbeObsAndAction-v0")
    assert action_probs(model, 1.0)[1] > MIN_P_CORRECT
    assert action_probs(model, -1.0)[0] > MIN_P_CORRECT
    actions, _, _ = model.act(obs(-1.0, 1.0), deterministic=True)
    assert actions.tolist() == [0, 1]
    assert values(model, -1.0, 1.0) == pytest.approx([1.0, 1.0], abs=VALUE_TOL)
