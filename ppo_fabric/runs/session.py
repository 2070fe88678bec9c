"""What a run owns whatever its strategy: the run directory, logging and progress, the checkpoint rule,
each collecting rank's part of a checkpoint, episode statistics, summary.json and the final line.

A strategy builds one `RunSession` per process and tells it what happened (a log row, an update that
finished, the end); the session decides what to write and where. Only the writing rank (global rank 0)
touches the disk; every other rank goes through the same calls, so the strategies never branch on the
rank for bookkeeping.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import torch
from omegaconf import DictConfig, OmegaConf

from ppo_fabric.collect.rollout import WINDOW, RolloutCollector
from ppo_fabric.compat.linux import drop_hung_up_terminal
from ppo_fabric.config.faults import SIGNAL_REPEAT_S, STOP_SIGNALS, RunFault
from ppo_fabric.envs.make import trust_override
from ppo_fabric.envs.multiagent import SINGLE
from ppo_fabric.learn.learners import PolicySpec, metric_name
from ppo_fabric.learn.schedule import LrSchedule
from ppo_fabric.runs import checkpoint as ckpt
from ppo_fabric.runs import deadman
from ppo_fabric.runs.continuation import config_differences, record_session
from ppo_fabric.runs.metrics import (
    RunLogger,
    Stopwatch,
    episode_means,
    episode_sums,
    final_mean_return,
    recent_episodes,
    save_resolved_config,
)
from ppo_fabric.runs.metrics_file import write_json
from ppo_fabric.runs.plots import save_learning_curve
from ppo_fabric.wire.progress import PROGRESS

Reduce = Callable[[torch.Tensor], torch.Tensor]


class Stopped(Exception):  # noqa: N818 - a stop asked for, not an error
    """The run stopped at an update boundary on a stop signal (`STOP_SIGNALS`), after writing a checkpoint
    every rank agrees on."""

    def __init__(self, signum: int, env_step: int, checkpoint: Path | None) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} at {env_step:,} env steps")
        self.signum, self.env_step, self.checkpoint = signum, env_step, checkpoint

    def continuation(self, run_dir: Path, env_id: str | None = None) -> str:
        """How to go on: the checkpoint that holds the run's state now (`resume=auto` in `run_dir` finds it
        only when it is that directory's `last.ckpt`), with the env id a module env's resume must name; a
        fresh run stopped before its first checkpoint has none."""
        if self.checkpoint is None:
            return "no checkpoint was written before it: run the command again to start over"
        named = trust_override(env_id)
        hint = f"continue with resume={self.checkpoint}{named}"
        if self.checkpoint == run_dir / "checkpoints" / "last.ckpt":
            hint += f" (or resume=auto hydra.run.dir={run_dir}{named})"
        return hint


class CheckpointFault(RunFault):
    """A checkpoint that must not or could not be written; the files already there are left as they were."""


class AbandonEvaluation(BaseException):  # noqa: N818 - a stop asked for during an evaluation, not an error
    """Raised by the stop signal's handler inside `StopSignals.abandoning`: the evaluation in progress is
    left unfinished so that the run reaches its boundary and checkpoints now. A BaseException, as
    KeyboardInterrupt is: the handlers that catch an env's own failures must let it through."""


class StopSignals:
    """The stop signals (`STOP_SIGNALS`: a cluster's preemption, Ctrl+C, a closed terminal) only set a flag: the strategies agree on it at the
    next update boundary, checkpoint and end with `Stopped`. A second signal ends the process at once.
    Within `abandoning` (an evaluation in this process) the first signal also raises `AbandonEvaluation`."""

    def __init__(self) -> None:
        self.signum = 0
        self._first = 0.0
        self._previous: dict[int, Any] = {}
        self._abandon = False

    REPEAT_S = SIGNAL_REPEAT_S

    def _handle(self, signum: int, _frame: Any) -> None:
        now = time.monotonic()
        if signum == signal.SIGHUP:
            drop_hung_up_terminal()
        if self.signum:
            # A cluster signals every process and the supervisor forwards the same signal to the group, so
            # a rank may get one stop request twice; only a later or a different signal means "now".
            if signum == self.signum and now - self._first < self.REPEAT_S:
                return
            os.write(2, f"ppo-fabric: second {signal.Signals(signum).name}, exiting now\n".encode())
            deadman.disarm()
            os._exit(128 + signum)
        self.signum, self._first = signum, now
        if self._abandon:
            self._abandon = False
            raise AbandonEvaluation(signum)

    @contextlib.contextmanager
    def abandoning(self) -> Iterator[None]:
        """A block (an evaluation in this process) that a stop signal ends with `AbandonEvaluation`, also
        when one came before it began: its episodes on a slow env held the stop for minutes, past a
        cluster's grace period, whose SIGKILL then lost everything since the last checkpoint."""
        if self.signum:
            raise AbandonEvaluation(self.signum)
        self._abandon = True
        try:
            yield
        finally:
            self._abandon = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopSignals]:
        """Handlers for the duration of a run (signal handlers can only be set from the main thread)."""
        self.signum = 0
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        try:
            yield self
        finally:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            self._previous.clear()


STOP = StopSignals()  # signal handlers belong to the process, so one per process


@contextlib.contextmanager
def closing_after(*owners: Any) -> Iterator[None]:
    """Run the block (the run's outputs: summary.json, the curve, the final or stop line), then close each
    of `owners` (the collector's envs, the evaluation; None skipped) however it ended. An env's close() is
    user code: one that hung held the outputs back until the watchdog ended the run without them, and a
    later `resume=auto` found the run complete, with no summary."""
    try:
        yield
    finally:
        for owner in owners:
            if owner is not None:
                owner.close()


class Boundary(NamedTuple):
    """What every rank agreed on at an update boundary (`RunSession.agreed`)."""

    signum: int  # the signal to stop on, or 0
    clock_due: bool  # a checkpoint by the clock (`checkpoint.every_minutes`)
    best: bool  # the writer's evaluation found a new best: every rank saves it
    abandoned: bool  # a stop left the writer's evaluation unfinished: every rank stops, even at the end


class RunSession:
    """One process's view of the run: `writer` is the rank that writes (global rank 0).

    Progress is counted in env steps: a resumed run continues from the checkpoint's env step with whatever
    batch its own layout makes (`per_update` env steps per update over all collecting ranks), and ends, like
    a fresh run, at the first update boundary at or past `algo.total_steps`. `update` numbers keep counting
    across resumes; they pace logging and `checkpoint.every`.
    """

    def __init__(
        self, cfg: DictConfig, run_dir: Path, writer: bool, per_update: int, resume: dict[str, Any] | None
    ) -> None:
        self.cfg, self.run_dir, self.writer, self.per_update = cfg, run_dir, writer, per_update
        self.start_step = int(resume["env_step"]) if resume is not None else 0
        self.start_update = int(resume["update"]) if resume is not None else 0
        left = max(-(-(int(cfg.algo.total_steps) - self.start_step) // per_update), 0)
        self.end_update = self.start_update + left
        self.every, self.keep = int(cfg.checkpoint.every), int(cfg.checkpoint.keep)
        self.every_seconds = 60.0 * float(cfg.checkpoint.every_minutes)
        self.log_every = int(cfg.logger.log_every)
        self.run_id = uuid.uuid4().hex[:8]
        self.lineage = [
            *(resume.get("lineage", []) if resume is not None else []),
            [self.run_id, self.start_step],
        ]
        self.best_return = resume.get("best_return") if resume is not None else None
        # seconds the run had trained before this process (its earlier parts, when resumed)
        self.start_wall = float(resume.get("wall_s", 0.0)) if resume is not None else 0.0
        self.protect = (Path(str(cfg.resume)),) if cfg.resume is not None else ()
        self.last_checkpoint = self.start_update if resume is not None else -1
        self._no_checkpoint_yet = self.last_checkpoint
        self._checkpoint_clock = time.monotonic()
        saved = resume.get("lr_schedule") if resume is not None else None
        self.lr_schedule = LrSchedule.continued(
            saved, self.start_step, self.final_step, bool(cfg.algo.anneal_lr)
        )
        replaced: str | None = None
        if writer:
            run_dir.mkdir(parents=True, exist_ok=True)
            if resume is None:  # an earlier attempt's, about to be replaced: said with its records
                replaced = config_differences(run_dir, cfg)
            if not (run_dir / "config.yaml").is_file() or resume is None:
                save_resolved_config(cfg, run_dir)  # a resume's own directory keeps its first session's
            if resume is not None:  # in a new directory too: what the branch changed is noted there
                record_session(run_dir, cfg, resume)
                moved = inherit_best(Path(str(cfg.resume)), run_dir, resume)
                if moved is not None:
                    print(moved, file=sys.stderr, flush=True)
            # The earlier session's summary says how that one ended: kept beside, not read as this session's
            # if this one fails before it writes its own (a sweep's table, a reader of the directory).
            earlier = run_dir / "summary.json"
            if earlier.is_file():
                earlier.replace(run_dir / "summary.previous.json")
        self.logger = RunLogger(
            run_dir,
            cfg,
            self.final_step,
            enabled=writer,
            resumed_at=self.start_step if resume else None,
            session=(self.run_id, self.lineage),
            replaced_config=replaced,
        )
        self.watch = Stopwatch()

    # ------------------------------------------------------------------------------------------ progress
    def env_step(self, update: int) -> int:
        """Env steps done once `update` updates are (the run's start counts as its first)."""
        return self.start_step + (update - self.start_update) * self.per_update

    @property
    def final_step(self) -> int:
        """The env step the run ends at; an annealed learning rate reaches 0 there (`lr_schedule`)."""
        return self.env_step(self.end_update)

    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / "checkpoints" / "last.ckpt"

    def steps_since_start(self, update: int) -> int:
        return self.env_step(update) - self.start_step

    def wall_s(self) -> float:
        """Seconds since the run started, the parts before a resume included (`time/wall_s`)."""
        return self.start_wall + self.watch.elapsed()

    def sps(self, update: int) -> float:
        return self.steps_since_start(update) / self.watch.elapsed()

    def log_due(self, update: int) -> bool:
        return update % self.log_every == 0 or update == self.end_update

    def log(
        self,
        update: int,
        metrics: dict[str, float],
        collector: RolloutCollector,
        windows: list[list[tuple[int, float, int]]] | None = None,
    ) -> None:
        """A log row of the update just finished, with the SPS so far and the recent mean return: of the
        last 20 episodes over every collecting rank (`windows`, from `recent_windows`), as summary.json's
        `final_mean_return`; this rank's alone without."""
        PROGRESS.mark("logging")  # trackers may wait on the network
        sps = self.sps(update)
        recent = final_mean_return(windows if windows is not None else [collector.episodes.window])
        row = metrics | {"time/sps": sps, "time/wall_s": self.wall_s()}
        if recent is not None:
            row["rollout/return_mean20"] = recent
        env_step = self.env_step(update)
        self.logger.log(row, env_step)
        self.logger.progress(env_step, sps, recent)

    # ----------------------------------------------------------------------------- boundary agreement
    def boundary_flags(self, best: bool = False, abandoned: bool = False) -> torch.Tensor:
        """This rank's view at an update boundary: [signal that asks to stop (0: none), a checkpoint due by
        the clock, `best` (the writer's evaluation found a new best, which every rank must save),
        `abandoned` (a stop left the writer's evaluation unfinished)]. The strategy takes the maximum over
        the ranks that must agree, then calls `agreed`."""
        clock_due = self.every_seconds > 0 and time.monotonic() - self._checkpoint_clock >= self.every_seconds
        return torch.tensor([float(STOP.signum), float(clock_due), float(best), float(abandoned)])

    def clock_checkpoint_planned(self) -> None:
        """A checkpoint by the clock is decided for a later boundary (the decoupled player's: after the
        update on the rollout now sent): the clock starts again now, not when it is written, or the next
        boundary, before that write, would decide another (clock checkpoints came in pairs)."""
        self._checkpoint_clock = time.monotonic()

    @staticmethod
    def agreed(flags: torch.Tensor) -> Boundary:
        """What the ranks agreed on at this boundary, from the reduced flags."""
        signum, clock_due, best, abandoned = flags.tolist()
        return Boundary(int(signum), bool(clock_due), bool(best), bool(abandoned))

    # ---------------------------------------------------------------------------------------- checkpoints
    def checkpoint_due(self, update: int) -> bool:
        """Every `checkpoint.every` updates, and always after the last one."""
        return update == self.end_update or (self.every > 0 and update % self.every == 0)

    def write_checkpoint(
        self,
        learner: dict[str, Any],
        rank_states: list[dict[str, Any]],
        update: int,
        best: bool | None = None,
        numbered: bool = True,
        best_policy: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None,
    ) -> Path:
        """`last.ckpt` (and a numbered copy when `checkpoint.every` or `every_minutes` is set and `numbered`:
        a checkpoint written only for a new best evaluation keeps the numbered files at their cadence), and
        `best.ckpt` when the mean return of the recent episodes of every collecting rank is the best so far
        (with evaluation on, when `best`: the writer's evaluation at this update is its best), or
        `best_policy(state)` when it gives one (a decoupled run's best evaluated policy), written first.
        Every rank calls it (to keep its clock and counters); only the writer writes."""
        PROGRESS.mark("checkpoint")
        self.last_checkpoint = update
        self._checkpoint_clock = time.monotonic()
        windows = [s["episodes"] for s in rank_states if "episodes" in s]
        recent = final_mean_return(windows)
        better = recent is not None and (self.best_return is None or recent > self.best_return)
        if better:
            self.best_return = recent
        if best is not None:  # evaluation is on: it decides best.ckpt (the writer's `best`)
            better = best
        if not self.writer:
            return self.checkpoint_path
        state = learner | {
            "update": update,
            "env_step": self.env_step(update),
            "world_size": len(rank_states),
            "ranks": rank_states,
            "run_id": self.run_id,
            "lineage": self.lineage,
            "best_return": self.best_return,
            "wall_s": self.wall_s(),
            "lr_schedule": self.lr_schedule.state(self.env_step(update - 1)),
        }
        numbered = numbered and (self.every > 0 or self.every_seconds > 0)
        bad = ckpt.nonfinite_reason(state)
        if bad is not None:  # never over a good file: last.ckpt, best.ckpt and the numbered ones stay
            raise CheckpointFault(
                f"the checkpoint at env step {self.env_step(update):,} was not written: {bad}; {self._kept()}"
            )
        own_best = best_policy(state) if best_policy is not None else None
        try:
            return ckpt.save(
                state,
                self.checkpoint_path.parent,
                numbered,
                self.keep,
                self.protect,
                own_best if own_best is not None else bool(better),
            )
        except OSError as exc:  # a full disk, permissions: the temp file is gone, the old file intact
            name = Path(exc.filename).name if exc.filename else "the checkpoint"
            # a stop's checkpoint that failed: the line said nothing of the stop it was for
            stopping = f"stopping on {signal.Signals(STOP.signum).name}: " if STOP.signum else ""
            raise CheckpointFault(
                f"{stopping}could not write {name} at env step {self.env_step(update):,} "
                f"({type(exc).__name__}: [Errno {exc.errno}] {exc.strerror}); {self._kept(name)}"
            ) from exc

    def _kept(self, failed: str = "") -> str:
        """Which checkpoint a resume continues from after the write of `failed` (a file name) failed:
        `ckpt.save` writes `best.ckpt`, `last.ckpt`, then the numbered copy, so a numbered copy that
        failed leaves this update's `last.ckpt` whole."""
        path = self.checkpoint_path
        if failed.startswith("step_"):
            return f"{path} holds this env step"
        return f"the last good checkpoint is {path}" if path.is_file() else "no checkpoint was written before"

    def stop(self, signum: int, update: int, summary: dict[str, Any] | None = None) -> NoReturn:
        """After the stop checkpoint: the writer saves `summary` (from `summary(..., signum=signum)`, marked
        interrupted) as summary.json and the learning curve, as at the end; then close what the run opened
        and leave with `Stopped`. The checkpoint is written already, and nothing here can lose it or change
        the exit: a summary or plot that cannot be written is a warning."""
        if self.writer and summary is not None:
            try:
                write_json(self.run_dir / "summary.json", summary)
            except Exception as exc:  # a full disk, say: the stop checkpoint is what matters
                warnings.warn(f"ppo-fabric: could not write summary.json: {exc!r}", stacklevel=2)
            self._plot()  # warns on any failure
        self.logger.close(summary, exit_code=128 + signum)
        raise Stopped(signum, self.env_step(update), self.stop_checkpoint())

    def stop_checkpoint(self) -> Path | None:
        """The checkpoint a stopped run continues from: this session's `last.ckpt` once it wrote one, else
        the checkpoint it resumed from (a decoupled run stopped before its first update writes none, and
        this directory's `last.ckpt` may be another run's or branch's), None for a fresh run."""
        if self.last_checkpoint != self._no_checkpoint_yet:
            return self.checkpoint_path
        return Path(str(self.cfg.resume)) if self.cfg.resume is not None else None

    # ------------------------------------------------------------------------------------------- the end
    def summary(
        self,
        strategy: str,
        update: int,
        players: list[dict[str, Any]],
        digests: list[str],
        time_split: dict[str, Any],
        specs: dict[str, PolicySpec],
        world_size: int,
        signum: int = 0,
    ) -> dict[str, Any]:
        """summary.json's content from every collecting rank's `end_of_run` part and every rank's digest,
        after `update` updates: the planned end, or the update a run stopped at on signal `signum`
        (`interrupted`, `stop_signal`).

        The run's numbers: `total_env_steps` (env steps done, earlier sessions included),
        `total_wall_seconds` (its training time, as `time/wall_s`), `updates`. This session's (the
        process's, since the resume when resumed): `steps_this_run`, `wall_seconds`, `sps`."""
        wall = self.watch.elapsed()
        steps = self.steps_since_start(update)
        summary = {
            "strategy": strategy,
            "env_id": str(self.cfg.env.id),
            "world_size": world_size,
            "seed": int(self.cfg.seed),
            "interrupted": bool(signum),
            "stop_signal": signal.Signals(signum).name if signum else None,
            "updates": update,
            "total_env_steps": self.env_step(update),
            "total_wall_seconds": self.start_wall + wall,
            "steps_this_run": steps,
            "wall_seconds": wall,
            "sps": steps / wall if wall > 0 else 0.0,
            "final_mean_return": final_mean_return([p["window"] for p in players]),
            "best_mean_return": self.best_return,
            "episodes": sum(p["episodes"] for p in players),
            "env_restarts": sum(int(p.get("env_restarts", 0)) for p in players),
            "time_split": time_split,
            "ranks_in_sync": len(set(digests)) == 1,
            "run_dir": str(self.run_dir),
            "checkpoint": str(self.checkpoint_path),
            "resumed_from": None if self.cfg.resume is None else str(self.cfg.resume),
        }
        if list(specs) != [SINGLE]:
            per_policy = policy_returns([p["policy_windows"] for p in players])
            summary["policies"] = {
                n: {"final_mean_return": per_policy.get(n), "agents_per_env": s.agents, "trained": s.trained}
                for n, s in specs.items()
            }
        return summary

    def finish(self, summary: dict[str, Any]) -> None:
        """The writer saves summary.json and the learning curve, closes the logger (a tracker sends both)
        and says the final line."""
        if not self.writer:
            self.logger.close()
            return
        write_json(self.run_dir / "summary.json", summary)
        self._plot()
        self.logger.close(summary)
        print(self.final_line(summary), file=sys.stdout, flush=True)

    def _plot(self) -> None:
        """learning_curve.png, unless `logger.plot=false`: the first figure of a process costs ~0.5 s of
        CPU (matplotlib's import and fonts), which sweeps of many short runs pay once per run."""
        if OmegaConf.select(self.cfg, "logger.plot", default=True):  # a user's own logger option may lack it
            save_learning_curve(self.run_dir, title=str(self.cfg.env.id))

    def final_line(self, summary: dict[str, Any]) -> str:
        """What the writer says at the end: the env steps, time and SPS of this session and, when it
        resumed a run, the run's total env steps as well."""
        ret = summary.get("final_mean_return")
        ret_text = "n/a" if ret is None else f"{ret:.1f}"
        wall, sps = f"{summary['wall_seconds']:.1f}s", f"{summary['sps']:,.0f} steps/s"
        if self.start_step > 0:
            counted = f"{summary['steps_this_run']:,} steps this session in {wall} ({sps}), "
            counted += f"{summary['total_env_steps']:,} in all"
        else:
            counted = f"{summary['total_env_steps']:,} steps in {wall} ({sps})"
        return (
            f"ppo-fabric: {summary['strategy']} {summary['env_id']}: {counted}, final mean return {ret_text}; "
            f"outputs in {self.run_dir}"
        )


# ------------------------------------------------------------------------------ a collecting rank's state
def _of_timeline(path: Path, resume: dict[str, Any]) -> bool | None:
    """Whether the checkpoint at `path` was written on the timeline `resume` continues (by a run of its
    lineage, at or before the step it resumes from); None when that cannot be told (unreadable, no lineage)."""
    try:
        state = ckpt.load(path, key="checkpoint", env_state="fresh")  # a decoupled run's holds a policy only
    except ValueError:
        return None
    lineage, step = state.get("lineage") or [], int(state["env_step"])
    if not lineage:
        return None
    return step <= int(resume["env_step"]) and ckpt.in_lineage(
        step, str(lineage[-1][0]), resume.get("lineage", [])
    )


def inherit_best(source: Path, run_dir: Path, resume: dict[str, Any]) -> str | None:
    """`run_dir`'s `best.ckpt` as the timeline the resume continues left it; returns a line to say when one
    was moved aside. A resume from an older checkpoint into the run's own directory found there the best of
    the branch it leaves: kept, `load_policy` and `evaluate` of `best.ckpt` gave a policy from outside the
    run's timeline, while `summary.json` named another best; it goes to `best.dropped.ckpt`, as the branch's
    metrics rows go to `metrics.dropped.csv`. A run continued in a new directory gets the `best.ckpt` beside
    the checkpoint it resumed from, when that one is of its timeline: the session writes best.ckpt only when it
    beats the run's best so far, so a branch that never did had none, while its summary named that best."""
    target = run_dir / "checkpoints" / "best.ckpt"
    moved = None
    if target.is_file() and _of_timeline(target, resume) is False:
        target.replace(target.with_name(ckpt.DROPPED_BEST))
        moved = (
            f"ppo-fabric: {target} was the best of the branch this resume leaves: moved to {ckpt.DROPPED_BEST}; "
            "best.ckpt is written again when this branch beats the timeline's best"
        )
    best = source.parent / "best.ckpt"
    if best.is_file() and not target.exists() and _of_timeline(best, resume):
        target.parent.mkdir(parents=True, exist_ok=True)
        ckpt.atomic_write(best.read_bytes(), target)
    return moved


def collector_state(collector: RolloutCollector) -> dict[str, Any]:
    """What one collecting rank needs to continue its rollouts exactly: its RNG, its envs (pickled and
    signed, None where that cannot keep them) and the collector's own state."""
    return {"rng": ckpt.rng_state(), "envs": ckpt.pickle_envs(collector.envs)} | collector.state_dict()


def collecting_parts(resume: dict[str, Any]) -> list[dict[str, Any]]:
    """The checkpoint's collecting ranks' parts, in rank order: the k-th is the k-th collecting rank's,
    whichever rank number it had (a decoupled layout on another node count puts players on other ranks)."""
    return [state for state in resume["ranks"] if "num_envs" in state]


def env_settings(cfg: DictConfig) -> dict[str, Any]:
    """The run's `env` section as plain values, as a checkpoint's config holds it (`resume_collector`)."""
    settings = OmegaConf.to_container(cfg.env, resolve=True)
    assert isinstance(settings, dict)
    return settings


# env settings a restored env snapshot does not depend on: the layout (`num_envs`, compared as such), the
# normalisation warm-up (a fresh run's only) and the restart budget (the collector's)
_SNAPSHOT_FREE = ("num_envs", "normalize_warmup", "max_restarts")


def resume_collector(
    collector: RolloutCollector,
    resume: dict[str, Any],
    collector_index: int,
    collecting: int,
    seed: int,
    env: Mapping[str, Any] | None = None,
) -> str | None:
    """Continue the `collector_index`-th collecting rank from the checkpoint's: exactly when the collecting
    layout is the same (as many collecting ranks, as many envs each; trainer ranks may differ), and so are
    the seed and the env settings (`env`, this run's resolved `env` section; None: the checkpoint's);
    otherwise with fresh envs and RNG (from `seed`, this run's) but the normaliser statistics (identical on
    every collecting rank) carried over, and the run's episode record in the first collecting rank's.
    Returns the line to print in that case (None when exact). A new seed restored exactly was named in the
    run's config and summary but trained nothing differently; restored envs keep the wrappers and settings
    they were saved with, so `env.on_error=restart`, `env.max_episode_steps`, `env.kwargs` or normalisation
    changed by `resume_overrides=allow` were recorded as changed and never applied."""
    saved = collecting_parts(resume)
    was_seed = int(resume["config"]["seed"])
    was_env = dict(resume["config"].get("env") or {})
    changed = [  # a key the package added since the run started is none of the user's changes
        k for k in sorted(was_env) if env is not None and k not in _SNAPSHOT_FREE and was_env[k] != env.get(k)
    ]  # fmt: skip
    same_layout = len(saved) == collecting and all(int(s["num_envs"]) == collector.num_envs for s in saved)
    if same_layout and was_seed == seed and not changed:
        restore_collector(collector, saved[collector_index], say=collector_index == 0)
        return None
    if saved:
        collector.carry_statistics(saved[0])
        if collector_index == 0:  # the run's episode record goes on in one rank's counts
            collector.carry_episodes(saved)
    if not same_layout:
        was = f"{len(saved)} collecting rank(s) x {saved[0]['num_envs'] if saved else '?'} envs"
        why = f"the checkpoint has {was}, this run {collecting} x {collector.num_envs}"
    elif was_seed != seed:
        why = f"seed {was_seed} -> {seed}"
    else:
        why = ", ".join(f"env.{k}" for k in changed) + " changed (the saved envs hold the old settings)"
    return f"ppo-fabric: resume: {why}; envs and RNG start fresh, normaliser statistics carried over"


def restore_collector(collector: RolloutCollector, state: dict[str, Any], say: bool = True) -> None:
    """`collector_state`'s inverse. An async pool never takes a snapshot (another backend's envs, a
    gymnasium run's, cannot go on as one): it keeps its fresh envs (`say`: warned of, by one rank)."""
    snapshot = None if collector.asynchronous else state["envs"]
    fresh = collector.envs
    envs = ckpt.restore_envs(snapshot, fresh, say)  # closes the fresh envs when it restores the saved ones
    collector.load_state_dict(state, None if envs is fresh else envs)
    ckpt.set_rng_state(state["rng"])


def end_of_run(collector: RolloutCollector) -> dict[str, Any]:
    """A collecting rank's part of the summary: its recent episodes, their count, per policy windows."""
    return {
        "window": list(collector.episodes.window),
        "episodes": collector.episodes.count,
        "policy_windows": policy_windows(collector),
        "env_restarts": collector.restarts,
    }


# ------------------------------------------------------------------------------------------- episodes
def episode_metrics(collector: RolloutCollector, sum_over_ranks: Reduce | None) -> dict[str, float]:
    """Mean return and length of the episodes finished since the last call, over every collecting rank;
    per policy too in multi-agent runs (an episode there is one agent's)."""
    logs = [(SINGLE, collector.episodes)]
    if collector.multiagent:
        logs += [(g.name, g.episodes) for g in collector.groups]
    sums = torch.stack([episode_sums(*log.drain()) for _, log in logs])
    if sum_over_ranks is not None:
        sums = sum_over_ranks(sums)
    out: dict[str, float] = {}
    for (name, _), row in zip(logs, sums, strict=True):
        out |= {metric_name(name, k): v for k, v in episode_means(row).items()}
    if collector.selfplay is not None:
        out |= collector.selfplay.metrics(sum_over_ranks)
    if collector.max_restarts is not None:  # env.on_error=restart: sub-envs rebuilt so far, all ranks
        restarts = torch.tensor([float(collector.restarts)])
        out["env/restarts"] = float((restarts if sum_over_ranks is None else sum_over_ranks(restarts))[0])
    return out


RECENT = 20  # episodes in `rollout/return_mean20`


def recent_windows(
    window: Iterable[tuple[int, float, int]], slot: int, slots: int, sum_over_ranks: Reduce | None
) -> list[list[tuple[int, float, int]]]:
    """Every collecting rank's recent episodes (env step ended, return): its last `RECENT` and those that
    ended with the earliest of them (`recent_episodes`, a superset of what the run's last 20 take from it),
    this one's being `slot` of `slots`: each rank fills its own row of a zero tensor and the sum over the
    ranks holds them all."""
    if sum_over_ranks is None or slots == 1:
        return [list(window)]
    mine = recent_episodes(list(window), RECENT)[-WINDOW:]
    rows = torch.zeros(slots, WINDOW, 3, dtype=torch.float64)
    if mine:
        rows[slot, : len(mine)] = torch.tensor(
            [[float(s), float(r), 1.0] for s, r, *_ in mine], dtype=torch.float64
        )
    rows = sum_over_ranks(rows)
    return [[(int(s), r, 0) for s, r, seen in rank if seen] for rank in rows.tolist()]


def policy_returns(windows: list[dict[str, list]]) -> dict[str, float | None]:
    """Per policy `final_mean_return` from every collecting rank's `policy_windows`."""
    names = windows[0].keys() if windows else []
    return {n: final_mean_return([w[n] for w in windows]) for n in names}


def policy_windows(collector: RolloutCollector) -> dict[str, list]:
    return {g.name: list(g.episodes.window) for g in collector.groups} if collector.multiagent else {}
