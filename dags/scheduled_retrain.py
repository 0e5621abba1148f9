"""Nightly continual training from tiny-arith's latest snapshot (see experiments/scheduled_retrain.yaml)."""
from pathlib import Path

from verl_tasks.airflow.factory import build_dag

dag = build_dag(Path(__file__).parent / "experiments" / "scheduled_retrain.yaml")
