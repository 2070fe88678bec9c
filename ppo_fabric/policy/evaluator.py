"""The evaluator process a decoupled player scores its snapshots in (`policy/periodic.py` starts it)."""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ppo_fabric.compat.linux import die_with_parent
from ppo_fabric.config.faults import STOP_SIGNALS
from ppo_fabric.config.values import ConfigError
from ppo_fabric.envs.guard import EnvFault, error_line
from ppo_fabric.learn.learners import PolicySpec
from ppo_fabric.models.agent import ActorCritic
from ppo_fabric.policy.scorers import score, scorer_for
from ppo_fabric.wire.progress import PROGRESS, STACK_HOOKS

# The evaluator's scheduling priority relative to its player: evaluation is off the critical path, so on a
# machine whose cores the player and the trainer fill, it runs in their idle moments (their waits for data
# and parameters) instead of taking time slices from them; alone on a core, it runs as fast as before.
EVALUATOR_NICE = 19
STACKS_SIGNAL = signal.SIGUSR2  # the evaluator writes its stacks (faulthandler) to its file on this signal


class EvaluatorProcess:
    """A process that scores the parameters it is sent with a scorer of its own (`scorer_for`), so that a
    decoupled player's evaluation takes neither its time nor its interpreter's lock: on 2 cores a thread
    cost the pipelined CartPole run ~20% of its SPS, more than evaluating in place (~14%), as the episodes'
    Python and the rollout's fought over the GIL (`benchmarks/results/eval_cost_pipelined.md`).

    Forked where the platform allows it (Linux: nothing to import again; it never touches the parent's
    devices or envs), spawned elsewhere. It ignores SIGINT and SIGTERM (the player that owns it stops it
    at its own boundary) and ends when its pipe closes. It never outlives the player, even stuck in an env
    that never returns: it is killed when the player dies (`_watch`). A fault in it (a failing
    env) comes back as its one line, raised by `result` as `EnvFault`.
    """

    def __init__(self, cfg: DictConfig, specs: dict[str, PolicySpec], seed: int) -> None:
        methods = multiprocessing.get_all_start_methods()
        context = multiprocessing.get_context(
            "fork" if sys.platform == "linux" and "fork" in methods else "spawn"
        )
        self.conn, child = context.Pipe()
        self.beat = context.Value("d", 0.0, lock=False)  # the evaluator's last progress (`_watch`)
        config = OmegaConf.to_container(cfg, resolve=True)
        # Where the evaluator writes its stacks when asked (`write_stacks`): a forked one writes to this
        # descriptor, whose file is unlinked at once (nothing is left behind, however the run ends); a
        # spawned one opens the file by its name.
        self.stacks_fd, path = tempfile.mkstemp(prefix="ppo-fabric-evaluator-", suffix=".stacks")
        self.forked = context.get_start_method() == "fork"
        self.stacks_path = None if self.forked else Path(path)
        if self.forked:
            os.unlink(path)
        self.process = context.Process(
            target=_serve,
            args=(
                child,
                config,
                specs,
                seed,
                os.getpid(),
                self.beat,
                self.stacks_fd if self.forked else path,
            ),
            name="ppo-fabric-evaluator",
            daemon=True,
        )
        self.process.start()
        child.close()
        STACK_HOOKS.append(self.write_stacks)

    def write_stacks(self, target: Path) -> None:
        """The evaluator's stacks into the stall directory `target` (`<label>-evaluator.stacks`, beside
        the ranks' own files): an evaluation env that never returns is named by its player's watchdog,
        and this shows where it is stuck."""
        if not self.process.is_alive() or self.process.pid is None:
            return
        size = os.fstat(self.stacks_fd).st_size
        os.kill(self.process.pid, STACKS_SIGNAL)
        deadline = time.monotonic() + 2.0
        while os.fstat(self.stacks_fd).st_size == size and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.1)  # the rest of the dump (every thread)
        end = os.fstat(self.stacks_fd).st_size
        if end > size:  # nothing written (not started yet, or past its last moment): no file
            label = PROGRESS.label.replace(" ", "-")
            (target / f"{label}-evaluator.stacks").write_bytes(os.pread(self.stacks_fd, end - size, size))

    def submit(self, weights: dict[str, dict[str, Any]], obs_normalization: dict[str, Any] | None) -> None:
        self.conn.send((weights, obs_normalization))

    def ready(self) -> bool:
        return self.conn.poll()

    def result(self) -> tuple[dict[str, float], float]:
        """(metrics, seconds) of the evaluation submitted last, waiting for it (the stall watchdog names this
        wait when the evaluation never ends)."""
        beat = None
        while not self.conn.poll(0.5) and self.process.is_alive():
            if self.beat.value != beat:  # its episodes move, so does this wait; a stuck env stops both
                beat = self.beat.value
                PROGRESS.mark("waiting for the evaluation process")
        try:
            kind, value = self.conn.recv()
        except EOFError:
            self.process.join(5)
            raise EnvFault(
                f"the evaluation process ended without a result (exit code {self.process.exitcode})"
            ) from None
        if kind == "fault":
            raise EnvFault(value)
        return value

    def close(self, patience_s: float = 10.0) -> None:
        """End the process: asked to leave, then killed after `patience_s` (0: an evaluation still running,
        given up at a stop)."""
        with contextlib.suppress(ValueError):
            STACK_HOOKS.remove(self.write_stacks)
        with contextlib.suppress(OSError):  # it may have gone already
            self.conn.send(None)
        self.process.join(patience_s)
        if self.process.is_alive():  # stuck in an env: it holds nothing to keep
            self.process.kill()
            self.process.join()
        self.conn.close()
        os.close(self.stacks_fd)
        if self.stacks_path is not None:
            self.stacks_path.unlink(missing_ok=True)


def _watch(parent: int, beat: Any) -> None:
    """In the evaluator: end this process when the player that started it is gone (killed by the launcher
    after a fault, say) while an env here never returns: on Linux the kernel's parent-death signal (SIGKILL,
    whatever this process is doing), elsewhere a daemon thread that watches the parent's pid. The same
    thread copies this process's progress (the evaluation envs' steps) into `beat` for the player's wait."""
    if not die_with_parent(parent):
        os._exit(0)

    def watch() -> None:
        while os.getppid() == parent:
            beat.value = PROGRESS.at
            time.sleep(0.25)
        os._exit(0)

    threading.Thread(target=watch, name="ppo-fabric-evaluator-watch", daemon=True).start()


def _serve(
    conn: Any,
    config: dict[str, Any],
    specs: dict[str, PolicySpec],
    seed: int,
    parent: int,
    beat: Any,
    stacks: int | str,
) -> None:
    """The evaluator process: score each (weights, statistics) received until None or the pipe closes."""
    # first: the signal's default action ends the process, and the player may ask for stacks at any time
    stacks_file = stacks if isinstance(stacks, int) else os.open(stacks, os.O_WRONLY | os.O_APPEND)
    faulthandler.register(STACKS_SIGNAL, file=stacks_file, all_threads=True)
    import torch

    _watch(parent, beat)
    for signum in STOP_SIGNALS:
        if signum != STACKS_SIGNAL:
            signal.signal(signum, signal.SIG_IGN)
    torch.set_num_threads(1)
    with contextlib.suppress(OSError, AttributeError):  # no os.nice (Windows) or not allowed: as it is
        os.nice(EVALUATOR_NICE)
    scorer = None
    try:
        scorer = scorer_for(OmegaConf.create(config), specs, seed)
        models = {n: ActorCritic(s.obs_space, s.action_space, s.model) for n, s in specs.items()}
        while (message := conn.recv()) is not None:
            weights, obs_normalization = message
            for name, state in weights.items():
                models[name].load_state_dict(state)
            start = time.perf_counter()
            metrics = score(scorer, models, obs_normalization)
            conn.send(("ok", (metrics, time.perf_counter() - start)))
    except EOFError:  # the player has gone
        pass
    except Exception as exc:  # noqa: BLE001 - handed to the player as its one line
        line = (
            str(exc)
            if isinstance(exc, EnvFault | ConfigError)
            else f"{type(exc).__name__}: {error_line(exc)}"
        )
        with contextlib.suppress(OSError):
            conn.send(("fault", f"evaluation: {line}" if not line.startswith("evaluation") else line))
    finally:
        if scorer is not None:
            scorer.close()
