"""The promotion gate through Airflow (``dag.test`` on a migrated SQLite metadata DB, in a fresh process).

Two scheduled retraining runs of one DAG, each a child of the parent's latest snapshot,
train one real epoch on the tiny model. What each child is compared with, the accuracy of
the snapshot it started from on its own held-out prompts (its ``base/evaluate`` unit), is
committed before the run with a chosen value, so the outcome does not hang on the tiny
model's luck: 1.0 cannot be beaten, 0.0 is beaten by any answer right.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.airflow.test_clear_lifts_safe_mode import prepare_dag_test
from tests.conftest import ROOT, TINY_YAML, small_overrides, write_yaml

DAG_ID = "retrain_gate"
RUNNER = textwrap.dedent('''
    import json, runpy, sys
    from datetime import datetime, timezone
    import airflow.models.dagrun as dagrun_module
    from airflow.models import DagRun
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState
    from airflow.utils.types import DagRunType

    def scheduled_run(*, dag, logical_date, run_after, **kwargs):  # dag.test makes manual runs; the cron makes these
        kwargs.pop("run_id")
        return dag.create_dagrun(run_id=DagRun.generate_run_id(run_type=DagRunType.SCHEDULED, logical_date=logical_date,
                                                               run_after=run_after),
                                 logical_date=logical_date, run_after=run_after, run_type=DagRunType.SCHEDULED,
                                 state=DagRunState.RUNNING, **kwargs)

    dagrun_module.get_or_create_dagrun = scheduled_run
    dag = runpy.run_path(sys.argv[1])["dag"]
    for stamp in sys.argv[2:]:
        when = datetime.strptime(stamp, "%Y%m%dT%H%M%S").replace(tzinfo=timezone.utc)
        dag.test(run_after=when, logical_date=when)
        with create_session() as session:
            run = session.query(DagRun).filter(DagRun.dag_id == dag.dag_id, DagRun.logical_date == when).one()
            states = {t.task_id: str(t.state) for t in run.get_task_instances(session=session) if t.map_index < 1}
            rows = (session.query(AssetModel.name, AssetEvent.extra)
                    .join(AssetModel, AssetModel.id == AssetEvent.asset_id)
                    .filter(AssetEvent.source_run_id == run.run_id))
            events = [{"asset": name, "extra": extra} for name, extra in rows]
            print("RUN " + json.dumps({"stamp": stamp, "run_type": str(run.run_type), "state": str(run.state),
                                       "tasks": states, "events": events}))
''')


def _runs(out: str) -> dict[str, dict]:
    runs = [json.loads(line[len("RUN "):]) for line in out.splitlines() if line.startswith("RUN ")]
    return {run["stamp"]: run for run in runs}


def test_a_child_that_beats_its_parent_is_promoted_and_one_that_does_not_is_not(tmp_path):
    from tests.test_promotion import commit_accuracy
    from verl_tasks.config import load_config
    from verl_tasks.events import read_events
    from verl_tasks.layout import Layout
    from verl_tasks.runner import make_context, run_phase
    from verl_tasks.store.units import read_marker

    uri = f"file://{tmp_path}/store"
    fast = small_overrides(epochs=1, **{"evaluate.max_prompts": 16, "storage.uri": uri})
    parent = make_context(load_config(TINY_YAML, {**fast, "experiment": "arith"}))
    run_phase(parent, "plan", 0)  # publishes the parent's snapshot 0, the latest one
    config = write_yaml(tmp_path, {**fast, "experiment": "retrain", "schedule.cron": "0 3 * * *",
                                   "schedule.parent": "arith", "schedule.promote_margin": 0.0})
    store = parent.store
    kept, beaten = "20260101T030000", "20260102T030000"
    commit_accuracy(store, Layout(f"retrain-{kept}").base_evaluate, 1.0, 0)
    commit_accuracy(store, Layout(f"retrain-{beaten}").base_evaluate, 0.0, 0)

    dag_file, runner, env = prepare_dag_test(tmp_path, config, DAG_ID, RUNNER)
    done = subprocess.run([sys.executable, str(runner), str(dag_file), kept, beaten], env=env, capture_output=True,
                          text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    runs, logs = _runs(done.stdout), done.stdout + done.stderr

    for stamp in (kept, beaten):
        run = runs[stamp]
        assert run["run_type"] == "scheduled" and run["state"] == "success", run
        pin = json.loads(store.get(Layout(f"retrain-{stamp}").experiment_json))
        assert (pin["parent"]["experiment"], pin["parent"]["version"]) == ("arith", 0)
        assert read_marker(store, Layout(f"retrain-{stamp}").snapshot(1)) is not None  # kept either way

    held_back = runs[kept]
    assert held_back["tasks"]["promote"] == "skipped", held_back
    assert [e["asset"] for e in held_back["events"]] == [f"verl-tasks/{DAG_ID}/snapshots"]
    decision = [e for e in read_events(store, Layout(f"retrain-{kept}")) if e["kind"] == "promotion"]
    assert len(decision) == 1 and decision[0]["promoted"] is False and decision[0]["baseline"] == 1.0
    assert "does not beat arith snapshot 0 (1.0000 on the same held-out prompts)" in decision[0]["reason"]
    assert decision[0]["reason"] in logs  # the task log says why

    promoted = runs[beaten]
    assert promoted["tasks"]["promote"] == "success", promoted
    events = {e["asset"]: e["extra"] for e in promoted["events"]}
    extra = events[f"verl-tasks/{DAG_ID}/promoted"]
    snapshot = read_marker(store, Layout(f"retrain-{beaten}").snapshot(1))
    assert extra["experiment"] == f"retrain-{beaten}" and extra["version"] == 1
    assert extra["uri"] == store.url(snapshot.unit)
    assert extra["weights_sha256"] == snapshot.files["model.safetensors"].sha256
    assert extra["accuracy"] > extra["baseline"] == 0.0
    decision = [e for e in read_events(store, Layout(f"retrain-{beaten}")) if e["kind"] == "promotion"]
    assert len(decision) == 1 and decision[0]["promoted"] is True and decision[0]["accuracy"] == extra["accuracy"]



SCHEDULED_YAML = ROOT / "dags" / "experiments" / "scheduled_retrain.yaml"


def test_the_shipped_scheduled_retrain_keeps_what_tiny_arith_learned_and_is_promoted(tmp_path):
    """The shipped example of continual training, end to end: ``tiny-arith`` (the parent) trains its
    epochs, then one scheduled run of the shipped ``scheduled_retrain`` DAG trains a child from its
    final snapshot on new prompts. The child ends at or above the parent on the same held-out prompts and
    above the parent's own final number, and the promotion gate publishes it."""
    from verl_tasks.config import load_config
    from verl_tasks.layout import Layout
    from verl_tasks.report import curve_markdown
    from verl_tasks.runner import make_context, train
    from verl_tasks.status import status

    uri = f"file://{tmp_path}/store"
    parent = make_context(load_config(TINY_YAML, {"storage.uri": uri}))
    parent_run = train(parent, parent.config.epochs)
    parent_final = parent_run["epochs"][-1]["metrics"]["eval_accuracy"]
    config = write_yaml(tmp_path, {"storage.uri": uri}, base=SCHEDULED_YAML)
    dag_id, stamp = "scheduled_retrain", "20260103T030000"
    dag_file, runner, env = prepare_dag_test(tmp_path, config, dag_id, RUNNER)
    done = subprocess.run([sys.executable, str(runner), str(dag_file), stamp], env=env, capture_output=True,
                          text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    run = _runs(done.stdout)[stamp]
    assert run["run_type"] == "scheduled" and run["state"] == "success", run

    store, child = parent.store, f"scheduled-retrain-{stamp}"
    pin = json.loads(store.get(Layout(child).experiment_json))
    assert (pin["parent"]["experiment"], pin["parent"]["version"]) == ("tiny-arith", parent.config.epochs)
    child_cfg = load_config(config, {"experiment": child})
    shown = status(child_cfg, store)
    curve = [shown["base"]["metrics"]["eval_accuracy"]] + [e["metrics"]["eval_accuracy"] for e in shown["epochs"]]
    report = curve_markdown(shown)
    assert f"| tiny-arith snapshot {parent.config.epochs} (parent) |" in report, report
    assert curve[-1] >= curve[0] and curve[-1] >= parent_final, (parent_final, curve, report)
    # It holds on the way: no dip as deep as evaluate.regression_margin, where status would warn.
    assert min(curve[1:]) > curve[0] - child_cfg.evaluate.regression_margin, report

    assert run["tasks"]["promote"] == "success", run
    events = {e["asset"]: e["extra"] for e in run["events"]}
    extra = events[f"verl-tasks/{dag_id}/promoted"]
    assert extra["experiment"] == child and extra["version"] == child_cfg.epochs
    assert extra["accuracy"] == curve[-1] > extra["baseline"] == curve[0]
