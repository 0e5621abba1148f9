"""Nightly continual training from tiny-arith's latest snapshot (see experiments/scheduled_retrain.yaml).

Its `promote` task publishes the final snapshot as `promoted_asset("scheduled_retrain")` only when
it beats the snapshot the run started from. A deployment DAG schedules on that Asset::

    from airflow.sdk import DAG, task
    from verl_tasks.airflow.promotion import promoted_asset

    with DAG("deploy_arith", schedule=[promoted_asset("scheduled_retrain")]):
        @task
        def deploy(*, triggering_asset_events=None):
            for event in triggering_asset_events[promoted_asset("scheduled_retrain")]:
                ...  # event.extra: experiment, version, uri, weights_sha256, accuracy, baseline
        deploy()
"""
from pathlib import Path

from verl_tasks.airflow.factory import build_dag

dag = build_dag(Path(__file__).parent / "experiments" / "scheduled_retrain.yaml")
