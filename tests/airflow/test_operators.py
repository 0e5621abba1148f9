"""Operators without a scheduler: the trigger-form validation and the marker short-cut."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.airflow.conftest import DAGS
from verl_tasks.airflow.operators import ConfigureExperimentOperator, VerlPhaseOperator
from verl_tasks.errors import ConfigError, ConfigMismatch

TINY = str(DAGS / "experiments" / "tiny_arith.yaml")


def _ctx(**params):
    return {"params": params, "dag_run": SimpleNamespace(run_type="manual", conf={}, logical_date=None, run_after=None)}


@pytest.fixture
def store_root(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_TASKS_STORE_ROOT", str(tmp_path))
    return tmp_path


def test_configure_refuses_changed_hyperparameter(store_root):
    op = ConfigureExperimentOperator(task_id="configure", config_path=TINY)
    first = op.execute(_ctx(experiment="exp-a", lr=0.001))
    assert first["experiment"] == "exp-a" and (store_root / ".store/exp-a/experiment.json").is_file()
    assert op.execute(_ctx(experiment="exp-a", lr=0.001))["config_hash"] == first["config_hash"]
    from verl_tasks.layout import Layout
    from verl_tasks.store import open_store
    from verl_tasks.store.units import UnitWriter

    writer = UnitWriter(open_store(f"file://{store_root}/.store"), Layout("exp-a").rollout(0, 0))
    writer.write_json("samples.jsonl", {"x": 1})
    writer.commit({"samples": 1})  # after the first rollout the pin is final
    with pytest.raises(ConfigMismatch) as err:
        op.execute(_ctx(experiment="exp-a", lr=0.005, group_size=4))
    assert err.value.differing_keys == ["algorithm.group_size", "algorithm.lr"]
    with pytest.raises(ConfigError, match="already exists"):
        op.execute(_ctx(experiment="exp-a", resume="fresh"))
    with pytest.raises(ConfigError, match="no committed snapshot"):
        op.execute(_ctx(experiment="exp-b", resume="snapshot", parent="exp-a", from_snapshot=3))


def test_phase_operator_returns_from_marker_without_running(store_root):
    from verl_tasks.config import load_config
    from verl_tasks.layout import Layout
    from verl_tasks.store import open_store
    from verl_tasks.store.units import UnitWriter

    cfg = load_config(TINY, {"experiment": "exp-m"})
    store = open_store(f"file://{store_root}/.store")
    writer = UnitWriter(store, Layout("exp-m").rollout(0, 2))
    writer.write_json("samples.jsonl", {"x": 1})
    writer.commit({"samples": 3, "metrics": {"finished_fraction": 1.0}})
    # backend="ray" with no Ray configured: it must not even look for Ray when the marker exists.
    op = VerlPhaseOperator(task_id="rollout", config_path=TINY, phase="rollout", epoch=0, batch=2, backend="ray",
                           ray_conn_id=None)
    out = op.execute(_ctx(experiment="exp-m"))
    assert out["unit"] == "exp-m/epochs/00000/rollout/b0002" and out["metrics"]["samples"] == 3
    skipped = VerlPhaseOperator(task_id="plan", config_path=TINY, phase="plan", epoch=5, backend="inline")
    from airflow.sdk.exceptions import AirflowSkipException

    with pytest.raises(AirflowSkipException):
        skipped.execute(_ctx(experiment="exp-m", epochs=2))
    del cfg


SCHEDULED = str(DAGS / "experiments" / "scheduled_retrain.yaml")


def _publish_parent(store, version: int) -> None:
    """Commit ``tiny-arith`` snapshot ``version`` (with optimizer state) and make it the latest."""
    import json

    from verl_tasks.layout import Layout
    from verl_tasks.store.units import UnitWriter

    parent = Layout("tiny-arith")
    writer = UnitWriter(store, parent.snapshot(version))
    writer.write_bytes("model.safetensors", f"weights-v{version}".encode())
    writer.write_json("config.json", {"model_type": "tiny"})
    writer.write_bytes("optimizer.safetensors", b"moments")
    writer.commit({"version": version})
    store.put(parent.latest, json.dumps({"version": version}).encode())


def test_scheduled_run_starts_new_experiment_from_parent_snapshot(store_root):
    from datetime import datetime

    from verl_tasks.layout import Layout
    from verl_tasks.store import open_store
    from verl_tasks.store.units import read_marker

    store = open_store(f"file://{store_root}/.store")
    parent = Layout("tiny-arith")
    _publish_parent(store, 3)
    op = ConfigureExperimentOperator(task_id="configure",
                                     config_path=str(DAGS / "experiments" / "scheduled_retrain.yaml"))
    run = SimpleNamespace(run_type="scheduled", conf={}, logical_date=datetime(2026, 5, 1, 3, 0), run_after=None)
    out = op.execute({"params": {}, "dag_run": run})
    assert out["experiment"] == "scheduled-retrain-20260501T030000"
    assert out["parent"]["experiment"] == "tiny-arith" and out["parent"]["version"] == 3
    base = read_marker(store, Layout(out["experiment"]).snapshot(0))
    assert set(base.files) == {"model.safetensors", "config.json", "trainer_state.json"}  # fresh optimizer
    parent_weights = read_marker(store, parent.snapshot(3)).files["model.safetensors"]
    assert base.files["model.safetensors"].sha256 == parent_weights.sha256
    assert op.execute({"params": {}, "dag_run": run})["experiment"] == out["experiment"]  # idempotent


def test_a_manual_run_of_a_dag_with_schedule_parent_starts_from_the_parent_too(store_root):
    """A manual trigger of scheduled_retrain forks its experiment from tiny-arith's latest snapshot, not from
    the configured base model; once started it continues, and one pinned without a parent keeps its base."""
    from verl_tasks.config import load_config
    from verl_tasks.execution.lineage import start_experiment
    from verl_tasks.layout import Layout
    from verl_tasks.store import open_store
    from verl_tasks.store.units import read_marker

    store = open_store(f"file://{store_root}/.store")
    _publish_parent(store, 3)
    op = ConfigureExperimentOperator(task_id="configure", config_path=SCHEDULED)
    out = op.execute(_ctx())
    assert out["experiment"] == "scheduled-retrain" and out["resume"] == "latest"
    assert (out["parent"]["experiment"], out["parent"]["version"]) == ("tiny-arith", 3)
    base = read_marker(store, Layout("scheduled-retrain").snapshot(0))
    assert base.files["model.safetensors"].sha256 == read_marker(
        store, Layout("tiny-arith").snapshot(3)).files["model.safetensors"].sha256

    _publish_parent(store, 4)  # the parent trained on: the started experiment keeps its base
    assert op.execute(_ctx())["parent"]["version"] == 3
    assert op.execute(_ctx(experiment="retrain-later"))["parent"]["version"] == 4  # a new name: the latest

    start_experiment(store, load_config(SCHEDULED, {"experiment": "from-base"}))  # pinned without a parent
    assert op.execute(_ctx(experiment="from-base"))["parent"] is None
    assert read_marker(store, Layout("from-base").snapshot(0)) is None  # nothing seeded: its plan builds the base
