"""The Stable-Baselines3 baseline: SB3 `PPO` configured from ppo-fabric's composed config (`sb3_settings`),
the warm-up both libraries' timed children pay before their clocks start, and one timed SB3 run in a child
process (`run`), which `time_to_score.py` compares with ppo-fabric's layouts. tests/learn/test_sb3_parity.py
imports the settings; SB3 itself is imported only inside the child.

    python benchmarks/sb3_baseline.py --overrides '["env=lunarlander"]' --seed 1 --result /tmp/r.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

WINDOW = 20  # episodes in the mean return, as ppo-fabric's rollout/return_mean20


def warm_up_torch() -> None:
    """Pay torch's one-time, per-process costs before the timer starts, identically in both children.

    Constructing the first optimizer imports `torch._dynamo` (about 1.3 s here), and the first orthogonal
    init initialises LAPACK (about 0.2 s): neither is work of the library under test, and whichever
    library happened to trigger them would look slower.
    """
    import torch
    from torch import nn

    layer = nn.Linear(4, 4)
    nn.init.orthogonal_(layer.weight)
    optimizer = torch.optim.Adam(layer.parameters(), lr=1e-3, eps=1e-5)
    layer(torch.zeros(2, 4)).tanh().sum().backward()
    nn.utils.clip_grad_norm_(layer.parameters(), 0.5)
    optimizer.step()


def sb3_settings(w: dict[str, Any], nn: Any, schedule: Any) -> dict[str, Any]:
    """SB3 `PPO(...)` keyword arguments for ppo-fabric's workload `w` (flat keys, see resolved_workload).

    Equivalences: ppo-fabric's value loss is vf_coef * MSE, SB3's `F.mse_loss`; with `clip_vloss` ours takes
    the larger of the clipped and unclipped errors (CleanRL's) where SB3's `clip_range_vf` keeps the clipped
    one only, the nearest SB3 has (the compute is the same, the gradient can differ); `norm_adv` is per
    minibatch in both;
    both init orthogonally (sqrt 2 hidden, 0.01 policy head, 1 value head) and bootstrap truncated
    episodes from the final observation's value.
    """
    lr = float(w["algo.lr"])
    activations = {"tanh": nn.Tanh, "relu": nn.ReLU, "elu": nn.ELU, "gelu": nn.GELU}
    return {
        "learning_rate": schedule(lr, 0.0, 1.0) if w["algo.anneal_lr"] else lr,
        "n_steps": int(w["algo.rollout_steps"]),
        "batch_size": int(w["algo.minibatch_size"]),
        "n_epochs": int(w["algo.update_epochs"]),
        "gamma": float(w["algo.gamma"]),
        "gae_lambda": float(w["algo.gae_lambda"]),
        "clip_range": float(w["algo.clip_coef"]),
        "clip_range_vf": float(w["algo.clip_coef"]) if w["algo.clip_vloss"] else None,
        "normalize_advantage": bool(w["algo.norm_adv"]),
        "ent_coef": float(w["algo.ent_coef"]),
        "vf_coef": float(w["algo.vf_coef"]),
        "max_grad_norm": float(w["algo.max_grad_norm"]) if w["algo.max_grad_norm"] else float("inf"),
        "target_kl": w["algo.target_kl"],
        "policy_kwargs": {
            "net_arch": {"pi": list(w["model.actor_hidden"]), "vf": list(w["model.critic_hidden"])},
            "activation_fn": activations[w["model.activation"]],
            "ortho_init": True,
            "optimizer_kwargs": {"eps": float(w["algo.adam_eps"])},  # SB3's default is 1e-8
        },
    }


def flat_workload(overrides: list[str]) -> dict[str, Any]:
    """The composed config as the flat `group.key` -> value dict `sb3_settings` reads."""
    from omegaconf import OmegaConf

    from ppo_fabric.config.values import compose

    cfg, _ = compose(overrides)
    flat = OmegaConf.to_container(cfg, resolve=True)
    out: dict[str, Any] = {}
    for group in ("env", "algo", "model"):
        for key, value in flat[group].items():
            out[f"{group}.{key}"] = value
    # env options the SB3 child does not build: refused, rather than SB3 trained on another env than ours
    unbuilt = {"env.action_repeat": 1, "env.mask_velocity": False, "env.observation_noise": 0.0,
               "env.preprocess": "none"}  # fmt: skip
    if changed := [f"{k}={out[k]}" for k, plain in unbuilt.items() if out.get(k, plain) != plain]:
        raise SystemExit(f"the SB3 baseline builds the plain env; it cannot run {', '.join(changed)}")
    return out


def grid_extractor() -> type:
    """An SB3 features extractor that is ppo-fabric's `GridCNN` (model=grid, the MinAtar network) itself, so
    both libraries train the same network on 10x10 frames (SB3's CNN needs 36x36); SB3's heads sit on its
    128 features as ours do."""
    from stable_baselines3.common.torch_layers import BaseFeaturesExtractor

    from ppo_fabric.models.agent import GridCNN

    class GridExtractor(BaseFeaturesExtractor):
        def __init__(self, observation_space: Any) -> None:
            net = GridCNN(observation_space)
            super().__init__(observation_space, net.out_dim)
            self.net = net

        def forward(self, obs: Any) -> Any:
            return self.net(obs)

    return GridExtractor


def child(overrides: list[str], seed: int, result: Path, stop_at: float | None, cap_s: float | None) -> None:
    """One SB3 run of the workload `overrides` compose, in this process; writes its curve ([env step, wall s,
    mean20]) and summary to `result`. With `stop_at` it stops once the mean reaches it; with `cap_s`, after
    that many seconds (a full MuJoCo run is ~15 minutes of SB3 on 2 cores, and the time to a threshold is
    what the comparison needs). Observations and rewards are normalised by `VecNormalize` when the recipe
    normalises (both clipped at 10, as ppo-fabric's)."""
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.logger import Logger
    from stable_baselines3.common.utils import LinearSchedule
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize
    from torch import nn

    w = flat_workload(overrides)
    torch.set_num_threads(1)  # as ppo-fabric's torch_threads=1 default
    warm_up_torch()

    class Curve(BaseCallback):
        """Mean return of the last 20 finished episodes and the wall time, at the end of each rollout."""

        def __init__(self, start: float) -> None:
            super().__init__()
            self.start, self.window, self.curve = start, deque(maxlen=WINDOW), []
            self.stopped: str | None = None  # why the run ended early: "threshold" or "wall cap"

        def _on_step(self) -> bool:
            for info in self.locals["infos"]:
                if "episode" in info:
                    self.window.append(float(info["episode"]["r"]))  # Monitor's raw return
            if self.stopped is None and cap_s is not None and time.perf_counter() - self.start > cap_s:
                self.stopped = "wall cap"
            return self.stopped is None  # False ends `learn`

        def _on_rollout_end(self) -> None:
            if self.window:
                mean = sum(self.window) / len(self.window)
                self.curve.append([self.num_timesteps, time.perf_counter() - self.start, mean])
                if stop_at is not None and mean >= stop_at:
                    self.stopped = "threshold"

    if str(w["env.id"]).startswith("MinAtar/"):
        from minatar.gym import register_envs

        register_envs()  # as ppo-fabric's env factory does: gymnasium 1.x no longer loads MinAtar's entry point
    start = time.perf_counter()
    env_kwargs = dict(w["env.kwargs"] or {})
    if w["env.max_episode_steps"] is not None:
        env_kwargs["max_episode_steps"] = int(w["env.max_episode_steps"])
    env = make_vec_env(w["env.id"], n_envs=int(w["env.num_envs"]), seed=seed, vec_env_cls=DummyVecEnv,
                       env_kwargs=env_kwargs)  # fmt: skip
    if w["env.normalize_obs"] or w["env.normalize_reward"]:
        env = VecNormalize(env, norm_obs=bool(w["env.normalize_obs"]), norm_reward=bool(w["env.normalize_reward"]),
                           clip_obs=10.0, clip_reward=10.0, gamma=float(w["algo.gamma"]))  # fmt: skip
    settings = sb3_settings(w, nn, LinearSchedule)
    if w["model.encoder"] == "grid":
        settings["policy_kwargs"]["features_extractor_class"] = grid_extractor()
    model = PPO("MlpPolicy", env, **settings, seed=seed, device="cpu", verbose=0)
    model.set_logger(Logger(folder=None, output_formats=[]))  # its default makes a folder in /tmp per run
    callback = Curve(start)
    model.learn(total_timesteps=int(w["algo.total_steps"]), callback=callback)
    wall = time.perf_counter() - start
    env.close()
    window = callback.window
    summary = {
        "total_env_steps": int(model.num_timesteps),
        "final_mean_return": sum(window) / len(window) if window else None,
        "wall_seconds": wall,
        "sps": model.num_timesteps / wall,
        "curve": callback.curve,
        "stopped": callback.stopped,
    }
    result.write_text(json.dumps(summary))


def run(overrides: list[str], seed: int, stop_at: float | None, cap_s: float | None) -> dict[str, Any]:
    """`child` in a fresh process (as every ppo-fabric run of a benchmark is); returns its summary."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--overrides", json.dumps(overrides), "--seed", str(seed),
               "--result", str(result)]  # fmt: skip
        cmd += ["--stop-at", str(stop_at)] if stop_at is not None else []
        cmd += ["--cap", str(cap_s)] if cap_s is not None else []
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"SB3 run failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
        return json.loads(result.read_text())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="One timed SB3 PPO run of a ppo-fabric workload")
    parser.add_argument("--overrides", type=json.loads, required=True, help="a JSON list of Hydra overrides")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--stop-at", type=float, default=None, help="stop once the mean return reaches this")
    parser.add_argument("--cap", type=float, default=None, help="stop after this many seconds")
    a = parser.parse_args()
    child(a.overrides, a.seed, a.result, a.stop_at, a.cap)
