"""The learning-rate schedule: the rate of optimizer step ``k`` as a pure function of ``k``.

No scheduler object and no saved scheduler state: a resumed update reads the global
step from ``trainer_state.json`` and sets each step's rate from this formula, so an
interrupted and resumed run sets exactly the rates of an uninterrupted one.
"""
from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def lr_at(step: int, *, lr: float, schedule: str = "constant", warmup_steps: int = 0,
          total_steps: int | None = None, min_lr_ratio: float = 0.0) -> float:
    """Learning rate of optimizer step ``step`` (0-based global step count before it).

    Warm-up (any schedule): ``lr * (step + 1) / warmup_steps`` for ``step < warmup_steps``.
    Then, with ``p = (step - warmup_steps) / (total_steps - warmup_steps)`` clamped to [0, 1]
    and ``m = min_lr_ratio``: constant ``lr``; linear ``lr * (1 - p * (1 - m))``;
    cosine ``lr * (m + (1 - m) * (1 + cos(pi * p)) / 2)``. Past ``total_steps`` the rate stays
    at ``lr * m``.

    Raises:
        ValueError: an unknown schedule, or linear/cosine without ``total_steps``.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    if total_steps is None:
        raise ValueError(f"the {schedule} lr schedule needs total_steps")
    progress = min(1.0, max(0.0, (step - warmup_steps) / max(1, total_steps - warmup_steps)))
    if schedule == "linear":
        return lr * (1.0 - progress * (1.0 - min_lr_ratio))
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def schedule_of(algo) -> dict:
    """``lr_at``'s keyword arguments from an ``AlgorithmConfig``."""
    return {"lr": algo.lr, "schedule": algo.lr_schedule.value, "warmup_steps": algo.warmup_steps,
            "total_steps": algo.total_steps, "min_lr_ratio": algo.min_lr_ratio}
