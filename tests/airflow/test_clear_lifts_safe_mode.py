"""Through Airflow (``dag.test`` on a migrated SQLite metadata DB, in a fresh process):
a unit that fails for good puts the experiment in safe mode; Airflow's clear of the run's
task instances (``clear_task_instances``, what the UI's Clear calls) lets the units run and
the event log records that the clear lifted safe mode."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from tests.conftest import small_overrides, write_yaml

DAG_ID = "clear_lift"
RUNNER = textwrap.dedent('''
    import json, runpy, sys
    from datetime import datetime, timezone
    from airflow.models import DagRun
    from airflow.models.taskinstance import clear_task_instances
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState
    dag = runpy.run_path(sys.argv[1])["dag"]
    when = datetime(2026, 1, 1, tzinfo=timezone.utc)
    done = r"epoch_000\\.(rollout|score|validate|update|snapshot|evaluate)"  # only configure and plan run
    if sys.argv[2] == "clear":  # what the UI's Clear (failed tasks, Downstream) calls
        with create_session() as session:
            run = session.query(DagRun).filter(DagRun.dag_id == dag.dag_id).one()
            failed = [t for t in run.get_task_instances(session=session) if t.state in ("failed", "upstream_failed")]
            clear_task_instances(failed, session, dag_run_state=DagRunState.RUNNING)
        done = "configure|" + done  # committed in the first run; the plan is the first to run again
        import airflow.models.dagrun as dagrun_module

        def same_run(*, dag, logical_date, session, **_):  # dag.test would replace the run: continue it
            found = session.query(DagRun).filter(DagRun.dag_id == dag.dag_id,
                                                 DagRun.logical_date == logical_date).one()
            found.dag = dag
            return found

        dagrun_module.get_or_create_dagrun = same_run
    run = dag.test(run_after=when, logical_date=when, mark_success_pattern=done)
    with create_session() as session:
        tis = DagRun.find(dag_id=dag.dag_id, session=session)[0].get_task_instances(session=session)
        print("STATES " + json.dumps({t.task_id: [str(t.state), t.try_number, t.max_tries] for t in tis
                                      if t.map_index < 1}))
''')


def _airflow_env(tmp_path) -> dict[str, str]:
    home = tmp_path / "airflow"
    return {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__DAGS_FOLDER": str(tmp_path / "dags"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/db.sqlite",
            "AIRFLOW__CORE__UNIT_TEST_MODE": "True", "VERL_TASKS_AIRFLOW_API_CONN": "verl_airflow_api_absent"}


def prepare_dag_test(tmp_path, config, dag_id: str, runner_source: str):
    """A dags folder holding one inline DAG built from ``config``, a runner script, a migrated
    SQLite Airflow home; returns (dag file, runner script, environment)."""
    (tmp_path / "dags").mkdir()
    dag_file = tmp_path / "dags" / f"{dag_id}.py"
    dag_file.write_text("from verl_tasks.airflow.factory import build_dag\n"
                        f"dag = build_dag({str(config)!r}, dag_id={dag_id!r}, backend='inline', gpu_pool='')\n")
    runner = tmp_path / "run_dag.py"
    runner.write_text(runner_source)
    env = _airflow_env(tmp_path)
    _run([sys.executable, "-m", "airflow", "db", "migrate"], env)
    return dag_file, runner, env


def _run(args: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stdout


def _states(out: str) -> dict[str, list]:
    line = next(x for x in out.splitlines() if x.startswith("STATES "))
    return json.loads(line[len("STATES "):])


def test_a_clear_in_airflow_lifts_safe_mode_and_the_units_run(tmp_path):
    from verl_tasks.events import read_events
    from verl_tasks.layout import Layout
    from verl_tasks.ops.safe_mode import read_safe_mode
    from verl_tasks.store import open_store
    from verl_tasks.store.units import read_marker

    train = tmp_path / "train.jsonl"  # missing on the first run: the plan fails for good
    config = write_yaml(tmp_path, {**small_overrides(epochs=1), "model.tiny.warm_start_steps": 0,
                                   "data.train": str(train), "fault_tolerance.retries": 1,
                                   "fault_tolerance.retry_delay_s": 0, "experiment": "clear-lift",
                                   "storage.uri": f"file://{tmp_path}/store"})
    dag_file, runner, env = prepare_dag_test(tmp_path, config, DAG_ID, RUNNER)

    first = _states(_run([sys.executable, str(runner), str(dag_file), "first"], env))
    assert first["epoch_000.plan"][0] == "failed" and first["configure"][0] == "success", first
    store, layout = open_store(f"file://{tmp_path}/store"), Layout("clear-lift")
    halted = read_safe_mode(store, layout)
    assert halted is not None and "plan failed after all its retries" in halted["summary"]
    assert halted["dag_id"] == DAG_ID and "Clear the failed task(s)" in halted["what_to_do"]

    train.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "ground_truth": str(2 * a)}) + "\n"
                             for a in range(10, 50)))  # the person fixes the cause ...
    second = _states(_run([sys.executable, str(runner), str(dag_file), "clear"], env))  # ... and clears it
    assert second["epoch_000.plan"][0] == "success", second
    assert second["epoch_000.plan"][1:] == [2, 2]  # the clear: max_tries = try 1 + 1 retry, then try 2
    assert read_safe_mode(store, layout) is None and read_marker(store, layout.plan(0)) is not None
    lifted = [e for e in read_events(store, layout) if e["kind"] == "resumed"]
    assert len(lifted) == 1 and lifted[0]["by"] == "clear", lifted
    assert lifted[0]["note"].startswith("safe mode lifted by a clear of epoch_000.plan in manual__2026-01-01")
    assert lifted[0]["try_number"] == 2
