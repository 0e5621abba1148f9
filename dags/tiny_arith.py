"""The tiny CPU demo: two-digit addition with the built-in model (see experiments/tiny_arith.yaml)."""
from pathlib import Path

from verl_tasks.airflow.factory import build_dag

dag = build_dag(Path(__file__).parent / "experiments" / "tiny_arith.yaml")
