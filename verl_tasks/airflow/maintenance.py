"""The maintenance DAG: on a schedule, verify every experiment's newest snapshots, collect garbage, notify on trouble.

``dags/maintenance.py`` builds it from ``dags/maintenance.yaml``::

    schedule: "@daily"
    stores:
      - uri: file://.store
      - uri: s3://bucket/rl
        aws_conn_id: aws_default
    verify_newest: 1        # newest kept snapshots of each experiment: hashes + (forward_pass) a forward pass
    forward_pass: true
    gc_older_than: 1d       # garbage younger than this is kept (gc's safety rules apply besides)

One task per store (:class:`MaintainStoreOperator`) runs :func:`verl_tasks.ops.maintenance.maintain_store`.
When it finds a problem the task fails without retries, and the DAG's ``notifiers`` (Airflow
``BaseNotifier`` objects: a provider's Slack, SMTP or PagerDuty notifier, or your own) are
its ``on_failure_callback``, called with the task's context plus ``alert`` (``kind``
``maintenance``, ``store``, ``summary``), the same shape safe mode sends (see
:mod:`verl_tasks.airflow.callbacks`). Importing this module imports neither torch nor ray.
"""
from __future__ import annotations

import functools
import re
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from airflow.sdk import DAG, BaseOperator
from airflow.sdk.exceptions import AirflowFailException
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from verl_tasks.airflow.callbacks import notify
from verl_tasks.errors import ConfigError
from verl_tasks.ops.gc import parse_age


class StoreSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    uri: str = Field(description="file://PATH (relative to VERL_TASKS_STORE_ROOT or the working directory) "
                                 "or s3://BUCKET/PREFIX")
    aws_conn_id: str | None = Field(None, description="Airflow connection with the S3 keys")
    endpoint_url: str | None = None
    region: str | None = None


class MaintenanceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schedule: str | None = "@daily"
    stores: list[StoreSpec] = Field(min_length=1)
    verify_newest: int = Field(1, ge=0, description="newest kept snapshots verified per experiment")
    forward_pass: bool = Field(True, description="load each verified policy and run one forward pass")
    gc_older_than: str = Field("1d", description="garbage younger than this is kept (30m, 12h, 2d)")

    @field_validator("gc_older_than")
    @classmethod
    def _age(cls, value: str) -> str:
        try:
            parse_age(value)
        except ConfigError as err:
            raise ValueError(str(err).replace("--older-than", "gc_older_than")) from err
        return value


def read_maintenance_config(path: str | Path) -> MaintenanceConfig:
    """Raises ConfigError naming the bad key and the file."""
    from verl_tasks.yaml_files import read_yaml_file

    raw = read_yaml_file(path, "maintenance config")
    try:
        return MaintenanceConfig.model_validate(raw if raw is not None else {})
    except ValidationError as err:
        where = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<top level>'}: {e['msg']}" for e in err.errors())
        raise ConfigError(f"invalid maintenance config {path}: {where}") from err


class MaintainStoreOperator(BaseOperator):
    """Verify and collect every experiment of one store; fail (no retries) when anything is wrong.

    Args:
        store: where the store is and how to reach it.
        verify_newest, forward_pass, gc_older_than: see :class:`MaintenanceConfig`.
    """

    ui_color = "#eef3e2"

    def __init__(self, *, store: dict[str, Any], verify_newest: int = 1, forward_pass: bool = True,
                 gc_older_than: str = "1d", **kwargs: Any):
        super().__init__(**kwargs)
        self.store_spec = StoreSpec.model_validate(store).model_dump()
        self.verify_newest = verify_newest
        self.forward_pass = forward_pass
        self.gc_older_than = gc_older_than

    def open(self):
        from verl_tasks.airflow.connections import s3_access
        from verl_tasks.store import (
            absolute_uri,  # file:// paths resolved as the experiments' are
            open_store,
        )

        spec = self.store_spec
        access = s3_access(spec["aws_conn_id"])
        return open_store(absolute_uri(spec["uri"]), endpoint_url=spec["endpoint_url"] or access.endpoint_url,
                          region=spec["region"] or access.region, credentials=access.credentials)

    def execute(self, context: Any) -> dict[str, Any]:
        from verl_tasks.ops.maintenance import maintain_store

        care = maintain_store(self.open(), verify_newest=self.verify_newest, forward=self.forward_pass,
                              older_than_s=parse_age(self.gc_older_than))
        for line in care.lines():
            self.log.info("%s", line)
        if care.problems:
            raise AirflowFailException(f"maintenance of {care.uri} found {len(care.problems)} problem(s): "
                                       + " | ".join(care.problems))
        return care.summary()


def alert_on_failure(context: dict[str, Any], notifiers: tuple[Any, ...] = ()) -> None:
    """``on_failure_callback`` of a maintenance task: the notifiers hear what was found."""
    task, error = context.get("task"), context.get("exception")
    uri = getattr(task, "store_spec", {}).get("uri")
    summary = f"{type(error).__name__}: {error}" if error else f"maintenance of {uri} failed"
    notify(notifiers, context, {"kind": "maintenance", "store": uri, "summary": summary})


def task_id_for(uri: str) -> str:
    """A readable task id for a store URI: ``file://.store`` -> ``store_file_store``."""
    return "store_" + re.sub(r"[^A-Za-z0-9]+", "_", uri).strip("_")[:200]


def build_maintenance_dag(yaml_path: str | Path, *, dag_id: str | None = None, notifiers: list[Any] | None = None,
                          tags: list[str] | None = None) -> DAG:
    """The maintenance DAG for ``yaml_path`` (see the module docstring), named after the YAML by default.

    Raises:
        ConfigError: the YAML is invalid (the message names the key).
    """
    cfg = read_maintenance_config(yaml_path)
    dag_id = dag_id or Path(yaml_path).stem
    callbacks = [functools.partial(alert_on_failure, notifiers=tuple(notifiers))] if notifiers else None
    doc = (f"### verl-tasks maintenance\n\nBuilt from `{Path(yaml_path).name}`: for every experiment of each store, "
           f"verify the newest {cfg.verify_newest} kept snapshot(s) (sha256 of every file"
           f"{', then load the policy and run one forward pass' if cfg.forward_pass else ''}), then collect garbage "
           f"older than {cfg.gc_older_than} with gc's safety rules. A task fails, and notifies, when something is "
           f"wrong; its log names each problem.")
    with DAG(dag_id=dag_id, schedule=cfg.schedule, start_date=datetime(2024, 1, 1), catchup=False, max_active_runs=1,
             doc_md=doc, tags=tags or ["verl-tasks", "maintenance"],
             default_args={"retries": 1, "retry_delay": timedelta(minutes=5)}) as dag:
        for spec in cfg.stores:
            MaintainStoreOperator(task_id=task_id_for(spec.uri), store=spec.model_dump(),
                                  verify_newest=cfg.verify_newest, forward_pass=cfg.forward_pass,
                                  gc_older_than=cfg.gc_older_than, on_failure_callback=callbacks,
                                  doc_md=f"Verify and collect the experiments of `{spec.uri}`.")
    return dag
