"""Atomic checkpoints and exact resume.

A checkpoint holds the shared learner state (model, optimizer, counters) once, and per rank what makes
its next rollout identical to an uninterrupted run: RNG states, the vector env (pickled when it can be,
e.g. sync envs), the observation it acts on next, and its recent episodes.

Loading never runs code: everything is plain data (dicts, lists, tuples, numbers, strings, tensors; spaces
via `spaces.space_to_data`), read with `torch.load(weights_only=True)`. The one pickle, the vector env
snapshot, is signed with this installation's key (`signing`) and unpickled only when the signature holds.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import pickle
import pickletools
import random
import secrets
import sys
import warnings
import zipfile
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from omegaconf import OmegaConf

from ppo_fabric.config.defaults import with_defaults
from ppo_fabric.envs.spaces import space_from_data, space_to_data
from ppo_fabric.runs import signing

FORMAT_VERSION = 2  # 2: plain data only (weights_only loading), signed env snapshots
ENV_STATES = ("restore", "fresh")  # what `load` does with the env snapshots (config key resume_env)


def rng_state() -> dict[str, Any]:
    """Torch, numpy and Python RNG states as tensors, numbers and lists (numpy's and Python's own states
    are tuples holding arrays, which only a full unpickler reads)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    version, internal, gauss_next = random.getstate()
    cuda = (
        torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    )
    return {
        "torch": torch.get_rng_state(),
        "cuda": cuda,  # one state per visible CUDA device, or None on a CPU run
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
        "python": [version, list(internal), gauss_next],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` saved; CUDA states only where the resuming run sees as many devices (a
    GPU checkpoint resumed on a CPU, or the other way round, keeps this run's own CUDA seeds)."""
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))


def pickle_envs(envs: gym.vector.VectorEnv) -> dict[str, Any] | None:
    """The vector env's full state, pickled and signed with this installation's key, or None where it
    cannot be pickled (async workers, some simulators) or its pickle would not hold its state
    (`pickle_keeps_state`)."""
    if not pickle_keeps_state(envs):
        return None
    try:
        blob = pickle.dumps(envs)
    except Exception:  # any env may refuse; resume then starts fresh episodes
        return None
    return {"pickle": torch.frombuffer(bytearray(blob), dtype=torch.uint8), "hmac": signing.sign(blob)}


def pickle_keeps_state(envs: Any) -> bool:
    """False when an env of `envs` is rebuilt from its constructor arguments when unpickled (gymnasium's
    `EzPickle`: the Box2D, MuJoCo and Atari envs, PettingZoo's envs). Such a pickle holds a
    new env that was never reset, not the episode in progress: a Box2D env then fails its first step, a
    MuJoCo one goes on from its initial pose. Resume must start fresh episodes there instead.

    Walks the vector env's wrappers (`.env`) down to the object holding the sub-envs (`.envs`), then each
    sub-env's wrappers (gymnasium's and PettingZoo's keep the wrapped env in `.env`; PettingZoo's
    AEC-to-parallel conversion, which MPE's parallel envs are, in `.aec_env`). A holder with a
    `__setstate__` of its own restores its envs itself and is trusted."""
    from gymnasium.utils import EzPickle

    def chain(obj: Any) -> list[Any]:
        out: list[Any] = []
        while obj is not None and len(out) < 64 and not any(obj is seen for seen in out):
            out.append(obj)
            inner = getattr(obj, "env", None)
            obj = inner if inner is not None else getattr(obj, "aec_env", None)
        return out

    layers = chain(envs)
    holder = next((layer for layer in layers if isinstance(getattr(layer, "envs", None), list)), None)
    if holder is not None and "__setstate__" in vars(type(holder)):
        return True  # it restores its envs itself (turn_based.TurnBasedVectorEnv replays each game's moves)
    subs = [] if holder is None else holder.envs
    return not any(isinstance(layer, EzPickle) for obj in [*layers, *subs] for layer in chain(obj))


def _signed_pickle(snapshot: Any) -> bytes | None:
    """The snapshot's pickle when it carries this installation's signature, else None (never unpickle it)."""
    data = snapshot.get("pickle") if isinstance(snapshot, dict) else None
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1:
        return None
    blob = data.numpy().tobytes()
    return blob if signing.verify(blob, snapshot.get("hmac")) else None


def _is_tensordict(obj: Any) -> bool:
    """Without importing tensordict (1.5 s, torch._dynamo), which the checks before a run never need: a
    process that has not imported it holds no TensorDict."""
    module = sys.modules.get("tensordict")
    return module is not None and isinstance(obj, module.TensorDictBase)


def to_plain(obj: Any) -> Any:
    """`obj` with numpy arrays and scalars, spaces, TensorDicts and deques turned into what
    `torch.load(weights_only=True)` reads; containers already plain are returned as they are (model state
    dicts keep their type and metadata). Raises TypeError for anything else, at save rather than at load."""
    if isinstance(obj, np.generic):  # before float: np.float64 is one, yet pickles as a numpy object
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str, torch.Tensor)):
        return obj
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj.copy())
    if isinstance(obj, gym.Space):
        return space_to_data(obj)
    if _is_tensordict(obj):
        return to_plain(obj.to_dict())
    if isinstance(obj, Mapping):
        plain = {key: to_plain(value) for key, value in obj.items()}
        return obj if isinstance(obj, dict) and all(plain[k] is obj[k] for k in obj) else plain
    if isinstance(obj, (list, tuple, deque)):
        items = [to_plain(value) for value in obj]
        return tuple(items) if isinstance(obj, tuple) else items
    raise TypeError(f"a checkpoint cannot hold a {type(obj).__name__} (it would load only by running code)")


def atomic_write(data: bytes, path: Path) -> None:
    """Write to a temp file in the same directory, fsync, then rename: readers never see a partial file.
    The file gets the permissions of any file this user creates (the umask's; tempfile's 0600 kept a
    teammate's `evaluate` out of a shared run directory), and the temp files of a writer that died
    mid-write (SIGKILL) are removed at this process's first write there: a run preempted again and again
    would otherwise fill the disk with them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_writers_files(path.parent)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"  # not `random`, whose state a run keeps
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    _WRITING.add(tmp)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        _WRITING.discard(tmp)
    _sync_directory(path.parent)


def _sync_directory(directory: Path) -> None:
    """The rename made durable: until the directory's entry reaches the disk, a power loss or a node's
    crash can bring the previous file back under the name (never a partial one)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # a platform or file system that cannot open a directory: the rename stands as it is
        return
    try:
        with contextlib.suppress(OSError):  # some network file systems refuse fsync on a directory
            os.fsync(fd)
    finally:
        os.close(fd)


_SWEPT: set[Path] = set()  # the directories whose dead writers' temp files this process removed
_WRITING: set[Path] = set()  # this process's writes in progress (another thread's, while one sweeps)


def _remove_dead_writers_files(directory: Path) -> None:
    """Temp files of `atomic_write` that no write of this process holds: left by a writer killed mid-write
    (one writer per run directory, its lock's holder; a restarted container's may even share its pid),
    once per directory and process."""
    if directory in _SWEPT:
        return
    _SWEPT.add(directory)
    for tmp in directory.glob(".*.ckpt.*.tmp"):
        if tmp not in _WRITING:
            with contextlib.suppress(OSError):
                tmp.unlink()


def amend(path: Path, **fields: Any) -> None:
    """Replace top-level `fields` of a written checkpoint, atomically, the rest as it was written: what
    arrived after it was written (a background evaluation of its own update)."""
    raw = torch.load(path, map_location="cpu", weights_only=True)
    raw.update(to_plain(fields))
    buffer = io.BytesIO()
    torch.save(raw, buffer)
    atomic_write(buffer.getvalue(), path)


def encode(state: dict[str, Any]) -> bytes:
    """A checkpoint's bytes: the state as plain data, with the format version."""
    buffer = io.BytesIO()
    torch.save({"format": FORMAT_VERSION, **to_plain(state)}, buffer)
    return buffer.getvalue()


def numbered_name(env_step: int, run_id: str) -> str:
    """`step_<env step>_<run id>.ckpt`: the env step orders a lineage; the id of the launch that wrote it
    keeps a resumed run from overwriting what an earlier run wrote at the same step."""
    return f"step_{env_step:012d}_{run_id}.ckpt"


def parse_numbered(path: Path) -> tuple[int, str] | None:
    parts = path.stem.split("_")
    if len(parts) != 3 or parts[0] != "step" or not parts[1].isdigit():
        return None
    return int(parts[1]), parts[2]


DROPPED_BEST = "best.dropped.ckpt"  # a best.ckpt of the branch a resume left (`session.inherit_best`)


def in_lineage(env_step: int, run_id: str, lineage: list[list[Any]]) -> bool:
    """Whether a numbered checkpoint belongs to this run's lineage: `lineage` lists [run id, env step it
    started from] from the first run to this one, so an ancestor's checkpoints count up to the step the
    next run resumed from (what it wrote after that belongs to another branch)."""
    for (rid, _), nxt in zip(lineage, [*lineage[1:], None], strict=True):
        if rid == run_id and (nxt is None or env_step <= int(nxt[1])):
            return True
    return False


def save(
    state: dict[str, Any],
    ckpt_dir: Path,
    numbered: bool,
    keep: int,
    protect: tuple[Path, ...] = (),
    best: bool | dict[str, Any] = False,
) -> Path:
    """Write `best.ckpt` when `best` (`state` itself, or the state `best` is: a decoupled run's best
    evaluated policy, `policy_checkpoint`), then `last.ckpt`, then, when asked, the numbered copy, and prune this
    lineage's numbered copies to the newest `keep` (0 keeps all). Never deleted: the file just written and
    those in `protect` (the checkpoint the run resumed from). Other lineages' files in the same directory
    are left alone.

    In that order so that a write that fails (a full disk) loses nothing a resume cannot redo: `best.ckpt`
    first, since a resume from the previous `last.ckpt` replays the updates up to a best again but nothing
    rewrites a best once `last.ckpt` is past it (a run whose last best failed was complete and had none);
    then `last.ckpt`, which `resume=auto` continues from (a numbered copy written before it, then a failing
    `last.ckpt`, left the run's newest state in a file the failure line did not name). An OSError carries
    the file it was writing."""
    data = encode(state)
    kept = {p.resolve() for p in protect}
    last = ckpt_dir / "last.ckpt"
    targets = [(ckpt_dir / "best.ckpt", encode(best) if isinstance(best, dict) else data)] if best else []
    targets.append((last, data))
    if numbered:
        targets.append((ckpt_dir / numbered_name(int(state["env_step"]), str(state["run_id"])), data))
    for path, content in targets:
        try:
            atomic_write(content, path)
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
    if numbered:
        kept.add(targets[-1][0].resolve())
        if keep > 0:
            ours = []
            for old in ckpt_dir.glob("step_*.ckpt"):
                parsed = parse_numbered(old)
                if parsed is not None and in_lineage(*parsed, state["lineage"]):
                    ours.append((parsed[0], old))
            for _, old in sorted(ours)[:-keep]:
                if old.resolve() not in kept:
                    old.unlink(missing_ok=True)
    return last


def _unreadable(path: Path, exc: Exception) -> str:
    """Why `torch.load(weights_only=True)` refused a file, in words: what the file is, where that can be
    told (a torch zip archive or not, an exported TorchScript policy), else what the refusal says."""
    if not zipfile.is_zipfile(path):
        empty = path.stat().st_size == 0
        return "the file is empty" if empty else "not a torch file: truncated, damaged or of another kind"
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (OSError, zipfile.BadZipFile):
        return "a damaged zip archive"
    if any(name.split("/")[1:2] == ["code"] or name.endswith("/constants.pkl") for name in names):
        return "an exported TorchScript policy: load it with torch.jit.load"
    if "Unsupported global" in str(exc) or "Weights only load failed" in str(exc) and "GLOBAL" in str(exc):
        return "it holds objects that load only by running code"
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else 'unreadable'}"


def load(path: str | Path, key: str = "resume", env_state: str = "restore") -> dict[str, Any]:
    """Load a checkpoint written by `save` without running any code; raises ValueError with a one-line reason.

    `key` is the argument the user gave the path as (`resume` for training, `checkpoint` for the
    evaluate/export tools), so the message names what they typed. `env_state="restore"` refuses a
    checkpoint holding an env snapshot that this installation did not sign; `"fresh"` drops every
    snapshot (the envs then start fresh, everything else is restored).
    """
    if env_state not in ENV_STATES:
        raise ValueError(f"resume_env={env_state!r} is not one of {', '.join(ENV_STATES)}")
    path = Path(path)
    where = f"{key}={str(path)!r}"
    if path.is_dir():
        found = sorted((path / "checkpoints").glob("*.ckpt")) if (path / "checkpoints").is_dir() else []
        if not found:  # a run directory that saved none, or another folder: no file to suggest
            raise ValueError(
                f"{where} is a directory that holds no checkpoints/*.ckpt; point {key} at a .ckpt file"
            )
        # last.ckpt is the head of the run's timeline; the highest-numbered file may be a branch a resume left
        head = path / "checkpoints" / "last.ckpt"
        suggested = head if head.is_file() else max(found, key=lambda p: p.stat().st_mtime)
        raise ValueError(f"{where} is a directory; point {key} at a .ckpt file such as {suggested}")
    if not path.is_file():
        raise ValueError(f"{where}: no such checkpoint file")
    try:
        with warnings.catch_warnings():  # torch's warning that a file is a TorchScript archive: said below
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        old = _peek_format(path)
        if old is not None and old < FORMAT_VERSION:
            raise ValueError(_older_format(where, old)) from exc
        raise ValueError(f"{where}: not a readable checkpoint ({_unreadable(path, exc)})") from exc
    version = state.get("format") if isinstance(state, dict) else None
    if isinstance(version, int) and 0 < version < FORMAT_VERSION:
        raise ValueError(_older_format(where, version))
    if version != FORMAT_VERSION:
        raise ValueError(f"{where}: not a ppo-fabric checkpoint (format {FORMAT_VERSION})")
    if key == "resume" and state.get(POLICY_ONLY):
        raise ValueError(
            f"{where} holds a policy (the best one a decoupled run evaluated), not a state to resume: "
            "resume from last.ckpt or a numbered checkpoint; load this one with load_policy or evaluate"
        )
    renamed_counter(state)
    if isinstance(state.get("config"), dict):  # keys added to the package since: their defaults
        state["config"] = with_defaults(settled_eval_nulls(state["config"]))
    missing = [k for k in _REQUIRED if k not in state]
    if missing or not all(isinstance(rank, dict) for rank in state["ranks"]):
        raise ValueError(
            f"{where}: an incomplete ppo-fabric checkpoint (missing {', '.join(missing) or 'ranks'})"
        )
    for rank in state["ranks"]:
        if rank.get("envs") is None:
            continue
        if env_state == "fresh":
            rank["envs"] = None
        elif _signed_pickle(rank["envs"]) is None:
            raise ValueError(
                f"{where}: its env snapshot was not signed on this installation (another machine or key); "
                "continue with resume_env=fresh (fresh environments, everything else restored)"
            )
    return state


_REQUIRED = ("config", "observation_space", "action_space", "agent", "update", "env_step", "ranks")


def renamed_counter(state: dict[str, Any]) -> None:
    """The one migration of the update counter's names (in place): checkpoints written before it had one
    name call it `iteration` (the state), `policy_version` (a pipelined player's behaviour) and `version`
    (a self-play snapshot); today each is `update`."""
    if "iteration" in state and "update" not in state:
        state["update"] = state.pop("iteration")
    for rank in state.get("ranks") or ():
        if not isinstance(rank, dict):
            continue
        if "policy_version" in rank:
            rank["behaviour_update"] = rank.pop("policy_version")
        pool = (rank.get("selfplay") or {}).get("pool") or {}
        for snapshot in pool.get("snapshots") or ():
            if "version" in snapshot:
                snapshot["update"] = snapshot.pop("version")


def settled_eval_nulls(config: dict[str, Any]) -> dict[str, Any]:
    """`eval.every: null` and `eval.deterministic: null` in a config saved before they were refused: the run
    read them as evaluation off and as sampled actions, so they load as `0` and `false`, what the run did
    (a resume of such a run was refused until `eval.every=0` was named)."""
    evaluation = config.get("eval")
    if isinstance(evaluation, dict):
        if "every" in evaluation and evaluation["every"] is None:
            evaluation["every"] = 0
        if "deterministic" in evaluation and evaluation["deterministic"] is None:
            evaluation["deterministic"] = False
    return config


POLICY_ONLY = "policy_only"  # a checkpoint with a policy to load and no state to resume (policy_checkpoint)


def policy_checkpoint(
    state: dict[str, Any], agent: Any, env_step: int, obs_normalization: dict[str, Any] | None
) -> dict[str, Any]:
    """A policy's checkpoint cut from a run's `state`: its config and spaces, the policy's parameters
    (`agent`, as `state["agent"]` holds them) and observation statistics at `env_step`, and nothing to
    resume from (no optimizer, no env or RNG state; `load` refuses it as `resume=`). What a decoupled run
    keeps as `best.ckpt`: the parameters its evaluator scored best, which no full checkpoint holds."""
    dropped = ("agent", "optimizer", "ranks", "lr_schedule", "evaluation_policy")
    kept = {k: v for k, v in state.items() if k not in dropped}
    normalizers = {"NormalizeObservation": obs_normalization} if obs_normalization is not None else {}
    return kept | {
        "agent": agent,
        "env_step": env_step,
        "ranks": [{"normalizers": normalizers}],
        POLICY_ONLY: True,
    }


def _nonfinite(obj: Any, where: str = "") -> tuple[str, torch.Tensor] | None:
    """(dotted key path, tensor) of the first floating-point tensor in `obj` holding a NaN or an inf."""
    if isinstance(obj, (np.ndarray, np.floating)) and np.asarray(obj).dtype.kind in "fc":
        obj = torch.from_numpy(np.array(obj))  # a state not yet made plain: normaliser statistics
    if isinstance(obj, torch.Tensor):
        floating = obj.is_floating_point() or obj.is_complex()
        return (where, obj) if floating and not bool(torch.isfinite(obj).all()) else None
    if isinstance(obj, Mapping):
        if obj.get("type") == "Box" and "low" in obj:  # a stored space: unbounded is -inf/inf by design
            return None
        items: Any = obj.items()
    elif isinstance(obj, (list, tuple, deque)):
        items = enumerate(obj)
    else:
        return None  # numbers and strings: a -inf "best return so far" is a value, not a broken model
    for key, value in items:
        found = _nonfinite(value, f"{where}.{key}" if where else str(key))
        if found is not None:
            return found
    return None


def nonfinite_tensor(state: Any) -> str | None:
    """The dotted key path (e.g. `agent.actor.0.weight`, list items by index) of the first floating-point
    tensor in a checkpoint's state (nested dicts, lists, tuples) that holds a NaN or an inf, or None.

    A diverged update leaves such weights behind; a run resumed from them only produces NaNs, so
    `resume=auto` passes over such a checkpoint, and a run should refuse to write one. Not checked, being
    legitimately infinite: stored Box spaces (`space_to_data`: unbounded dimensions are -inf/inf) and plain
    numbers (e.g. an initial `-inf` best return); only tensors, and numpy arrays and scalars (the
    normalisers' statistics of a state not yet made plain), count elsewhere."""
    found = _nonfinite(state)
    return None if found is None else found[0]


def nonfinite_reason(state: Any) -> str | None:
    """`nonfinite_tensor`'s finding as the reason a person reads, e.g. `agent.actor.0.weight holds NaN`."""
    found = _nonfinite(state)
    if found is None:
        return None
    where, tensor = found
    return f"{where} holds {'NaN' if bool(torch.isnan(tensor).any()) else 'inf'}"


def _older_format(where: str, version: int) -> str:
    return (
        f"{where} was written by an older ppo-fabric (format {version}); this one reads format "
        f"{FORMAT_VERSION}, which loads without running code: start a new run or use the version that wrote it"
    )


_MEMO_OPS = ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE", "GET", "BINGET", "LONG_BINGET")


def _peek_format(path: Path) -> int | None:
    """The `format` entry of a torch file that weights_only refused, read from the pickle's opcodes without
    executing them (an older checkpoint then gets a clear message), or None."""
    try:
        with zipfile.ZipFile(path) as archive:
            name = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
            ops = itertools.islice(pickletools.genops(archive.read(name)), 24)
            args = [arg for op, arg, _ in ops if op.name not in _MEMO_OPS]  # memo indices are ints too
    except Exception:  # not a zip, no pickle, bad opcodes: nothing to tell
        return None
    return next((b for a, b in itertools.pairwise(args) if a == "format" and isinstance(b, int)), None)


def saved_spaces(state: dict[str, Any]) -> tuple[Any, Any]:
    """(observation space, action space) of a loaded checkpoint; multi-agent: dicts policy -> space."""
    obs, action = state["observation_space"], state["action_space"]
    if state.get("multiagent"):
        return {n: space_from_data(d) for n, d in obs.items()}, {
            n: space_from_data(d) for n, d in action.items()
        }
    return space_from_data(obs), space_from_data(action)


def restore_envs(snapshot: dict[str, Any] | None, fallback: Any, say: bool = True) -> Any:
    """Unpickle a saved vector env once its signature holds, or keep the freshly built one when there is
    none (async or unpicklable envs, or resume_env=fresh), which `say` warns of (one rank of a job says it
    for all). An unsigned snapshot raises ValueError unread."""
    if snapshot is None:
        if not say:
            return fallback
        warnings.warn(
            "ppo-fabric: the checkpoint holds no env state (async or unpicklable envs, envs whose pickle does not keep "
            "their state, or resume_env=fresh): episodes restart on resume",
            stacklevel=2,
        )
        return fallback
    blob = _signed_pickle(snapshot)
    if blob is None:
        raise ValueError("the env snapshot was not signed on this installation; it is never unpickled")
    # Guarded: `blob` is only non-None when its HMAC under this installation's key matched (_signed_pickle),
    # i.e. this installation wrote it; a snapshot from anywhere else never reaches this line.
    restored = pickle.loads(blob)
    if not pickle_keeps_state(restored):  # written before such envs were left out: new envs, never reset
        restored.close()
        return restore_envs(None, fallback, say)
    fallback.close()
    return restored


def resolve(path: str | Path) -> Path:
    """A checkpoint file, or a run directory standing for its `checkpoints/last.ckpt` (what users type)."""
    path = Path(path)
    last = path / "checkpoints" / "last.ckpt"
    return last if path.is_dir() and last.is_file() else path


def load_policy(path: str | Path, key: str = "checkpoint") -> tuple[dict[str, Any], Any]:
    """(checkpoint, ActorCritic in eval mode on the CPU) of a single-agent run, rebuilt from the
    checkpoint's own model config; raises ValueError (one line), also for a multi-agent checkpoint."""
    state, policies = load_policies(path, key)
    if state.get("multiagent"):
        raise ValueError(
            f"{key}={path} holds the policies of a multi-agent run ({', '.join(policies)}); this tool takes "
            "single-agent checkpoints"
        )
    return state, next(iter(policies.values()))


def load_policies(path: str | Path, key: str = "checkpoint") -> tuple[dict[str, Any], dict[str, Any]]:
    """(checkpoint, {policy name: ActorCritic in eval mode on the CPU}), each rebuilt from the checkpoint's
    own model config (a multi-agent run's per-policy overrides included), so evaluation and export need
    nothing from the run that wrote it. A single-agent run has the one policy `main`; raises ValueError."""
    from ppo_fabric.models.agent import ActorCritic

    state = load(resolve(path), key=key, env_state="fresh")  # never unpickle: no env is restored here
    obs_spaces, action_spaces = saved_spaces(state)
    if not state.get("multiagent"):
        return state, {"main": policy_from_weights(state["agent"], obs_spaces, action_spaces, state)}
    policies: dict[str, ActorCritic] = {}
    for name, weights in state["agent"].items():
        policies[name] = policy_from_weights(weights, obs_spaces[name], action_spaces[name], state, name)
    return state, policies


def policy_model_config(state: dict[str, Any], policy: str | None = None) -> Any:
    """The model config a policy of the checkpoint was built with: `model`, merged with the policy's own
    `multiagent.policies.<name>.model` overrides (as `learners.policy_specs` does)."""
    cfg = state["config"]
    model = OmegaConf.create(cfg["model"])
    own = ((cfg.get("multiagent") or {}).get("policies") or {}).get(policy or "") or {}
    return OmegaConf.merge(model, own.get("model") or {})


def policy_from_weights(
    weights: dict[str, Any],
    obs_space: Any,
    action_space: Any,
    state: dict[str, Any],
    policy: str | None = None,
) -> Any:
    """An ActorCritic (eval mode, CPU) of the checkpoint's model config loaded with `weights` (the policy's
    own, or a self-play snapshot's)."""
    from ppo_fabric.models.agent import ActorCritic

    try:
        agent = ActorCritic(obs_space, action_space, policy_model_config(state, policy))
        agent.load_state_dict(weights)
    except (
        RuntimeError,
        KeyError,
        TypeError,
    ) as exc:  # weights of another model, or a config that builds none
        which = "" if policy is None else f"policy {policy!r}: "
        # load_state_dict's message opens with "Error(s) in loading state_dict for ActorCritic:": the
        # first line that says what differs is the one worth reading
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
        first = lines[1] if len(lines) > 1 and lines[0].endswith(":") else lines[0]
        first = first if len(first) <= 200 else first[:197] + "..."
        raise ValueError(f"{which}the weights do not fit the model its config describes ({first})") from exc
    return agent.eval()


def mask_width(state: dict[str, Any], policy: str | None = None) -> int | None:
    """The action-mask width a policy was trained with (None: no masks). Single-agent checkpoints record it
    as `action_mask`; multi-agent ones as `action_masks` = {policy: width}, or else the game's own
    masks are read from a turn-based env."""
    if not state.get("multiagent"):
        return state.get("action_mask")
    if "action_masks" in state:
        return (state["action_masks"] or {}).get(policy)
    # Not recorded (a checkpoint from before the width was): a turn-based (AEC) game with algo.action_mask
    # on trained every policy with the masks of its `{"observation", "action_mask"}` observations (the only
    # multi-agent masks there are), read from the game itself, which is built only from a known env package:
    # loading never runs code a checkpoint names.
    cfg = state["config"]
    if str(cfg["algo"]["action_mask"]) == "off":
        return None
    from ppo_fabric.envs.make import foreign_module
    from ppo_fabric.games.play import aec_mask_width

    env_id = str(cfg["env"]["id"])
    if (module := foreign_module(env_id)) is not None:
        raise ValueError(
            f"this checkpoint does not record its action-mask width, and reading it from env.id={env_id!r} "
            f"would import and run module {module!r}; resume it for a few steps to write a checkpoint that does"
        )
    try:
        return aec_mask_width(env_id, dict(cfg["env"].get("kwargs") or {}))
    except ImportError as exc:
        raise ValueError(
            f"this checkpoint does not record its action-mask width, and env.id={env_id!r} cannot be built "
            f"here to read it ({exc})"
        ) from exc


def pool_snapshots(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The self-play opponent pool saved in a checkpoint, oldest first, as [{"id": int, "weights": state
    dict}, ...]. Read from `selfplay.pool.snapshots` at the top level or in the first rank's part (each
    entry's weights under `weights` or `policy`); [] when the checkpoint holds no pool."""
    holders = [state, *(state.get("ranks") or [])]
    for holder in holders:
        selfplay = holder.get("selfplay") if isinstance(holder, dict) else None
        if not isinstance(selfplay, dict):
            continue
        pool = selfplay.get("pool")
        entries = pool.get("snapshots") if isinstance(pool, dict) else pool
        if isinstance(entries, list) and entries:
            return [
                {"id": int(e.get("id", i)), "weights": e["weights"] if "weights" in e else e["policy"]}
                for i, e in enumerate(entries)
            ]
    return []


def observation_normalization(state: dict[str, Any]) -> dict[str, Any] | None:
    """The observation statistics a run normalised with (identical on every collecting rank), or None."""
    ranks = state.get("ranks") or [{}]
    return (ranks[0].get("normalizers") or {}).get("NormalizeObservation")


def run_dir_of(checkpoint: str | Path) -> Path:
    """The run directory a checkpoint belongs to: `<run>/checkpoints/x.ckpt` -> `<run>`; a checkpoint kept
    anywhere else counts its own directory as the run directory."""
    path = resolve(checkpoint).resolve()
    return path.parent.parent if path.parent.name == "checkpoints" else path.parent
