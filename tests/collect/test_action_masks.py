"""Action masks (`algo.action_mask=auto|off`): the masked head against hand-computed distributions, the
three conventions an env can provide masks by, whole runs that must never take an illegal action (and do
without masks), the decoupled strategy's trainers using the masks, and the one-line error for a state
without a legal action."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch.distributions import Categorical

import ppo_fabric
from ppo_fabric.collect.rollout import policy_storage
from ppo_fabric.config.faults import RunFault
from ppo_fabric.config.values import ConfigError
from ppo_fabric.envs.make import ActionMaskInfo, detect_action_mask, make_vector_env
from ppo_fabric.learn.buffer import training_batch
from ppo_fabric.learn.learners import PolicySpec
from ppo_fabric.models.agent import CategoricalHead
from ppo_fabric.runs.metrics_file import read_rows
from ppo_fabric.wire.protocol import BatchCodec, Header, Kind
from tests import probe_envs
from tests.conftest import env_section, job_env

REPO = Path(__file__).resolve().parents[2]
CONVENTIONS = ["ProbeMaskedObs-v0", "ProbeMaskedInfo-v0", "ProbeMaskedMethod-v0"]
# 8 envs x 16 steps per update, 32 updates: the masked probe reaches ~3.8 of its best return 4.
FAST = [
    "env=gym",
    "env.num_envs=8",
    "algo.rollout_steps=16",
    "algo.minibatch_size=64",
    "algo.total_steps=4096",
    "algo.lr=2e-3",
    "logger=none",
    "seed=0",
]


# ------------------------------------------------------------------------------------------------ heads
def _head(nvec: list[int], seed: int = 0) -> tuple[CategoricalHead, torch.Tensor, torch.Tensor]:
    """A head with non-trivial logits, its features, and those logits."""
    torch.manual_seed(seed)
    head = CategoricalHead(5, nvec)
    with torch.no_grad():
        head.linear.weight.normal_()
    features = torch.randn(3, 5)
    return head, features, head.linear(features).detach()


def _legal_categorical(logits: torch.Tensor, mask: torch.Tensor) -> Categorical:
    """The distribution over the legal actions, built the long way: softmax, zero the illegal, renormalise."""
    probs = logits.softmax(-1) * mask
    return Categorical(probs=probs / probs.sum(-1, keepdim=True))


def test_discrete_masked_log_prob_and_entropy_match_the_renormalised_distribution() -> None:
    head, features, logits = _head([4])
    mask = torch.tensor([[True, False, True, True], [False, True, False, False], [True, True, False, True]])
    actions = torch.tensor([2, 1, 3])
    logp, entropy = head.log_prob_entropy(features, actions, mask)
    want = _legal_categorical(logits, mask)
    torch.testing.assert_close(logp, want.log_prob(actions))
    torch.testing.assert_close(entropy, want.entropy())
    assert entropy[1].item() == pytest.approx(0.0, abs=1e-6)  # one legal action: no uncertainty
    # without a mask the result is the plain softmax's, as before
    logp, entropy = head.log_prob_entropy(features, actions)
    torch.testing.assert_close(logp, Categorical(logits=logits).log_prob(actions))


def test_multidiscrete_masked_log_prob_and_entropy_sum_the_dimensions() -> None:
    head, features, logits = _head([3, 2], seed=1)
    mask = torch.tensor(
        [[True, False, True, True, True], [False, True, False, False, True], [True, True, True, True, False]]
    )
    actions = torch.tensor([[0, 1], [1, 1], [2, 0]])
    logp, entropy = head.log_prob_entropy(features, actions, mask)
    dims = [_legal_categorical(logits[:, :3], mask[:, :3]), _legal_categorical(logits[:, 3:], mask[:, 3:])]
    torch.testing.assert_close(logp, dims[0].log_prob(actions[:, 0]) + dims[1].log_prob(actions[:, 1]))
    torch.testing.assert_close(entropy, dims[0].entropy() + dims[1].entropy())


def test_masked_gradients_are_finite() -> None:
    """0 * log 0 must not turn into NaN in the entropy's gradient, nor the huge negative logits into inf."""
    head, features, _ = _head([3, 2])
    mask = torch.tensor([[True, False, False, False, True]] * 3)
    logp, entropy = head.log_prob_entropy(features.requires_grad_(), torch.tensor([[0, 1]] * 3), mask)
    (logp.sum() + entropy.sum()).backward()
    assert torch.isfinite(logp).all() and torch.isfinite(entropy).all()
    assert torch.isfinite(head.linear.weight.grad).all() and torch.isfinite(features.grad).all()


@pytest.mark.parametrize("nvec", [[4], [3, 2]])
def test_sampling_never_picks_an_illegal_action_and_greedy_picks_the_best_legal(nvec: list[int]) -> None:
    head, _, _ = _head(nvec)
    n = 20000
    features = torch.randn(n, 5)
    mask = torch.rand(n, sum(nvec)) < 0.5
    for start in np.cumsum([0, *nvec[:-1]]):  # at least one legal action per dimension
        mask[torch.arange(n), start + torch.randint(0, nvec[0] if start == 0 else nvec[1], (n,))] = True
    actions, logp = head.sample(features, mask=mask)
    offsets = torch.tensor(np.cumsum([0, *nvec[:-1]]))
    flat = actions.view(n, -1) + offsets
    assert mask.gather(1, flat).all(), "a sampled action was illegal"
    assert torch.isfinite(logp).all()
    # greedy: the legal action of the highest logit, even where an illegal one is higher
    best, _ = head.sample(features, deterministic=True, mask=mask)
    logits = head.linear(features).detach().masked_fill(~mask, -float("inf"))
    want = torch.stack([part.argmax(-1) for part in logits.split(nvec, -1)], -1).view(best.shape)
    assert torch.equal(best, want)


# ---------------------------------------------------------------------------------------- conventions
@pytest.mark.parametrize("name", CONVENTIONS)
def test_every_convention_is_detected_and_reported_in_the_infos(name: str) -> None:
    env = gym.make(f"tests.probe_envs:{name}")
    assert detect_action_mask(env) == 4
    wrapped = ActionMaskInfo(env, 4)
    assert wrapped.observation_space == gym.spaces.Box(0.0, 1.0, (4,), np.float32)  # Dict: the other key
    obs, info = wrapped.reset(seed=3)
    assert obs.shape == (4,) and info["action_mask"].dtype == bool and info["action_mask"].sum() == 2
    assert np.array_equal(info["action_mask"], obs > 0)  # the observation marks the legal actions
    obs, _, _, _, info = wrapped.step(int(np.flatnonzero(info["action_mask"])[0]))
    assert np.array_equal(info["action_mask"], obs > 0)
    assert detect_action_mask(gym.make("tests.probe_envs:ProbeObsAndAction-v0")) is None


def test_vector_env_infos_carry_the_masks() -> None:
    cfg = env_section(id="tests.probe_envs:ProbeMaskedMethod-v0", num_envs=3, vector="sync")
    envs, first = make_vector_env(cfg, seed=0, rank=0, action_mask=4)
    _, _, _, _, info = envs.step(np.array([np.flatnonzero(row)[0] for row in first > 0]))
    assert info["action_mask"].shape == (3, 4) and info["_action_mask"].all()
    envs.close()


@pytest.mark.parametrize("name", ["ProbeMaskedInfo-v0", "ProbeMaskedMethod-v0"])
def test_the_normalisation_warm_up_takes_only_legal_actions(name: str) -> None:
    """The random steps that seed the observation statistics before training draw among the legal actions
    (they sampled the whole action space: an env refusing illegal moves failed the run before it began)."""
    probe_envs._MaskedProbe.ILLEGAL[0] = 0
    cfg = env_section(id=f"tests.probe_envs:{name}", num_envs=3, vector="sync", normalize_obs=True,
                      normalize_warmup=64)  # fmt: skip
    envs, _ = make_vector_env(cfg, seed=0, rank=0, action_mask=4)
    assert probe_envs._MaskedProbe.ILLEGAL[0] == 0
    envs.close()


def test_action_repeat_with_masks_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """A mask holds for the first step of a repeat only: the later ones would replay a move that may have
    become illegal."""
    from ppo_fabric import cli
    from tests.conftest import assert_cli_failure

    argv = ["env.id=tests.probe_envs:ProbeMaskedInfo-v0", "env.action_repeat=2"]
    assert_cli_failure(capsys, cli.main, argv, "env.action_repeat=2 cannot be used with action masks")


# ----------------------------------------------------------------------------------------------- runs
def _train(tmp_path: Path, name: str, *overrides: str) -> tuple[int, dict]:
    """(illegal actions taken, summary) of a whole in-process run on a masked probe."""
    probe_envs._MaskedProbe.ILLEGAL[0] = 0
    summary = ppo_fabric.run(
        [f"env.id=tests.probe_envs:{name}", *FAST, f"hydra.run.dir={tmp_path}", *overrides]
    )
    return probe_envs._MaskedProbe.ILLEGAL[0], summary


@pytest.mark.slow  # seconds in process (a run, or every option composed): not the unit tier
@pytest.mark.parametrize("name", CONVENTIONS)
def test_runs_with_masks_take_no_illegal_action_and_learn(tmp_path: Path, name: str) -> None:
    illegal, summary = _train(tmp_path, name)
    assert illegal == 0
    assert summary["final_mean_return"] >= 3.5  # best 4; uniform over the legal actions earns 2


@pytest.mark.slow  # seconds in process (a run, or every option composed): not the unit tier
@pytest.mark.parametrize("name", CONVENTIONS)
def test_runs_without_masks_take_illegal_actions(tmp_path: Path, name: str) -> None:
    illegal, _ = _train(tmp_path, name, "algo.action_mask=off")
    assert illegal > 50


def test_recurrent_policy_respects_masks(tmp_path: Path) -> None:
    illegal, _ = _train(
        tmp_path, "ProbeMaskedInfo-v0", "model=lstm", "model.lstm.seq_len=8", "algo.total_steps=512"
    )
    assert illegal == 0


def test_evaluate_and_export_take_the_masks(tmp_path: Path) -> None:
    """A trained masked run: evaluation plays legal moves only; the exported file takes the mask as an
    input (its step-by-step round trip is in test_export_policies)."""
    from ppo_fabric.policy.evaluate import evaluate
    from ppo_fabric.policy.export import export, run_exported

    _, summary = _train(tmp_path, "ProbeMaskedObs-v0", "algo.total_steps=1024")
    probe_envs._MaskedProbe.ILLEGAL[0] = 0
    result = evaluate(
        summary["checkpoint"], episodes=20, deterministic=False, out=tmp_path / "eval", trust_env=True
    )
    assert probe_envs._MaskedProbe.ILLEGAL[0] == 0 and min(result["returns"]) >= 0
    path = export(summary["checkpoint"], out=tmp_path / "policy.pt")
    obs = torch.zeros(2, 4)
    only = torch.tensor([[False, False, True, False], [False, True, False, False]])
    (actions,) = run_exported(path, "torchscript", obs, only)
    assert actions.tolist() == [2, 1]  # the one legal action, whatever the policy prefers


def test_a_state_without_legal_action_names_the_env(tmp_path: Path) -> None:
    """A run fault, as bad env data is: an EnvError ended a one-process run in a Hydra traceback."""
    with pytest.raises(RunFault) as info:
        _train(tmp_path, "ProbeNoLegalAction-v0", "algo.total_steps=128")
    assert re.fullmatch(r"rank 0, env \d+: no legal action at env step \d+ \(the action mask of "
                        r"env.id='tests.probe_envs:ProbeNoLegalAction-v0' is all False\)", str(info.value)), info.value  # fmt: skip


def test_unknown_action_mask_setting_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="algo.action_mask"):
        _train(tmp_path, "ProbeMaskedInfo-v0", "algo.action_mask=maybe")


# ------------------------------------------------------------------------------------------ decoupled
def test_codec_sends_the_masks_to_trainers() -> None:
    spec = PolicySpec("main", gym.spaces.Box(0, 1, (4,)), gym.spaces.Discrete(4), OmegaConf.create({}), 1.0,
                      True, 1, action_mask=4)  # fmt: skip
    storage = policy_storage(4, 2, spec, "cpu")
    storage["action_mask"] = torch.rand(4, 2, 4) < 0.5
    batch = training_batch(storage)
    codec = BatchCodec(batch, num_trainers=2)
    assert ("action_mask", torch.Size([4]), torch.bool) in codec.layout
    shards = [codec.unpack(buf, torch.device("cpu"))[1] for buf in codec.pack(batch, Header(Kind.DATA, 1))]
    assert torch.equal(torch.cat([s["action_mask"] for s in shards]), batch["action_mask"])


@pytest.mark.multiprocess
def test_decoupled_trainers_update_with_the_masks(tmp_path: Path) -> None:
    """1 player + 1 trainer: the player never takes an illegal action, and the trainer's entropy of the
    first update is that of 2 legal actions (log 2), not of 4 (log 4): it evaluated under the masks."""
    log = tmp_path / "illegal.txt"
    cmd = [
        sys.executable, "-m", "ppo_fabric", "strategy=decoupled", "fabric.devices=2",
        "env.id=tests.probe_envs:ProbeMaskedInfo-v0", *FAST[1:-2], "algo.total_steps=1024",
        "logger.tensorboard=false", "logger.plot=false", f"+env.kwargs.illegal_log={log}", f"hydra.run.dir={tmp_path / 'run'}",
    ]  # fmt: skip
    env = job_env(supervisor=False)  # the job's masks, not the supervisor
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not log.exists() or log.read_text() == ""
    rows = read_rows(tmp_path / "run" / "metrics.csv")
    rows = sorted((r for r in rows if r.get("loss/entropy")), key=lambda r: int(r["step"]))
    assert rows and float(rows[0]["loss/entropy"]) <= math.log(2) + 1e-3


def test_resume_with_masks_is_exact(tmp_path: Path) -> None:
    """The next observations' masks travel in the checkpoint's carry: 128 + 128 steps = 256 straight."""
    fixed = ["env.num_envs=4", "algo.total_steps=256", "algo.anneal_lr=false", "algo.minibatch_size=32"]
    _, straight = _train(tmp_path / "a", "ProbeMaskedInfo-v0", *fixed)
    _, half = _train(tmp_path / "b", "ProbeMaskedInfo-v0", *fixed, "algo.total_steps=128")
    assert "action_mask" in torch.load(half["checkpoint"], weights_only=True)["ranks"][0]["carry"]["main"]
    _, resumed = _train(tmp_path / "c", "ProbeMaskedInfo-v0", *fixed, f"resume={half['checkpoint']}")
    want = torch.load(straight["checkpoint"], weights_only=True)["agent"]
    got = torch.load(resumed["checkpoint"], weights_only=True)["agent"]
    assert all(torch.equal(want[k], got[k]) for k in want)
