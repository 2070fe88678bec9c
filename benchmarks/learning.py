"""Learning evidence over seeds on the standard suites, beside published references at the same budget.

One run per (suite task, variant, seed), seed-major, each in a fresh process; the runs accumulate in
`<out>/learning_<suite>.{json,md,png}` (a run already there is skipped unless `--force`). The suites, the
variants, `--reuse`, `--keep-runs` and the figures: benchmarks/README.md, "learning.py".

    python -m benchmarks learning --suite classic --envs CartPole-v1 --seeds 1 --steps 4096 --out /tmp/l
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
from common import RESULTS, run_once  # noqa: E402

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
# A suite's variants (default: the coupled and pipelined layouts) and the pair whose P(first > second) its
# table gives.
SUITE_VARIANTS: dict[str, dict[str, tuple[str, ...]]] = {
    "recurrent": {"lstm": common.LAYOUTS["coupled"], "mlp": (*common.LAYOUTS["coupled"], "model=mlp")},
}
PAIRS: dict[str, tuple[tuple[str, str], ...]] = {"recurrent": (("lstm", "mlp"),)}
EVALUATED = ("recurrent", "multiagent", "games")  # scored by evaluation: they always evaluate
KEPT_CHECKPOINT_MINUTES = 10  # --keep-runs: what a sitting stopped without warning loses at most


def variants_of(suite: str) -> dict[str, tuple[str, ...]]:
    return SUITE_VARIANTS.get(suite, {name: common.LAYOUTS[name] for name in ("coupled", "pipelined")})


def task_named(env: str, suite: str | None = None) -> Task:
    """The task of `env`: in `suite` when given (a report's runs are read as that suite's), else in any."""
    for name, tasks in SUITES.items():
        for task in tasks:
            if task.env == env and suite in (None, name):
                return task
    raise SystemExit(f"learning: no task {env!r} in {'the ' + suite + ' suite' if suite else 'any suite'}")


def run_record(
    task: Task, overrides: list[str], keep: Path | None = None, *, env: str, variant: str, seed: int
) -> dict[str, Any]:
    """One run's record (`common.record`). `keep`: the folder under which the run's own folder stays
    (`DIR/<env>_<variant>_seed<N>`, one per key, so the same command finds it again) and resumes from its last
    checkpoint, saving one every `KEPT_CHECKPOINT_MINUTES`: a budget longer than a sitting runs over several."""
    run_dir = None if keep is None else keep / f"{env.replace('/', '_')}_{variant}_seed{seed}"
    overrides = [*overrides, *([f"checkpoint.every_minutes={KEPT_CHECKPOINT_MINUTES}"] if keep else [])]
    train = lambda: run_once(overrides, curve=True, eval_key=task.score, run_dir=run_dir)  # noqa: E731
    return common.record(overrides, train, points=200)


def reused(overrides: list[str], paths: list[Path], evaluate: bool) -> dict[str, Any] | None:
    """This run as a report in `paths` already holds it (the same overrides, `common.effective`, its whole
    budget), so a run is trained once and reported by both, e.g. time_to_score's MuJoCo runs; None when none
    does. A `learning_<suite>.json` there is this benchmark's own sitting (`--seed-list` side by side): its
    run is marked with the sitting's path, another benchmark's with its file name (`run_by`). An evaluated
    run (`evaluate`) is taken only with its evaluations."""
    for path in paths:
        for r in json.loads(path.read_text()).get("runs", []) if path.is_file() else []:
            same = common.effective(r.get("overrides") or []) == common.effective(overrides)
            if (
                same
                and not r.get("stopped")
                and r.get("curve")
                and (not evaluate or "final_eval_return" in r)
            ):
                by = {"sitting": str(path)} if path.name.startswith("learning_") else {"run_by": path.name}
                kept = {k: v for k, v in r.items() if k not in ("env", "variant", "seed", "workload", "load")}
                return {**kept, "overrides": overrides, "curve": common.thin(r["curve"], 200), **by}
    return None


def shown_lines(suite: str, runs: list[dict[str, Any]]) -> list[str]:
    """The tasks' further final-evaluation metrics (`Task.shown`), mean ± std over the evaluated seeds."""
    rows = []
    evaluated = [r for r in runs if r.get("final_eval")]
    for env, variant, mine in common.groups(
        evaluated, "env", [t.env for t in SUITES[suite]], variants_of(suite)
    ):
        for key in task_named(env, suite).shown:
            values = [r["final_eval"][key] for r in mine if key in r["final_eval"]]
            if values:  # none: a metric newer than these runs
                rows.append(
                    f"| {env} | {variant} | `{key}` | {common.mean_std(values, '.3f')} ({len(values)}) |"
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
    for env, variant, mine in common.groups(runs, "env", [t.env for t in SUITES[suite]], variants):
        task, ref = task_named(env, suite), "n/a"
        if task.reference is not None:
            ref = f"{task.reference[0]:.1f}" + (
                "" if task.reference[1] is None else f" ± {task.reference[1]:.1f}"
            )
        finals = [r["final_mean_return"] for r in mine if r["final_mean_return"] is not None]
        evals = [r["final_eval_return"] for r in mine if "final_eval_return" in r]
        lines.append(
            f"| {env} | {variant} | {','.join(str(r['seed']) for r in mine)} "
            f"| {statistics.mean(r['total_env_steps'] for r in mine):,.0f} | {common.mean_std(finals)} | {ref} "
            f"| {statistics.mean(r['wall_seconds'] for r in mine):.0f} "
            f"| {statistics.mean(r['sps'] for r in mine):,.0f} | {task.note} |"
            + (f" {common.mean_std(evals)} ({len(evals)}) |" if any_eval else "")
        )
    sources = sorted({t.source for t in SUITES[suite] if any(r["env"] == t.env for r in runs)})
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
    scored = sorted(
        {task_named(r["env"], suite).score for r in runs if "final_eval_return" in r and r["env"] in envs}
    )
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
    plot = f"{'the evaluation' if suite in EVALUATED else 'mean return'} against env steps"
    return "\n".join([*lines, *common.footer(runs, f"learning_{suite}", command, plot)])


def plot(suite: str, report: dict[str, Any], path: Path) -> None:
    """The learning curves against env steps (the training mean return over 20 episodes; the evaluation
    score in a suite scored by evaluation), one panel per env, one colour per variant; and beside it
    (`<name>_profile.png`) the performance profiles of the final scores over seeds, one panel per env."""
    envs = [t.env for t in SUITES[suite] if any(r["env"] == t.env for r in report["runs"])]
    variants = tuple(variants_of(suite))
    runs = (
        [{**r, "curve": r.get("eval_curve") or []} for r in report["runs"]]
        if suite in EVALUATED
        else report["runs"]
    )
    ylabel = "final evaluation score" if suite in EVALUATED else "mean return, last 20 episodes"
    common.plot_curves(runs, "env", envs, variants, 0, path, ylabel=ylabel)
    stats.plot_profiles(report["runs"], "env", path.with_name(f"{path.stem}_profile.png"), tasks=envs,
                        variants=list(variants))  # fmt: skip


def main() -> None:
    parser = common.argument_parser(__doc__)
    parser.add_argument("--suite", choices=sorted(SUITES), required=True)
    parser.add_argument("--envs", nargs="+", default=None, help="a subset of the suite's envs (tasks)")
    parser.add_argument("--variants", nargs="+", default=None,
                        help="the suite's variants to run (default: coupled, or every model the suite compares)")  # fmt: skip
    common.sweep_arguments(parser, seeds=5)
    parser.add_argument("--keep-runs", type=Path, default=None, metavar="DIR",
                        help="keep each run's folder under DIR, checkpointed every 10 minutes; the same "
                        "command given again resumes an unfinished run (a budget longer than a sitting)")  # fmt: skip
    parser.add_argument("--reuse", nargs="*", type=Path, default=None,
                        help="reports whose runs with the same overrides are taken instead of training again "
                        "(default: time_to_score.json, none with --force; none: --reuse with no path)")  # fmt: skip
    parser.add_argument("extra", nargs="*", help="overrides added to every run (after --); needs an --out of "
                        "its own, as they change the recipe")  # fmt: skip
    args = parser.parse_args()
    if args.reuse is None:  # --force trains again: it does not take another report's runs unless told to
        args.reuse = [] if args.force else [RESULTS / "time_to_score.json"]
    elif missing := [str(p) for p in args.reuse if not p.is_file()]:  # a typo would train every run again
        parser.error(f"--reuse: no such file {', '.join(missing)}")
    if args.extra and args.out.resolve() == RESULTS.resolve():
        parser.error("overrides after -- change the recipe: write their runs elsewhere with --out DIR")
    known = variants_of(args.suite)
    chosen = args.variants or (list(known) if args.suite in SUITE_VARIANTS else ["coupled"])
    if set(chosen) - set(known):
        parser.error(
            f"the {args.suite} suite's variants are {list(known)}, not {sorted(set(chosen) - set(known))}"
        )
    if unknown := set(args.envs or ()) - {t.env for t in SUITES[args.suite]}:
        raise SystemExit(f"not in the {args.suite} suite: {sorted(unknown)}")
    tasks = {t.env: t for t in SUITES[args.suite] if args.envs is None or t.env in args.envs}
    evaluate = args.eval or args.suite in EVALUATED
    name = f"learning_{args.suite}"
    report = common.load_report(
        args.out / f"{name}.json", {"suite": args.suite, "runs": []}, ("env", "variant", "seed")
    )
    if report.get("extra", []) != args.extra and report["runs"]:
        parser.error(
            f"{args.out / name}.json holds runs with the overrides {report.get('extra', [])}, not {args.extra}"
        )
    report["machine"], report["extra"] = common.machine(), args.extra
    command = common.command_line(__file__)

    def run(env: str, variant: str, seed: int) -> dict[str, Any]:
        task = tasks[env]
        o = common.overrides(task.overrides, known[variant], seed, args.steps, evaluate, args.extra)
        return reused(o, args.reuse, evaluate) or run_record(
            task, o, args.keep_runs, env=env, variant=variant, seed=seed
        )

    def write(report: dict[str, Any]) -> None:
        common.write_report(args.out, name, report, markdown(args.suite, report, command))
        plot(args.suite, report, args.out / f"{name}.png")

    cells = common.cells(args, env=tasks, variant=chosen)
    common.sweep(report, cells, args.force, run, write, rerender=False)  # its machine: the last that ran


if __name__ == "__main__":
    main()
