"""Run one phase unit somewhere: inline (tests, ``dags test``) or as a Ray job.

The flow is always *Airflow operator -> backend -> phase function -> store*.
Nothing here imports Airflow; ``ray`` is imported lazily by :mod:`ray_jobs`.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any


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


def store_identity(config: Any) -> str:
    """A short digest of where an experiment commits (store URI without a trailing ``/``, and endpoint):
    what tells apart two deployments that run one experiment name on one Ray cluster."""
    where = json.dumps([config.storage.uri.rstrip("/"), (config.storage.endpoint_url or "").rstrip("/")])
    return hashlib.sha256(where.encode()).hexdigest()[:16]


__all__ = ["UnitSpec", "store_identity"]
