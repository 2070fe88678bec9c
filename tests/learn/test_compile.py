"""`algo.compile`: the compiled minibatch step trains like the eager one; the config keys; the CUDA math switch.

Compiling costs seconds on the CPU, so one test compiles one step and exercises everything the step must
carry in it (action masks, a step mask, advantage normalisation, value clipping, gradient clipping, a
changed learning rate), and one short run checks that the key reaches the update.
"""

from __future__ import annotations

import copy
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from lightning_fabric import Fabric
from omegaconf import OmegaConf
from tensordict import TensorDict

import ppo_fabric
from ppo_fabric.cli import main as cli_main
from ppo_fabric.config.values import ConfigError
from ppo_fabric.learn import accel
from ppo_fabric.learn.update import minibatch_losses, set_lr
from tests.conftest import algo_section, assert_cli_failure, update_with_config

ALGO = algo_section(
    **{
        "minibatch_size": 16,
        "update_epochs": 2,
        "clip_coef": 0.2,
        "clip_vloss": True,
        "norm_adv": True,
        "vf_coef": 0.5,
        "ent_coef": 0.01,
        "max_grad_norm": 0.5,
        "target_kl": None,
        "compile": False,
        "anneal_lr": False,
        "gamma": 0.99,
        "gae_lambda": 0.95,
    }
)
MODEL = OmegaConf.create(
    {"encoder": "auto", "actor_hidden": [32, 32], "critic_hidden": [32, 32], "activation": "tanh"}
)


def masked_batch(n: int, obs_dim: int, actions: int) -> TensorDict:
    """A batch with everything the step can meet: legal-action masks (action 0 always legal, the sampled
    action legal) and a step mask whose absent rows hold large advantages that must not leak in."""
    g = torch.Generator().manual_seed(0)
    action_mask = torch.rand(n, actions, generator=g) > 0.4
    action_mask[:, 0] = True
    acts = torch.randint(0, actions, (n,), generator=g)
    action_mask[torch.arange(n), acts] = True
    mask = torch.rand(n, generator=g) > 0.2
    advantages = torch.randn(n, generator=g)
    advantages[~mask] = 1e3
    return TensorDict(
        {
            "obs": torch.randn(n, obs_dim, generator=g),
            "actions": acts,
            "logprobs": -torch.rand(n, generator=g) - 0.5,
            "values": torch.randn(n, generator=g),
            "advantages": advantages,
            "returns": torch.randn(n, generator=g),
            "mask": mask,
            "action_mask": action_mask,
        },
        batch_size=[n],
    )


def trained(algo, model, batches, lrs, reload_at=None):  # type: ignore[no-untyped-def]
    """A fresh Fabric-wrapped copy of `model` and fused Adam, one update per (batch, lr) with the same
    shuffles; `reload_at`: before that update the optimiser's state is replaced by a copy (as a checkpoint
    load does). Returns (the wrapped module, the optimiser, each update's metrics)."""
    fabric = Fabric(accelerator="cpu", devices=1)
    module = copy.deepcopy(model)
    optimizer = torch.optim.Adam(module.parameters(), lr=lrs[0], eps=1e-5, fused=True)
    module, optimizer = fabric.setup(module, optimizer)
    torch.manual_seed(7)
    stats = []
    for i, (batch, lr) in enumerate(zip(batches, lrs, strict=True)):
        if i == reload_at:
            optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        set_lr(optimizer, lr)
        stats.append(update_with_config(fabric, module, optimizer, batch, algo))
    return module, optimizer, stats


def trained_copy(algo, model, batch, lrs):  # type: ignore[no-untyped-def]
    """`trained` on one batch, once per learning rate; returns (parameters, metrics of each update)."""
    module, _, stats = trained(algo, model, [batch] * len(lrs), lrs)
    return [p.detach().clone() for p in module.parameters()], stats


@pytest.mark.slow
def test_compiled_step_trains_like_eager() -> None:
    """Two updates (2 epochs x 4 minibatches each, lr changed in between) give the same parameters and
    metrics compiled as eager, within float32 reassociation noise; the lr change compiles nothing new."""
    from ppo_fabric.models.agent import ActorCritic

    torch.manual_seed(0)
    model = ActorCritic(gym.spaces.Box(-1, 1, (6,), np.float32), gym.spaces.Discrete(5), MODEL)
    batch = masked_batch(64, 6, 5)
    lrs = [3e-3, 1e-3]
    eager, eager_stats = trained_copy(ALGO, model, batch, lrs)
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    compiled, compiled_stats = trained_copy(OmegaConf.merge(ALGO, {"compile": True}), model, batch, lrs)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1, "nothing was compiled"
    moved = max((e - p).abs().max().item() for e, p in zip(eager, model.parameters(), strict=True))
    assert moved > 1e-3, "the updates did not change the parameters: the comparison would prove nothing"
    for e, c in zip(eager, compiled, strict=True):
        torch.testing.assert_close(c, e, rtol=1e-4, atol=2e-5)
    for e, c in zip(eager_stats, compiled_stats, strict=True):
        assert c.keys() == e.keys()
        for key in e:
            assert c[key] == pytest.approx(e[key], rel=1e-3, abs=1e-5), key
    # a third update at yet another lr: the compiled step is reused as it is
    module_graphs = counters["stats"]["unique_graphs"]
    trained_copy(OmegaConf.merge(ALGO, {"compile": True}), model, batch, [5e-4])
    assert counters["stats"]["unique_graphs"] == module_graphs == graphs


def test_cuda_graph_outputs_are_copied_before_the_next_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled step on a CUDA model replays CUDA graphs, whose outputs live in memory that the next
    replay overwrites. Simulated on the CPU: the step hands back its losses and log-probs in one static
    buffer each, poisoned with NaN at every `cudagraph_mark_step_begin`. The update must mark every
    minibatch step and copy what it keeps, so its parameters and metrics are the eager update's."""
    from ppo_fabric.models.agent import ActorCritic

    static: dict[str, torch.Tensor] = {}
    marks = []

    def graph_replays(step, model):  # type: ignore[no-untyped-def]
        def replay(*args):  # type: ignore[no-untyped-def]
            loss, stats, new_logp = step(*args)
            with torch.no_grad():
                out_stats = static.setdefault("stats", torch.empty_like(stats)).copy_(stats)
                out_logp = static.setdefault("logp", torch.empty_like(new_logp)).copy_(new_logp)
            return loss, out_stats, out_logp

        return replay

    def mark_step_begin() -> None:
        marks.append(True)
        for buffer in static.values():
            buffer.fill_(float("nan"))

    torch.manual_seed(0)
    model = ActorCritic(gym.spaces.Box(-1, 1, (6,), np.float32), gym.spaces.Discrete(5), MODEL)
    batch = masked_batch(64, 6, 5)
    eager, eager_stats = trained_copy(ALGO, model, batch, [3e-3, 1e-3])
    monkeypatch.setattr("ppo_fabric.learn.update.compiled", graph_replays)
    monkeypatch.setattr("ppo_fabric.learn.update.uses_cuda_graphs", lambda model: True)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", mark_step_begin)
    replayed, replayed_stats = trained_copy(
        OmegaConf.merge(ALGO, {"compile": True}), model, batch, [3e-3, 1e-3]
    )
    assert len(marks) == 2 * 2 * 4  # updates x epochs x minibatches: one mark before every replay
    for e, r in zip(eager, replayed, strict=True):
        assert torch.equal(e, r)
    assert replayed_stats == eager_stats
    assert all(np.isfinite(v) for stats in replayed_stats for v in stats.values())


def test_compiled_step_is_the_eager_function(monkeypatch: pytest.MonkeyPatch) -> None:
    """`algo.compile` hands `minibatch_losses` itself to torch.compile (no second copy of the losses), once
    per model, with CUDA graphs only for a CUDA model."""
    calls = []

    def fake_compile(fn, **kwargs):  # type: ignore[no-untyped-def]
        calls.append((fn, kwargs))
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    model = torch.nn.Linear(2, 2)
    first = accel.compiled(minibatch_losses, model)
    assert accel.compiled(minibatch_losses, model) is first
    assert calls == [(minibatch_losses, {"dynamic": False, "mode": "default"})]
    assert accel.compile_mode(torch.device("cuda", 0)) == "reduce-overhead"
    assert not accel.uses_cuda_graphs(model)


def test_compile_key_reaches_every_learner(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`algo.compile=true` through the run API, multi-agent (two trained policies): each learner's update
    asks for its own compiled step of the one loss function. (Compiling is stubbed: the equality test
    above pays for one real compile.)"""
    asked = []

    def record(step, model):  # type: ignore[no-untyped-def]
        asked.append((step, model))
        return step

    monkeypatch.setattr("ppo_fabric.learn.update.compiled", record)
    ppo_fabric.run(
        [
            "env=pettingzoo",
            "env.num_envs=4",
            "algo.rollout_steps=15",
            "algo.minibatch_size=20",
            "algo.total_steps=120",
            "multiagent.policies={first:{},rest:{lr:1e-3}}",
            "multiagent.policy_mapping={agent_0:first,agent_*:rest}",
            "algo.compile=true",
            "logger=none",
            f"hydra.run.dir={tmp_path}",
        ]
    )
    assert {step for step, _ in asked} == {minibatch_losses}
    assert len(asked) == 4  # 2 policies x 2 updates
    assert len({id(model) for _, model in asked}) == 2  # one compiled step per policy


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["algo.compile=maybe"], "algo.compile='maybe' must be false, true or graph"),
        (["fabric.tf32=1"], "fabric.tf32=1 must be true or false"),
        (["model=lstm", "algo.compile=true"], "algo.compile=true does not support recurrent policies"),
    ],
)
def test_bad_keys(capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str) -> None:
    assert_cli_failure(capsys, cli_main, argv, fragment)
    with pytest.raises(ConfigError, match="algo.compile|fabric.tf32"):
        ppo_fabric.run(argv)


@pytest.fixture
def cuda_flags() -> object:
    """Restore the process-wide flags the switch sets."""
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.benchmark,
    )
    yield
    (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.benchmark,
    ) = saved


def flags() -> tuple[bool, bool, bool]:
    return (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.benchmark,
    )


def test_tf32_switch_on_cuda(monkeypatch: pytest.MonkeyPatch, cuda_flags: object) -> None:
    """With CUDA present, fabric.tf32 sets TF32 matmuls, TF32 convolutions and cudnn.benchmark together,
    both ways."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert accel.set_cuda_math(True) is True
    assert flags() == (True, True, True)
    assert accel.set_cuda_math(False) is False
    assert flags() == (False, False, False)


def test_tf32_switch_without_cuda(monkeypatch: pytest.MonkeyPatch, cuda_flags: object) -> None:
    """Without CUDA the flags stay as they were: a CPU run's process state is not touched."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    assert accel.set_cuda_math(True) is False
    assert flags() == (False, False, False)


def test_launch_sets_cuda_math(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The run's Fabric set-up applies `fabric.tf32` (default true) once per process."""
    seen = []
    monkeypatch.setattr("ppo_fabric.app.launch.set_cuda_math", lambda on: seen.append(on) or on)
    ppo_fabric.run(["algo.total_steps=512", "logger=none", "fabric.tf32=false", f"hydra.run.dir={tmp_path}"])
    assert seen == [False]
