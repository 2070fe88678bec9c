"""Compose the Hydra config and check its values: a leaf that imports nothing from ppo_fabric.

Every problem is reported as a `ConfigError` whose message is one line naming the key and the fix; the
entry points print it and exit with status 2. Hydra's own multi-line errors are translated here. Checks
that need an environment, a model, a checkpoint or the machine's devices live in `preflight.py`.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

STRATEGIES = ("coupled", "decoupled")
ACCELERATORS = ("cpu", "cuda", "gpu", "mps", "auto")
# Set by the supervisor (supervisor.py) on the job it starts: the run directory it owns, which a relaunch
# without a checkpoint may reuse although the failed attempt already wrote into it.
OWN_RUN_DIR_ENV = "PPO_FABRIC_OWN_RUN_DIR"
SUPERVISED_ENV = "PPO_FABRIC_SUPERVISED"  # every process of a supervised job: run it, do not supervise


class ConfigError(ValueError):
    """A configuration the run cannot start with; `str()` is a single line for the user."""


def config_dir() -> Path:
    """The `conf/` directory: the repository's in a checkout, the packaged copy in an installed wheel."""
    repo_conf = Path(__file__).resolve().parents[2] / "conf"
    if (repo_conf / "config.yaml").is_file():
        return repo_conf
    return Path(str(resources.files("ppo_fabric.conf")))


def make_plugins_discoverable() -> None:
    """Hydra finds plugins by listing the directories of the `hydra_plugins` namespace package. An editable
    install in setuptools' import-hook mode (`pip install -e .`) makes ours importable with no directory to
    list, so Hydra would see neither our launcher nor our search path: put the directory that holds
    `hydra_plugins/ppo_fabric` on sys.path (for an installed wheel it is site-packages, already there)."""
    try:
        from hydra_plugins import ppo_fabric as ours
    except ImportError:
        return
    root = str(Path(ours.__file__).resolve().parent.parent.parent)
    if root not in sys.path:
        sys.path.append(root)
    # Hydra lists its plugins once a process: where it did before this (the caller's own Hydra in a
    # notebook or a @hydra.main app, then `ppo_fabric.run()`), that list lacks ours; register them with it.
    from hydra.core.plugins import Plugins

    from hydra_plugins.ppo_fabric.launcher import ProcessLauncher  # its import stores the launcher's config
    from hydra_plugins.ppo_fabric.searchpath import PpoFabricSearchPathPlugin

    for plugin in (ProcessLauncher, PpoFabricSearchPathPlugin):
        Plugins.instance().register(plugin)


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def translate_hydra_error(exc: Exception, overrides: list[str]) -> ConfigError:
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException

    text = str(exc)
    if isinstance(exc, MissingConfigException) and "Could not find '" in text:
        missing = text.split("Could not find '", 1)[1].split("'", 1)[0]
        group, _, option = missing.rpartition("/")
        if group and (config_dir() / group).is_dir():
            return ConfigError(
                f"{group}={option}: unknown option for config group '{group}'; "
                f"available: {', '.join(group_options(group))}"
            )
        if missing == "hydra/launcher/ppo_fabric":  # conf/config.yaml's default launcher is a plugin of ours
            return ConfigError(
                "hydra/launcher=ppo_fabric not found: the package's Hydra plugins (hydra_plugins/ppo_fabric) "
                "are not importable; reinstall the package (pip install -e . or make) or put its "
                "directory on PYTHONPATH"
            )
        return ConfigError(f"config '{missing}' not found")
    marked = _yaml_error(exc)
    if marked is not None:
        return ConfigError(marked)
    if text.startswith("Could not delete from config.") and "' does not exist" in text:
        key = text.split("'", 2)[1]  # Hydra says so of a key that is there but null, too
        return ConfigError(
            f"~{key}: nothing to delete (no such key, or it holds null already, as algo.target_kl does); "
            f"{key}=null sets a null, and a misspelt key is refused as unknown without ~"
        )
    if isinstance(exc, ConfigCompositionException) and text.startswith("Could not override '"):
        key = text.split("'", 2)[1]
        parent, _, _ = key.rpartition(".")
        inner = getattr(exc.__cause__, "full_key", None)
        if (
            inner and inner != key and str(inner).startswith(key + ".")
        ):  # the key is there, a key in it is not
            return ConfigError(
                f"{key}: it holds no key '{str(inner)[len(key) + 1 :]}'; add keys with +{inner}=VALUE, or give "
                f"the mapping whole with +{key}={{...}}"
            )
        closed = key.split(".", 1)[0] in CLOSED_SECTIONS  # a key added there is read by nothing
        # resume=auto too: it may find the run's checkpoint (and, finding none, a fresh run takes + alike)
        if any(o.startswith("resume=") and o != "resume=null" for o in overrides):
            # a key of the run's own option (exp=cartpole_lstm's model.lstm), or one the run added
            # (+env.kwargs.after): neither is in the default config
            added = (  # model.* never changes on a resume: only the env's own arguments are such keys
                f", or one the run added (+{key}=VALUE changes it, with resume_overrides=allow)"
                if key.startswith("env.kwargs.")
                else ""
            )
            return ConfigError(
                f"{key}: not a key of the default config, over which a resume's command line is read: "
                "misspelt, a key of the option the run started with (exp=cartpole_lstm's model.lstm: the "
                f"checkpoint keeps the run's own value, so leave it out, or name that option beside it){added}"
            )
        return ConfigError(
            f"{key}: unknown config key; check the spelling"
            + (f" against the keys of '{parent}'" if parent else "")
            + ("" if closed else f", or add a new key with +{key}=VALUE")
        )
    bad = _unparsable_override(overrides)
    if bad is not None:
        return ConfigError(f"cannot parse override {bad[0]!r}: {bad[1]}; write overrides as key=value")
    if isinstance(exc, OverrideParseException):
        return ConfigError(f"cannot parse override: {_first_line(exc)}")
    return ConfigError(_first_line(exc))


def _yaml_error(exc: BaseException) -> str | None:
    """A YAML syntax error in a config file, anywhere in `exc`'s causes, with its file, line and column:
    `while parsing a flow sequence` alone named neither the file nor the place."""
    import yaml

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, yaml.MarkedYAMLError) and seen.problem_mark is not None:
            mark = seen.problem_mark
            return (
                f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}: YAML syntax: {seen.problem}"
                + (f" ({seen.context})" if seen.context else "")
            )
        seen = seen.__cause__ or seen.__context__
    return None


def _unparsable_override(overrides: list[str]) -> tuple[str, str] | None:
    """The first override Hydra's grammar rejects (Hydra's own message does not say which)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for override in overrides:
        if not override.startswith("~") and (override.startswith("=") or "=" not in override):
            return override, "missing key or '='"
        try:
            parser.parse_overrides([override])
        except Exception as exc:  # Hydra's grammar errors have no common base
            return override, _first_line(exc)
    return None


def compose(
    overrides: list[str],
    config_path: str | None = None,
    config_name: str = "config",
    keep_hydra: bool = False,
    sweep: bool = False,
) -> tuple[DictConfig, str]:
    """Compose the primary config (ours, `conf/config.yaml`, or a user's `config_path`/`config_name`, which
    finds our groups through the search-path plugin) with overrides; returns (config, run-dir template).
    `keep_hydra`: the config keeps its `hydra` node (the options chosen: `hydra.runtime.choices`). `sweep`:
    a multirun's, whose jobs run in `hydra.sweep.dir`'s subdirectories."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir, initialize_config_module

    _refuse_added_keys(overrides)

    make_plugins_discoverable()
    if not OmegaConf.has_resolver("now"):
        OmegaConf.register_new_resolver("now", lambda fmt: _dt.datetime.now().strftime(fmt))
    where = config_path or str(config_dir())
    try:
        if where.startswith("pkg://"):
            context = initialize_config_module(
                where[len("pkg://") :], version_base="1.3", job_name="ppo_fabric"
            )
        else:
            where = where[len("file://") :] if where.startswith("file://") else where
            context = initialize_config_dir(version_base="1.3", config_dir=where, job_name="ppo_fabric")
        with context:
            cfg = hydra_compose(config_name, overrides=overrides, return_hydra_config=True)
    except Exception as exc:  # Hydra raises many types; each becomes one line
        raise translate_hydra_error(exc, overrides) from exc
    _check_auto_resume_dir(cfg, sweep)
    run_dir = str(cfg.hydra.run.dir)
    if not keep_hydra:
        with open_dict(cfg):
            del cfg["hydra"]
    return cfg, run_dir


def composer(
    config_path: str | None = None, config_name: str = "config"
) -> Callable[[list[str]], DictConfig]:
    """A function composing a command line's config (no `hydra` key), inside a running Hydra app too: there
    Hydra is initialised already (with the app's own primary config, which `config_path` would name) and
    `compose` would refuse to initialise it again."""

    def compose_again(overrides: list[str]) -> DictConfig:
        from hydra import compose as hydra_compose
        from hydra.core.global_hydra import GlobalHydra

        if not GlobalHydra.instance().is_initialized():
            return compose(overrides, config_path, config_name)[0]
        try:
            return hydra_compose(config_name, overrides=overrides)
        except Exception as exc:  # Hydra raises many types; each becomes one line
            raise translate_hydra_error(exc, overrides) from exc

    return compose_again


def without_sweeps(overrides: list[str]) -> list[str]:
    """The overrides that are not sweeps (`seed=1,2`, `range(3)`, `choice(...)`): what every job of a
    multirun shares, composable on its own. Raises `ConfigError` for one Hydra's grammar rejects."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    bad = _unparsable_override(overrides)
    if bad is not None:
        raise ConfigError(f"cannot parse override {bad[0]!r}: {bad[1]}; write overrides as key=value")
    parsed = OverridesParser.create().parse_overrides(overrides)
    return [o.input_line for o in parsed if not o.is_sweep_override() and o.input_line is not None]


# Sections whose keys the package reads all of: a key added to one (`+algo.lrr=3e-4`) is read by nothing
CLOSED_SECTIONS = ("algo", "eval", "checkpoint", "collectives", "selfplay")


def _refuse_added_keys(overrides: list[str]) -> None:
    """`+SECTION.KEY=...` of a closed section adds a key nothing reads (an existing one is refused by Hydra
    with +): the run trained as if it were not there, so a misspelt `+algo.lrr=3e-4` changed nothing."""
    for override in overrides:
        if override.startswith("+") and not override.startswith("++"):
            key = override[1:].split("=", 1)[0]
            section = key.split(".", 1)[0]
            if section in CLOSED_SECTIONS and "." in key:
                raise ConfigError(
                    f"+{key}: ppo-fabric reads no such key ({section}.* holds the keys it reads: "
                    f"python -m ppo_fabric --cfg job --package {section} lists them); without + a misspelt "
                    "key is named"
                )


def _check_auto_resume_dir(cfg: DictConfig, sweep: bool = False) -> None:
    """`resume=auto` continues the run in `hydra.run.dir` (a sweep's jobs: in `hydra.sweep.dir`'s
    subdirectories); a timestamped template names a new directory at every launch, so a relaunched command
    would never find its own checkpoints. A sweep was told about hydra.run.dir, which its jobs never use."""
    if cfg.get("resume") != "auto":
        return
    key = "sweep" if sweep else "run"
    template = str(OmegaConf.to_container(cfg.hydra[key], resolve=False).get("dir", ""))
    if "${now:" in template:
        raise ConfigError(
            f"resume=auto needs a stable run directory, but hydra.{key}.dir={template} is new at every launch; "
            f"set hydra.{key}.dir=DIR (the same on every launch)"
        )


# ------------------------------------------------------------------------------------------- validation
@dataclass(frozen=True)
class _Rule:
    key: str
    kind: type  # int or float
    low: float | None = None  # inclusive unless strict
    high: float | None = None
    strict_low: bool = False
    strict_high: bool = False
    optional: bool = False  # null allowed (it means off, or the env's own)
    absent_ok: bool = False  # the key may be missing (another config group), but never null


_RULES = (
    _Rule("seed", int, 0, 2**32 - 1),  # numpy's and torch's seeding take 32 bits
    _Rule("torch_threads", int, 0),
    _Rule("restarts", int, 0),
    _Rule("stall_timeout", float, 0, optional=True),
    _Rule("algo.max_skipped_updates", int, 0, absent_ok=True),
    _Rule("algo.max_param_abs", float, 0, absent_ok=True),
    _Rule("env.max_restarts", int, 0, absent_ok=True),
    _Rule("env.observation_noise", float, 0, optional=True),
    _Rule("algo.total_steps", int, 0, strict_low=True),
    _Rule("algo.rollout_steps", int, 0, strict_low=True),
    _Rule("algo.minibatch_size", int, 0, strict_low=True),
    _Rule("algo.update_epochs", int, 0, strict_low=True),
    _Rule("algo.lr", float, 0, strict_low=True),
    _Rule("algo.adam_eps", float, 0, strict_low=True),
    _Rule("algo.gamma", float, 0, 1),
    _Rule("algo.gae_lambda", float, 0, 1),
    # 1 - clip_coef <= 0 leaves a falling ratio unclipped (and the value clip, when on, as wide)
    _Rule("algo.clip_coef", float, 0, 1, strict_low=True, strict_high=True),
    _Rule("algo.vf_coef", float, 0),
    _Rule("algo.ent_coef", float, 0),
    _Rule("algo.max_grad_norm", float, 0),
    _Rule("algo.target_kl", float, 0, strict_low=True, optional=True),
    _Rule("algo.lag_weight_clip", float, 0, strict_low=True),
    _Rule("algo.players", int, 1),
    _Rule("env.num_envs", int, 0, strict_low=True),
    _Rule("env.action_repeat", int, 1),
    _Rule("env.max_episode_steps", int, 0, strict_low=True, optional=True),
    _Rule("env.normalize_warmup", int, 0, optional=True),
    _Rule("fabric.devices", int, 0, strict_low=True),
    _Rule("fabric.num_nodes", int, 0, strict_low=True),
    _Rule("checkpoint.every", int, 0),
    _Rule("checkpoint.keep", int, 0),
    _Rule("checkpoint.every_minutes", float, 0),
    _Rule("logger.log_every", int, 0, strict_low=True),
    _Rule("logger.progress_every", float, 0, optional=True),
    _Rule("eval.episodes", int, 0, strict_low=True, absent_ok=True),
    _Rule("collectives.timeout", float, 0, strict_low=True),
    _Rule("model.lstm.hidden_size", int, 0, absent_ok=True),  # model=lstm only
    _Rule("model.lstm.num_layers", int, 1, absent_ok=True),
    _Rule("model.lstm.seq_len", int, 1, absent_ok=True),
)

_CHOICES = {
    "strategy": STRATEGIES,
    "resume_env": ("restore", "fresh"),
    "resume_overrides": ("refuse", "allow", None),
    "env.vector": ("sync", "async"),
    "env.on_error": ("raise", "restart", None),
    "fabric.accelerator": ACCELERATORS,
    "algo.player_device": ("cpu", "auto"),
    "algo.trainer_device": ("auto", "cpu", "cuda"),
    "algo.action_mask": ("auto", "off"),
    "fabric.strategy": ("auto", "ddp"),
    "fabric.precision": ("32-true", "32", "bf16-mixed", "16-mixed"),
}
# Whole-model precisions Fabric offers that the policies cannot run: their encoders, recurrent states and
# rollout storage are float32, so the first forward failed on a dtype mismatch.
_WHOLE_MODEL_PRECISIONS = ("bf16-true", "16-true", "64-true", "64")
COMPILE_MODES = (False, True, "graph")  # eager, torch.compile, the whole step in one CUDA graph
_BOOLS = (
    "algo.anneal_lr",
    "algo.norm_adv",
    "algo.clip_vloss",
    "algo.pipeline",
    "algo.numpy_rollout",
    "algo.lag_objective",
    "algo.lag_refresh_advantages",
    "algo.lag_vtrace",
    "fabric.tf32",
    "logger.tensorboard",
    "logger.csv",
    "env.normalize_obs",
    "env.normalize_reward",
    "selfplay.enabled",
)
_BOOLS_IF_SET = (
    "model.lstm.shared",
    "logger.plot",
)  # model=lstm only; a user's own logger option may lack plot
_ABSENT = object()


def _check_number(cfg: DictConfig, rule: _Rule) -> None:
    value = OmegaConf.select(cfg, rule.key, default=_ABSENT, throw_on_missing=False)
    if value is _ABSENT and (rule.optional or rule.absent_ok):
        return
    if value is None and rule.optional:
        return
    if value is None or value is _ABSENT:
        raise ConfigError(f"{rule.key} is required; set {rule.key}=VALUE")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        shown = str(value).lower() if isinstance(value, bool) else repr(value)
        raise ConfigError(f"{rule.key}={shown} must be a finite number")
    if rule.kind is int:
        if not float(value).is_integer():
            raise ConfigError(f"{rule.key}={value!r} must be a whole number")
        value = int(value)
        OmegaConf.update(cfg, rule.key, value)

    def shown(limit: float) -> str:
        return str(int(limit)) if rule.kind is int else f"{limit:g}"

    bound = ""
    if rule.low is not None and (value <= rule.low if rule.strict_low else value < rule.low):
        bound = f"> {shown(rule.low)}" if rule.strict_low else f">= {shown(rule.low)}"
    if rule.high is not None and (value >= rule.high if rule.strict_high else value > rule.high):
        bound = f"< {shown(rule.high)}" if rule.strict_high else f"<= {shown(rule.high)}"
    if bound:
        opening, closing = "(" if rule.strict_low else "[", ")" if rule.strict_high else "]"
        span = (
            f"in {opening}{shown(rule.low or 0)}, {shown(rule.high)}{closing}"
            if rule.high is not None
            else bound
        )
        raise ConfigError(f"{rule.key}={value} is out of range; it must be {span}")


def sequence_length(model_cfg: DictConfig) -> int:
    """Steps per training unit: `model.lstm.seq_len` for recurrent models, 1 (single steps) otherwise."""
    lstm = model_cfg.get("lstm")
    return int(lstm.seq_len) if lstm is not None and int(lstm.hidden_size) > 0 else 1


def under_fabric_run() -> bool:
    """Whether `fabric run` started this process: Lightning's CLI says so only through this variable."""
    return bool(os.environ.get("LT_CLI_USED"))


def requested(cfg: DictConfig, key: str) -> str:
    """`fabric.accelerator` or `fabric.precision` as the job runs with it: `fabric run --accelerator` and
    `--precision` reach the processes only as LT_* variables, and win over the config."""
    value = os.environ.get(f"LT_{key.upper()}") if under_fabric_run() else None
    return str(value if value is not None else cfg.fabric[key])


def processes_per_node(cfg: DictConfig) -> int:
    """`fabric.devices`, or under `fabric run`/torchrun the processes it started on each node."""
    if under_fabric_run() and os.environ.get("LOCAL_WORLD_SIZE"):
        return int(os.environ["LOCAL_WORLD_SIZE"])
    return int(cfg.fabric.devices)


def launched_world_size(cfg: DictConfig) -> int:
    """Processes in the job: `fabric run` (torchrun) says so in WORLD_SIZE, otherwise the config does."""
    if under_fabric_run() and os.environ.get("WORLD_SIZE"):
        return int(os.environ["WORLD_SIZE"])
    return int(cfg.fabric.devices) * int(cfg.fabric.num_nodes)


@dataclass(frozen=True)
class Layout:
    """How one update's batch is made and split.

    `algo.minibatch_size` is the minibatch over all training ranks (RLlib's sgd_minibatch_size): each rank
    takes `minibatch_size / trainers` samples per step and DDP averages the gradients, so the same config
    takes as many gradient steps of the same size on 1 or N training ranks (advantages are normalised per
    rank, over its share).
    """

    collectors: int  # ranks that step envs
    trainers: int  # ranks that compute gradients
    batch: int  # samples per update over all ranks (storage rows: [T, E] per collecting rank)
    minibatch: int  # samples per gradient step over all ranks
    env_steps: int  # env steps per update over all ranks: `batch` unless only some envs act per step

    @property
    def rank_minibatch(self) -> int:
        return self.minibatch // self.trainers


def acting_envs(env_cfg: DictConfig) -> int:
    """Envs that take a step per rollout step: `env.envpool.batch_size` for an async EnvPool (only the
    envs that are ready act, `envpool_backend.AsyncEnvPoolVectorEnv`), else every one of `env.num_envs`."""
    num_envs = int(env_cfg.num_envs)
    batch = env_cfg.envpool.batch_size
    if str(env_cfg.backend) != "envpool":
        return num_envs
    if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
        return num_envs  # null (sync), or a bad value `envpool_backend.check_settings` names
    return min(batch, num_envs)


def training_layout(cfg: DictConfig, world_size: int) -> Layout:
    per_collector = int(cfg.algo.rollout_steps) * int(cfg.env.num_envs)
    if cfg.strategy == "decoupled":
        players = int(cfg.algo.players)
        collectors, trainers = players, max(world_size - players, 1)
    else:
        collectors = trainers = world_size
    env_steps = int(cfg.algo.rollout_steps) * acting_envs(cfg.env) * collectors
    return Layout(collectors, trainers, per_collector * collectors, int(cfg.algo.minibatch_size), env_steps)


def validate(cfg: DictConfig) -> int:
    """Check every value that can be checked without an env or a model; returns the job's process count."""
    check_values(cfg)
    world = launched_world_size(cfg)
    check_layout(cfg, world)
    return world


def check_values(cfg: DictConfig) -> None:
    """Each key on its own: numbers in range, one of the choices, booleans, layer widths."""
    for rule in _RULES:
        _check_number(cfg, rule)
    precision = OmegaConf.select(cfg, "fabric.precision")
    if precision in _WHOLE_MODEL_PRECISIONS:
        raise ConfigError(
            f"fabric.precision={precision} (every parameter in that type) is not supported: the policies "
            "compute in float32; bf16-mixed or 16-mixed runs the forward in half precision"
        )
    for key, choices in _CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in choices:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(str, choices))}")
    for key in (*_BOOLS, *_BOOLS_IF_SET):  # `off`, `no`, 'false' are strings, which `if` takes for true
        value = OmegaConf.select(cfg, key, default=_ABSENT)
        if not isinstance(value, bool) and not (value is _ABSENT and key in _BOOLS_IF_SET):
            shown = "missing" if value is _ABSENT else repr(value)
            raise ConfigError(f"{key}={shown} must be true or false")
    mode = OmegaConf.select(cfg, "algo.compile")
    if not isinstance(mode, bool | str) or mode not in COMPILE_MODES:
        raise ConfigError(f"algo.compile={mode!r} must be false, true or graph")
    every = OmegaConf.select(cfg, "eval.every")
    if isinstance(every, float) and every.is_integer():  # eval.every=1e5
        every = int(every)
        OmegaConf.update(cfg, "eval.every", every)
    # null is neither: it read as off (every) and as sampled actions (deterministic), silently
    if every != "auto" and (isinstance(every, bool) or not isinstance(every, int) or every < 0):
        shown = "null" if every is None else repr(every)
        raise ConfigError(f"eval.every={shown} must be a whole number of env steps >= 0 (0: off) or auto")
    deterministic = OmegaConf.select(cfg, "eval.deterministic")
    if not isinstance(deterministic, bool):
        shown = "null" if deterministic is None else repr(deterministic)
        raise ConfigError(f"eval.deterministic={shown} must be true or false")
    for key in ("model.actor_hidden", "model.critic_hidden"):
        widths = OmegaConf.select(cfg, key)
        if not OmegaConf.is_list(widths) or not all(isinstance(w, int) and w > 0 for w in widths):
            raise ConfigError(f"{key}={widths} must be a list of positive widths, e.g. [64, 64]")


def check_layout(cfg: DictConfig, world: int) -> None:
    """The keys together: processes, batch, minibatch and sequence sizes fit each other."""
    if cfg.strategy == "decoupled":
        if world < 2:
            raise ConfigError(
                f"strategy=decoupled needs at least 2 processes (players + trainers), got {world}; "
                "set fabric.devices=2 or more"
            )
        if cfg.algo.players > world - 1:
            raise ConfigError(
                f"algo.players={cfg.algo.players} leaves no trainer among {world} processes; "
                f"use algo.players<={world - 1} or more fabric.devices"
            )
    elif cfg.algo.players != 1:  # the run went on with every process collecting, without a word
        raise ConfigError(
            f"algo.players={cfg.algo.players} counts the player processes of strategy=decoupled; in a "
            "coupled run every process collects and trains (add strategy=decoupled, or drop algo.players)"
        )
    layout = training_layout(cfg, world)
    per_collector = cfg.algo.rollout_steps * cfg.env.num_envs
    if cfg.strategy == "decoupled" and per_collector % layout.trainers:
        raise ConfigError(
            f"each player's batch of {per_collector} samples (algo.rollout_steps*env.num_envs) cannot be "
            f"split evenly over {layout.trainers} trainers; change env.num_envs or algo.rollout_steps"
        )
    # V-trace without the recomputation it applies in: the run went on without either, silently
    if bool(cfg.algo.lag_vtrace) and not bool(cfg.algo.lag_refresh_advantages):
        raise ConfigError(
            "algo.lag_vtrace=true applies V-trace where a lagged batch's advantages are recomputed, which "
            "algo.lag_refresh_advantages=false turns off; set that true or drop algo.lag_vtrace"
        )
    refreshed = bool(cfg.algo.pipeline) and bool(cfg.algo.lag_refresh_advantages)
    # batches the refresh applies to: feed-forward, unmasked (multi-agent and async pools keep the player's)
    plain = layout.env_steps == layout.batch and cfg.env.get("api", "gymnasium") != "pettingzoo"
    steps = int(cfg.algo.rollout_steps)
    feed_forward = sequence_length(cfg.model) == 1
    if cfg.strategy == "decoupled" and refreshed and plain and feed_forward and steps % layout.trainers:
        # each trainer recomputes GAE over whole time rows of its shard: a shard that is no whole number
        # of rows would keep the player's stale advantages without a word
        why = (
            f"algo.lag_refresh_advantages=true recomputes advantages over whole time steps, and "
            f"algo.rollout_steps={steps} does not split into equal time rows over {layout.trainers} "
            f"trainers"
        )
        if cfg.get("resume") is None:
            raise ConfigError(
                f"{why}; use a multiple of {layout.trainers} (e.g. "
                f"{steps + layout.trainers - steps % layout.trainers}) or algo.lag_refresh_advantages=false"
            )
        # a run that trained so continues so (neither key may change on resume): said, not refused
        warnings.warn(
            f"ppo-fabric: {why}: this run's lagged batches keep the player's advantages", stacklevel=2
        )
    mb, trainers = layout.minibatch, layout.trainers
    if mb % trainers:
        raise ConfigError(
            f"algo.minibatch_size={mb} is the minibatch over all {trainers} training ranks and must be "
            f"divisible by {trainers}; use e.g. {max(trainers, mb - mb % trainers)}"
        )
    if layout.batch % mb:
        # what the later checks take too: whole sequences of a recurrent model on every training rank
        unit = trainers * sequence_length(cfg.model)
        divisors = [d for d in range(unit, layout.batch + 1, unit) if layout.batch % d == 0] or [
            d for d in range(trainers, layout.batch + 1, trainers) if layout.batch % d == 0
        ]
        near = sorted(sorted(divisors, key=lambda d: abs(d - mb))[:3])
        raise ConfigError(
            f"algo.minibatch_size={mb} does not divide the batch of {layout.batch} samples per update "
            f"(algo.rollout_steps*env.num_envs*{layout.collectors} collecting ranks); "
            f"use a divisor such as {', '.join(map(str, near))}"
        )
    if cfg.algo.norm_adv and layout.rank_minibatch < 2:
        raise ConfigError(
            f"algo.minibatch_size={mb} gives {layout.rank_minibatch} sample(s) per training rank; "
            "advantage normalisation (algo.norm_adv=true) needs at least 2"
        )
    _check_sequences(cfg, layout)
    _check_compile(cfg, layout)
    if cfg.algo.total_steps < layout.env_steps:
        envs = "env.num_envs" if layout.env_steps == layout.batch else "env.envpool.batch_size"
        raise ConfigError(
            f"algo.total_steps={cfg.algo.total_steps} is smaller than one batch of {layout.env_steps} env "
            f"steps (algo.rollout_steps*{envs}*collecting ranks); raise algo.total_steps"
        )
    _check_async(cfg, layout)


def _check_async(cfg: DictConfig, layout: Layout) -> None:
    """An async EnvPool advances only the envs that act at a step: a recurrent state would advance for the
    others too (their stale observations), so recurrent policies need a sync pool."""
    lstm = cfg.model.get("lstm")
    if layout.env_steps != layout.batch and lstm is not None and int(lstm.hidden_size) > 0:
        raise ConfigError(
            f"env.envpool.batch_size={cfg.env.envpool.batch_size} < env.num_envs={cfg.env.num_envs} (async "
            f"collection) does not support recurrent policies (model.lstm.hidden_size={lstm.hidden_size}); "
            "set env.envpool.batch_size=null"
        )


def _check_compile(cfg: DictConfig, layout: Layout) -> None:
    """The compiled step covers feed-forward policies; the LSTM's per-step reset loop is not compiled (it
    reads the episode starts on the host, which no CUDA graph can record either). The whole-step graph
    records the direct step (fused Adam at full precision, no DDP: learn/graph.py)."""
    mode = cfg.algo.compile
    lstm = cfg.model.get("lstm")
    if mode and lstm is not None and int(lstm.hidden_size) > 0:
        raise ConfigError(
            f"algo.compile={str(mode).lower()} does not support recurrent policies (model.lstm.hidden_size="
            f"{int(lstm.hidden_size)}); set algo.compile=false"
        )
    if mode != "graph":
        return
    if layout.trainers > 1:
        raise ConfigError(
            f"algo.compile=graph records one rank's step, without DDP's gradient all-reduce; this run trains "
            f"on {layout.trainers} ranks: use algo.compile=true, or train on one rank"
        )
    precision = requested(cfg, "precision")
    if precision not in ("32-true", "32"):
        raise ConfigError(
            f"algo.compile=graph records the full-precision step (fused Adam on float32 parameters); "
            f"fabric.precision={precision}: use algo.compile=true, or fabric.precision=32-true"
        )


def _check_sequences(cfg: DictConfig, layout: Layout) -> None:
    """Recurrent models train on whole sequences: rollouts, minibatches and shards hold whole ones."""
    seq = sequence_length(cfg.model)
    if seq == 1:
        return
    steps = int(cfg.algo.rollout_steps)
    if steps % seq:
        raise ConfigError(
            f"model.lstm.seq_len={seq} does not divide algo.rollout_steps={steps}; training sequences are "
            "cut from each rollout, so use a divisor"
        )
    if layout.rank_minibatch % seq:
        raise ConfigError(
            f"algo.minibatch_size={layout.minibatch} gives {layout.rank_minibatch} steps per training rank, "
            f"not whole sequences of model.lstm.seq_len={seq}; use a multiple of {seq * layout.trainers}"
        )
    sequences = steps // seq * int(cfg.env.num_envs)
    if cfg.strategy == "decoupled" and sequences % layout.trainers:
        raise ConfigError(
            f"each player's {sequences} sequences cannot be split evenly over {layout.trainers} trainers; "
            "change env.num_envs or model.lstm.seq_len"
        )


def _check_creatable(path: Path, shown: str) -> None:
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(
            f"hydra.run.dir={shown}: {existing} is a file, not a directory; choose another run directory"
        )
    unwritable = _unwritable(existing)
    if unwritable is not None and existing == path:  # it exists: "cannot be created" named the wrong fault
        raise ConfigError(
            f"hydra.run.dir={shown} is not writable ({unwritable}); choose another run directory"
        )
    if unwritable is not None:
        raise ConfigError(
            f"hydra.run.dir={shown} cannot be created under {existing} ({unwritable}); choose another run directory"
        )
    checkpoints = path / "checkpoints"  # a run continued in its own directory writes there at the end
    unwritable = _unwritable(checkpoints) if checkpoints.is_dir() else None
    if unwritable is not None:
        raise ConfigError(f"hydra.run.dir={shown}: {checkpoints} is not writable ({unwritable})")


def _unwritable(directory: Path) -> str | None:
    """Why this process cannot write into `directory` (a scratch folder made and removed there), or None."""
    try:
        tempfile.TemporaryDirectory(dir=directory, prefix=".ppo-fabric-check-").cleanup()
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def check_run_dir(cfg: DictConfig, run_dir: str, auto: bool = False) -> None:
    """Never overwrite another run's checkpoints: a used directory is only for continuing that run.

    `auto`: the run came with `resume=auto`, which names this directory as the run to continue (from its
    newest checkpoint, or afresh when it holds none). A supervisor's relaunch may reuse its own directory.
    The directory must also be one this process can create (checked by creating a scratch folder beside it).
    """
    path = Path(run_dir).resolve()
    _check_creatable(path, run_dir)
    if not ((path / "checkpoints" / "last.ckpt").exists() or (path / "summary.json").exists()):
        return
    if auto or (os.environ.get(OWN_RUN_DIR_ENV) and Path(os.environ[OWN_RUN_DIR_ENV]).resolve() == path):
        return
    if cfg.resume is not None and path in Path(str(cfg.resume)).resolve().parents:
        return
    raise ConfigError(
        f"hydra.run.dir={run_dir} already holds a run; choose a new directory, or continue that run with "
        f"resume={path / 'checkpoints' / 'last.ckpt'}"
    )
