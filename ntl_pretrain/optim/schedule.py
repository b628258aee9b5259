"""Learning-rate schedules as multipliers of the peak rate, for `torch.optim.lr_scheduler.LambdaLR`."""

from __future__ import annotations

import math
from collections.abc import Callable

from ntl_pretrain.config.recipe import ScheduleConfig


def lr_multiplier(schedule: ScheduleConfig, total_steps: int) -> Callable[[int], float]:
    """step -> multiplier of the peak lr: linear warmup, then cosine, warmup-stable-decay or constant.

    `step` counts optimizer updates already taken, so the first update uses `step = 0`; warmup reaches the peak
    on its last step rather than spending the first update at `warmup_start_ratio`.
    """

    def multiplier(step: int) -> float:
        if step < schedule.warmup_steps:
            start = schedule.warmup_start_ratio
            return start + (1.0 - start) * (step + 1) / schedule.warmup_steps
        if schedule.kind == "constant":
            return 1.0
        if schedule.kind == "cosine":
            progress = min(1.0, (step - schedule.warmup_steps) / max(1, total_steps - schedule.warmup_steps))
            return _toward_min(schedule, 0.5 * (1.0 + math.cos(math.pi * progress)))
        decay_steps = max(1, round(schedule.decay_fraction * total_steps))
        decay_start = max(schedule.warmup_steps, total_steps - decay_steps)
        progress = min(1.0, max(0.0, (step - decay_start) / max(1, total_steps - decay_start)))
        return _toward_min(schedule, 1.0 - progress)

    return multiplier


def warmup_note(schedule: ScheduleConfig, max_steps: int) -> str | None:
    """A line for a warmup longer than the run (accepted: a short trial of a long run's recipe is one), else None."""
    if schedule.warmup_steps <= max_steps:
        return None
    reached = lr_multiplier(schedule, max_steps)(max_steps - 1)
    return (f"schedule.warmup_steps={schedule.warmup_steps} is longer than train.max_steps={max_steps}: the learning "
            f"rate is still warming up at the last step, {reached:.0%} of optimizer.lr, and never decays")  # fmt: skip


def _toward_min(schedule: ScheduleConfig, fraction_of_range: float) -> float:
    """Map 1 -> peak and 0 -> min_lr_ratio."""
    return schedule.min_lr_ratio + (1.0 - schedule.min_lr_ratio) * fraction_of_range
