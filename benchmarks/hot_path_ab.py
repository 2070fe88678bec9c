"""The hot path of this checkout against another commit's, in one process: `update.update_policy`,
`rollout.RolloutCollector.collect` and the policy (`agent.ActorCritic`, acting in this checkout's rollout
with the same weights), each version alternated call by call on the same learner, batch and envs.

End-to-end A/B runs on a shared 2-core machine move by 10-20% with other jobs' load; running both versions
in one process, interleaved, makes the load hit them alike. The other commit's `ppo_fabric/update.py` and
`ppo_fabric/rollout.py` are read with `git show` and imported as modules of their own, on top of this
checkout's package (they must still import against it: hot-path modules of nearby commits do), and so is its
`ppo_fabric/agent.py`. Reports the median CPU time (this thread) of an update, of a rollout and of a rollout
acting with each version's policy, for each version, and their ratios; writes
benchmarks/results/hot_path_ab_<commit>.{json,md}.

    .venv/bin/python benchmarks/hot_path_ab.py --against 53958c8 [--exp cleanrl_cartpole] [--rounds 40]
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))  # ppo_fabric of this checkout
import common  # noqa: E402

from ppo_fabric import update as this_update  # noqa: E402
from ppo_fabric.config import training_layout  # noqa: E402
from ppo_fabric.launch import build_fabric  # noqa: E402
from ppo_fabric.learners import build_learners, policies_of, policy_specs  # noqa: E402
from ppo_fabric.multiagent import SINGLE  # noqa: E402
from ppo_fabric.preflight import load  # noqa: E402
from ppo_fabric.rollout import build_collector, training_batches  # noqa: E402


def module_at(commit: str, name: str, tmp: Path) -> ModuleType:
    """`ppo_fabric/<name>.py` as it is at `commit`, imported as `<name>_at_<commit>`."""
    text = subprocess.run(
        ["git", "show", f"{commit}:ppo_fabric/{name}.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = tmp / f"{name}_at_{commit}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = common.argument_parser(__doc__)
    parser.add_argument("--against", required=True, help="the other commit")
    parser.add_argument("--exp", default="cleanrl_cartpole")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        other_update = module_at(args.against, "update", Path(tmp))
        other_rollout = module_at(args.against, "rollout", Path(tmp))
        other_agent = module_at(args.against, "agent", Path(tmp))
    cfg, _, _ = load([f"exp={args.exp}", "logger=none"])
    torch.set_num_threads(1)
    fabric = build_fabric(cfg, 1)
    specs = policy_specs(cfg)
    learners = build_learners(fabric, specs, None, float(cfg.algo.adam_eps))
    this = build_collector(cfg, specs, 0, fabric.device, None)
    first = this.groups[0].next_obs.numpy().copy()
    gamma, lam = float(cfg.algo.gamma), float(cfg.algo.gae_lambda)
    other = other_rollout.RolloutCollector(
        this.envs, first, this.storage, gamma, lam
    )  # same envs and storage
    policies, learner = policies_of(learners), learners[SINGLE]
    spec = specs[SINGLE]
    other_policy = other_agent.ActorCritic(spec.obs_space, spec.action_space, spec.model)
    other_policy.load_state_dict(policies[SINGLE].state_dict())  # the same weights
    acting = {"this": policies, args.against: {SINGLE: other_policy}}
    layout = training_layout(cfg, 1)
    n = layout.batch
    updates = {"this": this_update.update_policy, args.against: other_update.update_policy}
    collectors = {"this": this, args.against: other}
    kinds = ("update", "collect", "policy")
    times: dict[str, list[float]] = {f"{kind} {v}": [] for kind in kinds for v in updates}
    loads = [os.getloadavg()[0]]
    for r in range(args.rounds + 3):
        versions = list(updates) if r % 2 == 0 else list(updates)[::-1]
        batch = training_batches(this, specs)[SINGLE]
        for v in versions:
            t = time.thread_time()
            updates[v](fabric, learner.model, learner.optimizer, batch, cfg.algo, None, layout.rank_minibatch)
            if r >= 3:
                times[f"update {v}"].append(time.thread_time() - t)
        for v in versions:
            t = time.thread_time()
            collectors[v].collect(policies, r * n)
            if r >= 3:
                times[f"collect {v}"].append(time.thread_time() - t)
        for v in versions:
            t = time.thread_time()
            with torch.no_grad():
                this.collect(acting[v], r * n)
            if r >= 3:
                times[f"policy {v}"].append(time.thread_time() - t)
    this.envs.close()
    loads.append(os.getloadavg()[0])
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    ratio = {kind: med[f"{kind} {args.against}"] / med[f"{kind} this"] for kind in kinds}
    m = common.machine()
    git = common.git_commit()
    lines = [
        f"# Hot path A/B in one process: this checkout ({git}) vs {args.against}",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}. `exp={args.exp}` ({n} samples per update), "
        f"one torch thread, the two versions alternated call by call, {args.rounds} calls each after 3 warm-up "
        f"rounds; median CPU time (this thread). 1-min load at start and end: {loads[0]:.1f}, {loads[1]:.1f}.",
        "",
        f"| part | this checkout ms | {args.against} ms | speed-up of this checkout |",
        "|---|---:|---:|---:|",
        *(
            f"| {kind} | {med[f'{kind} this']:.2f} | {med[f'{kind} {args.against}']:.2f} | {ratio[kind]:.3f}x |"
            for kind in kinds
        ),
        "",
        "update: `update_policy`; collect: `RolloutCollector.collect` with this checkout's policy; policy: this "
        "checkout's `collect` acting with each version's `ActorCritic` (same weights).",
        "",
        f"Command: `{common.command_line(__file__)}`",
        "",
    ]
    report = {"machine": m, "git": git, "against": args.against, "exp": args.exp, "rounds": args.rounds,
              "median_ms": med, "speedup": ratio, "load": loads}  # fmt: skip
    common.write_report(args.out, f"hot_path_ab_{args.against}", report, "\n".join(lines))


if __name__ == "__main__":
    main()
