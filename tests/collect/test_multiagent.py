"""Multi-agent PPO on PettingZoo Parallel envs: per-agent rollouts, masking of agents that left, the seed's
`MultiAgentRolloutBuffer`, learning with shared and frozen policies, outputs, multi-process runs, exact
resume, config errors and recurrent policies.

The unit tests step `matching_v0(leave_early=True)` (agent i leaves after 8 - i steps, so rows of departed
agents exist until the copy resets) through the real collector and compare every agent's stored trajectory
with a replay of the same seeded envs stepped by hand with the stored actions. The runs are small: most of
the time of this file goes into the seven processes the multi-process runs start (2 + 2 + 3).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lightning_fabric import Fabric
from omegaconf import DictConfig, OmegaConf
from tensordict import TensorDict

import ppo_fabric
from ppo_fabric import cli
from ppo_fabric import ppo as ppo_module
from ppo_fabric.collect.rollout import RolloutCollector, build_collector
from ppo_fabric.config.values import ConfigError, compose
from ppo_fabric.envs.make import EnvError, env_seeds
from ppo_fabric.envs.multiagent import MultiAgentVectorEnv
from ppo_fabric.envs.toy_multiagent import MatchingGame, matching_v0
from ppo_fabric.learn.advantages import compute_advantages
from ppo_fabric.learn.buffer import STATE_KEY, rollout_storage, training_batch
from ppo_fabric.learn.learners import policy_specs
from ppo_fabric.models.agent import ActorCritic
from ppo_fabric.runs import checkpoint as ckpt
from ppo_fabric.runs.metrics_file import read_rows
from tests.conftest import assert_cli_failure, job_env, numbered_checkpoint
from tests.conftest import update_with_config as train

REPO = Path(__file__).resolve().parents[2]
AGENTS = [f"agent_{i}" for i in range(3)]  # matching_v0's default n_agents=3, episode_length=8
GAMMA, LAMBDA = 0.9, 0.95
MA = ["env=pettingzoo", "algo.rollout_steps=32", "algo.minibatch_size=64", f"algo.gamma={GAMMA}"]
TEAMS = [
    "env.id=ppo_fabric.envs.toy_multiagent:teams_v0",
    "multiagent.policies={adversary:{},agent:{model:{actor_hidden:[32]}}}",
    "multiagent.policy_mapping={adversary_*:adversary,agent_*:agent}",
]
SMALL_RUN = [
    "env.num_envs=4",
    "algo.total_steps=1024",
    "algo.update_epochs=2",
    "logger.tensorboard=false",
    "logger.plot=false",
]


# ------------------------------------------------------------------------------------ collected rollouts
STEPS, COPIES, SEED = 20, 2, 5  # 20 steps: the second rollout starts in the middle of an episode


def _cfg(truncate: bool, *extra: str) -> DictConfig:
    cfg, _ = compose(
        [
            "env=pettingzoo",
            "+env.kwargs.leave_early=true",
            f"+env.kwargs.truncate={truncate}",
            f"env.num_envs={COPIES}",
            f"algo.rollout_steps={STEPS}",
            "algo.minibatch_size=20",
            f"algo.gamma={GAMMA}",
            f"algo.gae_lambda={LAMBDA}",
            f"seed={SEED}",
            *extra,
        ]  # fmt: skip
    )
    return cfg


def _row(agent: str, copy_index: int) -> int:
    """The documented layout of a policy's rows: copy * agents of the policy + the agent's index."""
    return copy_index * len(AGENTS) + AGENTS.index(agent)


def _replay(actions: list[torch.Tensor], truncate: bool) -> list[dict[str, np.ndarray]]:
    """Step fresh copies of the env seeded as rank 0's vector env with the stored actions, by hand.

    Per rollout, arrays [T, rows] of what each agent saw and got: `alive` (in the episode when acting),
    `obs` (the observation it acted on), `rewards`, `terminated`, `truncated`, `final_obs` (the observation
    after its last step), and `next_obs` [rows, ...] after the rollout.
    """
    envs = [matching_v0(leave_early=True, truncate=truncate) for _ in range(COPIES)]
    current = [env.reset(seed=s)[0] for env, s in zip(envs, env_seeds(SEED, 0, COPIES), strict=True)]
    dim = envs[0].observation_space(AGENTS[0]).shape[0]
    rows = COPIES * len(AGENTS)
    out = []
    for stored in actions:
        rec = {
            "alive": np.zeros((STEPS, rows), bool),
            "obs": np.zeros((STEPS, rows, dim), np.float32),
            "rewards": np.zeros((STEPS, rows), np.float32),
            "terminated": np.zeros((STEPS, rows), bool),
            "truncated": np.zeros((STEPS, rows), bool),
            "final_obs": np.zeros((STEPS, rows, dim), np.float32),
        }
        for t in range(STEPS):
            for e, env in enumerate(envs):
                acting = list(env.agents)
                for a in acting:
                    rec["alive"][t, _row(a, e)] = True
                    rec["obs"][t, _row(a, e)] = current[e][a]
                step = env.step({a: int(stored[t, _row(a, e)]) for a in acting})
                next_obs, rewards, terminations, truncations, _ = step
                for a in acting:
                    row = _row(a, e)
                    rec["rewards"][t, row] = rewards[a]
                    rec["terminated"][t, row] = terminations[a]
                    rec["truncated"][t, row] = truncations[a]
                    rec["final_obs"][t, row] = next_obs[a]
                current[e] = next_obs if env.agents else env.reset()[0]  # no seed: the stream continues
        rec["next_obs"] = np.zeros((rows, dim), np.float32)
        for e, env in enumerate(envs):
            for a in env.agents:
                rec["next_obs"][_row(a, e)] = current[e][a]
        out.append(rec)
    return out


@pytest.fixture(scope="module", params=[False, True], ids=["terminate", "truncate"])
def rollouts(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Two consecutive rollouts of the real collector (copies of its storage, the buffer view's summaries,
    the next observations) and the hand replay of the same envs."""
    truncate = request.param
    cfg = _cfg(truncate)
    specs = policy_specs(cfg)
    assert list(specs) == ["shared"] and specs["shared"].agents == len(AGENTS)
    torch.manual_seed(0)
    policy = ActorCritic(specs["shared"].obs_space, specs["shared"].action_space, specs["shared"].model)
    with torch.no_grad():  # a critic that is not 0 on the zero observations of absent rows
        for p in policy.parameters():
            p.add_(0.1 * torch.randn_like(p))
    collector = build_collector(cfg, specs, 0, "cpu", None)
    stores, trajectories, summaries, next_obs, next_values = [], [], [], [], []
    for i in range(2):
        assert collector.collect({"shared": policy}, i * STEPS * COPIES) == STEPS * COPIES
        stores.append(collector.storages["shared"].clone())
        buffer = collector.buffer
        trajectories.append(
            {(a, e): buffer.trajectory((a, e)).clone() for a in AGENTS for e in range(COPIES)}
        )
        view = buffer.current_episode
        next_values.append(dict(zip(buffer.agents, view["next_state_values"], strict=True)))
        summaries.append(buffer.end_episode())
        next_obs.append(collector.groups[0].next_obs.clone())
    collector.envs.close()
    replay = _replay([s["actions"] for s in stores], truncate)
    return {"cfg": cfg, "policy": policy, "stores": stores, "trajectories": trajectories,
            "summaries": summaries, "next_obs": next_obs, "replay": replay, "truncate": truncate,
            "next_values": next_values}  # fmt: skip


def test_agent_trajectories_match_the_env(rollouts: dict[str, Any]) -> None:
    """Every agent's trajectory in the buffer view is exactly what the env gave that agent, step by step,
    across a rollout boundary that falls inside an episode; absent steps are left out."""
    for i, rec in enumerate(rollouts["replay"]):
        assert rec["alive"].any(axis=0).all() and not rec["alive"].all(), "the rollout must see departures"
        summary = rollouts["summaries"][i]
        assert summary["agents"] == [(a, e) for e in range(COPIES) for a in AGENTS]
        for e in range(COPIES):
            for a in AGENTS:
                row = _row(a, e)
                steps = np.flatnonzero(rec["alive"][:, row])
                traj = rollouts["trajectories"][i][(a, e)]
                assert traj.batch_size[0] == len(steps), (i, a, e)
                torch.testing.assert_close(
                    traj["obs"], torch.from_numpy(rec["obs"][steps, row]), rtol=0, atol=0
                )
                torch.testing.assert_close(traj["rewards"], torch.from_numpy(rec["rewards"][steps, row]))
                assert traj["terminated"].tolist() == rec["terminated"][steps, row].tolist(), (i, a, e)
                assert traj["truncated"].tolist() == rec["truncated"][steps, row].tolist(), (i, a, e)
                assert torch.equal(traj["actions"], rollouts["stores"][i]["actions"][steps, row])
                assert summary["episode_length"][summary["agents"].index((a, e))] == len(steps)
                assert summary["episode_reward"][summary["agents"].index((a, e))] == pytest.approx(
                    float(rec["rewards"][steps, row].sum()), abs=1e-5
                )
        # the observation the next rollout starts from, for every agent still in its episode
        alive_next = rec["next_obs"].any(axis=1)
        torch.testing.assert_close(
            rollouts["next_obs"][i][alive_next], torch.from_numpy(rec["next_obs"][alive_next]), rtol=0, atol=0
        )
    truncated = np.concatenate([r["truncated"] for r in rollouts["replay"]])
    assert bool(truncated.any()) == rollouts["truncate"], (
        "agent_0 is cut by the time limit only with truncate"
    )


def test_the_per_agent_view_gives_the_value_each_step_bootstrapped_from(rollouts: dict[str, Any]) -> None:
    """`current_episode["next_state_values"]`: the agent's next step's value inside an episode, 0 after a
    termination, the final observation's value after a truncation (it was the step's own value)."""
    gamma = float(rollouts["cfg"].algo.gamma)
    for i, trajectories in enumerate(rollouts["trajectories"]):
        for agent, traj in trajectories.items():
            nxt = rollouts["next_values"][i][agent]
            term, trunc = traj["terminated"].bool(), traj["truncated"].bool()
            inside = ~(term | trunc)
            inside[-1] = False  # the rollout's last step bootstraps from the next rollout's first
            torch.testing.assert_close(nxt[:-1][inside[:-1]], traj["values"][1:][inside[:-1]])
            assert (nxt[term] == 0).all()
            torch.testing.assert_close(nxt[trunc & ~term], traj["final_values"][trunc & ~term])
            ended = term | trunc  # no continuation there: the advantage is the one-step TD error
            torch.testing.assert_close(
                traj["advantages"][ended], traj["rewards"][ended] + gamma * nxt[ended] - traj["values"][ended]
            )


def test_departed_agents_are_masked(rollouts: dict[str, Any]) -> None:
    """From an agent's departure until its copy resets, its rows hold no transition: mask False,
    terminated True, truncated False, reward 0, no bootstrap value, and they change no advantage."""
    for storage, rec in zip(rollouts["stores"], rollouts["replay"], strict=True):
        mask = storage["mask"].numpy()
        assert (mask == rec["alive"]).all()
        gone = ~mask
        assert gone.any()
        assert storage["terminated"].numpy()[gone].all()
        assert not storage["truncated"].numpy()[gone].any()
        assert (storage["rewards"].numpy()[gone] == 0).all()
        assert (storage["final_values"].numpy()[gone] == 0).all()
        # agent i of 3 leaves after 8 - i steps: agent_2 is absent 2 steps per episode, agent_0 never
        for e in range(COPIES):
            assert mask[:, _row("agent_0", e)].all()
            assert (~mask[:, _row("agent_2", e)]).sum() >= (~mask[:, _row("agent_1", e)]).sum() > 0


class _LateJoiner(MatchingGame):
    """agent_2 is not in the episode after reset (PettingZoo lets `agents` start as a subset)."""

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        obs, infos = super().reset(seed, options)
        self.agents = self.agents[:2]
        return {a: obs[a] for a in self.agents}, {a: infos[a] for a in self.agents}


def test_agent_absent_at_reset_is_masked_from_the_first_step() -> None:
    envs = MultiAgentVectorEnv([_LateJoiner, _LateJoiner], {"shared": AGENTS})
    first = envs.reset(seed=[1, 2])
    spaces = envs.observation_spaces["shared"], envs.action_spaces["shared"]
    storage = rollout_storage(6, COPIES * len(AGENTS), *spaces, "cpu", masked=True)
    collector = RolloutCollector(envs, first, {"shared": storage}, GAMMA, LAMBDA)
    model = OmegaConf.create(
        {"encoder": "auto", "actor_hidden": [8], "critic_hidden": [8], "activation": "tanh"}
    )
    collector.collect({"shared": ActorCritic(*spaces, model)}, 0)
    absent = [_row("agent_2", e) for e in range(COPIES)]
    assert not storage["mask"][:, absent].any()


def _reference_advantages(storage: TensorDict, next_value: torch.Tensor) -> torch.Tensor:
    """GAE over each agent's present steps only, as if the absent steps were never stored."""
    adv = torch.full_like(storage["values"], float("nan"))
    for row in range(storage.batch_size[1]):
        steps = torch.nonzero(storage["mask"][:, row]).flatten().tolist()
        last = 0.0
        for k in range(len(steps) - 1, -1, -1):
            t = steps[k]
            r, v = float(storage["rewards"][t, row]), float(storage["values"][t, row])
            if storage["terminated"][t, row]:
                bootstrap, cont = 0.0, 0.0
            elif storage["truncated"][t, row]:
                bootstrap, cont = float(storage["final_values"][t, row]), 0.0
            else:
                nxt = steps[k + 1] if k + 1 < len(steps) else None
                assert nxt in (t + 1, None), "an agent in its episode is present at the next step"
                bootstrap = float(storage["values"][nxt, row] if nxt is not None else next_value[row])
                cont = 1.0
            last = r + GAMMA * bootstrap - v + GAMMA * LAMBDA * cont * last
            adv[t, row] = last
    return adv


def test_advantages_stop_at_the_departure(rollouts: dict[str, Any]) -> None:
    """Each agent's advantages are GAE over its own present steps; the step an agent leaves on has
    advantage r - V and return r, whatever the masked steps after it hold; a truncated agent bootstraps
    from V(its final observation)."""
    policy = rollouts["policy"]
    for storage, rec, next_obs in zip(
        rollouts["stores"], rollouts["replay"], rollouts["next_obs"], strict=True
    ):
        mask = storage["mask"]
        with torch.no_grad():
            next_value = policy.get_value(next_obs)
        reference = _reference_advantages(storage, next_value)
        torch.testing.assert_close(storage["advantages"][mask], reference[mask], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            storage["returns"][mask], (reference + storage["values"])[mask], rtol=1e-5, atol=1e-5
        )
        term = storage["terminated"] & mask
        assert term.any()
        torch.testing.assert_close(
            storage["advantages"][term], (storage["rewards"] - storage["values"])[term]
        )
        torch.testing.assert_close(storage["returns"][term], storage["rewards"][term])
        trunc = torch.from_numpy(rec["truncated"])
        if rollouts["truncate"]:
            assert trunc.any()
            with torch.no_grad():
                expected = policy.get_value(torch.from_numpy(rec["final_obs"][trunc.numpy()]))
            torch.testing.assert_close(storage["final_values"][trunc], expected, rtol=1e-6, atol=1e-6)
        # garbage in the absent steps changes no present step's advantage
        noisy = storage.clone()
        noisy["values"][~mask] = 1e4
        noisy["rewards"][~mask] = -1e4
        compute_advantages(noisy, next_value, GAMMA, LAMBDA)
        torch.testing.assert_close(noisy["advantages"][mask], storage["advantages"][mask], rtol=0, atol=1e-6)


def _train_once(cfg: DictConfig, batch: TensorDict) -> tuple[dict[str, float], list[torch.Tensor]]:
    """One PPO update from fixed initial parameters and a fixed shuffle."""
    spec = policy_specs(cfg)["shared"]
    fabric = Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(11)
    model = ActorCritic(spec.obs_space, spec.action_space, spec.model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-5)
    model, optimizer = fabric.setup(model, optimizer)
    torch.manual_seed(12)
    rank_minibatch = int(cfg.algo.minibatch_size) * spec.agents
    stats = train(fabric, model, optimizer, batch, cfg.algo, rank_minibatch=rank_minibatch)
    return stats, [p.detach().clone() for p in model.parameters()]


def test_masked_steps_do_not_reach_the_update(rollouts: dict[str, Any]) -> None:
    """Replacing observations, log-probs, values, returns and advantages of absent steps with large numbers
    leaves every loss statistic and every updated parameter bit-identical."""
    cfg = rollouts["cfg"]
    batch = training_batch(rollouts["stores"][0]).clone()
    gone = ~batch["mask"]
    assert gone.any() and batch["mask"].any()
    garbage = batch.clone()
    garbage["obs"][gone] = 1e6
    garbage["logprobs"][gone] = 5.0
    garbage["values"][gone] = 1e6
    garbage["returns"][gone] = -1e6
    garbage["advantages"][gone] = 1e6
    clean_stats, clean_params = _train_once(cfg, batch)
    dirty_stats, dirty_params = _train_once(cfg, garbage)
    assert clean_stats == dirty_stats
    assert all(torch.equal(a, b) for a, b in zip(clean_params, dirty_params, strict=True))
    # guard: without the mask the same garbage does change the update, so the check above can fail
    unmasked_stats, _ = _train_once(cfg, garbage.exclude("mask"))
    assert unmasked_stats["loss/value"] != clean_stats["loss/value"]


# ----------------------------------------------------------------------------------- learning, outputs
@pytest.mark.slow
def test_shared_policy_learns_matching(tmp_path: Path) -> None:
    """One policy for all three agents must read the agent id to score; random play scores 8/4 = 2."""
    summary = ppo_fabric.run(
        [*MA, "algo.lr=2e-3", "algo.total_steps=12288", "logger=none", "seed=1", f"hydra.run.dir={tmp_path}"]
    )
    assert summary["final_mean_return"] > 5.0, summary
    assert summary["policies"]["shared"]["final_mean_return"] == summary["final_mean_return"]
    assert summary["policies"]["shared"]["agents_per_env"] == 3 and summary["policies"]["shared"]["trained"]


@pytest.fixture(scope="module")
def teams_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """teams_v0 with the adversaries frozen: records the parameters every policy starts from."""
    run_dir = tmp_path_factory.mktemp("teams") / "run"
    initial: dict[str, dict[str, torch.Tensor]] = {}
    real = ppo_module.build_learners

    def build_learners(*args: Any, **kwargs: Any) -> Any:
        learners = real(*args, **kwargs)
        initial.update({n: copy.deepcopy(lr.policy.state_dict()) for n, lr in learners.items()})
        return learners

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ppo_module, "build_learners", build_learners)
        summary = ppo_fabric.run(
            [
                *MA,
                *TEAMS,
                "multiagent.policies_to_train=[agent]",
                "algo.lr=2e-3",
                "algo.total_steps=12288",
                "logger.tensorboard=false",
                "logger.plot=false",
                "seed=1",
                f"hydra.run.dir={run_dir}",
            ]  # fmt: skip
        )
    return {"summary": summary, "run_dir": run_dir, "initial": initial}


@pytest.mark.slow
def test_trained_team_beats_frozen_team(teams_run: dict[str, Any]) -> None:
    """Against frozen random adversaries the agents reach L(1 - 1/K) = 5.3 at best; the frozen policy
    ends with exactly the parameters it started with, and has no optimiser."""
    policies = teams_run["summary"]["policies"]
    assert policies["agent"]["final_mean_return"] > 3.0, policies
    assert policies["adversary"]["final_mean_return"] == pytest.approx(
        -policies["agent"]["final_mean_return"]
    )
    assert policies["agent"]["trained"] and not policies["adversary"]["trained"]
    state = ckpt.load(teams_run["run_dir"] / "checkpoints" / "last.ckpt")
    assert state["multiagent"] is True and set(state["agent"]) == {"adversary", "agent"}
    assert state["optimizer"]["adversary"] is None and state["optimizer"]["agent"] is not None
    start, end = teams_run["initial"], state["agent"]
    assert start["adversary"].keys() == end["adversary"].keys()
    for key in start["adversary"]:
        assert torch.equal(start["adversary"][key], end["adversary"][key]), key
    assert any(not torch.equal(start["agent"][k], end["agent"][k]) for k in start["agent"])
    assert end["agent"]["actor_body.layers.0.weight"].shape[0] == 32, "the agent policy's own model override"
    # the evaluation's record is the trained team's: over both teams of this zero-sum game it stayed at 0 and
    # best.ckpt kept the first evaluation's weights
    rows = read_rows(teams_run["run_dir"] / "evaluations.csv")
    assert rows and all(r["eval/return_mean"] == r["eval/agent/return_mean"] for r in rows), rows
    assert float(rows[-1]["eval/return_mean"]) > 0 > float(rows[-1]["eval/adversary/return_mean"]), rows[-1]


@pytest.mark.slow  # needs the module's training run, as the slow test above does (same tier, same worker as a rule)
def test_outputs_report_every_policy(teams_run: dict[str, Any]) -> None:
    """summary.json carries each policy's final mean return; metrics.csv has per-policy columns, and
    training metrics only for the policy that trains."""
    run_dir = teams_run["run_dir"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary["policies"]) == {"adversary", "agent"}
    for name in ("adversary", "agent"):
        assert isinstance(summary["policies"][name]["final_mean_return"], float)
        assert summary["policies"][name]["agents_per_env"] == 2
    rows = read_rows(run_dir / "metrics.csv")
    columns = set(rows[0])
    for key in (
        "loss/policy",
        "loss/value",
        "loss/entropy",
        "train/approx_kl",
        "train/lr",
        "rollout/episode_return",
    ):
        assert f"agent/{key}" in columns, key
    assert "adversary/rollout/episode_return" in columns
    assert not any(c.startswith("adversary/") and not c.startswith("adversary/rollout/") for c in columns)
    assert "rollout/episode_return" in columns  # every agent's episodes together
    last = rows[-1]
    assert float(last["agent/rollout/episode_return"]) == pytest.approx(
        -float(last["adversary/rollout/episode_return"])
    )


# ------------------------------------------------------------------------------- multi-process runs
def _subprocess_env() -> dict[str, str]:
    return job_env(supervisor=False)  # runs that must succeed: the supervisor is tested in tests/app


def _run_processes(run_dir: Path, *overrides: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "ppo_fabric", *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(
        cmd, cwd=run_dir.parent, env=_subprocess_env(), capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ranks_in_sync"] is True, "ranks ended with different parameters"
    assert summary["total_env_steps"] == 1024
    return summary


@pytest.mark.multiprocess
def test_coupled_two_processes(tmp_path: Path) -> None:
    """DDP over two ranks with departing agents (masked rows in every rank's batch)."""
    summary = _run_processes(
        tmp_path / "run", *MA, *SMALL_RUN, "fabric.devices=2", "+env.kwargs.leave_early=true"
    )
    assert summary["world_size"] == 2 and summary["strategy"] == "coupled"
    assert set(summary["policies"]) == {"shared"} and summary["episodes"] > 0


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("devices", "trained"),
    [(2, "[agent]"), (3, "null")],
    ids=["1player-1trainer-frozen-adversary", "1player-2trainers-two-policies"],
)
def test_decoupled_runs(tmp_path: Path, devices: int, trained: str) -> None:
    """Players act for every policy, trainers learn the trained ones (one DATA message each) and send all
    parameters back: every rank ends in sync."""
    summary = _run_processes(
        tmp_path / "run", *MA, *TEAMS, *SMALL_RUN, "strategy=decoupled", f"fabric.devices={devices}",
        "algo.players=1", f"multiagent.policies_to_train={trained}", "eval.every=512", "eval.episodes=2",
    )  # fmt: skip
    assert summary["strategy"] == "decoupled" and summary["world_size"] == devices
    # the player's evaluator process scored every policy at 512 and at the end
    evaluated = [r for r in read_rows(tmp_path / "run" / "evaluations.csv") if r.get("eval/return_mean")]
    assert [int(r["step"]) for r in evaluated] == [512, 1024]
    assert all(r["eval/agent/return_mean"] and r["eval/adversary/return_mean"] for r in evaluated)
    assert summary["evaluation"]["last"]["env_step"] == 1024
    assert (summary["players"], summary["trainers"]) == (1, devices - 1)
    assert summary["policies"]["agent"]["trained"] and summary["policies"]["adversary"]["trained"] is (
        trained == "null"
    )
    state = ckpt.load(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert (state["optimizer"]["adversary"] is None) is (trained != "null")


# -------------------------------------------------------------------------------------------- resume
# 15 steps per rollout: the checkpoint after update 2 (step 30 = step 6 of an 8-step episode) falls while
# agent_2 has left, so the rows of absent agents must come back as absent.
RESUME = [
    "env=pettingzoo", "+env.kwargs.leave_early=true", "+env.kwargs.truncate=true", "env.num_envs=4",
    "algo.rollout_steps=15", "algo.minibatch_size=20", "algo.total_steps=360", "algo.update_epochs=2",
    "multiagent.policies={first:{},rest:{lr:1e-3}}", "multiagent.policy_mapping={agent_0:first,agent_*:rest}",
    "logger=none", "seed=3",
]  # fmt: skip


def _final_params(run_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    return ckpt.load(run_dir / "checkpoints" / "last.ckpt")["agent"]


def _assert_same_params(a: dict[str, dict[str, torch.Tensor]], b: dict[str, dict[str, torch.Tensor]]) -> bool:
    assert a.keys() == b.keys() == {"first", "rest"}
    return all(torch.equal(a[n][k], b[n][k]) for n in a for k in a[n])


@pytest.mark.slow  # seconds in process (a run, or every option composed): not the unit tier
def test_exact_resume_mid_episode(tmp_path: Path) -> None:
    """Resumed at update 2 of 6, with agents absent at that moment, both policies end bit-identical to
    an uninterrupted run; resuming with the absent rows marked present breaks that (guard)."""
    ppo_fabric.run([*RESUME, f"hydra.run.dir={tmp_path / 'full'}"])
    ppo_fabric.run([*RESUME, f"hydra.run.dir={tmp_path / 'part'}", "checkpoint.every=2", "checkpoint.keep=0"])
    middle = numbered_checkpoint(tmp_path / "part", 2)
    state = ckpt.load(middle)
    assert state["env_step"] == 2 * 60
    alive = state["ranks"][0]["carry"]["rest"]["alive"]
    assert not alive.all(), "the checkpoint should fall while agents are absent"
    summary = ppo_fabric.run([*RESUME, f"hydra.run.dir={tmp_path / 'resumed'}", f"resume={middle}"])
    assert summary["total_env_steps"] == 360 and summary["steps_this_run"] == 360 - 120
    full = _final_params(tmp_path / "full")
    assert _assert_same_params(full, _final_params(tmp_path / "resumed"))
    # the policies named in another order: equal as dicts, but the restored envs hand out actions by
    # position, so each would play the other's agents (or crash on their shapes)
    reordered = [o.replace("{first:{},rest:{lr:1e-3}}", "{rest:{lr:1e-3},first:{}}") for o in RESUME]
    with pytest.raises(ConfigError, match=r"multiagent.policies lists \['rest', 'first'\], the checkpoint "
                                          r"\['first', 'rest'\]; keep the checkpoint's order"):  # fmt: skip
        ppo_fabric.run([*reordered, f"hydra.run.dir={tmp_path / 'reordered'}", f"resume={middle}"])
    remapped = [o.replace("{agent_0:first,agent_*:rest}", "{agent_*:rest,agent_0:first}") for o in RESUME]
    with pytest.raises(ConfigError, match=r"multiagent.policy_mapping lists \['agent_\*', 'agent_0'\]"):
        ppo_fabric.run([*remapped, f"hydra.run.dir={tmp_path / 'remapped'}", f"resume={middle}"])

    state["ranks"][0]["carry"]["rest"]["alive"] = torch.ones_like(
        alive
    )  # checkpoints hold tensors, not numpy
    torch.save(state, tmp_path / "all_alive.ckpt")
    ppo_fabric.run([*RESUME, f"hydra.run.dir={tmp_path / 'wrong'}", f"resume={tmp_path / 'all_alive.ckpt'}"])
    assert not _assert_same_params(full, _final_params(tmp_path / "wrong"))


# -------------------------------------------------------------------------------------- config errors
@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        pytest.param(
            ["multiagent.policy_mapping={agent_*:nosuch}"],
            "'nosuch', which is not in multiagent.policies",
            id="mapping-unknown-policy",
        ),
        pytest.param(
            ["multiagent.policies={a:{},b:{}}", "multiagent.policy_mapping={agent_0:a,agent_1:b}"],
            "agent 'agent_2' matches no entry of multiagent.policy_mapping",
            id="agent-unmapped",
        ),
        pytest.param(
            ["multiagent.policies={a:{},b:{}}"],
            "multiagent.policy_mapping={pattern: policy",
            id="two-policies-no-mapping",
        ),
        pytest.param(  # read as a single-agent run's policy, it was 'add env=pettingzoo' under env=pettingzoo
            ["multiagent.policies={main:{}}"],
            "'main' names a single-agent run's policy; choose another name",
            id="policy-named-main",
        ),
        pytest.param(
            ["multiagent.policies={a:{},b:{}}", "multiagent.policy_mapping={*:a}"],
            "multiagent.policies ['b'] get no agents",
            id="policy-without-agents",
        ),
        pytest.param(  # a misspelt exact name beside a '*' entry sent its agent to the wildcard's policy
            ["multiagent.policies={a:{},b:{}}", "multiagent.policy_mapping={agnet_0:a,*:b}"],
            "multiagent.policy_mapping entry 'agnet_0' matches none of the env's agents (agent_0, agent_1, agent_2)",
            id="mapping-entry-matches-nothing",
        ),
        pytest.param(
            ["multiagent.policies_to_train=[nosuch]"],
            "multiagent.policies_to_train names unknown policies ['nosuch']",
            id="train-unknown",
        ),
        pytest.param(
            ["multiagent.policies={a:{foo:1}}"],
            "multiagent.policies.a has unknown keys ['foo']",
            id="policy-unknown-key",
        ),
        pytest.param(
            ["multiagent.policies={a:{lr:-1}}"],
            "multiagent.policies.a.lr=-1 must be a positive number",
            id="policy-bad-lr",
        ),
        pytest.param(
            ["env.id=nosuch_mod_xyz:game_v0"],
            "env.id='nosuch_mod_xyz:game_v0': cannot import module 'nosuch_mod_xyz'",
            id="module-missing",
        ),
        pytest.param(
            ["env.id=ppo_fabric.envs.toy_multiagent:nosuch_v0"], "has no nosuch_v0()", id="factory-missing"
        ),
        pytest.param(
            ["env.id=ppo_fabric.envs.toy_multiagent:teams_v0"],
            "agents 'adversary_0' and 'agent_0' share policy 'shared' but have different spaces",
            id="different-spaces-one-policy",
        ),
        pytest.param(["env.vector=async"], "PettingZoo envs run with env.vector=sync", id="async-vector"),
        pytest.param(["+env.kwargs.bogus=1"], "rejects env.kwargs={'bogus': 1}", id="bad-env-kwargs"),
        pytest.param(
            ["env.normalize_obs=true"],
            "env.normalize_obs",
            id="normalize-obs-unsupported",
        ),
        pytest.param(
            ["env.observation_noise=0.1"],
            "env.observation_noise=0.1 is not supported for PettingZoo envs yet; set env.observation_noise=0",
            id="observation-noise-unsupported",
        ),
    ],
)
def test_multiagent_config_errors(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, overrides: list[str], fragment: str
) -> None:
    """Each mistake stops the CLI before training with exit status 2 and one line naming it."""
    argv = ["env=pettingzoo", "algo.total_steps=2048", "logger=none", f"hydra.run.dir={tmp_path}", *overrides]
    assert_cli_failure(capsys, cli.main, argv, fragment)
    assert not (tmp_path / "config.yaml").exists(), "the run must not start"


# ------------------------------------------------------------------------------------------ recurrent
LSTM = ["model=lstm", "model.lstm.hidden_size=16", "model.lstm.seq_len=4"]


def test_lstm_states_are_per_agent() -> None:
    """model=lstm on a multi-agent env: each agent's row carries its own state; a departed agent's rows
    and the first step of every episode start from zero; the update rebuilds the stored log-probs."""
    cfg = _cfg(False, *LSTM)
    spec = policy_specs(cfg)["shared"]
    torch.manual_seed(0)
    policy = ActorCritic(spec.obs_space, spec.action_space, spec.model)
    assert policy.recurrent and spec.state_shape == policy.state_shape
    assert policy.state_shape[1:] == (1, 16)  # [h, c (per LSTM core), layers, hidden]
    collector = build_collector(cfg, {"shared": spec}, 0, "cpu", None)
    try:
        collector.collect({"shared": policy}, 0)
        storage = collector.storages["shared"]
        states = storage[STATE_KEY]
        assert states.shape == (STEPS, COPIES * len(AGENTS), *policy.state_shape)
        mask = storage["mask"]
        done = storage["terminated"] | storage["truncated"]
        after_done = torch.zeros_like(done)
        after_done[1:] = done[:-1]
        after_done[0] = True  # the rollout starts every episode
        assert (states[after_done] == 0).all() and (states[~mask] == 0).all()
        assert (states[~after_done].abs().sum(dim=(1, 2, 3)) > 0).all()
        # agents of one copy see different observations, so their states differ
        assert not torch.equal(states[3, _row("agent_0", 0)], states[3, _row("agent_1", 0)])
        extras = collector.buffer.current_episode["extras"]
        assert len(extras["prev_hidden_states"]) == COPIES * len(AGENTS)
        traj = collector.buffer.trajectory(("agent_2", 1))
        torch.testing.assert_close(extras["prev_hidden_states"][_row("agent_2", 1)], traj[STATE_KEY][:, 0::2])
        batch = training_batch(storage, spec.seq_len)
        with torch.no_grad():
            logp, _, values = policy(batch["obs"], batch["actions"], batch["initial_state"], batch["starts"])
        m = batch["mask"]
        torch.testing.assert_close(logp[m], batch["logprobs"][m], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(values[m], batch["values"][m], rtol=1e-4, atol=1e-4)
    finally:
        collector.envs.close()


def test_lstm_multiagent_run(tmp_path: Path) -> None:
    """A short recurrent run with two policies on teams_v0 completes and checkpoints both."""
    summary = ppo_fabric.run(
        [
            *MA,
            *TEAMS,
            *LSTM,
            "env.num_envs=4",
            "algo.total_steps=512",
            "algo.update_epochs=1",
            "logger=none",
            f"hydra.run.dir={tmp_path}",
        ]  # fmt: skip
    )
    assert summary["total_env_steps"] == 512 and set(summary["policies"]) == {"adversary", "agent"}
    state = ckpt.load(Path(summary["checkpoint"]))
    carry = state["ranks"][0]["carry"]
    model_cfg = OmegaConf.create(state["config"]["model"])
    obs_spaces, action_spaces = ckpt.saved_spaces(state)
    for name in ("adversary", "agent"):
        spaces = obs_spaces[name], action_spaces[name]
        assert carry[name]["state"].shape == (4 * 2, *ActorCritic(*spaces, model_cfg).state_shape)
        assert any("lstm" in k for k in state["agent"][name])


def broken_parallel_v0(**_: Any) -> Any:
    raise RuntimeError("no licence for the game server (injected by the test)")


def test_a_parallel_env_that_fails_while_the_checks_build_it_is_one_line() -> None:
    """As for gymnasium envs, a PettingZoo factory's own failure is one line naming it, not a traceback."""
    cfg, _ = compose(["env=pettingzoo", "env.id=tests.collect.test_multiagent:broken_parallel_v0"])
    with pytest.raises(EnvError, match=r"^env.id='tests.collect.test_multiagent:broken_parallel_v0' raised "
                                       r"RuntimeError: no licence for the game server"):  # fmt: skip
        policy_specs(cfg)
