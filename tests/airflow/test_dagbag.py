"""Every DAG file imports without errors, and without torch or ray at module top level.

How long each DAG file takes to parse is measured by ``benchmarks/dag_parse.py``, not asserted here.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.airflow.conftest import DAGS

DAG_FILES = sorted(p for p in DAGS.glob("*.py") if not p.name.startswith("_"))


def test_dagbag_imports_every_file():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(DAGS))
    assert bag.import_errors == {}, bag.import_errors
    assert {p.stem for p in DAG_FILES} <= set(bag.dag_ids)
    for stats in bag.dagbag_stats:
        took = stats.duration.total_seconds() if hasattr(stats.duration, "total_seconds") else stats.duration
        print(f"parse {stats.file}: {took}s, {stats.dag_num} dag(s), {stats.task_num} tasks")


@pytest.mark.parametrize("path", DAG_FILES, ids=lambda p: p.name)
def test_dag_file_parses_without_torch_or_ray(path):
    # A fresh interpreter: Airflow itself is imported first (every DAG processor has it loaded),
    # then the DAG file is run on its own.
    code = (
        "import sys, json, runpy\n"
        "import airflow.sdk\n"
        "from airflow.sdk import DAG, Asset, Param, TaskGroup, BaseOperator\n"
        f"runpy.run_path({str(path)!r})\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'ray': 'ray' in sys.modules}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert not result["torch"], "the DAG file imported torch"
    assert not result["ray"], "the DAG file imported ray"
