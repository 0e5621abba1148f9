"""Phase functions: ``fn(ctx, epoch)`` or, for batched phases, ``fn(ctx, epoch, batch)``.

None imports Airflow. Which phases exist, in what order, and which are batched
is declared once in :mod:`verl_tasks.phase_registry`.
"""
from __future__ import annotations

from verl_tasks.phases.common import PhaseContext

__all__ = ["PhaseContext"]
