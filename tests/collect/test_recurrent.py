"""Recurrent PPO (model=lstm): the update rebuilds exactly the states the rollout acted with, the memory
probe is solved only with memory, and every launch path, resume, evaluate and export handle the state.

The unit tests collect short rollouts of CartPole with the velocities hidden and a 12-step time limit, so
terminations and truncations fall inside the 8-step training sequences; the state each step started from
is stored as a rollout extra, zeroed where an episode ended. Re-evaluating those sequences from their
stored initial states, resetting at `starts`, must give the stored log-probs and values (the first
minibatch's ratio is 1 up to float rounding: the sequence LSTM and the per-step one take different kernels).
The runs are tiny: the file needs about a minute of CPU time, most of it starting the processes of the
multi-process runs (4 launches of 2-3 processes each).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning_fabric import Fabric
from omegaconf import DictConfig, OmegaConf
from tensordict import TensorDict

import ppo_fabric
from ppo_fabric import cli
from ppo_fabric.app import launch as launch_module
from ppo_fabric.collect.rollout import RolloutCollector
from ppo_fabric.envs.make import make_vector_env
from ppo_fabric.learn import update as update_module
from ppo_fabric.learn.buffer import STATE_KEY, rollout_storage, training_batch
from ppo_fabric.learn.learners import Learner
from ppo_fabric.models.agent import ActorCritic, RecurrentCore
from ppo_fabric.policy import evaluate, export
from ppo_fabric.runs import checkpoint as ckpt
from ppo_fabric.runs.metrics_file import read_rows, series
from tests.conftest import (
    algo_section,
    assert_cli_failure,
    cartpole_env_cfg,
    job_env,
    numbered_checkpoint,
    single_learner,
)
from tests.conftest import update_with_config as train

REPO = Path(__file__).resolve().parents[2]
STEPS, ENVS, SEQ = 32, 4, 8
N_STEPS = STEPS * ENVS
N_SEQ = N_STEPS // SEQ  # sequences per rollout


def env_cfg() -> DictConfig:
    """CartPole with position and angle only; a 12-step limit adds truncations to the terminations."""
    return cartpole_env_cfg(ENVS, max_episode_steps=12, mask_velocity=True)


def model_cfg(shared: bool = False) -> DictConfig:
    """conf/model/lstm.yaml, smaller; two layers so the [B, 2 * cores, layers, H] state layout is exercised."""
    return OmegaConf.create(
        {
            "encoder": "auto",
            "actor_hidden": [32],
            "critic_hidden": [32],
            "activation": "tanh",
            "lstm": {"hidden_size": 16, "num_layers": 2, "shared": shared, "seq_len": SEQ},
        }
    )


def algo_cfg(**overrides: object) -> DictConfig:
    algo = {"minibatch_size": N_STEPS, "update_epochs": 1, "lr": 2.5e-4, "adam_eps": 1e-5, "gamma": 0.99,
            "gae_lambda": 0.95, "norm_adv": True, "clip_coef": 0.2, "clip_vloss": False, "vf_coef": 0.5,
            "ent_coef": 0.01, "max_grad_norm": 0.5, "target_kl": None, "anneal_lr": False}  # fmt: skip
    return algo_section(**(algo | overrides))


def stir(model: ActorCritic) -> ActorCritic:
    """Random O(1) weights: the orthogonal init with its 0.01-gain policy head and CartPole's small
    observations give values ~1e-3 and a near-uniform policy, against which a wrong state or a missed reset
    would change the outputs by little more than the 1e-5 tolerance. Exactness does not depend on them."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model


def collect(model: ActorCritic, seed: int, rollouts: int = 1) -> list[TensorDict]:
    """`rollouts` consecutive [STEPS, ENVS] rollouts of one collector (episodes continue across them)."""
    envs, first_obs = make_vector_env(env_cfg(), seed, 0)
    try:
        storage = rollout_storage(
            STEPS, ENVS, envs.single_observation_space, envs.single_action_space, "cpu", model.state_shape
        )
        collector = RolloutCollector(envs, first_obs, storage, 0.99, 0.95)
        out = []
        for i in range(rollouts):
            assert collector.collect(model, i * N_STEPS) == N_STEPS
            out.append(storage.clone())
    finally:
        envs.close()
    return out


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """As the CLI runs (torch_threads=1); see tests/learn/test_ratio.py."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=[False, True], ids=["separate-lstms", "shared-lstm"])
def rollouts(one_thread: None, request: pytest.FixtureRequest) -> tuple[ActorCritic, list[TensorDict]]:
    """Two consecutive rollouts: the second starts from states carried over from the first. With separate
    actor and critic LSTMs (the default) and with one shared LSTM (`model.lstm.shared=true`)."""
    torch.manual_seed(0)
    envs, _ = make_vector_env(env_cfg(), 0, 0)
    model = stir(
        ActorCritic(envs.single_observation_space, envs.single_action_space, model_cfg(request.param))
    )
    envs.close()
    return model, collect(model, seed=0, rollouts=2)


def _locate(batch: TensorDict, storage: TensorDict) -> list[tuple[int, int]]:
    """(chunk, env) of each training sequence, found by its observations (the batch may order them freely)."""
    places = []
    for i in range(batch.batch_size[0]):
        found = [(c, e) for c in range(STEPS // SEQ) for e in range(ENVS)
                 if torch.equal(batch["obs"][i], storage["obs"][c * SEQ : (c + 1) * SEQ, e])]  # fmt: skip
        assert len(found) == 1, f"sequence {i} matches {found}"
        places.append(found[0])
    assert sorted(places) == [(c, e) for c in range(STEPS // SEQ) for e in range(ENVS)]
    return places


# ------------------------------------------------------------------------------- the stored sequences
def test_rollouts_end_episodes_inside_sequences(rollouts: tuple[ActorCritic, list[TensorDict]]) -> None:
    """Guard: the data holds terminations and truncations, some of them inside a training sequence."""
    model, (first, second) = rollouts
    cores = 1 if model.core.state_shape[0] == 2 else 2
    assert model.state_shape == (2 * cores, 2, 16)
    for s in (first, second):
        assert s[STATE_KEY].shape == (STEPS, ENVS, *model.state_shape)
        assert training_batch(s, SEQ)["starts"][:, 1:].sum() >= 2
    assert first["terminated"].any() or second["terminated"].any()
    assert (first["truncated"] & ~first["terminated"]).any() or (
        second["truncated"] & ~second["terminated"]
    ).any()


@pytest.mark.parametrize("which", [0, 1], ids=["first-rollout", "second-rollout"])
def test_training_batch_cuts_sequences_with_starts_and_initial_states(
    rollouts: tuple[ActorCritic, list[TensorDict]], which: int
) -> None:
    """Each sequence holds SEQ consecutive steps of one env, its `initial_state` is the state stored at its
    first step, and `starts` is True exactly at steps that follow a terminated or truncated step of it."""
    storage = rollouts[1][which]
    batch = training_batch(storage, SEQ)
    assert batch.batch_size == (N_SEQ,) and batch["starts"].shape == (N_SEQ, SEQ)
    done = storage["terminated"] | storage["truncated"]
    for i, (c, e) in enumerate(_locate(batch, storage)):
        steps = slice(c * SEQ, (c + 1) * SEQ)
        for key in ("actions", "logprobs", "values", "advantages", "returns"):
            assert torch.equal(batch[key][i], storage[key][steps, e]), key
        expected = [bool(done[c * SEQ + k - 1, e]) for k in range(1, SEQ)]
        assert batch["starts"][i, 1:].tolist() == expected
        assert torch.equal(batch["initial_state"][i], storage[STATE_KEY][c * SEQ, e])
        # At a sequence's first step the initial state (zero after an episode end) does the reset; a flag
        # there is allowed, but only where the step really begins an episode.
        begins = c > 0 and bool(done[c * SEQ - 1, e])
        assert not batch["starts"][i, 0] or begins
        if begins:
            assert not batch["initial_state"][i].any()


def test_stored_state_is_zero_exactly_at_episode_starts(
    rollouts: tuple[ActorCritic, list[TensorDict]],
) -> None:
    """The state a step started from is zero at the first step of every episode (the run's first step, and
    each step after a terminated or truncated one, also across the rollout boundary) and non-zero elsewhere."""
    _, storages = rollouts
    previous_done = torch.ones(ENVS, dtype=torch.bool)  # the first rollout begins fresh episodes
    for s in storages:
        done = s["terminated"] | s["truncated"]
        new_episode = torch.cat([previous_done[None], done[:-1]])
        zero = (s[STATE_KEY].flatten(2) == 0).all(-1)
        assert torch.equal(zero, new_episode)
        assert (s[STATE_KEY].flatten(2) != 0).any(-1)[~new_episode].all()
        previous_done = done[-1]
    assert not storages[1][STATE_KEY][0].eq(0).all(), "guard: some state is carried into the next rollout"


@pytest.mark.parametrize("minibatch", [1, 3, N_SEQ])
@pytest.mark.parametrize("which", [0, 1], ids=["first-rollout", "second-rollout"])
def test_forward_reproduces_the_stored_logprobs_and_values(
    rollouts: tuple[ActorCritic, list[TensorDict]], which: int, minibatch: int
) -> None:
    """`forward(obs, actions, initial_state, starts)` on shuffled minibatches of sequences gives the
    log-probs and values the rollout stored; without the resets or the stored states it would not."""
    model, storages = rollouts
    batch = training_batch(storages[which], SEQ)
    shuffled = batch[torch.randperm(N_SEQ, generator=torch.Generator().manual_seed(minibatch))]
    worst_logp, worst_value = 0.0, 0.0
    with torch.no_grad():
        for start in range(0, N_SEQ, minibatch):
            mb = shuffled[start : start + minibatch]
            logp, entropy, values = model(mb["obs"], mb["actions"], mb["initial_state"], mb["starts"])
            assert logp.shape == entropy.shape == values.shape == (len(mb), SEQ)
            assert (entropy > 0).all() and (entropy <= math.log(2) + 1e-6).all()
            worst_logp = max(worst_logp, (logp - mb["logprobs"]).abs().max().item())
            worst_value = max(worst_value, (values - mb["values"]).abs().max().item())
        assert worst_logp < 1e-5 and worst_value < 1e-5, (worst_logp, worst_value)
        # Guards: the data needs both the resets and (second rollout) the carried-over states.
        no_resets = model(
            batch["obs"], batch["actions"], batch["initial_state"], torch.zeros_like(batch["starts"])
        )
        assert (no_resets[2] - batch["values"]).abs().max() > 1e-3
        if which == 1:
            zero_state = model(
                batch["obs"], batch["actions"], torch.zeros_like(batch["initial_state"]), batch["starts"]
            )
            assert (zero_state[2] - batch["values"]).abs().max() > 1e-3


def test_recurrent_core_sequence_equals_stepping_with_resets() -> None:
    """One `sequence` call (the LSTM run once per stretch between resets) equals `step` at every step with
    the state zeroed by hand where a row starts an episode; a step's output is the last layer's h."""
    torch.manual_seed(1)
    for layers in (1, 2):
        core = RecurrentCore(in_dim=5, hidden_size=7, num_layers=layers)
        batch, steps = 4, 9
        x = torch.randn(batch, steps, 5)
        state0 = torch.randn(batch, *core.state_shape)
        starts = torch.zeros(batch, steps, dtype=torch.bool)
        starts[0, [2, 3, 7]] = True  # consecutive resets
        starts[1, 8] = True  # the last step
        starts[2, :] = True  # every step (step 0's flag is the initial state's business)
        starts[:, 5] = True  # all rows at once; row 3 resets only here
        with torch.no_grad():
            got = core.sequence(x, state0, starts)
            state, expected = state0.clone(), []
            for t in range(steps):
                if t > 0:
                    state[starts[:, t]] = 0.0
                out, state = core.step(x[:, t], state)
                assert state.shape == (batch, *core.state_shape)
                torch.testing.assert_close(out, state[:, 0, -1], rtol=0, atol=0)
                expected.append(out)
        assert got.shape == (batch, steps, 7)
        torch.testing.assert_close(got, torch.stack(expected, 1), rtol=0, atol=1e-6)
        with torch.no_grad():  # guard: the resets matter
            assert (core.sequence(x, state0, torch.zeros_like(starts)) - got).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------- train()
def single_process_learner(**algo: Any) -> tuple[Fabric, Learner]:
    """The LSTM learner of a 1-process run under a real Fabric, as `ppo.main()` builds it."""
    fabric = Fabric(accelerator="cpu", devices=1)
    envs, _ = make_vector_env(env_cfg(), 0, 0)
    spaces = envs.single_observation_space, envs.single_action_space
    envs.close()
    cfg = OmegaConf.create({"model": model_cfg(), "algo": algo_cfg(**algo)})
    return fabric, single_learner(fabric, cfg, *spaces)


def test_train_first_minibatch_sees_ratio_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a real single-process Fabric, the first gradient step of an update (4 minibatches of 4
    sequences, 2 epochs) sees ratio 1 and the stored values at every step; later ones do not (the
    parameters have moved)."""
    torch.manual_seed(2)
    fabric, learner = single_process_learner(lr=0.01)
    (storage,) = collect(stir(learner.policy), seed=2)
    ratios: list[torch.Tensor] = []
    value_moves: list[torch.Tensor] = []
    real_policy_loss, real_value_loss = update_module.policy_loss, update_module.value_loss

    def policy_loss(new_logp: torch.Tensor, old_logp: torch.Tensor, *args: Any) -> torch.Tensor:
        ratios.append((new_logp - old_logp).detach().exp())
        return real_policy_loss(new_logp, old_logp, *args)

    def value_loss(new_values: torch.Tensor, old_values: torch.Tensor, *args: Any) -> torch.Tensor:
        value_moves.append((new_values - old_values).detach().abs().max())
        return real_value_loss(new_values, old_values, *args)

    monkeypatch.setattr(update_module, "policy_loss", policy_loss)
    monkeypatch.setattr(update_module, "value_loss", value_loss)
    algo = algo_cfg(minibatch_size=N_STEPS // 4, update_epochs=2, lr=0.01)
    stats = train(fabric, learner.model, learner.optimizer, training_batch(storage, SEQ), algo)
    assert len(ratios) == len(value_moves) == 8 and stats["train/epochs"] == 2
    assert ratios[0].shape == (N_SEQ // 4, SEQ)
    assert (ratios[0] - 1).abs().max() < 1e-5
    assert value_moves[0] < 1e-5
    assert max((r - 1).abs().max().item() for r in ratios[1:]) > 1e-3


def test_train_one_minibatch_metrics_at_ratio_one() -> None:
    """One epoch, one minibatch: clip fraction and KL are 0, the normalised policy loss is 0, the value
    loss is mean(adv^2), and the parameters move."""
    torch.manual_seed(3)
    fabric, learner = single_process_learner()
    (storage,) = collect(stir(learner.policy), seed=3)
    batch = training_batch(storage, SEQ)
    before = [p.detach().clone() for p in learner.policy.parameters()]
    stats = train(fabric, learner.model, learner.optimizer, batch, algo_cfg())
    assert stats["train/clip_fraction"] == 0.0
    assert abs(stats["train/approx_kl"]) < 1e-7  # float32 rounding of ratio - 1 (~6e-8 per step)
    assert stats["loss/policy"] == pytest.approx(0.0, abs=1e-5)
    assert stats["loss/value"] == pytest.approx(batch["advantages"].double().pow(2).mean().item(), rel=1e-4)
    after = list(learner.policy.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


# ---------------------------------------------------------------------------------------- memory probe
MEMORY = ["env=gym", "env.id=tests.probe_envs:ProbeMemory-v0", "env.num_envs=8", "algo.rollout_steps=24",
          "algo.minibatch_size=48", "algo.update_epochs=4", "algo.lr=3e-3", "algo.ent_coef=0.0",
          "algo.total_steps=9216", "seed=0", "logger.tensorboard=false", "logger.plot=false"]  # fmt: skip
LSTM = ["model=lstm", "model.lstm.hidden_size=32", "model.lstm.seq_len=6"]


def _episode_returns(run_dir: Path) -> list[float]:
    """Per-update mean episode returns from metrics.csv."""
    return [value for _, value in series(read_rows(run_dir / "metrics.csv"), "rollout/episode_return")]


@pytest.fixture(scope="module")
def memory_lstm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """model=lstm trained on the memory probe; its checkpoint serves the evaluate and export tests."""
    run_dir = tmp_path_factory.mktemp("memory_lstm")
    return ppo_fabric.run([*MEMORY, *LSTM, f"hydra.run.dir={run_dir}"])


@pytest.mark.slow
def test_memory_probe_needs_the_lstm(memory_lstm: dict[str, Any], tmp_path: Path) -> None:
    """The cue is visible only at the first of 3 steps: the LSTM carries it and earns ~1, a memoryless MLP
    earns 0 in expectation (averaged over the ~600 episodes of the second half of its run)."""
    assert memory_lstm["final_mean_return"] > 0.9, memory_lstm["final_mean_return"]
    mlp = ppo_fabric.run([*MEMORY, "model=mlp", f"hydra.run.dir={tmp_path}"])
    returns = _episode_returns(tmp_path)
    late = returns[len(returns) // 2 :]
    assert abs(sum(late) / len(late)) < 0.3, late
    assert mlp["final_mean_return"] < 0.7


@pytest.mark.slow  # needs the module's training run, as the slow test above does (same tier, same worker as a rule)
def test_evaluate_carries_the_state(memory_lstm: dict[str, Any], tmp_path: Path) -> None:
    """Deterministic evaluation of the LSTM checkpoint solves the probe: only possible if `evaluate`
    carries the state from step to step (a fresh state at every step would score ~0)."""
    result = evaluate.main(
        [f"checkpoint={memory_lstm['checkpoint']}", "episodes=20", f"out={tmp_path}", "trust_env=true"]
    )
    assert result is not None
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert saved["episodes"] == 20 and saved["lengths"] == [3] * 20
    assert saved["mean_return"] == 1.0, saved["returns"]


@pytest.mark.slow  # needs the module's training run, as the slow test above does (same tier, same worker as a rule)
def test_exported_lstm_solves_the_memory_probe(memory_lstm: dict[str, Any], tmp_path: Path) -> None:
    """The exported file, fed its own `next_state` at every step, solves the probe as the checkpoint does;
    fed zeros at every step instead it cannot remember the cue (so the test sees a dropped state)."""
    import gymnasium as gym
    import numpy as np

    path = export.main([f"checkpoint={memory_lstm['checkpoint']}", f"out={tmp_path / 'policy.pt'}"])
    assert path == tmp_path / "policy.pt"
    policy = torch.jit.load(str(path))
    _, agent = ckpt.load_policy(memory_lstm["checkpoint"])
    env = gym.make("tests.probe_envs:ProbeMemory-v0")

    def play(carry: bool) -> float:
        total = 0.0
        for episode in range(20):
            obs, _ = env.reset(seed=episode)
            state, done = torch.zeros(1, *agent.state_shape), False
            while not done:
                action, next_state = policy(torch.as_tensor(np.asarray(obs, dtype=np.float32))[None], state)
                state = next_state if carry else torch.zeros_like(state)
                obs, reward, done, _, _ = env.step(int(action[0]))
                total += float(reward)
        return total / 20

    assert play(carry=True) == 1.0
    assert play(carry=False) < 0.9


# ------------------------------------------------------------------------------------------ config errors
@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        pytest.param(
            ["model.lstm.seq_len=5"],
            "model.lstm.seq_len=5 does not divide algo.rollout_steps=32",
            id="seq-len-does-not-divide-rollout",
        ),
        pytest.param(
            ["algo.minibatch_size=8"],
            "not whole sequences of model.lstm.seq_len=16",
            id="minibatch-not-whole-sequences",
        ),
        pytest.param(
            [
                "strategy=decoupled",
                "fabric.devices=4",
                "algo.players=2",
                "env.num_envs=1",
                "algo.rollout_steps=16",
                "algo.minibatch_size=32",
            ],
            "cannot be split evenly over 2 trainers",
            id="sequences-per-trainer",
        ),
    ],
)
def test_sequence_layout_errors(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, argv: list[str], fragment: str
) -> None:
    """conf/env/cartpole.yaml: 8 envs x 32 steps; model=lstm: sequences of 16. A config that slipped
    through must fail here, not start processes from inside pytest."""
    monkeypatch.setattr(launch_module, "launch", lambda *_: pytest.fail("the config was accepted"))
    assert_cli_failure(capsys, cli.main, ["model=lstm", "logger=none", *argv], fragment)


# --------------------------------------------------------------------------------------- resume in-process
RESUME = ["logger.tensorboard=false", "logger.plot=false", "seed=3", "env.num_envs=4", "algo.rollout_steps=16", "algo.minibatch_size=32",
          "algo.total_steps=1024", "algo.update_epochs=2", "model=lstm", "model.lstm.hidden_size=16",
          "model.lstm.seq_len=8", "env.mask_velocity=true"]  # fmt: skip


def _params(summary: dict[str, Any]) -> dict[str, torch.Tensor]:
    return ckpt.load(summary["checkpoint"])["agent"]


@pytest.mark.slow
def test_resume_mid_episode_matches_uninterrupted_run(tmp_path: Path) -> None:
    """16 updates in one go equal 8, checkpoint, then 8 resumed: the carried LSTM states (mid-episode at
    the checkpoint) are restored with the envs. Zeroing them in the checkpoint breaks the equality."""
    full = ppo_fabric.run([*RESUME, f"hydra.run.dir={tmp_path / 'full'}"])
    ppo_fabric.run([*RESUME, f"hydra.run.dir={tmp_path / 'part'}", "checkpoint.every=8", "checkpoint.keep=0"])
    middle = numbered_checkpoint(tmp_path / "part", 8)
    state = ckpt.load(middle)
    carried = state["ranks"][0]["carry"]["main"]["state"]
    assert carried.shape == (4, 4, 1, 16)  # 4 envs; h and c of separate actor and critic LSTMs
    assert (carried.flatten(1) != 0).any(1).sum() >= 2, "guard: envs are mid-episode at the checkpoint"
    resumed = ppo_fabric.run([*RESUME, f"hydra.run.dir={tmp_path / 'resumed'}", f"resume={middle}"])
    assert resumed["steps_this_run"] == 512
    for key in ("total_env_steps", "episodes", "final_mean_return"):
        assert resumed[key] == full[key], key
    want, got = _params(full), _params(resumed)
    for key in want:
        assert torch.equal(want[key], got[key]), key

    state["ranks"][0]["carry"]["main"]["state"] = torch.zeros_like(carried)
    torch.save(state, tmp_path / "zeroed.ckpt")
    lost = ppo_fabric.run(
        [*RESUME, f"hydra.run.dir={tmp_path / 'lost'}", f"resume={tmp_path / 'zeroed.ckpt'}"]
    )
    got = _params(lost)
    assert any(not torch.equal(want[k], got[k]) for k in want)


# ---------------------------------------------------------------------------------------- multi-process
MULTI = ["logger.tensorboard=false", "logger.plot=false", "env.num_envs=4", "algo.rollout_steps=32", "algo.minibatch_size=64",
         "algo.update_epochs=2", "model=lstm", "model.lstm.hidden_size=16", "model.lstm.seq_len=8",
         "env.mask_velocity=true"]  # fmt: skip
# 1 player + 1 trainer with the pipeline, a numbered checkpoint every 2 of the 6 updates: resumed below.
PIPELINED = ["strategy=decoupled", *MULTI, "algo.pipeline=true", "checkpoint.every=2", "checkpoint.keep=0",
             "algo.total_steps=768"]  # fmt: skip


def _start(devices: int, overrides: list[str], cwd: Path) -> subprocess.Popen[str]:
    """`python -m ppo_fabric` with `devices` processes, writing to `cwd/run` (the job without the
    supervising parent: these tests are about the recurrent state, not the supervisor)."""
    env = job_env(supervisor=False)
    cmd = [sys.executable, "-m", "ppo_fabric", f"fabric.devices={devices}", f"hydra.run.dir={cwd / 'run'}",
           *overrides]  # fmt: skip
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen[str], devices: int, cwd: Path) -> dict[str, Any]:
    """Wait for a launch; its summary.json after checking the exit and that all ranks agree."""
    try:
        _, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, stderr[-3000:]
    summary = json.loads((cwd / "run" / "summary.json").read_text())
    assert summary["world_size"] == devices
    assert summary["ranks_in_sync"] is True, "ranks ended with different parameters"
    assert summary["episodes"] > 0 and summary["final_mean_return"] is not None
    return summary


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("strategy", "devices"),
    [("coupled", 2), ("decoupled", 3)],
    ids=["coupled-2", "decoupled-1player-2trainers"],
)
def test_multi_process_runs_stay_in_sync(tmp_path: Path, strategy: str, devices: int) -> None:
    """DDP over sequence minibatches (coupled, 2 ranks), and batches of sequences sharded over two trainers
    (decoupled, 1 player + 2 trainers): every rank ends with the same parameters (checked in `_finish`)."""
    overrides = [f"strategy={strategy}", *MULTI, "algo.total_steps=1024"]
    summary = _finish(_start(devices, overrides, tmp_path), devices, tmp_path)
    assert summary["strategy"] == strategy and summary["total_env_steps"] == 1024


@pytest.mark.multiprocess
def test_decoupled_pipelined_resume_is_exact(tmp_path: Path) -> None:
    """1 player + 1 trainer with the pipeline (tests/strategies/test_decoupled.py's exact-resume test with model=lstm):
    the checkpoint falls while the next rollout is in flight, with the player's states mid-episode; the
    resumed run retraces the original one."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    first = _finish(_start(2, PIPELINED, a), 2, a)
    assert first["strategy"] == "decoupled" and first["total_env_steps"] == 768
    source = numbered_checkpoint(a / "run", 2)
    carried = ckpt.load(source)["ranks"][0]["carry"]["main"]["state"]
    assert carried is not None and carried.abs().sum() > 0
    again = _finish(_start(2, [*PIPELINED, f"resume={source}"], b), 2, b)
    for name, want_path, got_path in (
        ("update 4", numbered_checkpoint(a / "run", 4), numbered_checkpoint(b / "run", 4)),
        ("last.ckpt", a / "run" / "checkpoints" / "last.ckpt", b / "run" / "checkpoints" / "last.ckpt"),
    ):
        want, got = ckpt.load(want_path)["agent"], ckpt.load(got_path)["agent"]
        for key in want:
            assert torch.equal(want[key], got[key]), f"{name}: {key} differs"
    assert first["episodes"] == again["episodes"]
    assert first["final_mean_return"] == again["final_mean_return"]


def test_the_lstm_recipe_runs_with_another_model(tmp_path: Path) -> None:
    """`exp=cartpole_lstm model=mlp` is the same task without memory (the benchmark's baseline), and a
    partial model.lstm block is refused in one line instead of half-building an LSTM."""
    from ppo_fabric.app.preflight import load
    from ppo_fabric.config.values import ConfigError, sequence_length

    cfg, _, _ = load(["exp=cartpole_lstm", "model=mlp", "logger=none", f"hydra.run.dir={tmp_path}/a"])
    assert sequence_length(cfg.model) == 1 and cfg.env.mask_velocity
    with pytest.raises(ConfigError, match="model.lstm lacks num_layers") as err:
        load(["+model.lstm.hidden_size=8", "+model.lstm.seq_len=4", f"hydra.run.dir={tmp_path}/b"])
    assert "\n" not in str(err.value)


def test_recurrent_core_reads_the_resets_in_one_transfer(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU each tensor read on the host waits for the device: where the sequences reset is read once
    per minibatch, not once per time step (a 32-step sequence made 31 waits)."""
    core = RecurrentCore(in_dim=3, hidden_size=4, num_layers=1)
    starts = torch.zeros(2, 32, dtype=torch.bool)
    starts[0, 10] = starts[1, 20] = True
    reads: list[str] = []
    for name in ("__bool__", "item", "tolist"):
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args: Any, _name: str = name, _original: Any = original) -> Any:
            reads.append(_name)
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counted)
    with torch.no_grad():
        out = core.sequence(torch.randn(2, 32, 3), torch.zeros(2, *core.state_shape), starts)
    assert out.shape == (2, 32, 4) and len(reads) == 1, reads
