"""The ``promote`` task of a retraining DAG: publish the final snapshot as the ``promoted`` Asset, or say why not.

The decision is :func:`verl_tasks.ops.promotion.decide` (no Airflow). When the snapshot is
promoted, the task succeeds and Airflow records an event of :func:`promoted_asset` with
``experiment``, ``version``, ``uri``, ``weights_sha256``, ``accuracy`` and ``baseline`` as its
extra. When it is not, the task is **skipped** with the reason: a skipped task emits no
asset event (Airflow only sends outlet events with a success), the run still succeeds and
the snapshot stays where it is. Either way the experiment's event log gets a
``promotion`` event with the decision and its numbers.

Downstream DAGs (deploy, export) schedule on the Asset::

    from airflow.sdk import DAG, task
    from verl_tasks.airflow.promotion import promoted_asset

    with DAG("deploy_arith", schedule=[promoted_asset("scheduled_retrain")]):
        @task
        def deploy(*, triggering_asset_events=None):
            for event in triggering_asset_events[promoted_asset("scheduled_retrain")]:
                print(event.extra["uri"], event.extra["accuracy"])
        deploy()
"""
from __future__ import annotations

from typing import Any

from airflow.sdk import Asset, BaseOperator
from airflow.sdk.exceptions import AirflowSkipException

from verl_tasks.airflow.operators import _RunConfigMixin, fail_fast


def promoted_asset(dag_id: str) -> Asset:
    """The Asset a retraining DAG's ``promote`` task updates when the run beats where it started."""
    return Asset(name=f"verl-tasks/{dag_id}/promoted", uri=f"verl-tasks://{dag_id}/promoted")


class PromoteSnapshotOperator(_RunConfigMixin, BaseOperator):
    """Publish the run's final snapshot as ``asset`` when it beats its starting snapshot; skip otherwise.

    Args:
        config_path: the experiment YAML the DAG was built from.
        asset: the promoted Asset (see :func:`promoted_asset`); it is this task's only outlet.
        aws_conn_id: AWS connection for S3 (the YAML's ``storage.aws_conn_id`` wins).
    """

    ui_color = "#e6f4ea"

    def __init__(self, *, config_path: str, asset: Asset, aws_conn_id: str | None = None, **kwargs: Any):
        super().__init__(outlets=[asset], **kwargs)
        self.config_path = str(config_path)
        self.asset = asset
        self.aws_conn_id = aws_conn_id

    def execute(self, context: Any) -> dict[str, Any]:
        from verl_tasks.events import record_event
        from verl_tasks.layout import Layout
        from verl_tasks.ops.promotion import PROMOTION, decide
        from verl_tasks.ownership import check_may_write
        from verl_tasks.store.conventions import has_policy, weights_sha256
        from verl_tasks.store.units import read_marker

        with fail_fast(f"task {self.task_id}"):
            cfg, access = self.resolve(context)
        store = self.store(cfg, access)
        with fail_fast(f"task {self.task_id}"):
            check_may_write(store, cfg.experiment, self.dag_access(context, cfg))
        layout = Layout(cfg.experiment)
        decision = decide(store, layout, cfg.epochs - 1, cfg.schedule.promote_margin)
        record_event(store, layout, PROMOTION, **decision.to_dict())
        if not decision.promoted:
            self.log.warning("%s: %s", cfg.experiment, decision.reason)
            raise AirflowSkipException(decision.reason)
        unit = layout.snapshot(decision.version)
        record = read_marker(store, unit)
        extra = {"experiment": cfg.experiment, "version": decision.version, "uri": store.url(unit),
                 "weights_sha256": weights_sha256(record) if record and has_policy(record) else None,
                 "accuracy": decision.accuracy, "baseline": decision.baseline, "margin": decision.margin}
        context["outlet_events"][self.asset].extra = extra
        self.log.info("%s: %s", cfg.experiment, decision.reason)
        return extra
