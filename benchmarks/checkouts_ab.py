"""The same training run on several checkouts of the project (git worktrees), alternated run by run.

Each round runs `python -m ppo_fabric <overrides>` once per checkout, in a fresh process with that checkout
first on PYTHONPATH, the order reversed every other round so drifting machine load hits every checkout
alike; reports each run's SPS, wall time, time split, CPU seconds and load, and the medians per checkout
against the first one's, to benchmarks/results/<name>.{json,md}.

    git worktree add ../old 53958c8
    .venv/bin/python benchmarks/checkouts_ab.py --name pipelined_ab --rounds 3 . ../old -- \\
        exp=cleanrl_cartpole strategy=decoupled fabric.devices=2 algo.pipeline=true torch_threads=1

`--arms`: each checkout with each set of extra overrides (one checkout, two settings: an option's cost):

    .venv/bin/python benchmarks/checkouts_ab.py --name eval_cost --rounds 3 . --arms eval.every=0 \\
        eval.every=auto -- exp=cleanrl_cartpole strategy=decoupled fabric.devices=2 algo.pipeline=true
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def head(checkout: Path) -> str:
    """`common.git_commit` of another checkout: that one reads only its own tree (or PPO_FABRIC_COMMIT)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=checkout, capture_output=True, text=True).stdout.strip()

    return (git("rev-parse", "--short", "HEAD") or "unknown") + (
        "+dirty" if git("status", "--porcelain", "--", "ppo_fabric", "conf") else ""
    )


def run(checkout: Path, overrides: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PYTHONPATH=str(checkout))
        load = os.getloadavg()[0]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        cmd = [sys.executable, "-m", "ppo_fabric", "logger.tensorboard=false", f"hydra.run.dir={tmp}/run"]
        started = time.monotonic()
        proc = subprocess.run([*cmd, *overrides], cwd=checkout, env=env, capture_output=True, text=True)
        wall = time.monotonic() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            raise SystemExit(f"run failed in {checkout}:\n{proc.stderr[-2000:]}")
        summary = json.loads((Path(tmp) / "run" / "summary.json").read_text())
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "sps": float(summary["sps"]),
        "time_split": summary.get("time_split"),
        "cpu_s": cpu,
        "wall_s": wall,
        "load_before": load,
    }


def main() -> None:
    parser = common.argument_parser(__doc__)
    parser.add_argument("checkouts", nargs="+", type=Path, help="checkouts to compare; then -- and overrides")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--name", default="checkouts_ab", type=common.file_name)
    parser.add_argument("--arms", nargs="+", default=[""], help="override sets, each run on every checkout "
                        "(quoted, space-separated: --arms 'eval.every=0' 'eval.every=auto')")  # fmt: skip
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    argv = sys.argv[1:]
    overrides = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    checkouts = [c.resolve() for c in args.checkouts]
    for checkout in checkouts:  # found before the first run, not as a traceback rounds later
        if not (checkout / "ppo_fabric" / "__init__.py").is_file():
            parser.error(f"{checkout}: not a checkout of ppo-fabric (no ppo_fabric/ package there)")
    commits = {str(c): head(c) for c in checkouts}
    arms = [(c, arm) for c in checkouts for arm in args.arms]  # each checkout with each override set
    label = {(c, arm): commits[str(c)] + (f" {arm}" if arm else "") for c, arm in arms}
    rows = []
    for r in range(args.rounds):
        for c, arm in arms if r % 2 == 0 else arms[::-1]:
            row = {"round": r + 1, "checkout": label[c, arm], **run(c, [*overrides, *arm.split()])}
            rows.append(row)
            print(json.dumps(row), flush=True)
    med = {
        name: statistics.median(x["sps"] for x in rows if x["checkout"] == name) for name in label.values()
    }
    wall = {
        name: statistics.median(x["wall_s"] for x in rows if x["checkout"] == name) for name in label.values()
    }
    first = label[arms[0]]
    m = common.machine()
    lines = [
        f"# The same run on {len(checkouts)} checkouts, alternated",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}. Overrides: `{' '.join(overrides)}`. "
        f"{args.rounds} rounds, the checkouts' order reversed every other round; SPS = env steps / training wall "
        "time; wall s: the command, start to exit; CPU s: all of the run's processes, start-up included.",
        "",
        "| round | checkout | SPS | wall s | CPU s | 1-min load before | time split (s) |",
        "|---:|---|---:|---:|---:|---:|---|",
        *(
            f"| {x['round']} | {x['checkout']} | {x['sps']:,.0f} | {x['wall_s']:.2f} | {x['cpu_s']:.1f} | "
            f"{x['load_before']:.1f} | "
            f"`{json.dumps(x['time_split'], separators=(',', ':'))}` |"
            for x in rows
        ),
        "",
        *(
            f"- {k}: median SPS {v:,.0f}, {v / med[first]:.3f}x of {first}; median wall {wall[k]:.2f} s, "
            f"{wall[k] / wall[first]:.3f}x"
            for k, v in med.items()
        ),
        "",
        f"Command: `{common.command_line(__file__)}`",
        "",
    ]
    common.write_report(args.out, args.name, {"machine": m, "overrides": overrides, "rows": rows, "median_sps": med,
                        "median_wall_s": wall},
                        "\n".join(lines))  # fmt: skip


if __name__ == "__main__":
    main()
