"""Escalation: when light faults stop being light, halt the experiment and tell a person.

Tiered response:

1. a failed attempt is retried by Airflow (``on_retry_callback`` records it in the store);
2. if more than ``fault_tolerance.max_failed_batch_fraction`` of an epoch's batches have
   failed at least once, or a unit fails after all its retries (``on_failure_callback``),
   the experiment enters **safe mode**: ``control/safe_mode.json`` is written, so no unit of
   that experiment starts anywhere until ``verl-tasks resume``; the DAG is paused through the
   REST API (connection ``verl_airflow_api``) when one is configured; and the optional
   user callback (``VERL_TASKS_FAILURE_CALLBACK=module:function``) gets the summary.
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import urllib.request
from typing import Any

from verl_tasks.events import read_events, record_event
from verl_tasks.layout import Layout

log = logging.getLogger(__name__)
API_CONN_ID = os.environ.get("VERL_TASKS_AIRFLOW_API_CONN", "verl_airflow_api")
TASK_FAILED = "task_failed"


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
        "error": f"{type(context.get('exception')).__name__}: {context.get('exception')}"[:1500],
    }
    return cfg, store, layout, unit, info


def pause_dag(dag_id: str, conn_id: str = API_CONN_ID) -> str:
    """Pause a DAG through the REST API v2; returns what happened (never raises)."""
    try:
        from airflow.sdk import BaseHook

        conn = BaseHook.get_connection(conn_id)
    except Exception:  # noqa: BLE001 - no connection: the safe-mode file still halts the experiment
        return f"DAG not paused automatically (no Airflow connection {conn_id!r}); pause it in the UI"
    base = f"{conn.schema or 'http'}://{conn.host}:{conn.port or 8080}".rstrip("/")
    headers = {"Content-Type": "application/json"}
    try:
        if conn.login:
            body = json.dumps({"username": conn.login, "password": conn.password or ""}).encode()
            with urllib.request.urlopen(urllib.request.Request(f"{base}/auth/token", body, headers), timeout=10) as resp:
                headers["Authorization"] = f"Bearer {json.loads(resp.read())['access_token']}"
        request = urllib.request.Request(f"{base}/api/v2/dags/{dag_id}", json.dumps({"is_paused": True}).encode(),
                                         headers, method="PATCH")
        with urllib.request.urlopen(request, timeout=10):
            return f"DAG {dag_id} paused"
    except Exception as err:  # noqa: BLE001 - report, the safe-mode file is the real guard
        return f"DAG {dag_id} not paused ({type(err).__name__}); pause it in the UI"


def _notify(summary: dict[str, Any]) -> None:
    target = os.environ.get("VERL_TASKS_FAILURE_CALLBACK")
    if not target:
        return
    module, _, name = target.partition(":")
    try:
        getattr(importlib.import_module(module), name)(summary)
    except Exception as err:  # noqa: BLE001 - a broken notifier must not hide the failure
        log.warning("failure callback %s raised %s", target, err)


def _halt(context: dict[str, Any], cfg: Any, store: Any, failed: list[dict[str, Any]], reason: str) -> dict[str, Any]:
    from verl_tasks.ops.safe_mode import escalate

    summary = escalate(cfg, failed, reason, store=store)
    dag_id = getattr(context.get("dag"), "dag_id", None) or getattr(context.get("ti"), "dag_id", "")
    summary["paused"] = pause_dag(dag_id) if dag_id else "no DAG id"
    log.error("SAFE MODE: %s\n%s\n%s", summary["summary"], summary["what_to_do"], summary["paused"])
    _notify(summary)
    return summary


def on_retry(context: dict[str, Any]) -> None:
    """Record the failed try; escalate when too many of the epoch's batches have failed."""
    cfg, store, layout, unit, info = _unit_info(context)
    task = context["task"]
    record_event(store, layout, TASK_FAILED, epoch=task.epoch, phase=task.phase, batch=task.batch, **info)
    if task.batch is None:
        return
    failed_batches = {
        (e.get("phase"), e.get("batch"))
        for e in read_events(store, layout)
        if e.get("kind") == TASK_FAILED and e.get("epoch") == task.epoch and e.get("batch") is not None
    }
    share = len({b for _, b in failed_batches}) / cfg.rollout.batches_per_epoch
    if share > cfg.fault_tolerance.max_failed_batch_fraction:
        _halt(context, cfg, store, [info],
              f"{share:.0%} of epoch {task.epoch}'s batches failed (limit "
              f"{cfg.fault_tolerance.max_failed_batch_fraction:.0%})")


def on_failure(context: dict[str, Any]) -> None:
    """A unit failed after all its retries: halt the experiment."""
    cfg, store, layout, unit, info = _unit_info(context)
    record_event(store, layout, TASK_FAILED, epoch=context["task"].epoch, phase=context["task"].phase,
                 batch=context["task"].batch, final=True, **info)
    _halt(context, cfg, store, [info], f"{unit} failed after all its retries")
