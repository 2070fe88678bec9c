"""Start a run from a checked config: build Fabric, launch (or join) the processes, seed, run the strategy's
`main` on every rank, turn a rank's failure into one line, and leave the process cleanly.

Strategies hand their own `main` in (`run_script` under `fabric run`, `cli` for `python -m ppo_fabric`),
so this module never imports a strategy and no strategy imports the command line.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import random
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
from lightning_fabric import Fabric
from lightning_fabric.plugins.precision import MixedPrecision
from lightning_fabric.strategies import DDPStrategy
from lightning_fabric.utilities.seed import seed_everything
from omegaconf import DictConfig, OmegaConf
from threadpoolctl import threadpool_limits
from torch.nn.parallel import DistributedDataParallel

from ppo_fabric.app.preflight import prepare
from ppo_fabric.app.process import (
    QUIETED_LOGGERS,
    end_process,
    quiet_libraries,
    stop_status,
    stops_reach_blocking_waits,
)
from ppo_fabric.app.supervisor import SUPERVISED_ENV
from ppo_fabric.compat.private import launched_processes, set_fabric_precision
from ppo_fabric.config.arguments import fail
from ppo_fabric.config.faults import FAULT_EXIT, RunComplete, RunFault, fault_status
from ppo_fabric.config.values import ConfigError, composer, under_fabric_run
from ppo_fabric.envs.make import end_env_workers, rank_seed, trust_override
from ppo_fabric.learn.accel import set_cuda_math
from ppo_fabric.models.agent import float32_default
from ppo_fabric.runs import deadman
from ppo_fabric.runs import lock as run_lock
from ppo_fabric.runs.continuation import describe
from ppo_fabric.runs.metrics import close_after_failure
from ppo_fabric.runs.session import STOP, Stopped
from ppo_fabric.runs.watchdog import Stalled, Watchdog
from ppo_fabric.wire.placement import small_model_warning
from ppo_fabric.wire.progress import PROGRESS
from ppo_fabric.wire.protocol import end_process_group

StrategyMain = Callable[[Fabric, DictConfig, Path], dict[str, Any]]
# The mixed precisions by every name a job may be given them: `fabric run --precision` also takes
# Lightning's short aliases, which reach the processes as they were typed (LT_PRECISION).
MIXED_PRECISIONS = {
    "16-mixed": "16-mixed",
    "16": "16-mixed",
    "bf16-mixed": "bf16-mixed",
    "bf16": "bf16-mixed",
}


class GroupDDPStrategy(DDPStrategy):
    """Fabric's DDP for the decoupled strategy: every process launched on the CPU (gloo), each taking its
    role's device after launch, and DDP over a sub-group of the job (the trainers).

    Fabric has one accelerator per job (`Fabric(accelerator="cuda", devices=3)` on one GPU raises, and DDP
    over mixed CPU/CUDA devices fails), so the job is a CPU job and a trainer moves to its GPU with
    `take_device`: `fabric.device` and tensors' `fabric.to_device` then use it, and mixed precision
    autocasts on that device. Modules are moved with `.to(fabric.device)` and set up with
    `move_to_device=False`: Fabric's own module move asks the job's (CPU) accelerator, which refuses CUDA.
    Players never join the group. A group of one trainer gets no DDP wrapper at all: it has nothing to
    synchronise, and DDP's forward/backward hooks would still cost ~120 us per minibatch step.
    """

    def __init__(self, timeout: datetime.timedelta, start_method: str = "popen", **ddp_kwargs: Any) -> None:
        super().__init__(timeout=timeout, start_method=start_method, **ddp_kwargs)
        self.module_group: Any = None
        self.module_group_size = 0
        self.role_device: torch.device | None = None
        self.ddp_kwargs = ddp_kwargs  # what DistributedDataParallel gets, as DDPStrategy passes them on

    @property
    def root_device(self) -> torch.device:
        return self.role_device if self.role_device is not None else super().root_device

    def take_device(self, fabric: Fabric, device: torch.device, precision: str) -> None:
        """Work on `device` from now on (before any model is set up); `precision` is the job's
        `fabric.precision`, whose autocast follows the device (Fabric built it for the CPU)."""
        self.role_device = device
        if device.type == "cuda":
            torch.cuda.set_device(device)
            mixed = MIXED_PRECISIONS.get(str(precision))
            if mixed is not None:
                plugin = MixedPrecision(mixed, "cuda")  # type: ignore[arg-type]
                self.precision = plugin
                set_fabric_precision(fabric, plugin)  # Fabric keeps its own reference too

    def use_group(self, group: Any, size: int) -> None:
        self.module_group, self.module_group_size = group, size

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.module_group is None:
            return super().setup_module(module)
        if self.module_group_size == 1:
            return module
        device = self.root_device
        device_ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(
            module, device_ids=device_ids, process_group=self.module_group, **self.ddp_kwargs
        )


def describe_failure(exc: BaseException) -> str:
    """One line for a rank's failure; a broken collective means another rank died first."""
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    if peer_gone(exc) or timed_out(exc):
        return f"lost contact with another rank (it failed, was killed, or is stuck): {text}"
    return text


def peer_gone(exc: BaseException) -> bool:
    """Whether a collective broke because another process of the job ended (its sockets closed): this
    rank's failure is a consequence, and the cause is that process's (its own line, or a kill)."""
    text = f"{type(exc).__name__}: {exc}"
    gone = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
    return any(marker in text for marker in gone) or (
        type(exc).__name__ == "DistBackendError" and not timed_out(exc)
    )


def build_fabric(cfg: DictConfig, world_size: int) -> Fabric:
    """Fabric for the config. A decoupled job is a CPU job whatever `fabric.accelerator` says: each role
    takes its device after launch (GroupDDPStrategy.take_device), so players on the CPU and trainers on
    GPUs share one job, and the players <-> trainers messages go over gloo."""
    timeout = datetime.timedelta(seconds=float(cfg.collectives.timeout))
    under_cli = under_fabric_run()
    decoupled = cfg.strategy == "decoupled"
    kwargs: dict[str, Any] = {}
    if not under_cli:  # `fabric run` flags decide these, and passing others would conflict
        kwargs = {
            "accelerator": "cpu" if decoupled else cfg.fabric.accelerator,
            "devices": int(cfg.fabric.devices),
            "num_nodes": int(cfg.fabric.num_nodes),
            "precision": cfg.fabric.precision,
        }
    # `fabric run --strategy=...` reaches Fabric only as LT_STRATEGY, which wins over a strategy passed in.
    # For DDP (named or chosen by "auto") the job builds its own, so that its collectives wait
    # `collectives.timeout` and not Lightning's 30 minutes: the variable is out of the way while it does.
    cli_strategy = os.environ.get("LT_STRATEGY") if under_cli else None
    if world_size > 1 and cfg.fabric.strategy in ("auto", "ddp") and cli_strategy in (None, "auto", "ddp"):
        ddp = GroupDDPStrategy if decoupled else DDPStrategy
        kwargs["strategy"] = ddp(timeout=timeout, start_method="popen")
    elif not under_cli:
        kwargs["strategy"] = cfg.fabric.strategy
    hidden = {"LT_STRATEGY": None} if cli_strategy is not None and "strategy" in kwargs else {}
    # Under `fabric run` the processes exist already and Fabric reads the accelerator from LT_ACCELERATOR
    # (passing another one raises), so a decoupled job swaps it for "cpu" while Fabric is built, and only
    # then: `algo.trainer_device=auto` goes on reading `fabric run --accelerator` (config.requested), as
    # the checks before launch did. Left at "cpu", `--accelerator=cuda` would put the trainers on the CPU.
    swapped = {"LT_ACCELERATOR": "cpu"} if under_cli and decoupled else {}
    with environment_variables({**hidden, **swapped}):
        return Fabric(**kwargs)


@contextlib.contextmanager
def environment_variables(values: dict[str, str | None]) -> Iterator[None]:
    """Each `name=value` in this process's environment for the block (None: unset); their previous values
    (or absence) after."""
    before = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def set_threads(threads: int) -> None:
    """`torch_threads` for torch's intra-op pool and for NumPy's BLAS, which the NumPy rollout actor calls:
    OpenBLAS would otherwise give a large actor's matmuls (256 x 256 and up) a thread per core in every
    process, and processes sharing a node would oversubscribe its cores."""
    torch.set_num_threads(threads)
    threadpool_limits(threads, user_api="blas")


# A process still waiting for the job's others after this long (or a quarter of collectives.timeout, if
# sooner) says so, once.
MEETING_NOTICE_S = 30.0


def meeting_notice(cfg: DictConfig, world_size: int) -> threading.Timer:
    """A timer that, unless cancelled first, prints one line saying what this process waits for: each
    node's first process of a multi-node job waited for missing peers (a node whose command was never
    started, or was refused) in silence until `collectives.timeout` (180 s by default). One node's job
    starts its own processes, which a loaded machine may take a while to import: no line there."""

    nodes = int(cfg.fabric.num_nodes)

    def say() -> None:
        where = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '?')}"
        hint = f"each of the {nodes} nodes runs the command with its NODE_RANK (0-{nodes - 1})"
        os.write(2, f"ppo-fabric: waiting for the job's {world_size} processes to meet at {where}; {hint}; "
                    f"giving up after collectives.timeout={float(cfg.collectives.timeout):g} s\n".encode())  # fmt: skip

    timer = threading.Timer(min(MEETING_NOTICE_S, float(cfg.collectives.timeout) / 4), say)
    timer.daemon = True
    if nodes > 1 and (os.environ.get("LOCAL_RANK") or "0") == "0":
        timer.start()
    return timer


@contextlib.contextmanager
def no_silent_exit() -> Iterator[None]:
    """A `sys.exit()` or `sys.exit(0)` from code the run calls (an env, a wrapper, a callback) as the
    `RunFault` it is: it ended the run with exit 0 and no line, as if it had finished. The package's own
    exits carry a non-zero status, and a stop is `Stopped`."""
    try:
        yield
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        raise RunFault(
            f"sys.exit({'' if exc.code is None else exc.code}) was called during the run, at "
            f"{Path(frame.filename).name}:{frame.lineno} (in {frame.name}): the run did not finish"
        ) from None


def launch(
    cfg: DictConfig,
    run_dir_template: str,
    facts: dict[str, Any],
    main: StrategyMain,
    caller_owns_process: bool = False,
) -> dict[str, Any]:
    """Start the processes and run `main` on each; returns this rank's summary. `caller_owns_process`
    (`ppo_fabric.run()` from a script or notebook): a one-process run stopped by a signal raises, after its
    stop checkpoint, KeyboardInterrupt (SIGINT) or SystemExit(128 + N) (SIGTERM, SIGHUP, SIGUSR1/2) into the
    caller, whose `except` and `finally` then run, instead of ending the interpreter."""
    fabric = build_fabric(cfg, facts["world_size"])
    set_cuda_math(bool(cfg.fabric.tf32))  # process-wide; a no-op without CUDA
    own = Path(run_dir_template).resolve()
    notice = meeting_notice(cfg, fabric.world_size)
    meeting = stops_reach_blocking_waits() if fabric.world_size > 1 else contextlib.nullcontext()
    try:
        with meeting:
            if not under_fabric_run():  # under `fabric run` the processes exist and are set up already
                fabric.launch()
            # Every process composed the config itself (at its own time); rank 0's run directory wins.
            run_dir = Path(fabric.broadcast(str(own), src=0))
        notice.cancel()
    except Exception as exc:
        notice.cancel()
        if fabric.world_size == 1 or not timed_out(exc):
            raise
        text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
        os.write(
            2,
            f"ppo-fabric: error: the job's {fabric.world_size} processes did not all meet within "
            f"collectives.timeout={float(cfg.collectives.timeout):g} s ({text}); a machine that starts "
            "processes slowly needs a longer timeout\n".encode(),
        )
        os._exit(FAULT_EXIT)
    if own != run_dir:  # Hydra made this rank's own (timestamped) output directory: leave none behind
        with contextlib.suppress(OSError):
            own.rmdir()
    # One run per directory: rank 0 locks it (a supervised job's supervisor holds it already), every rank
    # raises rank 0's refusal; released when `main` ends, however it ends (before any os._exit below).
    held = run_lock.hold_for_ranks(fabric, run_dir, take=not os.environ.get(SUPERVISED_ENV))
    said = list(facts.get("warnings", []))  # the checks' (`preflight.check`)
    if "parameters" in facts:
        said.append(small_model_warning(int(facts["parameters"]), str(facts["train_device"])))
    for warning in said:
        if warning is not None and fabric.global_rank == 0:
            os.write(2, f"ppo-fabric: {warning}\n".encode())
    if fabric.global_rank == 0:
        print(opening_lines(cfg, facts.get("resume_changes"), facts.get("on_top", [])), flush=True)
    seed_everything(rank_seed(int(cfg.seed), fabric.global_rank), verbose=False)
    PROGRESS.label = f"rank {fabric.global_rank}"  # the decoupled strategy names the role too
    stall_s = float(cfg.stall_timeout or 0)
    watchdog = Watchdog(run_dir, stall_s, fabric.world_size)
    if caller_owns_process and fabric.world_size == 1 and stall_s > 0:
        watchdog.interrupting()  # a stall raised to the caller: a notebook's kernel lives on
    watchdog.start()
    try:
        with STOP.installed(), held, no_silent_exit():
            summary = main(fabric, cfg, run_dir)
    except Stalled as stall:
        watchdog.stop()
        end_env_workers()
        close_after_failure()
        raise RunFault(str(stall)) from None
    except Stopped as stop:
        if fabric.global_rank == 0:
            hint = stop.continuation(run_dir, OmegaConf.select(cfg, "env.id"))
            os.write(2, f"ppo-fabric: {stop}; {hint}\n".encode())
        if caller_owns_process and fabric.world_size == 1:  # ppo_fabric.run(): the caller's to end
            watchdog.stop()
            if stop.signum == signal.SIGINT:
                raise KeyboardInterrupt(str(stop)) from stop
            raise SystemExit(stop_status(stop.signum)) from stop
        watchdog.stop()
        end_process(stop_status(stop.signum))
    except KeyboardInterrupt:
        if fabric.global_rank == 0:
            last = run_dir / "checkpoints" / "last.ckpt"
            named = trust_override(OmegaConf.select(cfg, "env.id"))
            hint = f"; continue with resume={last}{named}" if last.exists() else ""
            os.write(2, f"ppo-fabric: interrupted{hint}\n".encode())
        if caller_owns_process and fabric.world_size == 1:
            watchdog.stop()
            raise
        watchdog.stop()
        os._exit(130)
    except Exception as exc:
        watchdog.stop()
        end_env_workers()  # not left to print tracebacks when they find their pipes closed
        close_after_failure()  # the records so far reach the tracker, whose run ends as failed
        if fabric.world_size == 1:
            raise  # the command line (or the caller of ppo_fabric.run) reports it
        if os.environ.get("PPO_FABRIC_TRACEBACK"):
            traceback.print_exc()
        hung = deadman.report(run_dir) if peer_gone(exc) and not watchdog.cause_said() else None
        if hung is not None:  # the peer was ended by its hang timer (C code held its interpreter lock)
            os.write(2, f"ppo-fabric: error: {hung}\n".encode())
            watchdog.spoke()
            watchdog.leave(FAULT_EXIT)
        ended = ended_peer(fabric) if peer_gone(exc) and not watchdog.cause_said() else None
        if ended is not None:  # a rank this process launched ended without a line: named, its status kept
            rank, code = ended
            os.write(2, f"ppo-fabric: error: {ended_line(rank, code, PROGRESS.label)}\n".encode())
            watchdog.spoke()
            watchdog.leave(128 - code if code < 0 else FAULT_EXIT)
        # one write per line: ranks failing together must not interleave their messages
        limit = f"collectives.timeout={float(cfg.collectives.timeout):g} s"
        if "update boundary" in PROGRESS.doing:  # the wait for rank 0's evaluation allows stall_timeout more
            waited = float(cfg.collectives.timeout) + float(cfg.stall_timeout or 0)
            limit = f"collectives.timeout + stall_timeout = {waited:g} s at the update boundary"
        line = failure_line(exc, watchdog, limit)
        if line is not None and peer_gone(exc) and (watchdog.cause_said() or watchdog.loss_said()):
            line = None  # the rank that ended first said why (or another said it was lost); this one only lost it
        if line is not None:
            os.write(2, f"ppo-fabric: error: {line}\n".encode())
            # the processes that answered a claim of this rank's may leave now; a lost peer is no cause:
            # the rank that launched the one that ended may still name it (`ended_peer`)
            watchdog.spoke(cause=not peer_gone(exc))
        # A rank that only lost a peer leaves no cause for the supervisor: when rank 0 was killed (kill -9,
        # the OOM killer), the job's status stays 137. No atexit hooks: peers may be stuck in a collective.
        watchdog.leave(FAULT_EXIT if peer_gone(exc) else fault_status(run_dir, line))
    watchdog.stop()
    end_process_group()
    return summary


SHOWN_ON_TOP = 4  # the opening line names this many values the command line sets over the tuned ones


def set_on_top(overrides: list[str] | None) -> list[str]:
    """The command line's `algo.`, `env.` and `model.` values (`env.id` aside): what it sets over the tuned
    values the opening line names (a run told "tuned values for CartPole-v1" trained with the user's own
    rollout and minibatch sizes)."""
    keys = []
    for override in overrides or []:
        key = override.split("=", 1)[0].lstrip("+~")
        if (
            "=" in override
            and "." in key
            and key.split(".", 1)[0] in ("algo", "env", "model")
            and key != "env.id"
        ):
            keys.append(override.lstrip("+~"))
    return list(dict.fromkeys(keys))


def opening_lines(
    cfg: DictConfig, changes: dict[str, tuple[Any, Any]] | None, on_top: list[str] | None = None
) -> str:
    """The run's first line: the env and whose values it trains with (`tuning`, conf/tuned.yaml), and the
    command line's own values over them (`set_on_top`); for a resumed run, a second one: where it
    continues from and what this session changes."""
    tuning = cfg.get("tuning") or ("its saved config" if changes is not None else "the composed config")
    if changes is not None:  # the run's own note, of the command line it started with, not this one's
        tuning = str(tuning).replace("on the command line", "on its first command line")
    if on_top and changes is None:
        shown = ", ".join(on_top[:SHOWN_ON_TOP])
        more = f" and {len(on_top) - SHOWN_ON_TOP} more" if len(on_top) > SHOWN_ON_TOP else ""
        tuning = f"{tuning}, and from the command line {shown}{more}"
    lines = [f"ppo-fabric: {cfg.env.id} with {tuning} ({cfg.strategy})"]
    if changes is not None:
        changed = f"; changed: {describe(changes)}" if changes else "; nothing changed"
        lines.append(f"ppo-fabric: continuing from {cfg.resume}{changed}")
    return "\n".join(lines)


def failure_line(exc: BaseException, watchdog: Watchdog, limit: str) -> str | None:
    """The line a rank of a multi-process job ends with: a fault's own line (which names its rank), a
    collective that timed out as the stuck rank it waited for (every process's stacks in the run
    directory; None when another rank already reports it), anything else as this rank's error."""
    if isinstance(exc, RunFault):
        text = str(exc)
        return (
            text if text.split(":")[0].split(",")[0].endswith(PROGRESS.label) else f"{PROGRESS.label}: {text}"
        )
    text = describe_failure(exc)
    if timed_out(exc):
        return watchdog.collective_timeout(f"its wait outlasted {limit}")
    return f"{PROGRESS.label}: {text}"


def ended_peer(fabric: Fabric, wait_s: float = 2.0) -> tuple[int, int] | None:
    """(global rank, return code: -N for signal N) of a rank this process launched that has ended with a
    failure, looked for up to `wait_s` (its exit may reach its parent just after its sockets closed);
    None when none has. Called when no process said the job's cause: a signal (kill -9, the OOM killer)
    or a C library's `exit()` leaves no line, and the peers see only a closed connection. Without this
    the job's line blamed the rank that lost contact, and a killed rank's job ended 1, not 137."""
    procs = launched_processes(fabric)
    deadline = time.monotonic() + wait_s
    while procs:
        codes = [(local_rank, proc.poll()) for local_rank, proc in enumerate(procs, start=1)]
        # a signal's first; exit 1 is a rank's own failure after its line (a peer it lost, or its cause)
        ended = sorted(
            (code, local) for local, code in codes if code is not None and code not in (0, FAULT_EXIT)
        )
        if ended:
            code, local_rank = ended[0]
            return fabric.global_rank + local_rank, code
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    return None


def ended_line(rank: int, code: int, label: str) -> str:
    if code > 0:
        return (
            f"rank {rank} ended with exit status {code} and no line of its own; {label} lost contact with it"
        )
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    cause = " (the out-of-memory killer, or kill -9)" if -code == signal.SIGKILL else ""
    return f"rank {rank} was killed by {name}{cause}; {label} lost contact with it"


def timed_out(exc: BaseException) -> bool:
    """Whether a collective gave up waiting (gloo and NCCL say so in their messages)."""
    text = f"{type(exc).__name__}: {exc}"
    return "timed out" in text.lower() or "timeout" in text.lower()


@contextlib.contextmanager
def callers_process_kept() -> Iterator[None]:
    """`ppo_fabric.run()` trains in its caller's process (a notebook, a script that goes on with work of its
    own): what a run sets process-wide for itself is put back as it was when the run returns or raises.
    torch's and BLAS's thread counts first (`torch_threads=1` by default: the caller's own torch and NumPy
    work ran on one core after the run), the global random generators the run seeds (a random search
    drawing its trials' values between runs drew the same values again after each run of one seed), the
    default dtype (float32 for the run), the CUDA math flags, the warnings' format and filters, and
    Lightning's log levels (`quiet_libraries`) and seed variables."""
    rngs = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda_rngs = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    variables = {name: os.environ.get(name) for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")}
    threads = torch.get_num_threads()
    blas = threadpool_limits(limits=None, user_api="blas")  # records the limits, changes nothing
    cuda = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.benchmark,
    )
    levels = {name: logging.getLogger(name).level for name in QUIETED_LOGGERS}
    formatwarning = warnings.formatwarning
    try:
        with warnings.catch_warnings(), float32_default():  # the filters and the default dtype, as they were
            yield
    finally:
        torch.set_num_threads(threads)
        blas.restore_original_limits()
        (
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32,
            torch.backends.cudnn.benchmark,
        ) = cuda
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        warnings.formatwarning = formatwarning
        random.setstate(rngs[0])
        np.random.set_state(rngs[1])
        torch.random.set_rng_state(rngs[2])
        if cuda_rngs is not None:
            torch.cuda.set_rng_state_all(cuda_rngs)
        for name, value in variables.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def train(
    cfg: DictConfig,
    strategy: Callable[[DictConfig], StrategyMain],
    run_dir: str | Path | None = None,
    overrides: list[str] | None = None,
    *,
    python_api: bool = False,
) -> dict[str, Any]:
    """The one way a run starts, whatever started it (the Hydra app's job, `ppo_fabric.run([...])`, each
    rank under `fabric run`): check the composed config for `run_dir` (default: the Hydra run's output
    directory), then launch the `main` that `strategy` gives for it; returns this rank's summary. The
    strategy is chosen after the checks: a resume continues the checkpoint's config, its strategy
    included (a decoupled run resumed without `strategy=decoupled` trained on as coupled). `overrides`: the command line `cfg` was
    composed from (default: the running Hydra app's), which is all a resume may change of the run's own
    config. `python_api`: called by `ppo_fabric.run()`, never the Hydra app's job, even where Hydra's
    global config is still set (a Hydra app that ran earlier in the process). Raises
    `ConfigError` before anything starts, `RunComplete` for a finished `resume=auto` run.
    """
    quiet_libraries()
    # Before the checks, which build the env and the model: every process of a job runs them, and each
    # taking every core for them (the model's orthogonal init and probe forward) oversubscribes the node.
    # Fifteen processes on 16 cores spent ~100 s there before any training.
    torch_default = torch.get_num_threads()  # what torch_threads=0 leaves it at
    if int(cfg.torch_threads) > 0:
        set_threads(int(cfg.torch_threads))
    from hydra.core.hydra_config import HydraConfig

    in_app = not python_api and HydraConfig.initialized()
    if run_dir is None:
        run_dir = HydraConfig.get().runtime.output_dir
    if overrides is None and in_app:
        overrides = list(HydraConfig.get().overrides.task)
    name = str(HydraConfig.get().job.config_name) if in_app else "config"
    threads = int(cfg.torch_threads)
    facts = prepare(cfg, str(run_dir), overrides, composer(None, name))
    facts["on_top"] = set_on_top(overrides)
    if int(cfg.torch_threads) != threads:  # a resume's own, restored (0: torch's choice)
        set_threads(int(cfg.torch_threads) or torch_default)
    if not in_app and int(facts["world_size"]) > 1 and not under_fabric_run():
        raise NeedsProcesses(int(facts["world_size"]))  # a resume's own layout: `ppo_fabric.run` starts a job
    return launch(cfg, str(run_dir), facts, strategy(cfg), caller_owns_process=not in_app)


class NeedsProcesses(Exception):
    """`ppo_fabric.run()` of a config that turned out, once its checks restored a resumed run's own config,
    to need several processes: the caller runs it as a job of its own (`cli._run_processes`), since
    Lightning would start the other ranks by running the calling script again."""


def run_script(strategy: str, main: StrategyMain) -> NoReturn:
    """`fabric run ppo_fabric/<strategy file>.py [Hydra flags] [overrides]`: the file fixes the strategy."""
    from ppo_fabric.app.hydra_app import run_app

    args = sys.argv[1:]
    given = [a.split("=", 1)[1] for a in args if a.startswith("strategy=")]
    if given and given[-1] != strategy:
        fail(f"strategy={given[-1]} conflicts with the launched file, which runs strategy={strategy}")

    def this_file(cfg: DictConfig) -> StrategyMain:
        if cfg.strategy != strategy:  # a resume's own config: the checkpoint's strategy
            raise ConfigError(
                f"resume={cfg.resume} continues a strategy={cfg.strategy} run; launch "
                f"ppo_fabric/{'ppo_decoupled' if cfg.strategy == 'decoupled' else 'ppo'}.py"
            )
        return main

    def task(cfg: DictConfig, _: Any) -> int:
        try:
            train(cfg, this_file)
        except ConfigError as exc:
            fail(str(exc))
        except RunComplete as done:  # every rank finds it; rank 0 says it
            if int(os.environ.get("RANK", "0") or 0) == 0:
                os.write(2, f"ppo-fabric: {done}\n".encode())
            return 0
        except RunFault as fault:  # a 1-process job: its cause in one line
            os.write(2, f"ppo-fabric: error: {fault}\n".encode())
            return FAULT_EXIT
        return 0

    # The file names the strategy of a new run; a resume continues its checkpoint's (`this_file` refuses
    # the other's in one line: given as an override, it read as a change to the run's experiment)
    resumed = [a.split("=", 1)[1] for a in args if a.startswith("resume=")]
    args = [a for a in args if not a.startswith("strategy=")]
    if not resumed or resumed[-1] in ("auto", "null", "None", ""):
        args.append(f"strategy={strategy}")
    end_process(run_app(args, task).status)
