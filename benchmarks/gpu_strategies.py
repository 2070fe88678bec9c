"""Coupled and decoupled on a CUDA machine: SPS and the collect / transfer / train time split.

For each workload it runs
  - coupled on the GPU (`fabric=gpu`, 1 process),
  - decoupled with the player on the CPU and the trainer on the GPU (`fabric=gpu fabric.devices=2
    algo.player_device=cpu`; needs 2 GPUs for 2 processes unless `--share-gpu`),
and writes benchmarks/results/gpu-strategies.{json,md}. Workloads whose extra is not installed
(LunarLander: box2d) are skipped with a note. Needs a CUDA device; exits with a message otherwise.

    .venv/bin/python benchmarks/gpu_strategies.py [--steps 500000]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import RESULTS, run_once  # noqa: E402

WORKLOADS = {
    "CartPole-v1, 64 envs": (["env=cartpole", "env.num_envs=64", "algo.minibatch_size=512"], None),
    "LunarLander-v3, 16 envs": (["env=lunarlander"], "Box2D"),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=500_000)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_strategies.py needs a CUDA device (torch.cuda.is_available() is False)")
    gpus = torch.cuda.device_count()
    variants = {"coupled, GPU": ["strategy=coupled", "fabric=gpu"]}
    if gpus >= 2:
        variants["decoupled, player CPU + trainer GPU"] = [
            "strategy=decoupled", "fabric=gpu", "fabric.devices=2", "algo.player_device=cpu"]  # fmt: skip
    rows, notes = [], []
    for workload, (overrides, module) in WORKLOADS.items():
        if module and importlib.util.find_spec(module) is None:
            notes.append(f"{workload}: skipped, {module} not installed")
            continue
        for variant, extra in variants.items():
            s = run_once([*overrides, *extra, f"algo.total_steps={args.steps}"])
            rows.append({"workload": workload, "variant": variant, "sps": s["sps"], "time_split": s["time_split"],
                         "final_mean_return": s["final_mean_return"]})  # fmt: skip
            print(
                f"{workload:26s} {variant:38s} {s['sps']:10,.0f} SPS {json.dumps(s['time_split'])}",
                flush=True,
            )
    if gpus < 2:
        notes.append(
            "decoupled skipped: one GPU (a player on CPU and a trainer on GPU need 2 processes with a GPU each)"
        )
    m = common.machine() | {"gpu": torch.cuda.get_device_name(0), "gpus": gpus}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu-strategies.json").write_text(
        json.dumps({"machine": m, "rows": rows, "notes": notes}, indent=2)
    )
    lines = ["# Strategies on the GPU", "", f"Machine: {m['gpu']} x{gpus}, {m['cpu']}, {m['cores']} cores.", "",
             "| workload | variant | SPS | time split (s) | final mean return |", "|---|---|---:|---|---:|"]  # fmt: skip
    lines += [f"| {r['workload']} | {r['variant']} | {r['sps']:,.0f} | {json.dumps(r['time_split'])} | "
              f"{r['final_mean_return']} |" for r in rows]  # fmt: skip
    lines += ["", *(f"- {n}" for n in notes), ""]
    (args.out / "gpu-strategies.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
