"""Decoupled PPO: player ranks step the environments, trainer ranks learn under DDP among themselves.

`main()` builds the process groups and sends each rank to `Player.run()` or `Trainer.run()`. Players use the
same rollout loop, storage and GAE as the coupled strategy; trainers the same update (`update.py`). The
messages between them, in order, are the methods of `protocol.PlayerLink` and `protocol.TrainerLink`.

With `algo.pipeline=true` a player collects rollout k+1 with the parameters it has while the trainers
learn from rollout k, then loads the new parameters before sending: the policy lag is one update. The lag
is measured (each batch carries the update whose parameters collected it) and logged as
`train/policy_lag`. A lagged batch's advantages are recomputed with the trainers' current critic, and
it is learnt with the decoupled PPO objective, which centres the clip range on the trainers' parameters
rather than on the older ones that collected it (`update.lagged_batch`, `algo.lag_*`).

Every process is launched on the CPU (gloo); `placement.role_map` says which ranks play, and each role then
takes its device (`algo.trainer_device`, `algo.player_device`): CPU players can feed GPU trainers.

Run as a script under `fabric run --accelerator=cpu --devices=3 ppo_fabric/ppo_decoupled.py [overrides]`
(`algo.trainer_device=cuda` for GPU trainers).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
from lightning_fabric import Fabric
from omegaconf import DictConfig
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from ppo_fabric.app.launch import GroupDDPStrategy
from ppo_fabric.collect.rollout import build_collector, policy_storage
from ppo_fabric.config.values import acting_envs, requested, training_layout
from ppo_fabric.envs.envpool_backend import is_async
from ppo_fabric.envs.multiagent import SINGLE
from ppo_fabric.learn.buffer import training_batch
from ppo_fabric.learn.learners import (
    PolicySpec,
    all_parameters,
    build_learners,
    learners_state,
    metric_name,
    policies_of,
    policy_specs,
    trained,
)
from ppo_fabric.learn.settings import UpdateSettings
from ppo_fabric.learn.update import LAG_METRICS, TRAIN_METRICS, update_policies
from ppo_fabric.models.agent import ActorCritic
from ppo_fabric.policy.periodic import evaluate_in_background, evaluation_for, finish_in_background
from ppo_fabric.runs import checkpoint as ckpt
from ppo_fabric.runs.metrics import parameters_digest
from ppo_fabric.runs.session import (
    STOP,
    CheckpointFault,
    RunSession,
    closing_after,
    collecting_parts,
    collector_state,
    end_of_run,
    env_settings,
    episode_metrics,
    recent_windows,
    resume_collector,
)
from ppo_fabric.wire.placement import (
    check_local_rank,
    player_kind,
    players_of,
    role_device,
    role_map,
    trainer_kind,
)
from ppo_fabric.wire.progress import PROGRESS
from ppo_fabric.wire.protocol import (
    BatchCodec,
    Header,
    Kind,
    PlayerLink,
    Topology,
    TrainerLink,
    max_over,
    setup_topology,
    sum_reduce,
)


def metric_names(specs: dict[str, PolicySpec]) -> list[str]:
    """What the first trainer appends to the parameters after each update (averaged over trainers)."""
    names = [metric_name(n, k) for n in trained(specs) for k in (*TRAIN_METRICS, *LAG_METRICS, "train/lr")]
    return [*names, "train/policy_lag", "time/trainer_sps", "time/train_s"]


def session_for(fabric: Fabric, cfg: DictConfig, run_dir: Path, resume: dict | None) -> RunSession:
    """Both roles count progress the same way: env steps per update over all players."""
    per_update = int(cfg.algo.rollout_steps) * acting_envs(cfg.env) * int(cfg.algo.players)
    return RunSession(cfg, run_dir, fabric.global_rank == 0, per_update, resume)


def gae_inputs(cfg: DictConfig) -> bool:
    """Whether DATA carries what GAE was computed from: only where the trainers recompute it (a pipeline,
    whose batches lag, with `algo.lag_refresh_advantages`)."""
    return bool(cfg.algo.pipeline) and bool(cfg.algo.lag_refresh_advantages)


def codecs_for(
    specs: dict[str, PolicySpec], storages: dict[str, Any], trainers: int, cfg: DictConfig
) -> dict[str, BatchCodec]:
    """One DATA message per trained policy, in this order, shaped by a rollout's training batch."""
    extra = gae_inputs(cfg)
    return {
        n: BatchCodec(training_batch(storages[n], specs[n].seq_len, extra), trainers) for n in trained(specs)
    }


def main(fabric: Fabric, cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Take this rank's role and device, build the groups (a collective on every rank), then play or
    train; returns this rank's summary."""
    strategy = fabric.strategy
    if not isinstance(strategy, GroupDDPStrategy):
        raise ValueError(
            "strategy=decoupled brings its own DDP strategy: `fabric run --strategy` and fabric.strategy "
            "may only be ddp or auto"
        )
    roles = role_map(fabric.world_size, strategy.num_nodes, int(cfg.algo.players))
    role = roles[fabric.global_rank]
    check_local_rank(role, fabric.local_rank)
    PROGRESS.label = f"{'player' if role.plays else 'trainer'} rank {fabric.global_rank}"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    trains_on = trainer_kind(str(cfg.algo.trainer_device), requested(cfg, "accelerator"), gpus > 0)
    kind = player_kind(str(cfg.algo.player_device), trains_on) if role.plays else trains_on
    strategy.take_device(fabric, role_device(role, roles, kind, gpus), requested(cfg, "precision"))
    backend = "nccl" if trains_on == "cuda" else "gloo"
    topo = setup_topology(players_of(roles), float(cfg.collectives.timeout), backend)
    resume = ckpt.load(cfg.resume, env_state=str(cfg.resume_env)) if cfg.resume is not None else None
    role_class = Player if topo.is_player else Trainer
    return role_class(fabric, cfg, run_dir, topo, resume).run()


# ------------------------------------------------------------------------------------------------ player
@dataclass
class PipelineState:
    """Where a player stands in the message sequence: what it carries from one rollout to the next.

    Without a pipeline `received == behaviour` always. With one, the rollout in flight acts with the
    parameters of `behaviour` while the trainers learn `received`'s successor. A resumed pipeline starts
    as the original run went on: its first rollout acts with the parameters `saved` with the checkpoint,
    and the trainers' newest ones are `held` until that rollout is sent."""

    received: int  # the update of the newest parameters received
    behaviour: int  # the update of the parameters the policy acts with (on the batch being collected)
    saved: dict[str, Any] | None = None  # a pipelined checkpoint's rank part: `policy`, `behaviour_update`
    held: torch.Tensor | None = None  # the received parameters, while the saved ones act
    timed: set[int] = field(default_factory=set)  # updates the players agreed to checkpoint by the clock

    def adopt(self, update: int) -> None:
        """The parameters of `update` are loaded: the next rollout acts with them."""
        self.received = self.behaviour = update


class Player:
    """A player rank: its envs, its copy of the policies, and where it stands in the message sequence."""

    def __init__(
        self, fabric: Fabric, cfg: DictConfig, run_dir: Path, topo: Topology, resume: dict | None
    ) -> None:
        self.topo, self.world = topo, fabric.world_size
        self.pipeline = bool(cfg.algo.pipeline)
        self.device = fabric.device  # the role's device (main)
        self.specs = specs = policy_specs(cfg)
        self.policies = {
            n: ActorCritic(s.obs_space, s.action_space, s.model).to(self.device) for n, s in specs.items()
        }
        self.params = all_parameters(self.policies)
        # normalisation statistics are merged over players
        self.collector = build_collector(
            cfg, specs, topo.rank, self.device, sum_reduce(topo.player_group, "cpu"), role="player rank",
            start_step=0 if resume is None else int(resume["env_step"]),
        )  # fmt: skip
        self.names = metric_names(specs)
        codecs = codecs_for(specs, self.collector.storages, len(topo.trainers), cfg)
        self.gae_inputs = gae_inputs(cfg)
        saved = None
        if resume is not None:
            player = topo.players.index(topo.rank)  # the k-th player continues the checkpoint's k-th
            changed = resume_collector(
                self.collector, resume, player, len(topo.players), int(cfg.seed), env_settings(cfg)
            )
            if changed is None and self.pipeline and "policy" in collecting_parts(resume)[player]:
                saved = collecting_parts(resume)[player]
            if changed and topo.rank == 0:
                print(changed, flush=True)
        self.session = session_for(fabric, cfg, run_dir, resume)
        start = self.session.start_update
        self.link = PlayerLink(topo, codecs, sum(p.numel() for p in self.params), len(self.names), start)
        self.state = PipelineState(start, start, saved)
        self.unwritten: tuple[int, list[dict[str, Any]]] | None = None  # a checkpoint gathered, not written
        self.recorded: dict[str, Any] | None = None  # the evaluation record the last checkpoint written holds
        # resumed from this directory's last.ckpt (resume=auto): with nothing to train, that is the run's last
        self.resumed_last = resume is not None and Path(str(cfg.resume)).resolve() == (
            self.session.checkpoint_path.resolve()
        )
        self.trainers_stop = 0  # a stop signal a trainer received, relayed with the parameters
        self.evaluation = (  # on a thread of the first player, off the critical path
            evaluation_for(cfg, specs, self.session.per_update, self.session, resume, background=True)
            if topo.rank == 0
            else None
        )

    def run(self) -> dict[str, Any]:
        """Play from the trainers' first parameters to the last update, then tell the trainers to stop."""
        self.start()
        for update in range(self.state.received, self.session.end_update):
            self.play(update)
        if self.pipeline and self.state.received < self.session.end_update:
            self.state.received = self.receive()  # the last update, learnt from the last rollout
        self.link.send_stop(self.state.received)
        return self.finish()

    def start(self) -> None:
        """Every player starts from the trainers' parameters; a resumed pipeline's first rollout acts with
        the saved ones, as it did in the original run."""
        state = self.state
        state.adopt(self.receive())
        if state.saved is not None:
            state.held = parameters_to_vector(self.params).clone()
            vector_to_parameters(state.saved["policy"].to(self.device), self.params)
            state.behaviour = int(state.saved["behaviour_update"])

    def play(self, update: int) -> None:
        """One rollout: agree on a stop or a clock checkpoint, collect, send, then load what is due."""
        session, state = self.session, self.state
        pipelined = self.pipeline and update > session.start_update
        signum, clock_due = self.agree()
        if signum:
            self.stop(signum, pipelined)
        if clock_due:
            state.timed.add(update + 1)
            session.clock_checkpoint_planned()
        # a checkpoint of update k (received during this rollout) holds the state from before it, and so
        # does its log row: the episodes that ended up to its env step
        snapshot = self.snapshot() if pipelined and self.checkpoint_due(update) else None
        episodes = self.episode_rows() if pipelined and session.log_due(update) else None
        t0 = time.perf_counter()
        self.collector.collect(self.policies, session.env_step(update))
        session.watch.add("collect", time.perf_counter() - t0)
        t0 = time.perf_counter()
        batches = {
            n: training_batch(self.collector.storages[n], self.specs[n].seq_len, self.gae_inputs)
            for n in self.link.codecs
        }
        self.link.send_data(batches, state.behaviour, self.pipeline, checkpoint_after=clock_due)
        session.watch.add("send", time.perf_counter() - t0)
        if pipelined:
            # the update on rollout `update - 1`, done meanwhile
            state.adopt(self.receive(snapshot, episodes))
        elif state.held is not None:  # the resumed rollout is sent: act with the newest parameters
            vector_to_parameters(state.held, self.params)
            state.behaviour, state.held = state.received, None
            # where the original run received them: the checkpoint's state is from before (a snapshot due)
            self.collector.after_update(self.policies, state.received)
        if not self.pipeline:
            state.adopt(self.receive())

    def agree(self) -> tuple[int, bool]:
        """Stop on a signal, or checkpoint by the clock: every player decides the same at this boundary."""
        flags = self.session.boundary_flags()
        flags[0] = max(float(flags[0]), float(self.trainers_stop))  # a signal that reached only trainers
        signum, clock_due, _, _ = self.session.agreed(max_over(flags, "cpu", self.topo.player_group))
        return signum, clock_due

    def checkpoint_due(self, update: int) -> bool:
        return self.session.checkpoint_due(update) or update in self.state.timed

    def receive(
        self,
        snapshot: dict[str, Any] | None = None,
        episodes: tuple[dict[str, float], list] | None = None,
    ) -> int:
        """PARAMS: load the newest parameters, log the update they came from, checkpoint when due.

        `snapshot` is this player's state from before the rollout now in flight (pipeline), which is what
        a checkpoint of the new update must hold for an exact resume; `episodes`, the episode statistics
        from before it (`episode_rows`), what the update's log row holds.
        """
        session = self.session
        t0 = time.perf_counter()
        update, flat, metrics, trainers_stop = self.link.receive_params()
        self.trainers_stop = max(self.trainers_stop, trainers_stop)
        vector_to_parameters(flat.to(self.device), self.params)
        session.watch.add("wait_params", time.perf_counter() - t0)
        evaluation = self.evaluation
        if (
            update == session.start_update
            and evaluation is not None
            and (evaluation.owed or evaluation.replay)
        ):
            # the evaluation in flight when the checkpoint was written: of its own parameters, or of an
            # earlier update's, which it kept
            evaluate_in_background(evaluation, session, update, self.policies, self.collector)
        if update > session.start_update:
            self.collector.after_update(self.policies, update)
            if session.log_due(update):
                finished, windows = episodes if episodes is not None else self.episode_rows()
                row = dict(zip(self.names, metrics.tolist(), strict=True)) | finished
                session.log(update, row, self.collector, windows)
            if evaluate_in_background(self.evaluation, session, update, self.policies, self.collector):
                self.amend_evaluation()  # the last checkpoint was written while this evaluation ran
            if self.checkpoint_due(update):  # the last one is written once the final evaluation is in it
                self.checkpoint(update, snapshot, write=update < session.end_update)
        return update

    def episode_rows(self) -> tuple[dict[str, float], list]:
        """The episodes finished since the last row and the recent ones, over every player (a collective
        of the players: each calls it at the same update)."""
        players = self.topo.players
        summed = self.link.sum_over_players if len(players) > 1 else None
        windows = recent_windows(
            self.collector.episodes.window, players.index(self.topo.rank), len(players), summed
        )
        return episode_metrics(self.collector, summed), windows

    def checkpoint(self, update: int, snapshot: dict[str, Any] | None, write: bool = True) -> None:
        """CHECKPOINT: every rank's part; the first trainer's holds the learners. Without `write`, the
        parts are kept for `write_checkpoint`: at the run's end and at a stop the trainers are released
        (the gathers done) before the first player waits for its evaluations."""
        rank_state = snapshot if snapshot is not None else collector_state(self.collector)
        self.unwritten = (update, self.topo.gather({"rank_state": rank_state}, "checkpoint"))
        if write:
            self.write_checkpoint()

    def checkpointed(self) -> int:
        """The update of the last checkpoint gathered, written or not (the trainers count it as done)."""
        return max(self.session.last_checkpoint, self.unwritten[0] if self.unwritten else -1)

    def write_checkpoint(self) -> None:
        if self.unwritten is None:
            return
        (update, parts), self.unwritten = self.unwritten, None
        learner = parts[self.topo.first_trainer]["learner"]
        evaluating = self.evaluation is not None and self.evaluation.keeps_record
        if evaluating:
            self.recorded = self.evaluation.state(upto=self.session.env_step(update))
            flying = self.evaluation.in_flight_policy(self.session.env_step(update))
            learner = learner | {"evaluation": self.recorded, "evaluation_policy": flying}
        # with evaluation on, best.ckpt holds the parameters the evaluator scored best (`best_policy`),
        # written before last.ckpt: a failed write of it (a full disk) leaves a checkpoint a resume replays
        upto = self.session.env_step(update)
        self.session.write_checkpoint(
            learner,
            [part["rank_state"] for part in parts],
            update,
            best=False if evaluating else None,
            best_policy=(lambda state: self.best_policy(state, upto)) if evaluating else None,
        )

    def amend_evaluation(self) -> None:
        """The evaluation record in the last checkpoint written (and its numbered copy) as it is now, and
        best.ckpt if that evaluation found a new best: a background evaluation started at an update runs
        while that update's checkpoint is written, and a stop (or a crash) before the next checkpoint lost
        it from the checkpoint, the resume's record and best.ckpt, which the summary still named."""
        if (
            not self.session.writer
            or self.evaluation is None
            or not self.evaluation.on
            or self.recorded is None
        ):
            return
        step = self.session.env_step(self.session.last_checkpoint)
        now = self.evaluation.state(upto=step)  # what had been evaluated by the checkpoint's step
        last = self.session.checkpoint_path
        if now == self.recorded or not last.is_file():
            return
        numbered = last.parent / ckpt.numbered_name(step, self.session.run_id)
        for path in (last, numbered):
            if path.is_file():  # the parameters it had in flight are scored now: no resume replays them
                ckpt.amend(path, evaluation=now, evaluation_policy=self.evaluation.in_flight_policy(step))
        self.recorded = now
        self.write_best(last, upto=step)

    def best_policy(self, state: dict[str, Any], upto: int) -> dict[str, Any] | None:
        """best.ckpt's content from the evaluation that found a new best since the last checkpoint, at its
        step `upto` or before: the parameters it scored, cut from the checkpoint `state`
        (`ckpt.policy_checkpoint`: loadable, not resumable); None when there is no new best."""
        best = self.evaluation.take_best_policy(upto)
        if best is None:
            return None
        env_step, weights, frozen = best
        agent = weights[SINGLE] if not state.get("multiagent") else weights
        return ckpt.policy_checkpoint(state, agent, env_step, frozen)

    def write_best(self, written: Path, upto: int) -> None:
        """best.ckpt from an evaluation that finished after the checkpoint `written` (`best_policy`)."""
        state = ckpt.load(written, key="checkpoint", env_state="fresh")
        policy = self.best_policy(state, upto)
        if policy is None:
            return
        try:
            ckpt.atomic_write(ckpt.encode(policy), written.parent / "best.ckpt")
        except OSError as exc:  # a full disk: the previous best.ckpt, if any, is intact
            raise CheckpointFault(
                f"could not write best.ckpt (the best evaluation's policy, from env step {int(policy['env_step']):,}) "
                f"({type(exc).__name__}: [Errno {exc.errno}] {exc.strerror}); {written} holds env step "
                f"{int(state['env_step']):,}"
            ) from exc

    def snapshot(self) -> dict[str, Any]:
        policy_now = parameters_to_vector(self.params).detach().cpu().clone()
        return collector_state(self.collector) | {
            "policy": policy_now,
            "behaviour_update": self.state.behaviour,
        }

    def stop(self, signum: int, pipelined: bool) -> NoReturn:
        """Stop at this boundary: take the update in flight (pipeline), tell the trainers, checkpoint the
        state every rank is at now, and leave with `Stopped` like every other rank."""
        state, snapshot = self.state, None
        if pipelined:  # the state from before the rollout not collected, as a pipelined checkpoint holds
            snapshot = self.snapshot()
            state.adopt(self.receive(snapshot))
        self.link.send_stop(state.received, signum)
        if self.checkpointed() < state.received:
            self.checkpoint(state.received, snapshot, write=False)
        parts = self.topo.gather(self.end_part(), "end")  # the trainers' last collective: they may leave
        # an evaluation already finished goes into the checkpoint; one still running stays in flight there
        finish_in_background(self.evaluation, self.session, state.received, {}, self.collector, final=False)
        self.write_checkpoint()
        self.amend_evaluation()  # when that checkpoint was written before the evaluation ended
        summary = self.summary(parts, signum)  # summary.json, interrupted
        with closing_after(self.collector, self.evaluation):  # the outputs first (ppo.main)
            self.session.stop(signum, state.received, summary)

    def end_part(self) -> dict[str, Any]:
        digest = parameters_digest(*self.policies.values())
        parts = {"digest": digest, "time": self.session.watch.totals, "device": str(self.device)}
        return end_of_run(self.collector) | parts

    def finish(self) -> dict[str, Any]:
        """Gather every rank's end-of-run part (the trainers' last collective), then wait for the final
        evaluation and write the last checkpoint with it; the first player writes the summary."""
        parts = self.topo.gather(self.end_part(), "end")
        state = self.state
        signum = finish_in_background(
            self.evaluation, self.session, state.received, self.policies, self.collector, True
        )
        self.write_checkpoint()
        if (
            self.recorded is None
            and self.resumed_last
            and self.session.start_update == self.session.end_update
        ):
            self.recorded = {}  # a resume that only played the final evaluation its checkpoint owed: that
            self.amend_evaluation()  # checkpoint gets the record, and best.ckpt its parameters if the best
        if signum:  # a stop gave the final evaluation up: the checkpoint owes it (the trainers have left)
            summary = self.summary(parts, signum)
            with closing_after(self.collector, self.evaluation):
                self.session.stop(signum, state.received, summary)
        summary = self.summary(parts)
        with closing_after(self.collector, self.evaluation):  # the outputs first (ppo.main)
            self.session.finish(summary)
        return summary

    def summary(self, parts: list[dict[str, Any]], signum: int = 0) -> dict[str, Any]:
        """summary.json's content from every rank's `end_part`, at the end or at a stop on `signum` (the
        trainers gather theirs on both paths, so a stopped run's summary is as complete as a finished one's)."""
        session = self.session
        players = [parts[p] for p in self.topo.players]
        time_split = {"player": session.watch.totals, "trainer": parts[self.topo.first_trainer]["time"]}
        digests = [part["digest"] for part in parts]
        summary = session.summary(
            "decoupled", self.state.received, players, digests, time_split, self.specs, self.world, signum
        )
        if self.evaluation is not None and self.evaluation.keeps_record:
            summary["evaluation"] = self.evaluation.state()
        summary |= {
            "players": len(self.topo.players),
            "trainers": len(self.topo.trainers),
            "pipeline": self.pipeline,
            "roles": [  # rank by rank: who played, who trained, on which device
                {
                    "rank": r,
                    "role": "player" if r in self.topo.players else "trainer",
                    "device": part["device"],
                }
                for r, part in enumerate(parts)
            ],
        }
        return summary


# ----------------------------------------------------------------------------------------------- trainer
def saved_trainer_rng(resume: dict | None, seed: int, trainers: list[int], rank: int) -> Any | None:
    """The RNG state trainer `rank` continues from: the checkpoint's k-th trainer's for the k-th of
    `trainers`, when the resume keeps the run's seed and its number of trainers; None otherwise, and the
    RNG stays as seeded from `seed`: a resume with a new seed starts the minibatch shuffles fresh from it,
    as it does the players' envs (restored, they followed the old seed under the new one's name)."""
    if resume is None or int(resume["config"]["seed"]) != seed:
        return None
    parts = [s for s in resume["ranks"] if "num_envs" not in s]  # the players' parts hold their envs
    return parts[trainers.index(rank)]["rng"] if len(parts) == len(trainers) else None


class Trainer:
    """A trainer rank: its learners under DDP among the trainers, and the update it has reached."""

    def __init__(
        self, fabric: Fabric, cfg: DictConfig, run_dir: Path, topo: Topology, resume: dict | None
    ) -> None:
        # Fabric's DDP wraps the model over the trainers' group only: players never join it.
        fabric.strategy.use_group(topo.trainer_group, len(topo.trainers))
        self.fabric, self.cfg, self.topo = fabric, cfg, topo
        specs = policy_specs(cfg)
        self.learners = build_learners(fabric, specs, resume, float(cfg.algo.adam_eps))
        self.params = all_parameters(policies_of(self.learners))
        rng = saved_trainer_rng(resume, int(cfg.seed), list(topo.trainers), topo.rank)
        if rng is not None:
            ckpt.set_rng_state(rng)
        steps, copies = int(cfg.algo.rollout_steps), int(cfg.env.num_envs)
        delayed = is_async(cfg.env)  # the players' storages have a `mask`: so has the template
        templates = {n: policy_storage(steps, copies, s, "cpu", delayed) for n, s in specs.items()}
        self.link = TrainerLink(topo, codecs_for(specs, templates, len(topo.trainers), cfg), fabric.device)
        self.names = metric_names(specs)
        self.rank_minibatch = training_layout(cfg, fabric.world_size).rank_minibatch
        # each trainer's batch: per player, a time-major piece of its rollout, rows of `envs` steps
        self.layouts = {n: (len(topo.players), t.batch_size[1]) for n, t in templates.items()}
        self.session = session_for(fabric, cfg, run_dir, resume)
        self.update = self.session.start_update  # the update the published parameters come from
        self.settings = UpdateSettings.of(cfg.algo)

    def run(self) -> dict[str, Any]:
        """Publish the first parameters; then learn from each round of DATA until the players' STOP."""
        session = self.session
        self.link.publish(self.params, torch.zeros(len(self.names)), self.update)
        while True:
            t0 = time.perf_counter()
            headers, batches = self.link.receive_data(self.fabric.device)
            session.watch.add("wait_data", time.perf_counter() - t0)
            if headers[0].kind == Kind.STOP:
                return self.finish(headers[0].signum)  # the players' signal, 0 at the planned end
            self.learn(headers, batches)

    def learn(self, headers: list[Header], batches: dict[str, Any]) -> None:
        """One update from every player's batch; publish the parameters and checkpoint when due."""
        session = self.session
        lag = self.update - sum(h.update for h in headers) / len(headers)
        t0 = time.perf_counter()
        stats = update_policies(
            self.fabric,
            self.learners,
            batches,
            settings=self.settings,
            env_step=session.env_step(self.update),
            lr_schedule=session.lr_schedule,
            mean_across=self.mean_across,
            rank_minibatch=self.rank_minibatch,
            policy_lag=lag,
            layouts=self.layouts,
        )
        elapsed = time.perf_counter() - t0
        session.watch.add("train", elapsed)
        self.update += 1
        samples = sum(b["logprobs"].numel() for b in batches.values())  # steps, also inside sequences
        stats |= {"train/policy_lag": lag, "time/trainer_sps": samples / elapsed, "time/train_s": elapsed}
        names = self.names
        values = [stats[k] for k in names] + [float(STOP.signum)]  # any trainer's signal: a mean above 0
        reduced = self.mean_across(torch.tensor(values, dtype=torch.float32))
        metrics, asked = reduced[:-1], float(reduced[-1]) > 0
        metrics[names.index("time/trainer_sps")] *= len(self.topo.trainers)  # samples/s of all trainers
        signum = STOP.signum or (signal.SIGTERM if asked else 0)  # relayed: only players agree on stopping
        self.link.publish(self.params, metrics.cpu(), self.update, signum)
        if session.checkpoint_due(self.update) or headers[0].checkpoint:
            self.checkpoint()

    def mean_across(self, t: torch.Tensor) -> torch.Tensor:
        return self.link.mean(t.to(self.fabric.device))

    def checkpoint(self) -> None:
        """CHECKPOINT: this rank's part; the first trainer's holds the learners."""
        part: dict[str, Any] = {"rank_state": {"rng": ckpt.rng_state()}}
        if self.link.publishes:
            part["learner"] = learners_state(self.cfg, self.learners)
        parts = self.topo.gather(part, "checkpoint")
        self.session.write_checkpoint({}, [p["rank_state"] for p in parts], self.update)

    def finish(self, signum: int) -> dict[str, Any]:
        """After STOP: checkpoint a stop, give the first player this rank's end-of-run part."""
        session = self.session
        if signum and session.last_checkpoint < self.update:
            self.checkpoint()
        digest = parameters_digest(*policies_of(self.learners).values())
        self.topo.gather(
            {"digest": digest, "time": session.watch.totals, "device": str(self.fabric.device)}, "end"
        )
        if signum:
            session.stop(signum, self.update)
        session.logger.close()
        return {"strategy": "decoupled", "rank": self.topo.rank, "role": "trainer"}


if __name__ == "__main__":
    from ppo_fabric.app.launch import run_script

    run_script("decoupled", main)
