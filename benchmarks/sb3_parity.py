"""Is ppo-fabric's PPO update Stable-Baselines3's? One rollout, two updates, the parameters compared.

SB3's PPO (configured from ppo-fabric's composed config by `sb3_baseline.sb3_settings`, as the time-to-score
benchmark configures it) collects one rollout of the workload and runs its update. ppo-fabric's model starts
from SB3's initial weights (mapped name by name) and runs its own `update.update_policy` on the same rollout
(observations, actions, log-probs, values, advantages, returns, in SB3's env-major order), with each epoch's
minibatch permutation the same as SB3's (both draws are replaced by one fixed list). Each parameter's largest
difference after the update is printed beside the size of the update itself: differences at float rounding
(~1e-7 relative) mean the losses, advantage normalisation, gradient clipping and Adam are the same, so a gap
in learning between the two libraries lies in collection (or chance), not in the update.

Discrete (LunarLander) and Gaussian (MuJoCo) policies; workloads without observation or reward normalisation
only (SB3's VecNormalize would change the stored observations). Both use the recipe's starting learning rate
(one rollout is SB3's whole budget here, so its annealed schedule would be at 0). Exit status 1 when a parameter differs by more
than `--tolerance` (default 1e-5).

    .venv/bin/python benchmarks/sb3_parity.py                         # env=lunarlander: 4 epochs x 256 of 64
    .venv/bin/python benchmarks/sb3_parity.py --epochs 1 --minibatch 16384   # one full-batch gradient step
    .venv/bin/python benchmarks/sb3_parity.py -- exp=mujoco env.id=Hopper-v5 env.normalize_obs=false env.normalize_reward=false
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from sb3_baseline import sb3_settings  # noqa: E402
from time_to_score import flat_workload  # noqa: E402

# ppo-fabric's parameter prefix -> SB3's (MlpPolicy with separate 2-layer actor and critic MLPs)
NAMES = {
    "actor_body.layers.0": "mlp_extractor.policy_net.0",
    "actor_body.layers.1": "mlp_extractor.policy_net.2",
    "critic_body.layers.0": "mlp_extractor.value_net.0",
    "critic_body.layers.1": "mlp_extractor.value_net.2",
    "value_out": "value_net",
}
KEYS = ("observations", "actions", "log_probs", "values", "advantages", "returns")


def sb3_names(ours: list[str]) -> dict[str, str]:
    """ppo-fabric name -> SB3 name for every parameter of the model."""
    out = {}
    for name in ours:
        prefix, _, leaf = name.rpartition(".")
        if prefix in NAMES:
            out[name] = f"{NAMES[prefix]}.{leaf}"
        elif prefix in ("head.linear", "head.mean"):
            out[name] = f"action_net.{leaf}"
        elif name == "head.log_std":
            out[name] = "log_std"
        else:
            raise SystemExit(f"sb3_parity: no SB3 counterpart for parameter {name}")
    return out


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


def main() -> None:
    parser = common.argument_parser(__doc__)
    parser.add_argument("--epochs", type=int, default=None, help="update epochs (default: the recipe's)")
    parser.add_argument("--minibatch", type=int, default=None, help="minibatch size (default: the recipe's)")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="largest difference that passes")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    parser.add_argument("extra", nargs="*", help="overrides of the workload (default env=lunarlander)")
    args = parser.parse_args()

    import gymnasium as gym
    from lightning_fabric import Fabric
    from omegaconf import OmegaConf
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.utils import LinearSchedule
    from stable_baselines3.common.vec_env import DummyVecEnv
    from tensordict import TensorDict
    from torch import nn

    import ppo_fabric.learn.update as update
    from ppo_fabric.config.defaults import with_defaults
    from ppo_fabric.learn.settings import UpdateSettings
    from ppo_fabric.models.agent import ActorCritic

    overrides = args.extra or ["env=lunarlander"]
    w = flat_workload(overrides)
    if w["env.normalize_obs"] or w["env.normalize_reward"]:
        raise SystemExit(
            "sb3_parity: turn normalisation off (env.normalize_obs=false env.normalize_reward=false)"
        )
    # One rollout is the whole of SB3's budget here, so an annealed schedule would hand its update a learning
    # rate of 0; the schedule is not the update's business: both take the recipe's starting rate.
    w["algo.anneal_lr"] = False
    steps, envs = int(w["algo.rollout_steps"]), int(w["env.num_envs"])
    epochs = args.epochs or int(w["algo.update_epochs"])
    minibatch = args.minibatch or int(w["algo.minibatch_size"])
    torch.set_num_threads(1)
    perms = FixedPermutations(steps * envs, epochs)
    np.random.permutation = perms.numpy  # SB3's RolloutBuffer.get draws each epoch's order with it

    settings = sb3_settings(w, nn, LinearSchedule) | {"batch_size": minibatch, "n_epochs": epochs}
    vec = make_vec_env(w["env.id"], n_envs=envs, seed=args.seed, vec_env_cls=DummyVecEnv)
    sb3 = PPO("MlpPolicy", vec, **settings, seed=args.seed, device="cpu")
    start = copy.deepcopy(sb3.policy.state_dict())
    rollout: dict[str, np.ndarray] = {}

    class KeepRollout(BaseCallback):
        """The rollout buffer as collected, before the update flattens and shuffles it."""

        def _on_step(self) -> bool:
            return True

        def _on_rollout_end(self) -> None:
            buffer = self.model.rollout_buffer
            rollout.update({k: getattr(buffer, k).copy() for k in KEYS})

    sb3.learn(total_timesteps=steps * envs, callback=KeepRollout())  # one rollout, one update
    after_sb3 = sb3.policy.state_dict()

    env = gym.make(w["env.id"])
    model_cfg = OmegaConf.create({k.split(".", 1)[1]: v for k, v in w.items() if k.startswith("model.")})
    ours = ActorCritic(env.observation_space, env.action_space, model_cfg)
    names = sb3_names([n for n, _ in ours.named_parameters()])
    with torch.no_grad():
        for name, param in ours.named_parameters():
            param.copy_(start[names[name]].reshape(param.shape))
    fabric = Fabric(accelerator="cpu", devices=1)
    optimizer = torch.optim.Adam(ours.parameters(), lr=float(w["algo.lr"]), eps=float(w["algo.adam_eps"]))
    model, optimizer = fabric.setup(ours, optimizer)
    given = {k.split(".", 1)[1]: v for k, v in w.items() if k.startswith("algo.")}
    algo = OmegaConf.create(with_defaults({"algo": given})["algo"])
    algo.minibatch_size, algo.update_epochs = minibatch, epochs

    def flat(a: np.ndarray) -> torch.Tensor:  # SB3's swap_and_flatten: [steps, envs, ...] -> env-major rows
        return torch.as_tensor(a.swapaxes(0, 1).reshape(steps * envs, *a.shape[2:]))

    discrete = isinstance(env.action_space, gym.spaces.Discrete)
    actions = flat(rollout["actions"])
    data = TensorDict({"obs": flat(rollout["observations"]).float(),
                       "actions": actions.long().squeeze(-1) if discrete else actions.float(),
                       "logprobs": flat(rollout["log_probs"]).float(), "values": flat(rollout["values"]).float(),
                       "advantages": flat(rollout["advantages"]).float(),
                       "returns": flat(rollout["returns"]).float()}, batch_size=[steps * envs])  # fmt: skip
    update.torch.randperm = perms.torch
    try:
        update.update_policy(fabric, model, optimizer, data, UpdateSettings.of(algo))
    finally:
        update.torch.randperm = torch.randperm
    if (perms.np_calls, perms.torch_calls) != (epochs, epochs):
        raise SystemExit(f"sb3_parity: {perms.np_calls} SB3 and {perms.torch_calls} ppo-fabric epoch orders "
                         f"drawn, {epochs} expected: the libraries no longer shuffle as this script assumes")  # fmt: skip

    rows, worst = [], 0.0
    for name, param in ours.named_parameters():
        before, theirs = start[names[name]].reshape(param.shape), after_sb3[names[name]].reshape(param.shape)
        moved = (theirs - before).abs().max().item()
        diff = (param.detach() - theirs).abs().max().item()
        worst = max(worst, diff)
        rows.append((name, names[name], moved, diff))
    verdict = "PASS" if worst <= args.tolerance else "FAIL"
    gradient_steps = epochs * (steps * envs // minibatch)
    lines = [
        "# ppo-fabric's PPO update against Stable-Baselines3's, from one rollout",
        "",
        f"Workload `{' '.join(overrides)}` ({w['env.id']}), seed {args.seed}: SB3 {sb3_version()} collects "
        f"{steps} steps x {envs} envs; both libraries then update from the same weights with the same "
        f"minibatch orders: {epochs} epochs x {steps * envs // minibatch} minibatches of {minibatch} "
        f"({gradient_steps} gradient steps). Machine: {common.cpu_model()}; torch {torch.__version__}; commit "
        f"{common.git_commit()}.",
        "",
        "| ppo-fabric parameter | SB3 parameter | SB3's update (max abs) | max abs difference after both updates |",
        "|---|---|---:|---:|",
        *(f"| {a} | {b} | {moved:.3e} | {diff:.3e} |" for a, b, moved, diff in rows),
        "",
        f"**{verdict}**: the largest difference is {worst:.2e} (tolerance {args.tolerance:g}).",
        "",
        f"Command: `{common.command_line(__file__)}`",
        "",
    ]
    name = "sb3_parity" + ("" if not args.extra else "_" + w["env.id"].split("/")[-1].split("-")[0].lower())
    common.write_report(args.out, name, {"workload": overrides, "seed": args.seed, "epochs": epochs,
                                         "minibatch": minibatch, "commit": common.git_commit(), "verdict": verdict,
                                         "largest_difference": worst, "rows": rows}, "\n".join(lines))  # fmt: skip
    raise SystemExit(0 if verdict == "PASS" else 1)


def sb3_version() -> str:
    import stable_baselines3

    return stable_baselines3.__version__


if __name__ == "__main__":
    main()
