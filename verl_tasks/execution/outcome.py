"""A unit's outcome across the Ray boundary: the job's result line and the typed error it carries.

A job prints one JSON object as its last stdout line; on failure::

    {"ok": false, "unit": "exp/epochs/00003/plan",
     "error": {"type": "ConfigMismatch", "module": "verl_tasks.errors", "message": "...", "fields": {...}}}

The Airflow side rebuilds the same class from :data:`REGISTRY` (the classes of
:mod:`verl_tasks.errors`): a name read from a job's output is never imported.
Deterministic errors (bad config or input, a failed quality gate, too many batches missing, safe
mode, a snapshot pruned by retention) fail the task without retries; everything else is retried.
"""
from __future__ import annotations

import json
from typing import Any

from verl_tasks import errors
from verl_tasks.errors import (
    BatchesMissing,
    ConfigError,
    NonFiniteUpdate,
    SafeMode,
    SnapshotPruned,
    UnsafeKey,
    ValidationFailed,
    VerlTasksError,
)

# A retry of the same unit fails the same way: a person must change something first.
DETERMINISTIC: tuple[type[VerlTasksError], ...] = (ConfigError, ValidationFailed, BatchesMissing, SafeMode, UnsafeKey,
                                                  SnapshotPruned, NonFiniteUpdate)
REGISTRY: dict[str, type[VerlTasksError]] = {
    cls.__name__: cls
    for cls in vars(errors).values()
    if isinstance(cls, type) and issubclass(cls, VerlTasksError) and cls.__module__ == errors.__name__
}
MAX_MESSAGE = 2000
SCAN_LINES = 200  # the result line is the job's last stdout line; stderr may interleave a little


def is_deterministic(err: BaseException) -> bool:
    """True when running the unit again cannot succeed without a person changing something."""
    return isinstance(err, DETERMINISTIC)


RETRY, LEAVE_OUT, RAISE = "retry", "leave out", "raise"


def after_failure(fault_tolerance: Any, batched: bool, error: BaseException, tries: int) -> str:
    """What a unit runner does once try number ``tries`` of a unit raised ``error``.

    One policy for every runner (inline, Ray pools), as Airflow applies it to a task:
    a transient error is retried until ``1 + retries`` tries are spent; a deterministic
    one is not retried. A batched unit that is out of tries is left out when
    ``min_committed_batch_fraction`` < 1 (the epoch's validate decides whether the
    epoch may go on without it); anything else is raised.
    """
    if is_deterministic(error):
        return RAISE
    if tries <= fault_tolerance.retries:
        return RETRY
    return LEAVE_OUT if batched and fault_tolerance.min_committed_batch_fraction < 1 else RAISE


def next_step_text(step: str, error: BaseException, fault_tolerance: Any) -> str:
    """What ``after_failure``'s ``step`` means, in words for the log line of the failed try."""
    if step == RETRY:
        return f"retrying in {fault_tolerance.retry_delay_s:g} s"
    if step == LEAVE_OUT:
        return "out of tries: the epoch goes on without this batch if validate allows it"
    if is_deterministic(error):
        return "not retried: a retry would fail the same way (bad input or config); fix it, then rerun"
    return "out of tries: the run stops"


def _plain(value: Any) -> bool:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return len(str(value)) <= MAX_MESSAGE
    return isinstance(value, list) and len(value) <= 100 and all(isinstance(v, (str, int)) for v in value)


def error_payload(err: BaseException) -> dict[str, Any]:
    """Class, module, message and the error's small public attributes (ids a person needs)."""
    fields = {k: v for k, v in vars(err).items() if not k.startswith("_") and _plain(v)}
    return {"type": type(err).__name__, "module": type(err).__module__, "message": str(err)[:MAX_MESSAGE],
            "fields": fields}


def failure_result(err: BaseException, unit: str) -> dict[str, Any]:
    return {"ok": False, "unit": unit, "error": error_payload(err)}


def parse_result(text: str | None) -> dict[str, Any] | None:
    """The job's result line: the last JSON object with an ``ok`` key among the last lines of ``text``."""
    for line in reversed((text or "").splitlines()[-SCAN_LINES:]):
        line = line.strip()
        if not (line.startswith("{") and line.endswith("}")):
            continue
        try:
            found = json.loads(line)
        except ValueError:
            continue
        if isinstance(found, dict) and "ok" in found:
            return found
    return None


def error_from_result(result: dict[str, Any] | None) -> VerlTasksError | None:
    """The typed error a failed result line names, or None when it names no class of :mod:`verl_tasks.errors`.

    The instance is built without calling the class's ``__init__`` (signatures differ):
    its message is the job's, its public attributes the job's ``fields``.
    """
    error = (result or {}).get("error")
    if not isinstance(error, dict) or error.get("module") != errors.__name__:
        return None
    cls = REGISTRY.get(str(error.get("type")))
    if cls is None:
        return None
    rebuilt = cls.__new__(cls)
    Exception.__init__(rebuilt, str(error.get("message", ""))[:MAX_MESSAGE])
    fields = error.get("fields")
    if isinstance(fields, dict):
        rebuilt.__dict__.update({k: v for k, v in fields.items() if isinstance(k, str) and not k.startswith("_")})
    return rebuilt


def describe(result: dict[str, Any] | None) -> str:
    """``Type: message`` of a failed result line, for logs and untyped errors."""
    error = (result or {}).get("error")
    if isinstance(error, dict):
        return f"{error.get('type')}: {error.get('message')}"
    return str(error) if error else "no result line"


__all__ = ["DETERMINISTIC", "REGISTRY", "is_deterministic", "after_failure", "next_step_text", "RETRY", "LEAVE_OUT",
           "RAISE", "error_payload", "failure_result", "parse_result", "error_from_result", "describe"]
