"""The inline backend: run a phase in this process (unit tests, ``airflow dags test``)."""
from __future__ import annotations

import logging
from typing import Any

from verl_tasks import hooks
from verl_tasks.config import ExperimentConfig
from verl_tasks.execution import UnitSpec
from verl_tasks.store.units import CommitRecord

log = logging.getLogger(__name__)


class InlineBackend:
    """Calls :func:`verl_tasks.runner.run_phase` directly; imports torch on first use."""

    name = "inline"

    def run(self, config: ExperimentConfig, spec: UnitSpec, credentials: dict[str, str] | None = None,
            attempt: str | None = None) -> CommitRecord:
        """Run (or skip, when committed) one unit and return its commit record.

        ``attempt`` names the attempt (a dispatcher that may cancel it fences that id).

        Raises:
            Whatever the phase raises (PhaseFailed, ValidationFailed, ...), unchanged.
        """
        from verl_tasks.runner import make_context, run_phase

        hooks.fire("unit_start", experiment=spec.experiment, phase=spec.phase, epoch=spec.epoch, batch=spec.batch)
        ctx = make_context(config, credentials)
        ctx.attempt = attempt
        log.info("running %s of %s inline", spec.label, config.experiment)
        return run_phase(ctx, spec.phase, spec.epoch, spec.batch)


def record_summary(record: CommitRecord) -> dict[str, Any]:
    """What a task may return to XCom: the unit key, the attempt, small scalar metrics."""
    meta = record.meta or {}
    metrics = meta.get("metrics", {}) if isinstance(meta.get("metrics"), dict) else {}
    small = {k: v for k, v in metrics.items() if isinstance(v, (int, float, str, bool)) and len(str(v)) < 64}
    for key, value in meta.items():
        if key != "metrics" and isinstance(value, (int, float, bool)):
            small.setdefault(key, value)
    return {"unit": record.unit, "attempt": record.attempt, "metrics": dict(list(small.items())[:24])}
