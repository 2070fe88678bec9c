"""`resume=auto` and the supervisor's relaunches: which checkpoint of a run directory a run continues from.

A requeued cluster job runs the same command again; `resume=auto` lets that command continue where the
previous attempt stopped instead of starting over, and the supervisor relaunches a failed job by the same
rule. Nothing writes a checkpoint before a run starts, so every rank composing its config resolves `auto`
to the same file.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from ppo_fabric.runs import checkpoint as ckpt

AUTO = "auto"


def newest_checkpoint(run_dir: Path) -> tuple[Path, int] | None:
    """(path, env step) of `checkpoints/last.ckpt` when it loads, else of the newest other `*.ckpt` there that
    loads; None when there is none.

    Only readability decides (env snapshots are dropped while looking): a checkpoint that loads but cannot
    continue this config is then refused by `preflight.check_resume` in one line, rather than skipped for an
    older one or a silent fresh start over a run the user wanted continued.
    """
    ckpt_dir = run_dir / "checkpoints"
    last = ckpt_dir / "last.ckpt"
    others = sorted(
        (p for p in ckpt_dir.glob("*.ckpt") if p.name != last.name and p.is_file()),
        key=lambda p: p.stat().st_mtime,  # by age, whatever the numbered files are named after
        reverse=True,
    )
    for path in [last, *others]:
        if not path.is_file():
            continue
        try:
            state = ckpt.load(path, env_state="fresh")
        except ValueError:
            continue
        return path, int(state["env_step"])
    return None


def resolve_auto(cfg: DictConfig, run_dir: str) -> bool:
    """Replace `resume=auto` by the run directory's newest valid checkpoint (or None: a fresh start);
    returns whether the config asked for `auto`."""
    if cfg.get("resume") != AUTO:
        return False
    found = newest_checkpoint(Path(run_dir).resolve())
    cfg.resume = str(found[0]) if found is not None else None
    return True
