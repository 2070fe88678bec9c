"""Learning evidence over seeds on the standard suites, beside published references at the same budget.

Each (suite, env, variant, seed) is one training run in a fresh process, one at a time. Results accumulate in
`<out>/learning_<suite>.json` keyed by (env, variant, seed): a run already there is skipped, so a suite can be
run over several sittings (`--force` re-runs). Each write rebuilds `learning_<suite>.md` (one row per env and
variant: the final mean return over seeds, the reference, the wall time) and `learning_<suite>.png` (mean
return against env steps, every seed).

    python -m benchmarks learning --suite classic --seeds 5                # CartPole, Acrobot, Pendulum, ...
    python -m benchmarks learning --suite classic --envs CartPole-v1 --seeds 5 --variants coupled pipelined
    python -m benchmarks learning --suite mujoco --seeds 3                 # needs the mujoco extra
    python -m benchmarks learning --suite minatar --seeds 3 --variants coupled pipelined   # exp=minatar, 5M
    python -m benchmarks learning --suite classic --steps 20000 --out /tmp/learning   # smoke test
    python -m benchmarks learning --suite box2d --envs BipedalWalker-v3 --seed-list 4 5   # held-out seeds
    python -m benchmarks learning --suite classic --envs CartPole-v1 --out DIR -- algo.vf_coef=0.25   # a recipe change
    python -m benchmarks learning --suite classic --envs Acrobot-v1 --seeds 10 --eval --force   # evaluated
    python -m benchmarks learning --suite recurrent --seeds 3                  # LSTM vs MLP, velocities hidden
    python -m benchmarks learning --suite multiagent --seeds 3                 # MPE spread, a two-team game
    python -m benchmarks learning --suite games --envs tictactoe_v3 --seeds 1  # self-play vs held-out players
    python -m benchmarks learning --suite recurrent --envs CartPole-v1/velocities-zeroed --seed-list 6 7 8 9 10
    python -m benchmarks learning --suite games --envs connect_four_v3 --steps 20000000 --keep-runs DIR --out DIR

Variants: `coupled` (1 process) and `pipelined` (decoupled, 1 player + 1 trainer, `algo.pipeline=true`); the
`recurrent` suite compares models instead (`lstm`, and `mlp`: the same recipe without memory). The
`recurrent`, `multiagent` and `games` suites always evaluate during training: their score is an evaluation
metric (`Task.score`: a policy's return, or a game's score, win 1 and draw 1/2, against the opponents it
trains against or could be tuned on, with the win rate against each opponent, held-out players included,
beside it, `Task.shown`), as their training return says little (the games are zero-sum self-play).
A run that `time_to_score.py` already trained with the same overrides (its MuJoCo coupled and pipelined runs
at the recipe's budget) is taken from `results/time_to_score.json` instead of trained again (`--reuse`).
"Final" is the mean return of the run's last 20 episodes (`summary.json`'s `final_mean_return`), the
training return with the stochastic policy, as CleanRL reports; RL Zoo's references evaluate the
deterministic policy after training, which tends to score higher. The references are copied, with their
budget and source, in `SUITES`; where ours runs a different budget or lacks a method the reference used,
the `note` says so.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import stats  # noqa: E402
from common import RESULTS, run_once, thin  # noqa: E402

CLEANRL = "CleanRL ppo.py, docs.cleanrl.dev/rl-algorithms/ppo (500k steps)"
CLEANRL_MUJOCO = (
    "CleanRL ppo_continuous_action.py on the v4 envs, docs.cleanrl.dev/rl-algorithms/ppo (1M steps)"
)
ZOO = "RL Zoo benchmark.md (one run, deterministic evaluation)"
MINATAR = (
    "gymnax README's table of its gymnax-blines PPO checkpoints (github.com/RobertTLange/gymnax, one run each, "
    "10M steps, gymnax's own MinAtar: no sticky actions, episodes capped at 1,000 steps, gamma 0.999, an MLP "
    "of 2x256); no table at 5M with MinAtar's sticky actions was found (Young and Tian 2019, arXiv 1903.03176, "
    "report curves of DQN and AC(lambda))"
)


@dataclass(frozen=True)
class Task:
    env: str  # the row's name: the env id, or a name of its own where one env holds several tasks
    overrides: tuple[str, ...]
    reference: tuple[float, float | None] | None  # mean, std (None: one run)
    source: str
    note: str = ""
    score: str = "eval/return_mean"  # the evaluation metric that ranks the runs (evaluated runs only)
    shown: tuple[str, ...] = ()  # more final-evaluation metrics the report shows (per policy, per opponent)


HIDDEN = "the policy must remember earlier observations; CartPole is solved at 475"
MEASURED = (
    "measured here by stepping the env: a scripted policy that reads the env's state to go to the "
    "nearest assignment of landmarks (a rough ceiling; random actions: -27.0), retired multiagent.py"
)
OPTIMAL = "the agents' optimal return against a random adversary team: 8 steps x (1 - 1/3)"
HELD_OUT = (
    "eval/random/win_rate",
    "eval/win_or_block/win_rate",
    "eval/win_or_block:centre/win_rate",
    "eval/win_or_block:careful/win_rate",
    "eval/search:1/win_rate",
    *(
        f"eval/{player}/win_rate_moving_second"
        for player in ("win_or_block:centre", "win_or_block:careful", "search:1")
    ),
)  # games/scripted.py's players; moving second, where a policy that opens well still loses
TEAMS = (
    "env=pettingzoo",
    "env.id=ppo_fabric.envs.toy_multiagent:teams_v0",
    "multiagent.policies={adversary:{},agent:{}}",
    "multiagent.policy_mapping={adversary_*:adversary,agent_*:agent}",
    "algo.rollout_steps=32",
    "algo.minibatch_size=64",
    "algo.lr=1e-3",
    "algo.gamma=0.9",
    "algo.total_steps=100000",
)
SUITES: dict[str, tuple[Task, ...]] = {
    "classic": (
        Task("CartPole-v1", ("exp=cleanrl_cartpole", "algo.total_steps=500000"), (490.04, 6.12), CLEANRL,
             "CleanRL's workload (its value loss), 500k"),
        Task("Acrobot-v1", ("env.id=Acrobot-v1", "algo.total_steps=500000"), (-86.36, 1.32), CLEANRL,
             "CleanRL's ppo.py defaults, 500k"),
        Task("Pendulum-v1", ("env=pendulum",), (-172.23, 104.16), f"{ZOO}, PPO 100k with gSDE",
             "200k without gSDE"),
        Task("MountainCarContinuous-v0", ("env.id=MountainCarContinuous-v0", "env.normalize_obs=true",
             "env.normalize_reward=true", "algo.total_steps=500000"), (88.34, 2.57),
             f"{ZOO}, PPO 20k with gSDE and tuned values", "the default values, no gSDE, 500k"),
    ),
    "box2d": (
        Task("LunarLander-v3", ("env=lunarlander",), (242.12, 31.82), f"{ZOO}, PPO LunarLander-v2, 1M", "1M"),
        # target_kl: without an entropy bonus the action std shrinks until each update's KL reaches 0.2 and the
        # gait is lost (bipedalwalker_seed3_diagnosis.md); stopping an update's epochs at 0.02 keeps it ~0.016
        Task("BipedalWalker-v3", ("exp=mujoco", "env.id=BipedalWalker-v3", "algo.total_steps=5000000",
             "algo.target_kl=0.02"), (213.30, 129.49), f"{ZOO}, PPO BipedalWalker-v3, 5M",
             "exp=mujoco's values with algo.target_kl=0.02, 5M"),
    ),
    "mujoco": (
        Task("HalfCheetah-v5", ("exp=mujoco",), (1442.64, 46.03), CLEANRL_MUJOCO, "v5, 1M"),
        Task("Hopper-v5", ("exp=mujoco", "env.id=Hopper-v5"), (2382.86, 271.74), CLEANRL_MUJOCO, "v5, 1M"),
        Task("Walker2d-v5", ("exp=mujoco", "env.id=Walker2d-v5"), (2287.95, 571.78), CLEANRL_MUJOCO, "v5, 1M"),
    ),
    "minatar": (
        Task("MinAtar/Breakout-v1", ("exp=minatar",), (28.0, None), MINATAR, "5M (reference: 10M)"),
        Task("MinAtar/SpaceInvaders-v1", ("exp=minatar", "env.id=MinAtar/SpaceInvaders-v1"), (131.0, None),
             MINATAR, "5M (reference: 10M)"),
    ),
    "recurrent": (  # exp=cartpole_lstm: RL-Zoo's RecurrentPPO settings for CartPoleNoVel with 10 epochs, 200k
        Task("CartPole-v1/velocities-dropped", ("exp=cartpole_lstm",), None, HIDDEN,
             "2 observations: cart position, pole angle"),
        Task("CartPole-v1/velocities-zeroed", ("exp=cartpole_lstm", "env.mask_velocity=zero"), None, HIDDEN,
             "4 observations, the velocities read 0"),
        Task("CartPole-v1/noisy", ("exp=cartpole_lstm", "env.mask_velocity=false",
             "env.observation_noise=0.1"), None, HIDDEN, "4 observations, each with N(0, 0.1^2) added"),
    ),
    "multiagent": (
        Task("mpe2.simple_spread_v3", ("exp=mpe_spread",), (-9.14, None), MEASURED,
             "3 agents share one policy; return per agent-episode, 400k"),
        Task("teams_v0/adversary-frozen", (*TEAMS, "multiagent.policies_to_train=[agent]"), (5.33, None),
             OPTIMAL, "2 agents vs 2 adversaries frozen at their random start, 100k",
             score="eval/agent/return_mean", shown=("eval/adversary/return_mean",)),
    ),
    "games": (  # self-play; every evaluation plays 100 greedy games against each opponent, seats alternated
        Task("tictactoe_v3", ("exp=tictactoe", "eval.episodes=100"), None, "a perfect player scores >= 0.5",
             "1M moves", score="eval/score", shown=("eval/random/win_rate", "eval/loss_rate")),
        Task("connect_four_v3", ("exp=connect_four", "eval.episodes=100"), None,
             "the target: greedy wins >= 60% against the held-out players", "6M moves; trains against "
             "random and win_or_block, never the other three", score="eval/score", shown=HELD_OUT),
    ),
}  # fmt: skip
LAYOUTS = {name: common.LAYOUTS[name] for name in ("coupled", "pipelined")}
# A suite's variants (default: the two layouts) and the pair whose P(first > second) its table gives.
SUITE_VARIANTS: dict[str, dict[str, tuple[str, ...]]] = {
    "recurrent": {"lstm": common.LAYOUTS["coupled"], "mlp": (*common.LAYOUTS["coupled"], "model=mlp")},
}
PAIRS: dict[str, tuple[tuple[str, str], ...]] = {"recurrent": (("lstm", "mlp"),)}
EVALUATED = ("recurrent", "multiagent", "games")  # scored by evaluation: they always evaluate


def variants_of(suite: str) -> dict[str, tuple[str, ...]]:
    return SUITE_VARIANTS.get(suite, LAYOUTS)


def task_named(env: str) -> Task:
    return next(t for tasks in SUITES.values() for t in tasks if t.env == env)


def run_overrides(
    task: Task, variant: str, seed: int, steps: int | None, extra: tuple[str, ...] = (), suite: str = ""
) -> list[str]:
    """A run's overrides: the task's recipe, the variant's layout, the seed, the budget, then `extra`."""
    overrides = [*task.overrides, *variants_of(suite)[variant], f"seed={seed}"]
    if steps:
        overrides.append(f"algo.total_steps={steps}")
    return [*overrides, *extra]


def run_record(
    task: Task,
    variant: str,
    seed: int,
    steps: int | None,
    extra: tuple[str, ...] = (),
    evaluate: bool = False,
    suite: str = "",
    keep: Path | None = None,
) -> dict[str, Any]:
    """One run's record. `keep`: the folder under which the run's own folder stays (`kept_run_dir`) and
    resumes from its last checkpoint when the same command is given again, saving one every
    `KEPT_CHECKPOINT_MINUTES`: a budget longer than a sitting runs over several."""
    # the evaluation's settings first, so that a task's own (games: more games an evaluation) win
    overrides = (common.EVALUATION if evaluate else []) + run_overrides(
        task, variant, seed, steps, extra, suite
    )
    run_dir = None
    if keep is not None:
        run_dir = kept_run_dir(keep, task.env, variant, seed)
        overrides.append(f"checkpoint.every_minutes={KEPT_CHECKPOINT_MINUTES}")
    commit = common.git_commit()  # the code the run starts with (a sitting outlasts commits made beside it)
    s = run_once(overrides, curve=True, eval_key=task.score, run_dir=run_dir)
    evaluated = s.get("eval_curve") or []
    # a kept run may have trained over several sittings: its whole training time and rate
    wall = s.get("total_wall_seconds", s["wall_seconds"]) if keep else s["wall_seconds"]
    return {
        "env": task.env,
        "variant": variant,
        "seed": seed,
        "overrides": overrides,
        "commit": commit,
        "machine": common.machine()["cpu"],  # each run's own: a report gathers sittings of several machines
        "total_env_steps": s["total_env_steps"],
        "final_mean_return": s["final_mean_return"],
        "wall_seconds": wall,
        "sps": s["total_env_steps"] / wall if keep else s["sps"],
        "curve": thin(s["curve"]),
        **(
            {  # evaluated during training (--eval): the final evaluation and the best
                "final_eval_return": evaluated[-1][2],
                "best_eval_return": max(e[2] for e in evaluated),
                "eval_curve": evaluated,
                "final_eval": s.get("final_eval", {}),  # every eval/* metric of the last evaluation
            }
            if evaluated
            else {}
        ),
    }


KEPT_CHECKPOINT_MINUTES = 10  # --keep-runs: what a sitting stopped without warning loses at most


def kept_run_dir(keep: Path, env: str, variant: str, seed: int) -> Path:
    """A kept run's folder: one per (env, variant, seed), so the same command finds it again."""
    return keep / f"{env.replace('/', '_')}_{variant}_seed{seed}"


EVALUATED_FIELDS = ("final_eval_return", "best_eval_return", "eval_curve", "final_eval")


def same_overrides(theirs: list[str], ours: list[str], evaluate: bool) -> bool:
    """Whether a run with `theirs` is the run `ours` asks for: the same list, or, evaluated, the same list
    with the evaluation's overrides placed elsewhere (time_to_score puts them after the seed, this benchmark
    before the task's; they set keys nothing else in either list sets)."""
    if theirs == ours:
        return True
    rest = [[o for o in x if o not in common.EVALUATION] for x in (theirs, ours)]
    return evaluate and all(set(common.EVALUATION) <= set(x) for x in (theirs, ours)) and rest[0] == rest[1]


def reused_record(
    task: Task,
    variant: str,
    seed: int,
    steps: int | None,
    paths: list[Path],
    extra: tuple[str, ...] = (),
    evaluate: bool = False,
    suite: str = "",
) -> dict[str, Any] | None:
    """This run as another benchmark already ran it (the same overrides, full budget, e.g. `time_to_score.py`'s
    coupled and pipelined MuJoCo runs), so a run is trained once and reported by both; None when none did.
    A `learning_<suite>.json` found there is this benchmark's own sitting (`--seed-list` side by side): its
    run is gathered as it is, marked with the sitting's report instead of another benchmark's name, and an
    evaluated run (`evaluate`: the overrides begin with the evaluation's) keeps its evaluations."""
    overrides = (common.EVALUATION if evaluate else []) + run_overrides(
        task, variant, seed, steps, extra, suite
    )
    for path in paths:
        for r in json.loads(path.read_text()).get("runs", []) if path.is_file() else []:
            if (
                same_overrides(r.get("overrides") or [], overrides, evaluate)
                and not r.get("stopped")
                and r.get("curve")
            ):
                if evaluate and "final_eval_return" not in r:
                    continue
                return {"env": task.env, "variant": variant, "seed": seed, "overrides": overrides,
                        "commit": r["commit"], "total_env_steps": r["total_env_steps"],
                        "final_mean_return": r["final_mean_return"], "wall_seconds": r["wall_seconds"],
                        "sps": r["sps"], "curve": thin(r["curve"]),
                        **({"machine": r["machine"]} if r.get("machine") else {}),
                        **{k: r[k] for k in EVALUATED_FIELDS if evaluate and k in r},
                        **({"sitting": str(path)} if path.name.startswith("learning_") else {"run_by": path.name})}  # fmt: skip
    return None


def shown_lines(suite: str, runs: list[dict[str, Any]]) -> list[str]:
    """The tasks' further final-evaluation metrics (`Task.shown`), mean ± std over the evaluated seeds."""
    rows = []
    for task in SUITES[suite]:
        for variant in variants_of(suite):
            mine = [
                r for r in runs if (r["env"], r["variant"]) == (task.env, variant) and r.get("final_eval")
            ]
            for key in task.shown if mine else ():
                values = [r["final_eval"][key] for r in mine if key in r["final_eval"]]
                if values:  # none: a metric newer than these runs
                    rows.append(
                        f"| {task.env} | {variant} | `{key}` | {common.mean_std(values, '.3f')} ({len(values)}) |"
                    )
    if not rows:
        return []
    return ["## More of the final evaluation", "", "| task | variant | metric | mean ± std (runs) |",
            "|---|---|---|---:|", *rows, ""]  # fmt: skip


def markdown(suite: str, report: dict[str, Any], command: str) -> str:
    runs, m, variants = report["runs"], report["machine"], list(variants_of(suite))
    any_eval = any("final_eval_return" in r for r in runs)
    lines = [
        f"# Learning: the {suite} suite",
        "",
        f"Machine: {common.machines_line(runs, m)}. Final: mean return of the last 20 "
        "training episodes at the end of each run, mean ± std over the seeds shown. Wall: the run's own "
        "training time (process start-up excluded), mean over seeds.",
        "",
        "| env | variant | seeds | steps | final | reference | wall s | SPS | budget here |"
        + (" final eval (runs) |" if any_eval else ""),
        "|---|---|---|---:|---:|---:|---:|---:|---|" + ("---:|" if any_eval else ""),
    ]
    for task in SUITES[suite]:
        for variant in variants:
            mine = sorted(
                (r for r in runs if (r["env"], r["variant"]) == (task.env, variant)), key=lambda r: r["seed"]
            )
            if not mine:
                continue
            ref = "n/a" if task.reference is None else f"{task.reference[0]:.1f}"
            ref += (
                "" if task.reference is None or task.reference[1] is None else f" ± {task.reference[1]:.1f}"
            )
            finals = [r["final_mean_return"] for r in mine if r["final_mean_return"] is not None]
            evals = [r["final_eval_return"] for r in mine if "final_eval_return" in r]
            lines.append(
                f"| {task.env} | {variant} | {','.join(str(r['seed']) for r in mine)} "
                f"| {statistics.mean(r['total_env_steps'] for r in mine):,.0f} | {common.mean_std(finals)} | {ref} "
                f"| {statistics.mean(r['wall_seconds'] for r in mine):.0f} "
                f"| {statistics.mean(r['sps'] for r in mine):,.0f} | {task.note} |"
                + (f" {common.mean_std(evals)} ({len(evals)}) |" if any_eval else "")
            )
    sources = sorted({t.source for t in SUITES[suite] if any(r["env"] == t.env for r in runs)})
    commits = sorted({r["commit"] for r in runs})
    if report.get("extra"):
        lines += ["", f"Every run here adds `{' '.join(report['extra'])}` to its recipe: the recipe changed, not "
                  "the suite's own rows (those are in `benchmarks/results/`)."]  # fmt: skip
    reused = sorted({r["run_by"] for r in runs if r.get("run_by")})
    lines += ["", "References: " + "; ".join(sources) + ".", ""]
    if reused:
        lines += [f"Runs trained by another benchmark with the same overrides and taken from its report: "
                  f"{', '.join(reused)} (`run_by` in the JSON).", ""]  # fmt: skip
    envs = [t.env for t in SUITES[suite]]
    pairs = PAIRS.get(suite, stats.PAIRS)
    spec = ".3f" if suite == "games" else ".1f"  # a game's score lies in [0, 1]
    table = stats.markdown_table(runs, "env", pairs, tasks=envs, variants=variants, spec=spec)
    scored = sorted({task_named(r["env"]).score for r in runs if "final_eval_return" in r})
    keys = ", ".join(f"`{k}`" for k in scored)
    what = (
        "final return"
        if not scored
        else "final evaluation return (10 deterministic episodes at the last update)"
        if scored == ["eval/return_mean"] and suite not in EVALUATED
        else f"final evaluation {'score' if suite == 'games' else 'return'} ({keys} at the last update)"
    )
    if table:
        lines += [f"## The {what} over seeds: IQM and probability of improvement", "", *table, "",
                  f"![performance profiles of the {what}](learning_{suite}_profile.png)", ""]  # fmt: skip
    lines += shown_lines(suite, runs)
    if scored and suite not in EVALUATED:  # every run's training return too, as CleanRL reports it
        training = stats.markdown_table(runs, "env", pairs, tasks=envs, variants=variants,
                                        score=lambda r: None if r.get("stopped") else r.get("final_mean_return"))  # fmt: skip
        lines += ["## Every run's final training return (last 20 episodes, as CleanRL reports)", "",
                  *training[:-1], ""]  # fmt: skip
    lines += [
        f"Commits of the runs: {', '.join(commits)} (each run's own is in `learning_{suite}.json`). The last "
        f"sitting: `{command}`.",
        "",
        f"![{'the evaluation' if suite in EVALUATED else 'mean return'} against env steps](learning_{suite}.png)",
        "",
    ]
    return "\n".join(lines)


def plot(suite: str, report: dict[str, Any], path: Path) -> None:
    """The learning curves against env steps (the training mean return over 20 episodes; the evaluation
    score in a suite scored by evaluation), one panel per env, one colour per variant; and beside it
    (`<name>_profile.png`) the performance profiles of the final scores over seeds, one panel per env."""
    envs = [t.env for t in SUITES[suite] if any(r["env"] == t.env for r in report["runs"])]
    variants = tuple(variants_of(suite))
    if suite in EVALUATED:
        runs = [{**r, "curve": r.get("eval_curve") or []} for r in report["runs"]]
        common.plot_curves(runs, "env", envs, variants, 0, "env steps", path, ylabel="final evaluation score")
    else:
        common.plot_curves(report["runs"], "env", envs, variants, 0, "env steps", path)
    stats.plot_profiles(report["runs"], "env", path.with_name(f"{path.stem}_profile.png"), tasks=envs,
                        variants=list(variants))  # fmt: skip


def main() -> None:
    parser = common.argument_parser(__doc__)
    parser.add_argument("--suite", choices=sorted(SUITES), required=True)
    parser.add_argument("--envs", nargs="+", default=None, help="a subset of the suite's envs (tasks)")
    parser.add_argument("--variants", nargs="+", default=None,
                        help="the suite's variants to run (default: coupled, or every model the suite compares)")  # fmt: skip
    parser.add_argument("--seeds", type=int, default=5, help="seeds 1..N")
    parser.add_argument("--seed-list", nargs="+", type=int, default=None,
                        help="these seeds instead of 1..N: held-out seeds, or one seed per sitting when "
                        "sittings run side by side (each with its own --out; gather them with --reuse)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=None, help="env steps per run (default: the recipe's)")
    parser.add_argument("--eval", action="store_true", help="evaluate during training (eval.every=auto, 10 "
                        "episodes); the IQM table ranks the final evaluation return")  # fmt: skip
    parser.add_argument("--force", action="store_true", help="re-run runs already in the results")
    parser.add_argument("--keep-runs", type=Path, default=None, metavar="DIR",
                        help="keep each run's folder under DIR, checkpointed every 10 minutes; the same "
                        "command given again resumes an unfinished run (a budget longer than a sitting)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--reuse", nargs="*", type=Path, default=None,
                        help="reports whose runs with the same overrides are taken instead of training again "
                        "(default: time_to_score.json, none with --force; none: --reuse with no path)")  # fmt: skip
    parser.add_argument("extra", nargs="*", help="overrides added to every run (after --); needs an --out of "
                        "its own, as they change the recipe")  # fmt: skip
    args = parser.parse_args()
    if args.reuse is None:  # --force trains again: it does not take another report's runs unless told to
        args.reuse = [] if args.force else [RESULTS / "time_to_score.json"]
    extra = tuple(args.extra)
    if extra and args.out.resolve() == RESULTS.resolve():
        parser.error("overrides after -- change the recipe: write their runs elsewhere with --out DIR")
    known = variants_of(args.suite)
    chosen = args.variants or (list(known) if args.suite in SUITE_VARIANTS else ["coupled"])
    if set(chosen) - set(known):
        parser.error(
            f"the {args.suite} suite's variants are {list(known)}, not {sorted(set(chosen) - set(known))}"
        )
    tasks = [t for t in SUITES[args.suite] if args.envs is None or t.env in args.envs]
    unknown = set(args.envs or ()) - {t.env for t in SUITES[args.suite]}
    if unknown:
        raise SystemExit(f"not in the {args.suite} suite: {sorted(unknown)}")
    evaluate = args.eval or args.suite in EVALUATED
    name = f"learning_{args.suite}"
    path = args.out / f"{name}.json"
    report = common.load_report(path, {"suite": args.suite, "runs": []}, ("env", "variant", "seed"))
    if report.get("extra", []) != list(extra) and report["runs"]:
        parser.error(f"{path} holds runs with the overrides {report.get('extra', [])}, not {list(extra)}")
    report["machine"], report["extra"] = common.machine(), list(extra)
    command = common.command_line(__file__)
    seeds = args.seed_list or range(1, args.seeds + 1)
    for seed in seeds:  # seed-major: a partial sitting covers every env
        for task in tasks:
            for variant in chosen:
                done = common.runs_to_replace(report, args.force, env=task.env, variant=variant, seed=seed)
                if done is None:
                    continue
                reused = reused_record(
                    task, variant, seed, args.steps, args.reuse, extra, evaluate, args.suite
                )
                r = reused or run_record(
                    task, variant, seed, args.steps, extra, evaluate, args.suite, args.keep_runs
                )
                common.replace_runs(report, done, r)
                print(f"{task.env} {variant} seed {seed}: final {r['final_mean_return']}, "
                      f"{r['wall_seconds']:.0f} s", flush=True)  # fmt: skip
                common.write_report(args.out, name, report, markdown(args.suite, report, command))
                plot(args.suite, report, args.out / f"{name}.png")


if __name__ == "__main__":
    main()
