"""Is ppo-fabric's PPO update Stable-Baselines3's? One rollout, two updates, every parameter compared.

SB3's PPO, configured from the composed config by `benchmarks/sb3_baseline.sb3_settings` (as the
time-to-score and CartPole benchmarks configure it), collects one rollout and runs its update. ppo-fabric's
model starts from SB3's initial weights (mapped name by name) and runs `update_policy` on the same rollout in
SB3's row order, each epoch's minibatch order the same as SB3's (both draws replaced by one fixed list).
Differences at float rounding mean the losses, the per-minibatch advantage normalisation, the gradient
clipping and Adam are SB3's; a learning gap between the libraries then lies in collection or chance.
Discrete (CartPole) and Gaussian (Hopper) policies; normalisation off (SB3's VecNormalize would change the
stored observations). Both use the recipe's starting learning rate: one rollout is SB3's whole budget here,
so its annealed schedule would be at 0. Figures from LunarLander (1,024 gradient steps, 3.0e-8) are in
benchmarks/results/sb3_parity.md.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.slow
sb3 = pytest.importorskip("stable_baselines3")  # the dev extra installs it; a bare install has no baseline

# ppo-fabric's parameter prefix -> SB3's (MlpPolicy with separate 2-layer actor and critic MLPs)
NAMES = {
    "actor_body.layers.0": "mlp_extractor.policy_net.0",
    "actor_body.layers.1": "mlp_extractor.policy_net.2",
    "critic_body.layers.0": "mlp_extractor.value_net.0",
    "critic_body.layers.1": "mlp_extractor.value_net.2",
    "value_out": "value_net",
}
KEYS = ("observations", "actions", "log_probs", "values", "advantages", "returns")
TOLERANCE = 1e-6  # observed: ~1e-8 (3e-8 on LunarLander, 6e-8 on Hopper)


def sb3_name(name: str) -> str:
    prefix, _, leaf = name.rpartition(".")
    if prefix in NAMES:
        return f"{NAMES[prefix]}.{leaf}"
    if prefix in ("head.linear", "head.mean"):
        return f"action_net.{leaf}"
    assert name == "head.log_std", f"no SB3 counterpart for parameter {name}"
    return "log_std"


class FixedPermutations:
    """Each epoch's minibatch order, the same list for SB3 (`np.random.permutation` of the buffer) and for
    ppo-fabric (`torch.randperm` in the update)."""

    def __init__(self, size: int, epochs: int) -> None:
        rng = np.random.default_rng(0)
        self.size, self.perms = size, [rng.permutation(size) for _ in range(epochs)]
        self.np_calls = self.torch_calls = 0
        self._np_permutation = np.random.permutation

    def numpy(self, n: Any) -> np.ndarray:
        if n != self.size:  # any other use of the global permutation
            return self._np_permutation(n)
        self.np_calls += 1
        return self.perms[self.np_calls - 1].copy()

    def torch(self, n: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.torch_calls += 1
        return torch.as_tensor(self.perms[self.torch_calls - 1], device=kwargs.get("device"))


def updates_from_one_rollout(overrides: list[str], monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """(parameter, SB3's update of it, largest difference after both updates) for every parameter."""
    import gymnasium as gym
    from lightning_fabric import Fabric
    from omegaconf import OmegaConf
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.logger import Logger
    from stable_baselines3.common.utils import LinearSchedule
    from stable_baselines3.common.vec_env import DummyVecEnv
    from tensordict import TensorDict
    from torch import nn

    import ppo_fabric.learn.update as update
    from benchmarks.sb3_baseline import flat_workload, sb3_settings
    from ppo_fabric.config.defaults import with_defaults
    from ppo_fabric.learn.settings import UpdateSettings
    from ppo_fabric.models.agent import ActorCritic

    w = flat_workload(overrides) | {"algo.anneal_lr": False}
    assert not w["env.normalize_obs"] and not w["env.normalize_reward"]
    steps, envs = int(w["algo.rollout_steps"]), int(w["env.num_envs"])
    epochs = int(w["algo.update_epochs"])
    perms = FixedPermutations(steps * envs, epochs)
    monkeypatch.setattr(np.random, "permutation", perms.numpy)  # SB3's RolloutBuffer.get draws with it
    monkeypatch.setattr(update.torch, "randperm", perms.torch)

    vec = make_vec_env(w["env.id"], n_envs=envs, seed=1, vec_env_cls=DummyVecEnv)
    baseline = PPO("MlpPolicy", vec, **sb3_settings(w, nn, LinearSchedule), seed=1, device="cpu")
    baseline.set_logger(Logger(folder=None, output_formats=[]))  # its default makes a folder in /tmp per run
    start = copy.deepcopy(baseline.policy.state_dict())
    rollout: dict[str, np.ndarray] = {}

    class KeepRollout(BaseCallback):
        """The rollout buffer as collected, before the update flattens and shuffles it."""

        def _on_step(self) -> bool:
            return True

        def _on_rollout_end(self) -> None:
            buffer = self.model.rollout_buffer
            rollout.update({k: getattr(buffer, k).copy() for k in KEYS})

    baseline.learn(total_timesteps=steps * envs, callback=KeepRollout())  # one rollout, one update
    after = baseline.policy.state_dict()

    env = gym.make(w["env.id"])
    model_cfg = OmegaConf.create({k.split(".", 1)[1]: v for k, v in w.items() if k.startswith("model.")})
    ours = ActorCritic(env.observation_space, env.action_space, model_cfg)
    with torch.no_grad():
        for name, param in ours.named_parameters():
            param.copy_(start[sb3_name(name)].reshape(param.shape))
    fabric = Fabric(accelerator="cpu", devices=1)
    optimizer = torch.optim.Adam(ours.parameters(), lr=float(w["algo.lr"]), eps=float(w["algo.adam_eps"]))
    model, optimizer = fabric.setup(ours, optimizer)
    given = {k.split(".", 1)[1]: v for k, v in w.items() if k.startswith("algo.")}
    algo = OmegaConf.create(with_defaults({"algo": given})["algo"])

    def flat(a: np.ndarray) -> torch.Tensor:  # SB3's swap_and_flatten: [steps, envs, ...] -> env-major rows
        return torch.as_tensor(a.swapaxes(0, 1).reshape(steps * envs, *a.shape[2:]))

    actions = flat(rollout["actions"])
    discrete = isinstance(env.action_space, gym.spaces.Discrete)
    data = TensorDict({"obs": flat(rollout["observations"]).float(),
                       "actions": actions.long().squeeze(-1) if discrete else actions.float(),
                       "logprobs": flat(rollout["log_probs"]).float(), "values": flat(rollout["values"]).float(),
                       "advantages": flat(rollout["advantages"]).float(),
                       "returns": flat(rollout["returns"]).float()}, batch_size=[steps * envs])  # fmt: skip
    update.update_policy(fabric, model, optimizer, data, UpdateSettings.of(algo))
    assert (perms.np_calls, perms.torch_calls) == (epochs, epochs), (
        "the libraries no longer draw one minibatch order per epoch as this test assumes"
    )
    rows = []
    for name, param in ours.named_parameters():
        before, theirs = (t[sb3_name(name)].reshape(param.shape) for t in (start, after))
        rows.append(
            (name, (theirs - before).abs().max().item(), (param.detach() - theirs).abs().max().item())
        )
    return rows


@pytest.mark.parametrize(
    "overrides",
    [
        ["exp=cleanrl_cartpole", "algo.clip_vloss=false"],  # 4 epochs x 4 minibatches of 128, discrete
        [
            "exp=mujoco",
            "env.id=Hopper-v5",
            "env.normalize_obs=false",
            "env.normalize_reward=false",
            "algo.update_epochs=2",
        ],  # Gaussian: 2 epochs x 32 minibatches of 64
    ],  # fmt: skip
    ids=["cartpole", "hopper"],
)
def test_the_update_is_stable_baselines3s(overrides: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    rows = updates_from_one_rollout(overrides, monkeypatch)
    assert min(moved for _, moved, _ in rows) > 100 * TOLERANCE, rows  # the update moved every parameter
    worst = max(rows, key=lambda row: row[2])
    assert worst[2] <= TOLERANCE, f"{worst[0]} differs from SB3's by {worst[2]:.2e} after one update"
