"""Exported policies of every kind, run step by step against the PyTorch policy along real episodes:
masked discrete (the mask is an input), LSTM (the state goes in and comes out), and a multi-agent run (one
file per policy), each as TorchScript (torch.jit.load) and ONNX (onnxruntime).

The checkpoints are written here from freshly initialised models (head weights scaled up so greedy
actions are decided by clear margins), so no training is needed: what is tested is the file, not the
policy's quality.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import tests.probe_envs  # noqa: F401  (registers the probe envs)
from ppo_fabric.config.values import compose
from ppo_fabric.envs.make import make_env
from ppo_fabric.envs.multiagent import make_parallel_env
from ppo_fabric.models.agent import ActorCritic
from ppo_fabric.policy import export
from ppo_fabric.runs import checkpoint as ckpt

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.jit.*deprecated:DeprecationWarning")
HAS_ONNX = all(importlib.util.find_spec(m) is not None for m in ("onnx", "onnxscript", "onnxruntime"))
LSTM = ["model=lstm", "model.lstm.hidden_size=8"]


def _net(obs_space: gym.Space, action_space: gym.Space, model: Any, seed: int) -> ActorCritic:
    torch.manual_seed(seed)
    net = ActorCritic(obs_space, action_space, model)
    with torch.no_grad():  # decisive heads: greedy actions that differ from state to state (and Box means
        # that reach past the bounds)
        getattr(net.head, "linear", getattr(net.head, "mean", None)).weight.mul_(200.0)
    return net.eval()


def _write(
    path: Path, overrides: list[str], spaces: dict[str, tuple[gym.Space, gym.Space]], **extra: Any
) -> Path:
    """A checkpoint of fresh models: single-agent when `spaces` has the one policy `main`."""
    cfg, _ = compose(overrides)
    state: dict[str, Any] = {
        "config": OmegaConf.to_container(cfg, resolve=True),
        "update": 1,
        "env_step": 64,
        "ranks": [{}],
        **extra,
    }
    if list(spaces) == ["main"]:
        obs_space, action_space = spaces["main"]
        state |= {"observation_space": obs_space, "action_space": action_space}
        state["agent"] = _net(obs_space, action_space, cfg.model, 0).state_dict()
    else:
        state |= {
            "multiagent": True,
            "observation_space": {n: s[0] for n, s in spaces.items()},
            "action_space": {n: s[1] for n, s in spaces.items()},
        }
        state["agent"] = {
            n: _net(*s, ckpt.policy_model_config(state, n), i).state_dict()
            for i, (n, s) in enumerate(spaces.items())
        }
    path.write_bytes(ckpt.encode(state))
    return path


class Exported:
    """An exported file as a consumer runs it: one step for a batch of one."""

    def __init__(self, path: Path, fmt: str) -> None:
        if fmt == "torchscript":
            module = torch.jit.load(str(path))
            self.run: Callable[..., list[np.ndarray]] = lambda *xs: [
                t.numpy() for t in _tuple(module(*(torch.as_tensor(x) for x in xs)))
            ]
        else:
            import onnxruntime as ort

            session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            names = [i.name for i in session.get_inputs()]
            self.names = names
            self.run = lambda *xs: session.run(None, dict(zip(names, xs, strict=True)))


def _tuple(out: Any) -> tuple[Any, ...]:
    return out if isinstance(out, tuple) else (out,)


def _obs(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)[None]


MASKED_ENV = "tests.probe_envs:ProbeMaskedInfo-v0"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fmt", "recurrent"),
    [
        ("torchscript", False),
        ("torchscript", True),
        pytest.param(
            "onnx", True, marks=pytest.mark.skipif(not HAS_ONNX, reason="pip install 'ppo-fabric[onnx]'")
        ),
    ],
)
def test_masked_policy_step_by_step(tmp_path: Path, fmt: str, recurrent: bool) -> None:
    """The env's mask goes in with every step (and the LSTM state in and out): the file's greedy action,
    value and next state equal the PyTorch policy's along whole episodes, and are always legal."""
    overrides = [f"env.id={MASKED_ENV}", *(LSTM if recurrent else [])]
    env = make_env(compose(overrides)[0].env, action_mask=4)
    path = _write(
        tmp_path / "m.ckpt", overrides, {"main": (env.observation_space, env.action_space)}, action_mask=4
    )
    out = export.export(path, format=fmt, out=tmp_path / f"p{export.FORMATS[fmt]}", value=True)
    _, agent = ckpt.load_policy(path)
    inputs = ["obs", "action_mask", *(["state"] if recurrent else [])]
    outputs = ["action", "value", *(["next_state"] if recurrent else [])]
    assert _meta(out, fmt)["inputs"] == inputs and _meta(out, fmt)["outputs"] == outputs
    exported = Exported(out, fmt)
    differ = 0
    for episode in range(3):
        obs, info = env.reset(seed=episode)
        state = np.zeros((1, *agent.state_shape), dtype=np.float32) if recurrent else None
        ref_state, done = None, False
        while not done:
            mask = np.asarray(info["action_mask"], dtype=bool)[None]
            got = exported.run(_obs(obs), mask, *(() if state is None else (state,)))
            with torch.no_grad():
                want, _, value, ref_state = agent.act_with_state(
                    torch.as_tensor(_obs(obs)), ref_state, True, torch.as_tensor(mask)
                )
                free = agent.act_with_state(torch.as_tensor(_obs(obs)), ref_state, True)[0]
            action = int(got[0][0])
            assert action == int(want[0]) and mask[0, action]
            np.testing.assert_allclose(got[1], value.numpy(), rtol=1e-4, atol=1e-5)
            if recurrent:
                state = got[2]
                np.testing.assert_allclose(state, ref_state.numpy(), rtol=1e-4, atol=1e-5)
            differ += int(free[0]) != action
            obs, _, terminated, truncated, info = env.step(action)
            done = terminated or truncated
    assert differ > 0, "the mask never changed the greedy action: the test could not catch a dropped mask"
    env.close()


def _meta(path: Path, fmt: str) -> dict[str, Any]:
    if fmt == "torchscript":
        extra = {export.METADATA_FILE: ""}
        torch.jit.load(str(path), _extra_files=extra)
        return json.loads(extra[export.METADATA_FILE])
    import onnx

    props = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    return json.loads(props[export.METADATA_FILE])


@pytest.mark.parametrize("fmt", ["torchscript"])
def test_multiagent_one_file_per_policy(tmp_path: Path, fmt: str) -> None:
    overrides = [
        "env=pettingzoo",
        "env.id=ppo_fabric.envs.toy_multiagent:teams_v0",
        "multiagent.policies={adversary:{},agent:{model:{actor_hidden:[32]}}}",
        "multiagent.policy_mapping={adversary_*:adversary,agent_*:agent}",
        *LSTM,
    ]
    cfg = compose(overrides)[0]
    env = make_parallel_env(cfg.env)
    spaces = {
        "adversary": (env.observation_space("adversary_0"), env.action_space("adversary_0")),
        "agent": (env.observation_space("agent_0"), env.action_space("agent_0")),
    }
    path = _write(tmp_path / "ma.ckpt", overrides, spaces)
    files = export.main([f"checkpoint={path}", f"format={fmt}", f"out={tmp_path / 'files'}"])
    suffix = export.FORMATS[fmt]
    assert files == {n: tmp_path / "files" / f"policy_{n}{suffix}" for n in ("adversary", "agent")}
    _, policies = ckpt.load_policies(path)
    assert policies["agent"].actor_body.layers[0].out_features == 32  # the policy's own model override
    exported = {n: Exported(p, fmt) for n, p in files.items()}
    obs, _ = env.reset(seed=1)
    states = {a: np.zeros((1, *policies[a.split("_")[0]].state_shape), dtype=np.float32) for a in env.agents}
    refs: dict[str, Any] = dict.fromkeys(env.agents)
    while env.agents:
        actions = {}
        for a in env.agents:
            name = a.split("_")[0]
            action, states[a] = exported[name].run(_obs(obs[a]), states[a])
            with torch.no_grad():
                want, _, _, refs[a] = policies[name].act_with_state(
                    torch.as_tensor(_obs(obs[a])), refs[a], True
                )
            assert int(action[0]) == int(want[0])
            np.testing.assert_allclose(states[a], refs[a].numpy(), rtol=1e-4, atol=1e-5)
            actions[a] = int(action[0])
        obs, *_ = env.step(actions)
    env.close()


def test_turn_based_game_policy_takes_the_mask(tmp_path: Path) -> None:
    """A tictactoe self-play checkpoint records no mask widths: the game's `action_mask` observations say
    the policy was trained with masks, so its file takes them (a file without would play illegal moves)."""
    from tests.policy.test_evaluate_policies import _tictactoe_checkpoint

    path = _tictactoe_checkpoint(tmp_path / "ttt.ckpt", with_pool=False)
    assert ckpt.mask_width(ckpt.load(path, key="checkpoint", env_state="fresh"), "shared") == 9
    files = export.export(path, out=tmp_path)
    assert files == {"shared": tmp_path / "policy_shared.pt"}
    assert _meta(files["shared"], "torchscript")["inputs"] == ["obs", "action_mask"]
    only = torch.zeros(1, 9, dtype=torch.bool)
    only[0, 7] = True
    (action,) = Exported(files["shared"], "torchscript").run(np.zeros((1, 3, 3, 2), np.float32), only.numpy())
    assert int(action[0]) == 7  # its favourite, move 0, is illegal here
