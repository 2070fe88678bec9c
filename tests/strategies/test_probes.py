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
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env
from omegaconf import DictConfig, OmegaConf

import ppo_fabric
from ppo_fabric.models.agent import ActorCritic
from ppo_fabric.runs.checkpoint import saved_spaces
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
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    cfg = OmegaConf.create(state["config"])
    model = ActorCritic(*saved_spaces(state), cfg.model)
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


# ------------------------------------------------------------------------------ continuous-action probe
CONTINUOUS = "ProbeContinuousAction-v0"
# On top of FAST (later overrides win): no entropy bonus, so only the policy gradient moves the log-std;
# 4x the steps and lr 5e-3, because the state-independent log-std moves by about lr per Adam step and
# must fall from 0 (std 1) to well below. 128 updates, ~2 s. Seeds 0-5 all pass at half the steps; at
# the full budget the mean is within 0.042 of the target, the std ~0.105 and V within 0.014.
CONTINUOUS_OVERRIDES = ["algo.ent_coef=0.0", "algo.total_steps=16384", "algo.lr=5e-3"]
GRID = [-1.0, -0.75, -0.5, -0.25, 0.0, 0.25, 0.5, 0.75, 1.0]
ACTION_TOL = 0.1  # the mean action's distance to the target at every grid point
MAX_STD = 0.3  # the policy's std after training (it starts at 1; ~0.28 at half the steps)
CONTINUOUS_VALUE_TOL = 0.03  # a critic blind to the noise predicts 0, about 0.085 off


def test_continuous_probe_follows_the_gymnasium_api() -> None:
    """Box action, uniform observation, one terminated step, reward 0 exactly at the target."""
    env = gym.make(f"tests.probe_envs:{CONTINUOUS}")
    check_env(env.unwrapped, skip_render_check=True)
    assert env.action_space == gym.spaces.Box(-1.0, 1.0, (1,), "float32")
    seen = []
    for seed in range(50):
        first, _ = env.reset(seed=seed)
        seen.append(float(first[0]))
        target = probe_envs.ProbeContinuousAction.target(float(first[0]))
        _, reward, terminated, truncated, _ = env.step(np.array([target], dtype=np.float32))
        assert terminated and not truncated
        assert reward == pytest.approx(0.0, abs=1e-6)
    assert min(seen) < -0.5 and max(seen) > 0.5  # observations cover the range, not one point
    env.reset(seed=0)  # an out-of-bounds action is clipped to 1, then scored: at least 0.5 from any target
    assert env.step(np.array([2.0], dtype=np.float32))[1] <= -0.5


@torch.no_grad()
def expected_reward(mean: torch.Tensor, std: float, targets: torch.Tensor) -> torch.Tensor:
    """E[-|clip(mean + std * eps, -1, 1) - target|] for eps ~ N(0, 1), by quadrature on a fine grid.

    This is what the critic must predict for the policy as it is: about -std * sqrt(2/pi) once the mean
    is on target, less negative where clipping at the bounds cuts the noise short.
    """
    eps = torch.linspace(-6.0, 6.0, 4001)
    weights = torch.exp(-0.5 * eps**2)
    weights = weights / weights.sum()
    actions = (mean.unsqueeze(-1) + std * eps).clamp(-1.0, 1.0)
    return -((actions - targets.unsqueeze(-1)).abs() * weights).sum(-1)


@pytest.mark.slow
def test_probe6_continuous_action(tmp_path: Path) -> None:
    """Reward -|a - obs/2| for a uniform obs: the Gaussian head's mean must follow the observation.

    Checks the deterministic action (the mean) on a grid of observations, that the exploration noise
    shrank (once the mean is right, only a smaller std improves the return), and that the critic predicts
    the return the stochastic policy earns at each observation: a critic that ignored the noise would say
    0, one that ignored the observation would be off where clipping differs.
    """
    model, _ = train_probe(tmp_path, CONTINUOUS, *CONTINUOUS_OVERRIDES)
    with torch.no_grad():
        actions, _, _ = model.act(obs(*GRID), deterministic=True)
        std = model.head.log_std.exp().item()
    means = actions.squeeze(-1)
    targets = torch.tensor([probe_envs.ProbeContinuousAction.target(o) for o in GRID])
    assert means.tolist() == pytest.approx(targets.tolist(), abs=ACTION_TOL)
    assert std < MAX_STD  # started at 1.0
    expected = expected_reward(means, std, targets).tolist()
    assert values(model, *GRID) == pytest.approx(expected, abs=CONTINUOUS_VALUE_TOL)
