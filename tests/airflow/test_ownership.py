"""Experiments belong to the DAG that made them: the operators of DAGs built by the factory, without a scheduler.

Two DAGs share one store (``VERL_TASKS_STORE_ROOT``): a run of one can neither write to an experiment of
the other (pin, re-pin, commit units, its safe-mode record), nor fork from it, unless the YAML's
``access`` section names that DAG. Experiments that record no DAG (made by the CLI, or pinned before
DAGs were recorded) are claimed by the DAG whose YAML names them. The same rules through a real
api-server, REST triggers and Airflow's task runner: ``test_ownership_auth.py``.
"""
from __future__ import annotations

import json
from datetime import datetime
from types import SimpleNamespace

import pytest
import yaml

from tests.airflow.conftest import DAGS
from verl_tasks.airflow.factory import build_dag
from verl_tasks.errors import NotPermitted
from verl_tasks.layout import Layout
from verl_tasks.store.conventions import WEIGHTS, write_latest
from verl_tasks.store.units import UnitWriter, is_committed, read_marker

TINY = DAGS / "experiments" / "tiny_arith.yaml"
SCHEDULED = DAGS / "experiments" / "scheduled_retrain.yaml"


def _ctx(dag, run_type: str = "manual", when: datetime | None = None, **params):
    run = SimpleNamespace(run_type=run_type, dag_id=dag.dag_id, conf=params, logical_date=when, run_after=when)
    return {"params": params, "dag_run": run, "dag": dag}


def _copy(tmp_path, source, name: str, **changes):
    raw = yaml.safe_load(source.read_text())
    raw.update(changes)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _publish(store, experiment: str, version: int) -> None:
    writer = UnitWriter(store, Layout(experiment).snapshot(version))
    writer.write_bytes(WEIGHTS, f"{experiment} weights v{version}".encode())
    writer.write_json("config.json", {"model_type": "tiny"})
    write_latest(store, Layout(experiment), version, writer.commit({"version": version})[0])


def _prelude(store, experiment: str) -> None:
    """Commit the data units, as the first plan does: until a rollout commits, the owner may re-pin."""
    for split in ("train", "eval"):
        writer = UnitWriter(store, Layout(experiment).data(split))
        writer.write_bytes("prompts.jsonl", b"{}\n")
        writer.commit()


@pytest.fixture
def store(tmp_path, monkeypatch):
    from verl_tasks.store import open_store

    monkeypatch.setenv("VERL_TASKS_STORE_ROOT", str(tmp_path))
    return open_store(f"file://{tmp_path}/.store")


@pytest.fixture
def dags(tmp_path, store):
    """tiny_arith and an ``other`` DAG (the same YAML, experiment ``other-exp``), one store."""
    return build_dag(TINY), build_dag(_copy(tmp_path, TINY, "other", experiment="other-exp"), dag_id="other")


def _pin(store, experiment: str) -> dict:
    return json.loads(store.get(Layout(experiment).experiment_json))


def test_configure_records_the_dag_and_refuses_a_re_pin_from_another_one(store, dags):
    tiny, other = dags
    tiny.get_task("configure").execute(_ctx(tiny, experiment="mine", lr=0.0002))
    assert _pin(store, "mine")["dag_id"] == "tiny_arith"
    _prelude(store, "mine")
    pinned = store.get(Layout("mine").experiment_json)
    with pytest.raises(NotPermitted) as err:
        other.get_task("configure").execute(_ctx(other, experiment="mine", lr=0.0005))
    message = str(err.value)
    assert "experiment 'mine' belongs to DAG 'tiny_arith'; a run of DAG 'other' may not write to it" in message
    assert "adds 'tiny_arith' to access.write_to in" in message and str(other.get_task("configure").config_path) \
        in message
    assert store.get(Layout("mine").experiment_json) == pinned
    assert is_committed(store, Layout("mine").data("train")) and not store.list("mine/events/")
    # its own DAG may still re-pin it (only its prelude is committed): the refusal is about ownership
    tiny.get_task("configure").execute(_ctx(tiny, experiment="mine", lr=0.0005))
    assert _pin(store, "mine")["dag_id"] == "tiny_arith" and _pin(store, "mine")["config"]["algorithm"]["lr"] == 0.0005
    assert not is_committed(store, Layout("mine").data("train"))  # set aside by the owner's re-pin


def test_access_write_to_lets_another_dag_continue(tmp_path, store):
    tiny = build_dag(TINY)
    tiny.get_task("configure").execute(_ctx(tiny, experiment="shared-run"))
    writer = build_dag(_copy(tmp_path, TINY, "writer", experiment="writer-exp", access={"write_to": ["tiny_arith"]}),
                       dag_id="writer")
    assert writer.get_task("configure").execute(_ctx(writer, experiment="shared-run"))["experiment"] == "shared-run"
    assert _pin(store, "shared-run")["dag_id"] == "tiny_arith"  # the owner stays the DAG that made it


def test_a_fork_needs_access_fork_from(tmp_path, store, dags):
    tiny, other = dags
    tiny.get_task("configure").execute(_ctx(tiny, experiment="tiny-arith"))
    _publish(store, "tiny-arith", 0)
    with pytest.raises(NotPermitted) as err:
        other.get_task("configure").execute(_ctx(other, experiment="other-child", resume="snapshot",
                                                 parent="tiny-arith"))
    assert "a run of DAG 'other' may not start from experiment 'tiny-arith', which belongs to DAG 'tiny_arith'" \
        in str(err.value) and "adds 'tiny_arith' to access.fork_from" in str(err.value)
    assert not store.list("other-child/")
    forker = build_dag(_copy(tmp_path, TINY, "forker", experiment="forker-exp", access={"fork_from": ["tiny_arith"]}),
                       dag_id="forker")
    out = forker.get_task("configure").execute(_ctx(forker, experiment="forker-child", resume="snapshot",
                                                    parent="tiny-arith"))
    assert out["parent"]["experiment"] == "tiny-arith" and _pin(store, "forker-child")["dag_id"] == "forker"
    with pytest.raises(NotPermitted, match="belongs to DAG 'tiny_arith'"):  # forking is not writing
        forker.get_task("configure").execute(_ctx(forker, experiment="tiny-arith"))


def test_the_scheduled_retrain_dag_forks_tiny_arith_because_its_yaml_declares_it(tmp_path, store):
    tiny = build_dag(TINY)
    tiny.get_task("configure").execute(_ctx(tiny, experiment="tiny-arith"))
    _publish(store, "tiny-arith", 3)
    scheduled = build_dag(SCHEDULED)
    when = datetime(2026, 5, 1, 3, 0)
    out = scheduled.get_task("configure").execute(_ctx(scheduled, "scheduled", when))
    assert out["experiment"] == "scheduled-retrain-20260501T030000" and out["parent"]["version"] == 3
    assert _pin(store, out["experiment"])["dag_id"] == "scheduled_retrain"
    raw = yaml.safe_load(SCHEDULED.read_text())
    assert raw["access"] == {"fork_from": ["tiny_arith"]}
    del raw["access"]
    undeclared = tmp_path / "scheduled_retrain.yaml"
    undeclared.write_text(yaml.safe_dump(raw))
    dag = build_dag(undeclared)
    with pytest.raises(NotPermitted, match="adds 'tiny_arith' to access.fork_from"):
        dag.get_task("configure").execute(_ctx(dag, "scheduled", datetime(2026, 5, 2, 3, 0)))
    assert not store.list("scheduled-retrain-20260502T030000/")


@pytest.mark.parametrize("recorded", ["cli", "before"])
def test_an_experiment_without_a_dag_is_claimed_by_the_dag_whose_yaml_names_it(store, dags, recorded):
    """Made by ``verl-tasks run`` (dag_id null) or pinned before DAGs were recorded (no dag_id key)."""
    from verl_tasks.config import load_config
    from verl_tasks.execution.lineage import start_experiment

    tiny, other = dags
    cfg = load_config(TINY, {"storage.uri": store.uri})
    start_experiment(store, cfg)  # what the CLI does: no DAG
    layout = Layout("tiny-arith")
    assert _pin(store, "tiny-arith")["dag_id"] is None
    if recorded == "before":
        pin = _pin(store, "tiny-arith")
        del pin["dag_id"]
        store.put(layout.experiment_json, json.dumps(pin).encode())
    with pytest.raises(NotPermitted) as err:  # its YAML names another experiment
        other.get_task("configure").execute(_ctx(other, experiment="tiny-arith"))
    assert "belongs to no DAG" in str(err.value) and "adds 'tiny-arith' to access.adopt" in str(err.value)
    tiny.get_task("configure").execute(_ctx(tiny, experiment="tiny-arith"))
    pin = _pin(store, "tiny-arith")
    assert pin["dag_id"] == "tiny_arith"
    assert pin["claimed"]["recorded_before"] == (None if recorded == "cli" else "absent")
    assert [json.loads(store.get(k))["kind"] for k in store.list(layout.events + "/")] == ["claimed"]
    with pytest.raises(NotPermitted, match="belongs to DAG 'tiny_arith'"):
        other.get_task("configure").execute(_ctx(other, experiment="tiny-arith"))
    start_experiment(store, cfg)  # the CLI is not governed, and keeps the owner
    assert _pin(store, "tiny-arith")["dag_id"] == "tiny_arith"


def test_access_adopt_claims_another_name(tmp_path, store):
    from verl_tasks.config import load_config
    from verl_tasks.execution.lineage import start_experiment

    start_experiment(store, load_config(TINY, {"storage.uri": store.uri, "experiment": "by-hand"}))
    adopter = build_dag(_copy(tmp_path, TINY, "adopter", experiment="adopter-exp", access={"adopt": ["by-hand"]}),
                        dag_id="adopter")
    adopter.get_task("configure").execute(_ctx(adopter, experiment="by-hand"))
    assert _pin(store, "by-hand")["dag_id"] == "adopter"


def test_a_phase_task_refuses_another_dags_experiment_and_its_callbacks_write_nothing(store, dags):
    """configure refused the run, and someone marked it success: the epoch's tasks refuse it too."""
    from airflow.sdk.exceptions import AirflowFailException

    from verl_tasks.airflow import callbacks

    tiny, other = dags
    tiny.get_task("configure").execute(_ctx(tiny, experiment="mine"))
    before = sorted(store.list("mine/"))
    plan = other.get_task("epoch_000.plan")
    context = _ctx(other, experiment="mine")
    with pytest.raises(AirflowFailException, match="may not write to it") as err:
        plan.execute(context)
    assert isinstance(err.value.__cause__, NotPermitted)
    callbacks.on_failure({**context, "task": plan, "exception": err.value})
    callbacks.on_retry({**context, "task": plan, "exception": err.value})
    assert sorted(store.list("mine/")) == before  # no task_failed event, no safe mode


def test_pin_keeps_the_owner_through_a_re_pin_by_a_phase(store, dags):
    """The plan's own pin (no DAG) re-pins a prelude-only experiment under an edited YAML: the owner stays."""
    from verl_tasks.config import load_config
    from verl_tasks.pinning import pin_experiment

    tiny, _ = dags
    tiny.get_task("configure").execute(_ctx(tiny, experiment="mine"))
    edited = load_config(TINY, {"storage.uri": store.uri, "experiment": "mine", "algorithm.lr": 0.0003})
    pin = pin_experiment(SimpleNamespace(config=edited, store=store, layout=Layout("mine")))
    assert pin["dag_id"] == "tiny_arith" and _pin(store, "mine")["dag_id"] == "tiny_arith"
    assert _pin(store, "mine")["config"]["algorithm"]["lr"] == 0.0003


def test_a_parent_without_experiment_json_is_forked_only_when_the_yaml_names_it(store, dags):
    tiny, other = dags
    _publish(store, "loose", 0)  # snapshots written by a script: no experiment.json at all
    with pytest.raises(NotPermitted, match="it has no experiment.json in this store"):
        other.get_task("configure").execute(_ctx(other, experiment="x-child", resume="snapshot", parent="loose"))
    assert read_marker(store, Layout("x-child").snapshot(0)) is None
