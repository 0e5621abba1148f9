"""Phase functions: ``fn(ctx, epoch, batch=None) -> CommitRecord``; none imports Airflow."""
from __future__ import annotations

from typing import Callable

from verl_tasks.phases.common import PhaseContext
from verl_tasks.phases.evaluate import evaluate
from verl_tasks.phases.plan import plan
from verl_tasks.phases.rollout import rollout
from verl_tasks.phases.score import score
from verl_tasks.phases.snapshot import snapshot
from verl_tasks.phases.update import update
from verl_tasks.phases.validate import validate
from verl_tasks.store.units import CommitRecord

PhaseFn = Callable[..., CommitRecord]
PHASE_FUNCTIONS: dict[str, PhaseFn] = {
    "plan": plan,
    "rollout": rollout,
    "score": score,
    "validate": validate,
    "update": update,
    "snapshot": snapshot,
    "evaluate": evaluate,
}
BATCHED = ("rollout", "score")

__all__ = ["PHASE_FUNCTIONS", "BATCHED", "PhaseContext"]
