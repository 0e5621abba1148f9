"""Every DAG file imports without errors, quickly, and without torch or ray at module top level."""
from __future__ import annotations

import json
import subprocess
import sys
import time

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
def test_dag_file_parses_fast_without_torch_or_ray(path):
    # A fresh interpreter: Airflow itself is imported first (every DAG processor has it loaded),
    # then the DAG file is timed on its own.
    code = (
        "import sys, time, json, runpy\n"
        "import airflow.sdk\n"
        "from airflow.sdk import DAG, Asset, Param, TaskGroup, BaseOperator\n"
        f"t = time.perf_counter(); runpy.run_path({str(path)!r}); dt = time.perf_counter() - t\n"
        "print(json.dumps({'seconds': dt, 'torch': 'torch' in sys.modules, 'ray': 'ray' in sys.modules}))\n"
    )
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{path.name}: DAG file parse {result['seconds']:.3f}s (process {time.perf_counter() - started:.1f}s)")
    assert not result["torch"], "the DAG file imported torch"
    assert not result["ray"], "the DAG file imported ray"
    assert result["seconds"] < 1.0
