"""The promotion gate's decision (verl_tasks.ops.promotion), without Airflow: which numbers are compared, the margin,
and what is said when an evaluation is missing. tests/airflow/test_promotion.py runs it through Airflow."""
from __future__ import annotations

import json

import pytest

from verl_tasks.layout import Layout
from verl_tasks.ops.promotion import beats, decide
from verl_tasks.store import open_store
from verl_tasks.store.units import UnitWriter


def commit_accuracy(store, unit: str, accuracy: float, version: int) -> None:
    """A committed evaluate unit whose metrics say ``accuracy`` for policy ``version``."""
    writer = UnitWriter(store, unit)
    metrics = {"eval_accuracy": accuracy, "policy_version": version}
    writer.write_json("metrics.json", metrics)
    writer.commit({"metrics": metrics})


def pin(store, experiment: str, parent: dict | None) -> None:
    body = {"experiment": experiment, "config_hash": "0" * 64, "parent": parent}
    store.put(Layout(experiment).experiment_json, json.dumps(body).encode())


@pytest.fixture
def child(tmp_path):
    """A child of ``parent`` snapshot 3 after 2 epochs; the parent reported 0.9 for snapshot 3 on its own prompts."""
    store = open_store(f"file://{tmp_path}/store")
    commit_accuracy(store, Layout("parent").evaluate(2), 0.9, 3)
    pin(store, "child", {"experiment": "parent", "version": 3})
    return store, Layout("child")


@pytest.mark.parametrize("accuracy,baseline,margin,expected", [
    (0.5, 0.4, 0.0, True), (0.4, 0.4, 0.0, False), (0.3, 0.4, 0.0, False),
    (0.5, 0.4, 0.1, False), (0.51, 0.4, 0.1, True), (0.35, 0.4, -0.1, True),
])
def test_beats_by_more_than_the_margin(accuracy, baseline, margin, expected):
    assert beats(accuracy, baseline, margin) is expected


def test_the_child_is_compared_with_its_own_evaluation_of_the_parent_snapshot(child):
    store, layout = child
    commit_accuracy(store, layout.base_evaluate, 0.40, 0)  # parent snapshot 3, on the child's held-out prompts
    commit_accuracy(store, layout.evaluate(1), 0.45, 2)
    decision = decide(store, layout, final_epoch=1)
    assert decision.promoted and (decision.accuracy, decision.baseline) == (0.45, 0.40)
    assert decision.parent_reported_accuracy == 0.9  # reported, not compared: another held-out set
    assert decision.reason.startswith("promoted: snapshot 2 eval_accuracy 0.4500 beats parent snapshot 3 (0.4000")
    held_back = decide(store, layout, final_epoch=1, margin=0.05)
    assert not held_back.promoted and "does not beat parent snapshot 3" in held_back.reason
    assert "margin 0.05" in held_back.reason


def test_a_tie_is_not_promoted(child):
    store, layout = child
    commit_accuracy(store, layout.base_evaluate, 0.40, 0)
    commit_accuracy(store, layout.evaluate(1), 0.40, 2)
    assert not decide(store, layout, final_epoch=1).promoted


def test_a_missing_evaluation_is_not_promoted_and_named(child):
    store, layout = child
    commit_accuracy(store, layout.evaluate(1), 0.45, 2)
    decision = decide(store, layout, final_epoch=1)
    assert not decision.promoted and decision.accuracy == 0.45 and decision.baseline is None
    assert decision.reason == ("not promoted: child/base/evaluate is not committed, so snapshot 2 cannot be compared "
                               "with where the run started")


def test_a_run_without_parent_is_compared_with_its_base_model(tmp_path):
    store, layout = open_store(f"file://{tmp_path}/store"), Layout("solo")
    pin(store, "solo", None)
    commit_accuracy(store, layout.base_evaluate, 0.2, 0)
    commit_accuracy(store, layout.evaluate(0), 0.1, 1)
    decision = decide(store, layout, final_epoch=0)
    assert not decision.promoted and decision.parent is None and decision.parent_reported_accuracy is None
    assert "does not beat the configured base model (0.2000" in decision.reason
