"""Safe mode: the experiment is halted until a person resumes it.

While ``<experiment>/control/safe_mode.json`` exists, ``run_unit`` refuses to
start any unit (``SafeMode``). Committed units stay valid; resuming only
removes the file, so the next run (or DAG run) continues where it stopped.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any

from verl_tasks.config import ExperimentConfig
from verl_tasks.events import record_event
from verl_tasks.layout import Layout
from verl_tasks.store.base import NotFound, ObjectStore

log = logging.getLogger(__name__)


def read_safe_mode(store: ObjectStore, layout: Layout) -> dict[str, Any] | None:
    """The safe-mode record, or None when the experiment is not halted."""
    try:
        return json.loads(store.get(layout.safe_mode))
    except NotFound:
        return None


def enter_safe_mode(store: ObjectStore, layout: Layout, summary: dict[str, Any]) -> dict[str, Any]:
    """Halt the experiment: write ``control/safe_mode.json`` and a ``safe_mode`` event.

    Args:
        summary: JSON-serialisable; should hold ``summary`` (one line), ``reason``,
            ``failed_units`` and ``what_to_do``.
    Returns:
        The record written (``summary`` plus ``entered_at``).
    """
    body = {**summary, "experiment": layout.experiment, "entered_at": time.time()}
    store.put(layout.safe_mode, json.dumps(body, indent=1, sort_keys=True, default=str).encode())
    record_event(store, layout, "safe_mode", summary=str(body.get("summary", ""))[:2000],
                 failed_units=[u.get("unit") for u in body.get("failed_units", []) if isinstance(u, dict)])
    log.warning("experiment %s is now in safe mode: %s", layout.experiment, body.get("summary"))
    return body


def leave_safe_mode(store: ObjectStore, layout: Layout, by: str = "verl-tasks resume") -> bool:
    """Remove the safe-mode file and record a ``resumed`` event. Returns False if it was not halted."""
    previous = read_safe_mode(store, layout)
    if previous is None:
        return False
    store.delete(layout.safe_mode)
    record_event(store, layout, "resumed", by=by, was=str(previous.get("summary", ""))[:2000])
    log.info("experiment %s left safe mode", layout.experiment)
    return True


def escalate(config: ExperimentConfig, failed_units: list[dict[str, Any]], reason: str,
             store: ObjectStore | None = None) -> dict[str, Any]:
    """Put an experiment in safe mode after its retries are exhausted; return the summary for a callback.

    Args:
        config: the experiment.
        failed_units: one dict per failed unit, e.g. ``{"unit": ..., "error": ..., "try_number": ...}``.
        reason: why the experiment is halted (e.g. "update failed after 3 retries").
        store: the experiment's store (built from the config when not given).
    Returns:
        The safe-mode record: ``summary`` (a short text), ``what_to_do`` (a runbook text),
        ``failed_units``, ``reason``, ``experiment``, ``entered_at``.
    """
    from verl_tasks.runner import store_for

    store = store or store_for(config)
    layout = Layout(config.experiment)
    names = ", ".join(str(u.get("unit", "?")) for u in failed_units) or "none named"
    errors = "; ".join(f"{u.get('unit', '?')}: {str(u.get('error', ''))[:300]}" for u in failed_units)
    what_to_do = (
        f"1. Inspect: `verl-tasks status CONFIG --experiment {config.experiment}` and the failed task logs.\n"
        f"2. Fix the cause (data, reward function, resources, storage); if a snapshot is suspect, "
        f"`verl-tasks checkpoint verify {store.url(layout.snapshots)}`; to drop bad epochs, "
        f"`verl-tasks rollback CONFIG --experiment {config.experiment} --to-epoch K`.\n"
        f"3. Leave safe mode: `verl-tasks resume CONFIG --experiment {config.experiment}`, then unpause "
        f"the DAG in the Airflow UI (or run `verl-tasks run`). Committed units are kept; only missing ones rerun."
    )
    summary = {
        "summary": f"{config.experiment} halted: {reason} (failed units: {names})",
        "reason": reason,
        "failed_units": failed_units,
        "errors": errors,
        "what_to_do": what_to_do,
    }
    return enter_safe_mode(store, layout, summary)
