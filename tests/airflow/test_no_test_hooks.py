"""A DAG run's conf cannot inject faults: keys the old test hooks read (``fail_once``) and any
other unknown key do nothing; the unit runs normally and no file appears where they point."""
from __future__ import annotations

from types import SimpleNamespace

from tests.conftest import small_overrides, write_yaml
from verl_tasks.airflow.operators import VerlPhaseOperator


def test_run_conf_cannot_create_files_or_fail_units(tmp_path):
    yaml = write_yaml(tmp_path, small_overrides(**{"storage.uri": f"file://{tmp_path}/store",
                                                   "model.tiny.warm_start_steps": 20}))
    planted = tmp_path / "planted"
    conf = {
        "experiment": "conf-hooks",
        "fail_once": {"phase": "plan", "epoch": 0, "batch": None, "flag": str(planted / "fail-once")},
        "hold": {"dir": str(planted), "label": "e0-plan"},
        "VERL_TASKS_FAIL_ONCE": str(planted / "env-flag"),
        "some_unknown_key": str(planted / "unknown"),
    }
    dag_run = SimpleNamespace(run_type="manual", conf=conf, logical_date=None, run_after=None)
    op = VerlPhaseOperator(task_id="plan", config_path=str(yaml), phase="plan", epoch=0, backend="inline")
    out = op.execute({"params": {"experiment": "conf-hooks"}, "dag_run": dag_run})
    assert out["unit"] == "conf-hooks/epochs/00000/plan"
    assert not planted.exists(), sorted(planted.rglob("*"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp.yaml", "store"]
