"""A run of fewer epochs than its DAG (trigger form ``epochs``), through Airflow (``dag.test`` on a
migrated SQLite metadata DB, in a fresh process): ``configure`` skips the later epochs' tasks at once
(not one dependency level per scheduling loop), keeps its own result in XCom, and the run succeeds."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.airflow.test_clear_lifts_safe_mode import prepare_dag_test
from tests.conftest import small_overrides, write_yaml

DAG_ID = "fewer_epochs"
RUNNER = textwrap.dedent('''
    import json, runpy, sys
    from datetime import datetime, timezone
    from airflow.models import DagRun
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    dag = runpy.run_path(sys.argv[1])["dag"]
    when = datetime(2026, 1, 1, tzinfo=timezone.utc)
    dag.test(run_after=when, logical_date=when, run_conf={"experiment": "fewer", "epochs": 1})
    with create_session() as session:
        run = session.query(DagRun).filter(DagRun.dag_id == dag.dag_id).one()
        states = [[t.task_id, t.map_index, str(t.state)] for t in run.get_task_instances(session=session)]
        xcom = session.query(XComModel.value).filter(XComModel.run_id == run.run_id, XComModel.task_id == "configure",
                                                     XComModel.key == "return_value").scalar()
        print("RUN " + json.dumps({"state": str(run.state), "tasks": states, "configure": xcom}, default=str))
''')


def test_configure_skips_the_epochs_this_run_does_not_train(tmp_path):
    config = write_yaml(tmp_path, {**small_overrides(epochs=3), "model.tiny.warm_start_steps": 20,
                                   "evaluate.max_prompts": 8, "storage.uri": f"file://{tmp_path}/store"})
    dag_file, runner, env = prepare_dag_test(tmp_path, config, DAG_ID, RUNNER)
    done = subprocess.run([sys.executable, str(runner), str(dag_file)], env=env, capture_output=True, text=True,
                          timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    line = next((x for x in done.stdout.splitlines() if x.startswith("RUN ")), None)
    assert line is not None, done.stdout[-3000:] + done.stderr[-3000:]
    run = json.loads(line[len("RUN "):])
    assert run["state"].endswith("success"), run
    by_epoch: dict[str, set[str]] = {}
    for task_id, _map_index, state in run["tasks"]:
        by_epoch.setdefault(task_id.split(".")[0], set()).add(state.rsplit(".", 1)[-1].lower())
    assert by_epoch["configure"] == {"success"}
    assert by_epoch["epoch_000"] == {"success"}, by_epoch
    assert by_epoch["epoch_001"] == by_epoch["epoch_002"] == {"skipped"}, by_epoch
    later = [t for t in run["tasks"] if not t[0].startswith(("configure", "epoch_000"))]
    assert len({t[0] for t in later}) == 14, later  # 7 phases x 2 epochs, mapped ones included
    xcom = run["configure"]
    xcom = json.loads(xcom) if isinstance(xcom, str) else xcom
    assert xcom["experiment"] == "fewer" and xcom["epochs"] == 1, xcom
    assert "skipping the 14 tasks of the DAG's later epochs" in done.stdout + done.stderr


RERUNS = textwrap.dedent('''
    import json, runpy, sys
    from datetime import datetime, timezone
    from airflow.models import DagRun
    from airflow.utils.session import create_session

    dag = runpy.run_path(sys.argv[1])["dag"]
    for day, epochs in enumerate(json.loads(sys.argv[2]), start=1):
        when = datetime(2026, 1, day, tzinfo=timezone.utc)
        dag.test(run_after=when, logical_date=when, run_conf={"experiment": "again", "epochs": epochs})
        with create_session() as session:
            run = session.query(DagRun).filter(DagRun.dag_id == dag.dag_id, DagRun.logical_date == when).one()
            states = [[t.task_id, t.map_index, str(t.state)] for t in run.get_task_instances(session=session)]
            print("RUN " + json.dumps({"epochs": epochs, "state": str(run.state), "tasks": states}, default=str),
                  flush=True)
''')


def test_configure_skips_the_epochs_already_committed_and_the_next_one_still_runs(tmp_path):
    """Three runs on one store: 1 epoch (trains it), 2 epochs (epoch 0 skipped by configure, epoch 1
    trained: its plan runs after a skipped epoch), 2 epochs again (nothing to do: every epoch skipped,
    no unit started)."""
    from verl_tasks.config import load_config
    from verl_tasks.events import read_events
    from verl_tasks.layout import Layout
    from verl_tasks.store import open_store

    config = write_yaml(tmp_path, {**small_overrides(epochs=3), "model.tiny.warm_start_steps": 20,
                                   "evaluate.max_prompts": 8, "storage.uri": f"file://{tmp_path}/store"})
    dag_file, runner, env = prepare_dag_test(tmp_path, config, DAG_ID, RERUNS)
    done = subprocess.run([sys.executable, str(runner), str(dag_file), "[1, 2, 2]"], env=env, capture_output=True,
                          text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    runs = [json.loads(x[len("RUN "):]) for x in done.stdout.splitlines() if x.startswith("RUN ")]
    assert len(runs) == 3, done.stdout[-3000:] + done.stderr[-3000:]

    def states(run):
        by_epoch: dict[str, set[str]] = {}
        for task_id, _map_index, state in run["tasks"]:
            by_epoch.setdefault(task_id.split(".")[0], set()).add(state.rsplit(".", 1)[-1].lower())
        return by_epoch

    first, second, third = map(states, runs)
    assert all(run["state"].endswith("success") for run in runs), runs
    assert first["epoch_000"] == {"success"} and first["epoch_001"] == {"skipped"}, first
    assert second["epoch_000"] == {"skipped"} and second["epoch_001"] == {"success"}, second
    assert third["configure"] == {"success"} and third["epoch_000"] == third["epoch_001"] == {"skipped"}, third
    assert "epoch(s) 0, 1 left nothing to do (every unit committed)" in done.stdout + done.stderr

    cfg = load_config(config, {"experiment": "again", "storage.uri": f"file://{tmp_path}/store"})
    events = read_events(open_store(cfg.storage.uri), Layout("again"))
    started = [(e["unit"], e["epoch"]) for e in events if e["kind"] == "started"]
    assert len(started) == len(set(started)), started  # no unit started twice over the three runs
    assert {epoch for _, epoch in started} == {0, 1}
