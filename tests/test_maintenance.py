"""Store maintenance without Airflow (verl_tasks.ops.maintenance): which experiments and snapshots it checks, and
what counts as a problem. tests/airflow/test_maintenance.py runs the DAG, with real weights and a forward pass."""
from __future__ import annotations

import json

import pytest

from verl_tasks.layout import Layout
from verl_tasks.ops.maintenance import list_experiments, maintain_store, newest_versions
from verl_tasks.store import open_store
from verl_tasks.store.units import PRUNED, UnitWriter, read_marker


def _snapshot(store, layout: Layout, version: int) -> None:
    writer = UnitWriter(store, layout.snapshot(version))
    writer.write_json("trainer_state.json", {"version": version})
    writer.commit({"version": version})


@pytest.fixture
def store(tmp_path):
    """Experiment ``a`` with snapshots 0-3 (2 pruned by retention); ``b`` with snapshot 0; a non-experiment folder."""
    store = open_store(f"file://{tmp_path}/store")
    for name, versions in (("a", range(4)), ("b", range(1))):
        store.put(Layout(name).experiment_json, json.dumps({"config_hash": "0" * 64, "config": {}}).encode())
        for version in versions:
            _snapshot(store, Layout(name), version)
    store.put(f"{Layout('a').snapshot(2)}/{PRUNED}", b"{}")
    store.put("scratch/notes.txt", b"not an experiment")
    return store


def test_experiments_are_the_folders_with_experiment_json(store):
    assert list_experiments(store) == ["a", "b"]


def test_the_newest_kept_snapshots_are_checked(store):
    assert newest_versions(store, Layout("a"), 2) == [3, 1]  # 2 was pruned: no weights to check
    assert newest_versions(store, Layout("a"), 0) == []


def test_a_changed_file_and_a_damaged_pin_are_problems(store):
    record = read_marker(store, Layout("a").snapshot(3))
    store.put(record.key("trainer_state.json"), b'{"version": 33}')
    store.put(Layout("b").experiment_json, b"{not json")
    care = maintain_store(store, verify_newest=2, forward=False, older_than_s=0)
    by_name = {c.experiment: c for c in care.experiments}
    assert [(v["version"], v["state"]) for v in by_name["a"].verified] == [(3, "FAILED"), (1, "OK")]
    assert care.problems[0].startswith("a: snapshot 3 (") and "failed verification" in care.problems[0]
    assert by_name["a"].gc is not None and by_name["b"].gc is None  # no timeouts known: gc stays away
    assert care.problems[1].startswith("b: gc not run: StoreError")
    assert len(care.problems) == 2 and care.summary()["verified"] == 3


def test_a_healthy_store_has_no_problems(store):
    care = maintain_store(store, verify_newest=1, forward=False, older_than_s=0)
    assert care.problems == [] and [len(c.verified) for c in care.experiments] == [1, 1]
