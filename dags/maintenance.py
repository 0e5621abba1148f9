"""Store maintenance: verify snapshots, collect garbage, notify (see maintenance.yaml; add notifiers=[...] here)."""
from pathlib import Path

from verl_tasks.airflow.maintenance import build_maintenance_dag

dag = build_maintenance_dag(Path(__file__).parent / "maintenance.yaml")
