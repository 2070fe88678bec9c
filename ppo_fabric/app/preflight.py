"""Checks that need more than the config's values, run once before any process starts: the environment
(its id, spaces and agents), the model for those spaces, the machine's devices and the checkpoint to
resume from. `load` is what every entry point calls: compose, check the values, check these, check the
run directory; any problem is one `ConfigError` line.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import gymnasium as gym
import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from ppo_fabric.app import prestart
from ppo_fabric.config.faults import FAULT_EXIT, RunComplete
from ppo_fabric.config.tuned import without_tuned_values
from ppo_fabric.config.values import (
    ConfigError,
    check_layout,
    check_run_dir,
    check_values,
    compose,
    composer,
    launched_world_size,
    processes_per_node,
    requested,
    sequence_length,
    under_fabric_run,
)
from ppo_fabric.envs.make import EnvError, check_normalizable, foreign_module
from ppo_fabric.envs.multiagent import is_multiagent, policy_settings
from ppo_fabric.learn.learners import policy_specs, spaces_of
from ppo_fabric.models.agent import ACTIVATIONS, ActorCritic, clipped_actions_warning
from ppo_fabric.runs import checkpoint as ckpt
from ppo_fabric.runs import signing
from ppo_fabric.runs.continuation import continued_config
from ppo_fabric.runs.lock import refuse_if_held, speaks_first
from ppo_fabric.runs.resume import resolve_auto
from ppo_fabric.runs.trackers import check as check_tracker
from ppo_fabric.runs.watchdog import main_thread_place
from ppo_fabric.wire.placement import role_map, trainer_kind, trainers_per_node

# Keys whose change makes a checkpoint meaningless for a new run: what shapes the saved parameters.
_MODEL_KEYS = ("model", "multiagent")


def load(
    overrides: list[str], config_path: str | None = None, config_name: str = "config"
) -> tuple[DictConfig, str, dict[str, Any]]:
    """Compose and check: (config, run-dir template, facts found on the way)."""
    cfg, run_dir = compose(overrides, config_path, config_name)
    return cfg, run_dir, prepare(cfg, run_dir, overrides, composer(config_path, config_name))


def prepare(
    cfg: DictConfig,
    run_dir: str,
    overrides: list[str] | None = None,
    compose_again: Callable[[list[str]], DictConfig] | None = None,
) -> dict[str, Any]:
    """Check a composed config for a run in `run_dir`; returns the facts `check` found.

    `resume=auto` is resolved first, so the checks see the checkpoint it stands for. A resume then
    continues the run's own config: `cfg` is replaced, in place, by the checkpoint's config with what
    `overrides` (the command line `cfg` was composed from; None: nothing) may change on top
    (`continuation.continued_config`; `compose_again` composes a command line for the group options it
    names). A `resume=auto` run that is already complete raises `RunComplete`."""
    if speaks_first():
        refuse_if_held(run_dir)  # a live run's directory: named before any other check says otherwise
    auto = resolve_auto(cfg, run_dir)
    changes = None
    if cfg.resume is not None:
        changes = continue_run(cfg, overrides or [], compose_again, auto, run_dir)
    facts = check(cfg)
    check_run_dir(cfg, run_dir, auto=auto)
    if changes is not None:  # the values as the checks left them (algo.total_steps=1e4 is 10000)
        facts["resume_changes"] = {
            key: (before, OmegaConf.select(cfg, key, default=now)) for key, (before, now) in changes.items()
        }
    return facts


def continue_run(
    cfg: DictConfig,
    overrides: list[str],
    compose_again: Callable[[list[str]], DictConfig] | None,
    auto: bool,
    run_dir: str,
) -> dict[str, tuple[Any, Any]]:
    """Replace `cfg` by the resumed run's config (in place: every caller holds it); returns its changes."""
    path = str(cfg.resume)
    try:
        state = ckpt.load(path, env_state="fresh")  # the config and step only: check_resume loads it whole
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    saved_id = str(state["config"]["env"]["id"])
    own_id = str(OmegaConf.select(cfg, "env.id", throw_on_missing=False) or saved_id)  # env=gym alone: none
    named = any(o.partition("=")[0].lstrip("+~") == "env.id" for o in overrides)
    if not (named and own_id != saved_id):  # another id named: refused below as a change of env.id
        check_env_trusted(path, saved_id, own_id)
    if auto:  # the tuned values added in case it started afresh are not the user's overrides
        typed = without_tuned_values(overrides)
        added = [o for o in overrides if o not in typed]
        if added and compose_again is not None:
            # but `cfg` was composed with them: what an option the user gave (logger=none) changes is seen
            # against a composition with them too. Without, every key the added option sets (env=gym's
            # algo.total_steps) read as set by the user's option, and the resume took it: a run of 512 steps
            # resumed with resume=auto logger=none trained to 1M.
            compose_again = _with_options(compose_again, added)
        overrides = typed
    merged, changes = continued_config(cfg, state["config"], overrides, compose_again)
    with open_dict(cfg):
        for key in list(cfg.keys()):
            if key not in merged:
                del cfg[key]
        for key in merged:
            cfg[key] = merged[key]
    if auto and int(state["env_step"]) >= int(cfg.algo.total_steps):
        done, total = int(state["env_step"]), int(cfg.algo.total_steps)
        summary = _last_summary(Path(run_dir))
        completed = summary is not None and not summary.get("interrupted")
        # a stop gave its final evaluation up: the resume plays it (a decoupled resume that did so leaves
        # its checkpoint owing it still, and a summary saying the run completed)
        if owes_its_final_evaluation(state) and not (
            completed and int(summary.get("total_env_steps") or 0) >= done
        ):
            return changes
        if summary is None or int(summary.get("total_env_steps") or 0) < done:
            # its final checkpoint was written, then a failure (a full disk) ended the session before its
            # summary: "complete; nothing to do" read as if the run had ended well
            raise RunComplete(
                f"resume=auto: the run in {run_dir} finished its training ({done:,} env steps >= "
                f"algo.total_steps={total:,}), but its last session failed before writing summary.json: its "
                "checkpoints and metrics.csv are whole; nothing to train (raise algo.total_steps to go on)"
            )
        if summary.get("interrupted"):  # called complete, its summary saying interrupted, no final evaluation
            raise RunComplete(
                f"resume=auto: the run in {run_dir} was stopped by {summary.get('stop_signal')} at {done:,} env "
                f"steps, at or past algo.total_steps={total:,}: nothing to train (raise algo.total_steps to go on)"
            )
        raise RunComplete(
            f"resume=auto: the run in {run_dir} is complete ({done:,} env steps >= "
            f"algo.total_steps={total:,}); nothing to do (raise algo.total_steps to train longer)"
        )
    return changes


def _with_options(
    compose: Callable[[list[str]], DictConfig], added: list[str]
) -> Callable[[list[str]], DictConfig]:
    return lambda overrides: compose([*added, *overrides])


def owes_its_final_evaluation(state: dict[str, Any]) -> bool:
    """A checkpoint at the end of its run, written when a stop abandoned the final evaluation: a resume
    plays it, with nothing to train (any other `algo.total_steps` at or below its env step is refused)."""
    step = int(state["env_step"])
    owed = (state.get("evaluation") or {}).get("in_flight") == step
    return owed and step >= int(state["config"]["algo"]["total_steps"])


def _last_summary(run_dir: Path) -> dict[str, Any] | None:
    """The run's last summary: summary.json, or the one a later session that failed before its first
    checkpoint moved aside (summary.previous.json); None when neither reads as one."""
    for name in ("summary.json", "summary.previous.json"):
        try:
            summary = json.loads((run_dir / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(summary, dict):
            return summary
    return None


def check_env_trusted(path: str, saved_id: str, own_id: str) -> None:
    """A resume builds the env its checkpoint names, and an id naming a module outside the known env
    packages imports that module and may call it with the checkpoint's `env.kwargs`: that is code a file
    chose. It is built only when the command line's own config names the same id (the user's env, or a
    checkpoint they trust), as `evaluate` builds it only with `trust_env=true`."""
    module = foreign_module(saved_id)
    if module is not None and own_id != saved_id:
        raise ConfigError(
            f"resume={path!r}: the checkpoint's env.id={saved_id!r} would import and run module {module!r}; "
            f"a resume builds it only when the command line names it: add env.id={saved_id} if you trust "
            "this checkpoint"
        )


def check(cfg: DictConfig) -> dict[str, Any]:
    """Everything that can be checked without starting a run; returns the process count, the spaces, the
    kind of device that trains and the trained policies' parameter count (for the placement warning)."""
    check_values(cfg)
    if cfg.model.activation not in ACTIVATIONS:
        raise ConfigError(f"model.activation={cfg.model.activation!r} is not one of {', '.join(ACTIVATIONS)}")
    world = launched_world_size(cfg)
    if (under_fabric_run() or os.environ.get("TORCHELASTIC_RUN_ID")) and int(cfg.restarts) > 0:
        raise ConfigError(
            f"restarts={cfg.restarts} needs the supervisor of python -m ppo_fabric; under fabric run or "
            "torchrun use torchrun --max-restarts=N with resume=auto and a fixed hydra.run.dir"
        )
    check_tracker(cfg)
    try:
        signing.check_key()  # what signs the checkpoints' env snapshots
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    train_device = _check_accelerator(cfg, world)
    check_layout(cfg, world)
    check_nodes(cfg)
    spaces, parameters = _check_env_and_model(cfg)
    if cfg.resume is not None:
        check_resume(cfg, str(cfg.resume), *spaces)
    actions = spaces[1].values() if isinstance(spaces[1], dict) else [spaces[1]]
    return {
        "world_size": world,
        "observation_space": spaces[0],
        "action_space": spaces[1],
        "train_device": train_device,
        "parameters": parameters,
        # a fresh run's: a resumed policy has moved its mean and std from where they started
        "warnings": []
        if cfg.resume is not None
        else [w for s in actions if (w := clipped_actions_warning(s))],
    }


def _check_env_and_model(cfg: DictConfig) -> tuple[tuple[Any, Any], int]:
    """The spaces as checkpoints record them, and the parameters of the policies that train."""
    if OmegaConf.is_missing(cfg.env, "id") or cfg.env.id is None:
        raise ConfigError("env.id is required; set env.id=CartPole-v1 (or any gymnasium id)")
    if not OmegaConf.is_dict(cfg.env.kwargs):
        raise ConfigError(
            f"env.kwargs={cfg.env.kwargs} must be a mapping; add keys with +env.kwargs.NAME=VALUE"
        )
    lstm = cfg.model.get("lstm")
    missing = [k for k in ("hidden_size", "num_layers", "seq_len") if lstm is not None and k not in lstm]
    if missing:
        raise ConfigError(
            f"model.lstm lacks {', '.join(missing)}; model.lstm settings belong to model=lstm (drop them with "
            "~model.lstm to use another model)"
        )
    _check_multiagent(cfg)
    try:
        with bounded(float(cfg.stall_timeout or 0), f"building env.id={cfg.env.id!r} for the checks"):
            specs = policy_specs(cfg)
            if is_multiagent(cfg.env) and cfg.eval.every not in (None, 0):
                from ppo_fabric.policy.scorers import check_players

                check_players(cfg)
        for spec in specs.values():
            check_normalizable(cfg.env, spec.obs_space)
    except EnvError as exc:
        raise ConfigError(str(exc)) from exc
    parameters = 0
    for spec in specs.values():
        try:
            model = ActorCritic(spec.obs_space, spec.action_space, spec.model)
        except ValueError as exc:  # the model cannot serve these spaces, or a model key is wrong
            prefix = "" if len(specs) == 1 and spec.name == "main" else f"policy {spec.name!r}: "
            raise ConfigError(prefix + str(exc)) from exc
        if spec.trained:
            parameters += sum(p.numel() for p in model.parameters())
    return spaces_of(specs), parameters


def _check_multiagent(cfg: DictConfig) -> None:
    """What building the policies cannot see: sequence lengths of per-policy recurrent models; and
    multi-agent settings given for a single-agent env, which would otherwise be ignored."""
    if not is_multiagent(cfg.env):
        if cfg.eval.get("opponents"):
            raise ConfigError(
                f"eval.opponents is set but env.id={cfg.env.id} is a single-agent env; opponents are for "
                "two-player games (env=pettingzoo): drop it"
            )
        given = [
            k
            for k in ("policies", "policy_mapping", "policies_to_train")
            if cfg.multiagent.get(k) is not None
        ]
        if given:
            raise ConfigError(
                f"multiagent.{given[0]} is set but env.id={cfg.env.id} is a single-agent (gymnasium) env; "
                "multiagent settings apply to PettingZoo envs (env=pettingzoo); drop them"
            )
        return
    if cfg.env.vector != "sync" or int(cfg.env.action_repeat) != 1 or cfg.env.max_episode_steps is not None:
        raise ConfigError(
            "PettingZoo envs run with env.vector=sync, env.action_repeat=1 and env.max_episode_steps=null "
            "(set episode limits through the env's own kwargs, e.g. +env.kwargs.max_cycles=50)"
        )
    if str(cfg.env.backend) != "gymnasium":
        raise ConfigError(f"PettingZoo envs run with env.backend=gymnasium, not {cfg.env.backend}")
    # the evaluation builds them in the job: a misspelt one would end it there
    if cfg.eval.get("opponents") is not None:
        from ppo_fabric.policy.scorers import check_opponents

        check_opponents(cfg)
    for key, off in (
        ("normalize_obs", "false"),
        ("normalize_reward", "false"),
        ("mask_velocity", "false"),
        ("observation_noise", "0"),
    ):
        if cfg.env.get(key, False):
            raise ConfigError(
                f"env.{key}={cfg.env.get(key)} is not supported for PettingZoo envs yet; set env.{key}={off}"
            )
    try:
        settings = policy_settings(cfg.multiagent)
    except EnvError as exc:
        raise ConfigError(str(exc)) from exc
    for name, own in settings.items():
        try:
            model = OmegaConf.merge(cfg.model, (own or {}).get("model") or {})
        except Exception as exc:  # a key the model config does not have
            raise ConfigError(f"multiagent.policies.{name}.model: {exc}".splitlines()[0]) from exc
        seq = sequence_length(model)
        if cfg.algo.rollout_steps % seq:
            raise ConfigError(
                f"multiagent.policies.{name}: model.lstm.seq_len={seq} does not divide "
                f"algo.rollout_steps={cfg.algo.rollout_steps}"
            )


# Environment variables by which a cluster's launcher tells each process where the job's processes meet
# (Lightning reads them: SLURM, LSF, torchrun, Kubeflow, MPI); without one of them, MASTER_ADDR/MASTER_PORT.
CLUSTER_MARKERS = ("SLURM_NTASKS", "LSB_JOBID", "TORCHELASTIC_RUN_ID", "KUBERNETES_PORT", "OMPI_COMM_WORLD_SIZE",
                   "PMI_SIZE")  # fmt: skip


def check_nodes(cfg: DictConfig) -> None:
    """A job over several nodes launched by its commands alone (one per node) needs node 0's address and a
    port on it in every command: without MASTER_PORT each node picked a free port of its own and waited
    alone until `collectives.timeout`."""
    nodes = int(cfg.fabric.num_nodes)
    if nodes == 1 or under_fabric_run() or any(name in os.environ for name in CLUSTER_MARKERS):
        return
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise ConfigError(
            f"fabric.num_nodes={nodes}: set {' and '.join(missing)} in every node's command (node 0's address "
            f"and a free port on it), with its NODE_RANK (0-{nodes - 1}); without them the nodes cannot meet"
        )


def _check_accelerator(cfg: DictConfig, world: int) -> str:
    """The devices the job asks for exist; returns the kind of device the training ranks use.

    A decoupled job launches every process on the CPU and only its trainers take a GPU each (players act on
    the CPU or share GPUs), so it needs as many GPUs on a node as that node has trainers, whatever
    `fabric.devices` is. A coupled job gives every process its own device.
    """
    accelerator = requested(cfg, "accelerator")
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cfg.strategy == "decoupled":
        if accelerator == "mps":  # its trainers take CUDA or the CPU: mps would train on the CPU unsaid
            raise ConfigError(
                "fabric.accelerator=mps: the decoupled strategy's trainers run on CUDA or the CPU; use "
                "strategy=coupled for MPS, or fabric=cpu"
            )
        kind = trainer_kind(str(cfg.algo.trainer_device), accelerator, available > 0)
        if kind == "cuda":
            _check_trainer_gpus(cfg, world, available)
        return kind
    if accelerator == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(
            "fabric.accelerator=mps but this machine has no MPS device (Apple silicon); use fabric=cpu"
        )
    if accelerator not in ("cuda", "gpu"):
        return "cuda" if accelerator == "auto" and available else "cpu"
    if available == 0:
        raise ConfigError(
            f"fabric.accelerator={accelerator} but no CUDA device is available; "
            "use fabric=cpu (or fabric.accelerator=auto)"
        )
    if not under_fabric_run() and cfg.fabric.devices > available:
        raise ConfigError(
            f"fabric.devices={cfg.fabric.devices} but this machine has {available} CUDA device(s); "
            "strategy=coupled runs one process per GPU (strategy=decoupled runs CPU players beside GPU trainers)"
        )
    return "cuda"


def _check_trainer_gpus(cfg: DictConfig, world: int, available: int) -> None:
    """Trainers on CUDA: one GPU per trainer on each node (NCCL refuses two ranks on one GPU)."""
    setting = f"algo.trainer_device={cfg.algo.trainer_device}" + (
        f" (fabric.accelerator={requested(cfg, 'accelerator')})" if cfg.algo.trainer_device == "auto" else ""
    )
    if available == 0:
        raise ConfigError(
            f"{setting} puts the trainers on CUDA but no CUDA device is available; use algo.trainer_device=cpu "
            "or fabric=cpu"
        )
    per_node, players = processes_per_node(cfg), int(cfg.algo.players)
    if world % per_node or not 1 <= players < world:
        return  # check_layout names the problem
    most = max(trainers_per_node(role_map(world, world // per_node, players)))
    if most > available:
        raise ConfigError(
            f"{setting}: {most} trainer(s) on a node ({per_node} processes, of which "
            f"{per_node - most} play) but this machine has {available} CUDA device(s), one per trainer; "
            f"raise algo.players or lower fabric.devices to at most {available} trainer(s) per node"
        )


def check_resume(cfg: DictConfig, path: str, obs_space: gym.Space, action_space: gym.Space) -> dict[str, Any]:
    """Refuse checkpoints that cannot continue this config, before any process starts."""
    try:
        state = ckpt.load(path, env_state=str(cfg.resume_env))
        spaces = ckpt.saved_spaces(state)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    saved = state["config"]
    if saved["env"]["id"] != cfg.env.id:
        raise ConfigError(
            f"resume={path!r} was trained on env.id={saved['env']['id']!r}, not {cfg.env.id!r}; "
            "set env.id to match or start a new run"
        )
    for group in _MODEL_KEYS:
        now = OmegaConf.to_container(cfg[group], resolve=True) if cfg.get(group) is not None else {}
        before = saved.get(group) or {}
        for key in ("policies", "policy_mapping") if group == "multiagent" else ():
            # dicts compare equal in any order, but the order decides: a restored vector env hands its
            # groups actions by position, and the first pattern that matches an agent wins
            order, saved_order = list(now.get(key) or {}), list(before.get(key) or {})
            if order != saved_order and sorted(order) == sorted(saved_order):
                raise ConfigError(
                    f"resume={path!r}: multiagent.{key} lists {order}, the checkpoint {saved_order}; keep "
                    "the checkpoint's order (the policies would play each other's agents)"
                )
        for key in sorted(set(now) | set(before)):
            if now.get(key) != before.get(key):
                raise ConfigError(
                    f"resume={path!r}: {group}.{key}={now.get(key)} differs from the checkpoint's "
                    f"{before.get(key)}; use the same {group} settings"
                )
    if spaces != (obs_space, action_space):
        now_env = OmegaConf.to_container(cfg.env, resolve=True)
        assert isinstance(now_env, dict)
        was_env = saved.get("env") or {}
        changed = [f"env.{k}" for k in sorted(was_env) if k in now_env and now_env[k] != was_env[k]]
        cause = f" (this resume changes {', '.join(changed)})" if changed else ""
        raise ConfigError(
            f"resume={path!r}: the env's observation or action space differs from the checkpoint's{cause}"
        )
    if saved["strategy"] != cfg.strategy:
        raise ConfigError(f"resume={path!r} comes from strategy={saved['strategy']}; use the same strategy")
    if state["env_step"] >= cfg.algo.total_steps and not owes_its_final_evaluation(state):
        raise ConfigError(
            f"resume={path!r} is already at {state['env_step']:,} env steps >= algo.total_steps="
            f"{int(cfg.algo.total_steps):,}; raise algo.total_steps to train further"
        )
    return state


@contextmanager
def bounded(seconds: float, what: str) -> Iterator[None]:
    """A check that runs the user's code (building and closing a probe env) ends the command after
    `stall_timeout` seconds without returning, in one line naming where it is stuck: no watchdog runs
    before the run starts, and an env whose constructor or `close` never returns hung it for ever."""
    if seconds <= 0:
        yield
        return
    done = threading.Event()

    def watch() -> None:
        if done.wait(seconds):
            return
        line = f"{what}: no progress for {seconds:g} s{main_thread_place()} (stall_timeout={seconds:g})"
        os.write(2, f"ppo-fabric: error: {line}\n".encode())
        prestart.discard()  # a job's first process started before these checks: it never runs
        prestart.said()  # in that process, checking for the supervisor: its status, and nothing more said
        os._exit(FAULT_EXIT)

    threading.Thread(target=watch, name="ppo-fabric-check-watchdog", daemon=True).start()
    try:
        yield
    finally:
        done.set()
