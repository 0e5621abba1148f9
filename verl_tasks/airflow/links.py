"""Extra links on each phase task: the unit in storage (the dashboard's unit page) and its Ray job.

Airflow 3 computes a link in the worker when the task finishes (``get_link`` with the real operator
and the running task instance) and keeps it as an XCom the UI reads, so a link costs the UI nothing.
The unit page is served by the plugin behind Airflow's auth; the Ray link opens the job in the Ray
dashboard named by the operator's Ray connection (empty for inline tasks or before a job existed).
"""
from __future__ import annotations

from typing import Any
from urllib.parse import quote, urlencode

from airflow.sdk import BaseOperatorLink

DASHBOARD = "/verl-tasks"


def unit_key(operator: Any, ti_key: Any) -> str:
    """The unit's storage key: from the task's XCom when it committed, else from the YAML's experiment."""
    pulled = None
    if hasattr(ti_key, "xcom_pull"):
        pulled = ti_key.xcom_pull(task_ids=ti_key.task_id, map_indexes=ti_key.map_index, key="return_value")
    if isinstance(pulled, dict) and isinstance(pulled.get("unit"), str):
        return pulled["unit"]
    from verl_tasks.airflow.runconfig import read_yaml
    from verl_tasks.layout import Layout

    return Layout(str(read_yaml(operator.config_path)["experiment"])).unit(operator.phase, operator.epoch,
                                                                           operator.batch)


def base_path() -> str:
    """The path Airflow's UI is served under (``[api] base_url``), so links work behind a prefix."""
    from urllib.parse import urlparse

    from airflow.configuration import conf

    return urlparse(conf.get("api", "base_url", fallback="") or "").path.rstrip("/")


def task_id(phase: str, epoch: int) -> str:
    """The Airflow task id of ``phase`` in ``epoch`` (``factory.build_dag``: one task group per epoch)."""
    return f"epoch_{epoch:03d}.{phase}"


def task_url(dag_id: str, task: str) -> str:
    """The task's page in Airflow's UI: its task instances over the runs (map indexes included), where a
    person reads the log and clears it."""
    return f"{base_path()}/dags/{quote(dag_id, safe='')}/tasks/{quote(task, safe='')}"


def run_url(dag_id: str, run_id: str) -> str:
    """The DAG run's page in Airflow's UI: its Clear (with "Clear only failed tasks") reruns every failed task."""
    return f"{base_path()}/dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}"


def task_instance_url(dag_id: str, run_id: str, task: str, map_index: int | None) -> str:
    """One task instance's page in Airflow's UI (a mapped one by its map index): its log and its Clear."""
    url = f"{run_url(dag_id, run_id)}/tasks/{quote(task, safe='')}"
    return url + (f"/mapped/{map_index}" if map_index is not None else "")


def unit_page(dag_id: str, key: str = "") -> str:
    """The unit's page on the Training dashboard (its experiment is the key's first part); with ``key``
    empty, the prefix a URL-quoted key completes (the Training page's cells)."""
    return f"{base_path()}{DASHBOARD}/unit?{urlencode({'dag': dag_id})}&key={quote(key, safe='/')}"


class StoreUnitLink(BaseOperatorLink):
    """The unit's page on the Training dashboard: committed attempt, files with size and sha256, events."""

    name = "Unit in storage"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        key = unit_key(operator, ti_key)
        query = urlencode({"dag": ti_key.dag_id, "experiment": key.split("/", 1)[0], "key": key})
        return f"{base_path()}{DASHBOARD}/unit?{query}"


def job_id(operator: Any, ti_key: Any) -> str | None:
    """The Ray submission id: set by ``execute`` before deferring, or handed to ``execute_complete``."""
    if getattr(operator, "_job_id", None):
        return operator._job_id
    context = getattr(ti_key, "_ti_context_from_server", None)
    return ((getattr(context, "next_kwargs", None) or {}).get("submission_id")) if context else None


class RayJobLink(BaseOperatorLink):
    """The unit's Ray job in the Ray dashboard (jobs page), for Ray-backed tasks."""

    name = "Ray job"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        submission = job_id(operator, ti_key)
        if getattr(operator, "backend", None) != "ray" or not submission:
            return ""
        from verl_tasks.airflow.connections import ray_target

        return f"{ray_target(operator.ray_conn_id).address.rstrip('/')}/#/jobs/{submission}"


__all__ = ["StoreUnitLink", "RayJobLink", "run_url", "task_id", "task_instance_url", "task_url", "unit_page"]
