"""The inline backend: run a phase in this process (unit tests, ``airflow dags test``)."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from verl_tasks.config import ExperimentConfig
from verl_tasks.execution import UnitSpec
from verl_tasks.store.units import CommitRecord

log = logging.getLogger(__name__)
# Test hook (chaos tests only, like VERL_TASKS_FAIL_ONCE): with this set to a folder, a rollout
# that finds ``<folder>/<unit label>.hold`` writes its PID to ``<label>.held`` and waits in the
# middle of its batch (after loading the policy, before generating) until the hold file is gone.
HOLD_ENV = "VERL_TASKS_TEST_HOLD_DIR"


def _hold_hook(folder: str, label: str):
    def hold(**_: Any) -> None:
        flag = Path(folder) / f"{label}.hold"
        if not flag.exists():
            return
        (Path(folder) / f"{label}.held").write_text(str(os.getpid()))
        deadline = time.monotonic() + 600
        while flag.exists() and time.monotonic() < deadline:
            time.sleep(0.1)

    return hold


class InlineBackend:
    """Calls :func:`verl_tasks.runner.run_phase` directly; imports torch on first use."""

    name = "inline"

    def run(self, config: ExperimentConfig, spec: UnitSpec, credentials: dict[str, str] | None = None) -> CommitRecord:
        """Run (or skip, when committed) one unit and return its commit record.

        Raises:
            Whatever the phase raises (PhaseFailed, ValidationFailed, ...), unchanged.
        """
        from verl_tasks.runner import make_context, run_phase

        ctx = make_context(config, credentials)
        if os.environ.get(HOLD_ENV):
            ctx.hooks["rollout_generate"] = _hold_hook(os.environ[HOLD_ENV], spec.label)
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
