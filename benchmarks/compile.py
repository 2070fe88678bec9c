"""`algo.compile` on and off on the CPU: training speed of `exp=fast` and `exp=cleanrl_cartpole`, and what
compiling costs, measured separately.

Each (experiment, compile) run is its own `python -m ppo_fabric` process with one torch thread, started
one after the other; the order of on/off alternates each round, so a neighbour's load drifting over the
minutes does not always land on the same setting. From each run's metrics.csv:

* update s: the median `time/train_s` of the updates after the first (the steady update time);
* compile s: the first update's `time/train_s` minus that median (the first compiled update traces and
  compiles the step; an eager first update costs about what the others do);
* SPS: env steps / wall time of the whole run (compile included); SPS w/o compile: the same with the
  compile seconds taken out, what a long run tends to.

    .venv/bin/python benchmarks/compile.py [--rounds 2] [--fast-steps 100352] [--cleanrl-steps 50176]
"""

from __future__ import annotations

import csv
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def one_run(exp: str, compile_on: bool, steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [
            sys.executable, "-m", "ppo_fabric", f"exp={exp}", f"algo.compile={str(compile_on).lower()}",
            f"algo.total_steps={steps}", "torch_threads=1", "logger.tensorboard=false",
            "checkpoint.every=0", f"hydra.run.dir={run_dir}",
        ]  # fmt: skip
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"benchmark run failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
        summary = json.loads((run_dir / "summary.json").read_text())
        with (run_dir / "metrics.csv").open(newline="") as fh:
            train = [float(r["time/train_s"]) for r in csv.DictReader(fh) if r.get("time/train_s")]
    steady = statistics.median(train[1:]) if len(train) > 1 else train[0]
    compile_s = max(train[0] - steady, 0.0)
    run_wall = float(summary["wall_seconds"])
    steps = int(summary["total_env_steps"])  # a run ends at the first whole update at or past total_steps
    return {
        "exp": exp,
        "compile": compile_on,
        "steps": steps,
        "updates": len(train),
        "process_wall_s": wall,
        "run_wall_s": run_wall,
        "sps": steps / run_wall,
        "compile_s": compile_s,
        "sps_without_compile": steps / max(run_wall - compile_s, 1e-9),
        "update_s": steady,
        "final_return": summary.get("final_mean_return"),
    }


def main() -> None:
    p = common.argument_parser(__doc__)
    p.add_argument("--rounds", type=int, default=2, help="on/off pairs per experiment (default 2)")
    p.add_argument("--fast-steps", type=int, default=100_352)  # 49 updates of 2048
    p.add_argument("--cleanrl-steps", type=int, default=50_176)  # 98 updates of 512
    p.add_argument("--out", type=Path, default=common.RESULTS)
    args = p.parse_args()
    runs = []
    for exp, steps in (("fast", args.fast_steps), ("cleanrl_cartpole", args.cleanrl_steps)):
        for r in range(args.rounds):
            for on in (False, True) if r % 2 == 0 else (True, False):
                runs.append(one_run(exp, on, steps))
                print(json.dumps(runs[-1]), flush=True)
    rows, ratios = [], {}
    for exp in ("fast", "cleanrl_cartpole"):
        med = {}
        for on in (False, True):
            mine = [x for x in runs if x["exp"] == exp and x["compile"] is on]
            med[on] = {k: statistics.median(x[k] for x in mine) for k in
                       ("sps", "sps_without_compile", "compile_s", "update_s")}  # fmt: skip
            each = ", ".join(f"{x['sps']:,.0f}" for x in mine)
            rows.append(
                f"| `exp={exp}` | {'on' if on else 'off'} | {mine[0]['steps']:,} | {med[on]['sps']:,.0f} ({each}) "
                f"| {med[on]['sps_without_compile']:,.0f} | {med[on]['compile_s']:.1f} | {med[on]['update_s'] * 1e3:.1f} |"
            )
        ratios[exp] = {
            "sps": med[True]["sps"] / med[False]["sps"],
            "sps_without_compile": med[True]["sps_without_compile"] / med[False]["sps_without_compile"],
            "update": med[False]["update_s"] / med[True]["update_s"],
        }
    m = common.machine()
    md = [
        "# `algo.compile` on the CPU",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores (shared with other jobs while measured), torch {m['torch']}, "
        f"Python {m['python']}; one torch thread per run; commit {common.git_commit()}.",
        f"Command: `{common.command_line(__file__)}`",
        "",
        "| run | compile | env steps | SPS, median (each run) | SPS w/o compile | compile s | update ms |",
        "|---|---|---:|---:|---:|---:|---:|",
        *rows,
        "",
        *(
            f"- `exp={exp}`: compiled / eager SPS {r['sps']:.2f}x, without the compile time "
            f"{r['sps_without_compile']:.2f}x; update step eager / compiled {r['update']:.2f}x"
            for exp, r in ratios.items()
        ),
        "",
        "update ms: median time of one update (all epochs and minibatches) after the first. compile s: the "
        "first update's time minus that median. The machine's 2 cores were shared with other jobs: compare "
        "the on/off runs of one round, which ran back to back.",
        "",
    ]
    common.write_report(
        args.out, "compile_cpu", {"machine": m, "runs": runs, "ratios": ratios}, "\n".join(md)
    )


if __name__ == "__main__":
    main()
