"""The Stable-Baselines3 baseline's adapter: SB3 `PPO` configured from ppo-fabric's composed config, and
the warm-up both libraries' timed children pay before their clocks start. `time_to_score.py` and
tests/learn/test_sb3_parity.py import it; it imports no SB3 itself."""

from __future__ import annotations

from typing import Any


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
    return out
