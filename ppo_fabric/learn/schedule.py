"""The learning-rate schedule: linear annealing to zero at the run's last env step, continued on resume.

A fresh run anneals `algo.lr` from 1x at env step 0 to 0 at its final step. A resume that keeps
`algo.total_steps` continues the same line (exact resume). A resume that moves the final step ("train
longer") would, if the line were recomputed from step 0, jump the rate back up (a finished 10k run resumed
to 20k went from 2.5e-5 to 4.9e-4 and lost a third of its return), so the schedule starts a new line where
it stands: from the fraction the next update would have used (for a finished run, the last update's) down
to zero at the new final step. The rate never rises on a resume.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class LrSchedule:
    """Fraction of `algo.lr` at each env step: `start_fraction` at `start_step`, falling linearly to zero
    at `end_step`; 1 throughout when annealing is off."""

    end_step: int
    anneal: bool = True
    start_step: int = 0
    start_fraction: float = 1.0

    def fraction(self, env_step: int) -> float:
        if not self.anneal:
            return 1.0
        span = self.end_step - self.start_step
        if span <= 0:
            return 0.0
        return max(self.start_fraction * (1.0 - (env_step - self.start_step) / span), 0.0)

    def state(self, last_update_step: int) -> dict[str, Any]:
        """What a checkpoint keeps: the line, and the fraction of the update that started at
        `last_update_step` (where a finished run's continuation starts)."""
        return asdict(self) | {"last_fraction": self.fraction(last_update_step)}

    @classmethod
    def continued(
        cls, saved: dict[str, Any] | None, resume_step: int, end_step: int, anneal: bool
    ) -> LrSchedule:
        """The schedule of a run resumed at `resume_step` that now ends at `end_step`: the saved line when
        the end is the same (or the checkpoint predates schedules: the line from step 0, as it was then),
        else a new line from where the saved one stands."""
        if saved is None:
            return cls(end_step, anneal)
        before = cls(int(saved["end_step"]), anneal, int(saved["start_step"]), float(saved["start_fraction"]))
        if before.end_step == end_step:
            return before
        if resume_step < before.end_step:
            standing = before.fraction(resume_step)
        else:
            standing = float(saved["last_fraction"])
        return cls(end_step, anneal, resume_step, standing)
