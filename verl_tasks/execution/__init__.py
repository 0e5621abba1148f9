"""Run one phase unit somewhere: inline (tests, ``dags test``) or as a Ray job.

The flow is always *Airflow operator -> backend -> phase function -> store*.
Nothing here imports Airflow; ``ray`` is imported lazily by :mod:`ray_jobs`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class UnitSpec:
    """One unit of work: a phase of an epoch (and a batch for rollout/score)."""

    experiment: str
    phase: str
    epoch: int
    batch: int | None = None

    @property
    def label(self) -> str:
        """``e3-rollout-b7``: the unit's part of a submission id and of log lines."""
        base = f"e{self.epoch}-{self.phase}"
        return base if self.batch is None else f"{base}-b{self.batch}"


__all__ = ["UnitSpec"]
