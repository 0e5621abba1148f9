"""Escalation: when light faults stop being light, halt the experiment and tell a person.

Tiered response:

1. a failed attempt is retried by Airflow (``on_retry_callback`` records it in the store: a
   ``task_failed`` event for people and, for a batch, a durable record per failed try that the
   count below reads, :func:`verl_tasks.ops.safe_mode.record_failed_try`; never the event log);
2. if more than ``fault_tolerance.max_failed_batch_fraction`` of an epoch's batches have
   failed at least once since the experiment last left safe mode, or a unit fails after
   all its retries (``on_failure_callback``), the experiment enters **safe mode**:
   ``control/safe_mode.json`` is written, so no unit of that experiment starts anywhere;
   the DAG is paused through the REST API (:mod:`verl_tasks.airflow.rest`, connection
   ``verl_airflow_api``) when one is configured; and the DAG's notifiers (Airflow
   ``BaseNotifier`` objects given to ``build_dag(..., notifiers=[...])``, e.g. a provider's
   Slack or SMTP notifier) are called with the task's context plus ``alert`` (the summary,
   what to do, the experiment);
3. a person resumes: ``verl-tasks resume`` or a **Clear** of the failed tasks. The operators
   call :func:`lift_safe_mode_if_cleared` first: the first try after a clear lifts safe mode
   (an automatic retry never does) and the event log records the clear, with the user when
   Airflow's audit log names one.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from verl_tasks.airflow import rest
from verl_tasks.errors import NotPermitted, SafeMode
from verl_tasks.events import record_event
from verl_tasks.layout import Layout
from verl_tasks.ops.safe_mode import (
    failed_batches,
    first_try_after_clear,
    leave_safe_mode,
    note_dag_pause,
    read_safe_mode,
    record_failed_try,
)

log = logging.getLogger(__name__)
TASK_FAILED = "task_failed"
# Audit-log events of a person's clear: a task instance (UI, REST) or a whole DAG run.
CLEAR_EVENTS = ("post_clear_task_instances", "clear_dag_run")


def _unit_info(context: dict[str, Any]) -> tuple[Any, Any, Any, str, dict[str, Any]]:
    task = context["task"]
    cfg, access = task.resolve(context)
    store = task.store(cfg, access)
    layout = Layout(cfg.experiment)
    unit = layout.unit(task.phase, task.epoch, task.batch)
    ti = context.get("ti")
    info = {
        "unit": unit,
        "task_id": getattr(ti, "task_id", task.task_id),
        "map_index": getattr(ti, "map_index", -1),
        "try_number": getattr(ti, "try_number", None),
        "run_id": getattr(ti, "run_id", None),
        "dag_id": getattr(ti, "dag_id", None),
        "error": f"{type(context.get('exception')).__name__}: {context.get('exception')}"[:1500],
    }
    return cfg, store, layout, unit, info


def pause_dag(dag_id: str, conn_id: str = rest.API_CONN_ID) -> tuple[bool, str]:
    """Pause a DAG through the REST API; returns (paused, what happened) for the safe-mode record. Never raises."""
    try:
        rest.api(conn_id).pause_dag(dag_id)
        return True, f"DAG {dag_id} paused"
    except rest.NoConnection:
        return False, f"DAG {dag_id} not paused (no Airflow connection {conn_id!r}); the safe-mode file halts it"
    except Exception as err:  # noqa: BLE001 - report, the safe-mode file is the real guard
        log.warning("DAG %s not paused: Airflow's REST API call failed (%s)", dag_id, rest.describe(err))
        return False, f"DAG {dag_id} not paused ({rest.describe(err)}); the safe-mode file halts it"


@functools.cache
def _say_clears_not_recorded(conn_id: str) -> None:
    """Once per process: without the connection no lifted safe mode can name who cleared."""
    log.info("who cleared DAG runs is not recorded: no Airflow connection %r (add one to record the user)", conn_id)


def cleared_by(dag_id: str, since: float | None, conn_id: str = rest.API_CONN_ID) -> str | None:
    """The user of the newest clear of ``dag_id`` after ``since`` in Airflow's audit log, or None. Never raises."""
    try:
        return rest.api(conn_id).newest_event_owner(
            dag_id, CLEAR_EVENTS, datetime.fromtimestamp(since, UTC) if since else None)
    except rest.NoConnection:
        _say_clears_not_recorded(conn_id)
    except Exception as err:  # noqa: BLE001 - the user is a detail of the record, never a reason to fail
        log.warning("who cleared %s is not known: Airflow's REST API call failed (%s)", dag_id, rest.describe(err))
    return None


def lift_safe_mode_if_cleared(context: dict[str, Any], cfg: Any, store: Any) -> bool:
    """A person's Clear is the confirmation safe mode asks for: its first try lifts safe mode.

    Returns True when this try lifted it. Automatic retries (and first tries) leave it in place.
    """
    ti, task = context.get("ti"), context.get("task")
    if ti is None or task is None:
        return False
    if not first_try_after_clear(int(ti.try_number), int(ti.max_tries), int(task.retries or 0)):
        return False
    layout = Layout(cfg.experiment)
    record = read_safe_mode(store, layout)
    if record is None:
        return False
    user = cleared_by(ti.dag_id, record.get("entered_at"))
    where = f"{ti.task_id}" + (f"[{ti.map_index}]" if getattr(ti, "map_index", -1) >= 0 else "")
    lifted = leave_safe_mode(store, layout, by="clear", user=user, task_id=ti.task_id,
                             map_index=getattr(ti, "map_index", -1), run_id=ti.run_id, try_number=ti.try_number,
                             note=f"safe mode lifted by a clear of {where} in {ti.run_id}"
                                  + (f" by {user}" if user else ""))
    if lifted is not None:
        log.warning("safe mode of %s lifted by a clear of %s%s", cfg.experiment, where, f" by {user}" if user else "")
    return lifted is not None


def escalation(callback: Callable[..., None], notifiers: list[Any] | None) -> Callable[..., None]:
    """``on_retry`` or ``on_failure`` bound to the notifiers that safe mode calls (itself when there are none)."""
    return functools.partial(callback, notifiers=tuple(notifiers)) if notifiers else callback


def notify(notifiers: tuple[Any, ...], context: dict[str, Any], alert: dict[str, Any]) -> None:
    """Call each notifier (``BaseNotifier`` or any callable taking the context) with ``alert`` in the context.

    A notifier that raises is logged and the next one still runs: a broken notifier must not
    hide the failure, nor keep the others from hearing of it.
    """
    for notifier in notifiers:
        try:
            notifier({**context, "alert": alert})
        except Exception as err:  # noqa: BLE001 - see the docstring
            log.warning("notifier %s raised %s: %s", type(notifier).__name__, type(err).__name__, err)


def _halt(context: dict[str, Any], cfg: Any, store: Any, failed: list[dict[str, Any]],
          reason: str, notifiers: tuple[Any, ...] = ()) -> dict[str, Any] | None:
    """Safe mode first (the guard), then pause the DAG, then record whether it really was paused.

    An experiment already halted keeps its record: the units safe mode refuses fail too,
    and must not overwrite why it was halted and what to do.
    """
    from verl_tasks.ops.safe_mode import escalate

    if read_safe_mode(store, Layout(cfg.experiment)) is not None:
        log.info("%s is already in safe mode; %s", cfg.experiment, reason)
        return None
    dag_id = getattr(context.get("dag"), "dag_id", None) or getattr(context.get("ti"), "dag_id", None)
    summary = escalate(cfg, failed, reason, store=store, config_path=context["task"].config_path, dag_id=dag_id)
    if dag_id:
        paused, detail = pause_dag(dag_id)
        summary = note_dag_pause(store, Layout(cfg.experiment), paused, detail) or summary
    log.error("SAFE MODE: %s\n%s", summary["summary"], summary["what_to_do"])
    notify(notifiers, context, {"kind": "safe_mode", "experiment": cfg.experiment, "dag_id": dag_id, **summary})
    return summary


def _caused_by(context: dict[str, Any], kind: type[BaseException]) -> bool:
    err = context.get("exception")
    while err is not None:
        if isinstance(err, kind):
            return True
        err = err.__cause__
    return False


def refused_by_owner(context: dict[str, Any]) -> bool:
    """The task failed because its DAG may not write to the experiment: record nothing there, halt nothing."""
    return _caused_by(context, NotPermitted)


def refused_by_safe_mode(context: dict[str, Any]) -> bool:
    """The task failed because the experiment was already halted: its unit never ran, and failed in nothing."""
    return _caused_by(context, SafeMode)


def _count_failed_try(context: dict[str, Any], store: Any, layout: Layout, info: dict[str, Any], *,
                      final: bool = False) -> set[int]:
    """Record this batch's failed try durably and return the epoch's failed batches since the last resume
    (``final``: those failed after all their retries). A record the store refuses is logged, and this
    batch still counts."""
    task, ti = context["task"], context.get("ti")
    instance = None if ti is None else f"{getattr(ti, 'dag_id', '')}|{getattr(ti, 'run_id', '')}|" \
                                       f"{info['task_id']}|{info['map_index']}"
    try:
        record_failed_try(store, layout, epoch=task.epoch, batch=task.batch, phase=task.phase,
                          try_number=info["try_number"], final=final, instance=instance,
                          task_id=info["task_id"], map_index=info["map_index"], error=info["error"][:500])
    except Exception as err:  # noqa: BLE001 - count it anyway: a failure must never go uncounted silently
        log.error("the failed try of %s was not recorded (%s: %s); it counts only in this callback",
                  info["unit"], type(err).__name__, err)
    return failed_batches(store, layout, task.epoch, final_only=final) | {task.batch}


def on_retry(context: dict[str, Any], notifiers: tuple[Any, ...] = ()) -> None:
    """Record the failed try; escalate when too many of the epoch's batches have failed since the last resume."""
    if refused_by_owner(context):
        return
    cfg, store, layout, unit, info = _unit_info(context)
    task = context["task"]
    record_event(store, layout, TASK_FAILED, epoch=task.epoch, phase=task.phase, batch=task.batch, **info)
    if task.batch is None:
        return
    share = len(_count_failed_try(context, store, layout, info)) / cfg.rollout.batches_per_epoch
    if share > cfg.fault_tolerance.max_failed_batch_fraction:
        _halt(context, cfg, store, [info],
              f"{share:.0%} of epoch {task.epoch}'s batches failed (limit "
              f"{cfg.fault_tolerance.max_failed_batch_fraction:.0%})", notifiers)


def on_failure(context: dict[str, Any], notifiers: tuple[Any, ...] = ()) -> None:
    """A unit failed after all its retries: halt the experiment, unless the epoch may go on without its batch.

    With ``fault_tolerance.min_committed_batch_fraction`` below 1, a batch whose rollout or score
    failed for good is left to the epoch's validate (it runs on ``all_done`` and records the
    skipped batches) while the batches failed for good still leave that share committed.
    A task that safe mode refused (its unit never ran) is recorded as refused: no failed batch, no new halt.
    """
    if refused_by_owner(context):
        log.warning("not recorded in the experiment: this DAG may not write to it (%s)", context.get("exception"))
        return
    cfg, store, layout, unit, info = _unit_info(context)
    task = context["task"]
    refused = refused_by_safe_mode(context)
    record_event(store, layout, TASK_FAILED, epoch=task.epoch, phase=task.phase, batch=task.batch, final=True,
                 **({"refused": "safe_mode"} if refused else {}), **info)
    if refused:  # neither a failed batch nor a new halt: the Clear of the run's failed tasks reruns it
        log.warning("%s did not run: %s is in safe mode", unit, cfg.experiment)
        return
    if task.batch is not None:
        lost = _count_failed_try(context, store, layout, info, final=True)
        if cfg.fault_tolerance.may_skip(len(lost), cfg.rollout.batches_per_epoch):
            log.warning("%s failed for good; epoch %d goes on without batch %s (%d of %d batches lost, "
                        "min_committed_batch_fraction %s)", unit, task.epoch, task.batch, len(lost),
                        cfg.rollout.batches_per_epoch, cfg.fault_tolerance.min_committed_batch_fraction)
            return
    _halt(context, cfg, store, [info], f"{unit} failed after all its retries", notifiers)
