"""The maintenance DAG and the notifiers: a store with a corrupted snapshot fails its task and the DAG's notifier
(a BaseNotifier writing a file) hears of it; a healthy store passes and its garbage is collected; safe mode calls
the same notifiers. The run goes through Airflow (``dag.test`` on a migrated SQLite metadata DB, in a fresh process).
"""
from __future__ import annotations

import json
import shutil
import sys
import textwrap

import pytest
import yaml
from airflow.sdk import BaseNotifier

from tests.airflow.test_clear_lifts_safe_mode import _airflow_env, _run
from tests.conftest import TINY_YAML, small_overrides
from verl_tasks.errors import ConfigError

DEAD_ATTEMPT = "20200101T000000-deadbeef00"  # an attempt that lost its unit's commit in 2020
NOTIFIER = textwrap.dedent('''
    import json
    from airflow.sdk import BaseNotifier

    class FileNotifier(BaseNotifier):
        """Appends each alert to a file: stands in for a provider's Slack or SMTP notifier."""

        template_fields = ("path",)

        def __init__(self, path):
            super().__init__()
            self.path = path

        def notify(self, context):
            with open(self.path, "a") as out:
                alert = {"task_id": context["ti"].task_id, "alert": context["alert"]}
                out.write(json.dumps(alert, default=str) + "\\n")
''')
RUNNER = textwrap.dedent('''
    import json, runpy, sys
    from datetime import datetime, timezone
    from airflow.models import DagRun
    from airflow.utils.session import create_session
    dag = runpy.run_path(sys.argv[1])["dag"]
    when = datetime(2026, 1, 1, tzinfo=timezone.utc)
    dag.test(run_after=when, logical_date=when)
    with create_session() as session:
        tis = DagRun.find(dag_id=dag.dag_id, session=session)[0].get_task_instances(session=session)
        print("STATES " + json.dumps({t.task_id: [str(t.state), t.try_number] for t in tis}))
''')


def _healthy_store(root):
    """An experiment whose snapshot 0 is real tiny-model weights, with one dead attempt folder beside its plan."""
    from verl_tasks.config import load_config
    from verl_tasks.runner import make_context, run_phase
    from verl_tasks.store.units import ATTEMPTS, UnitWriter

    cfg = load_config(TINY_YAML, {**small_overrides(**{"model.tiny.warm_start_steps": 0}),
                                  "experiment": "arith", "storage.uri": f"file://{root}"})
    ctx = make_context(cfg)
    run_phase(ctx, "plan", 0)
    UnitWriter(ctx.store, ctx.layout.plan(0), DEAD_ATTEMPT).write_json("plan.json", {"lost": True})
    assert ctx.store.list(f"{ctx.layout.plan(0)}/{ATTEMPTS}/{DEAD_ATTEMPT}/")
    return ctx.store, ctx.layout


def _corrupt_weights(store, layout) -> None:
    from verl_tasks.store.units import read_marker

    record = read_marker(store, layout.snapshot(0))
    key = record.key("model.safetensors")
    data = bytearray(store.get(key))
    data[-1] ^= 0xFF
    store.put(key, bytes(data))


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """(healthy, corrupted) store roots: the same experiment; one byte of the second's weights flipped."""
    from verl_tasks.layout import Layout
    from verl_tasks.store import open_store

    root = tmp_path_factory.mktemp("maintenance")
    _healthy_store(root / "healthy")
    shutil.copytree(root / "healthy", root / "corrupted")
    _corrupt_weights(open_store(f"file://{root}/corrupted"), Layout("arith"))
    return root / "healthy", root / "corrupted"


def test_healthy_and_corrupted_stores_through_airflow(stores, tmp_path):
    from verl_tasks.airflow.maintenance import task_id_for
    from verl_tasks.events import read_events
    from verl_tasks.layout import Layout
    from verl_tasks.store import open_store
    from verl_tasks.store.units import ATTEMPTS

    healthy, corrupted = tmp_path / "healthy", tmp_path / "corrupted"
    shutil.copytree(stores[0], healthy)
    shutil.copytree(stores[1], corrupted)
    config = tmp_path / "maintenance.yaml"
    config.write_text(yaml.safe_dump({"schedule": "@daily", "stores": [{"uri": f"file://{healthy}"},
                                                                       {"uri": f"file://{corrupted}"}],
                                      "verify_newest": 1, "forward_pass": True, "gc_older_than": "1d"}))
    alerts = tmp_path / "alerts.jsonl"
    (tmp_path / "dags").mkdir()
    dag_file = tmp_path / "dags" / "maintenance.py"
    dag_file.write_text(NOTIFIER + "from verl_tasks.airflow.maintenance import build_maintenance_dag\n"
                        f"dag = build_maintenance_dag({str(config)!r}, notifiers=[FileNotifier({str(alerts)!r})])\n")
    runner = tmp_path / "run_dag.py"
    runner.write_text(RUNNER)
    env = _airflow_env(tmp_path)
    _run([sys.executable, "-m", "airflow", "db", "migrate"], env)
    out = _run([sys.executable, str(runner), str(dag_file)], env)
    states = json.loads(next(x for x in out.splitlines() if x.startswith("STATES "))[len("STATES "):])

    ok_task, bad_task = (task_id_for(f"file://{root}") for root in (healthy, corrupted))
    assert states[ok_task] == ["success", 1], states
    assert states[bad_task] == ["failed", 1], states  # a corruption is not retried
    sent = [json.loads(line) for line in alerts.read_text().splitlines()]
    assert [s["task_id"] for s in sent] == [bad_task]
    alert = sent[0]["alert"]
    assert alert["kind"] == "maintenance" and alert["store"] == f"file://{corrupted}"
    assert "arith: snapshot 0" in alert["summary"] and "failed verification" in alert["summary"]
    assert "model.safetensors" in alert["summary"]

    layout = Layout("arith")
    for root in (healthy, corrupted):
        store = open_store(f"file://{root}")
        assert not store.list(f"{layout.plan(0)}/{ATTEMPTS}/{DEAD_ATTEMPT}/")  # gc ran in both stores
        done = [e for e in read_events(store, layout) if e["kind"] == "maintenance"]
        assert len(done) == 1 and done[0]["gc_deleted_keys"] >= 1
    good = [e for e in read_events(open_store(f"file://{healthy}"), layout) if e["kind"] == "maintenance"][0]
    assert good["verified"] == [{"version": 0, "state": "OK", "problems": []}] and good["problems"] == []


def test_a_bad_maintenance_yaml_names_the_key(tmp_path):
    from verl_tasks.airflow.maintenance import build_maintenance_dag

    config = tmp_path / "maintenance.yaml"
    config.write_text(yaml.safe_dump({"stores": [{"uri": "file://x"}], "gc_older_than": "soon"}))
    with pytest.raises(ConfigError, match=r"gc_older_than: .*gc_older_than 'soon': use a number with s, m, h, d or w"):
        build_maintenance_dag(config)
    config.write_text(yaml.safe_dump({"stores": [], "verify_newst": 2}))
    with pytest.raises(ConfigError, match=r"invalid maintenance config .*stores: .*verify_newst: Extra inputs"):
        build_maintenance_dag(config)


class FileNotifier(BaseNotifier):
    """Appends each alert to a file (the same as the one the Airflow run above loads)."""

    def __init__(self, path):
        super().__init__()
        self.path = path

    def notify(self, context):
        with open(self.path, "a") as out:
            out.write(json.dumps(context["alert"], default=str) + "\n")


def test_safe_mode_calls_the_dags_notifiers(tmp_path):
    """The DAG's own on_failure_callback of a phase task: a unit failed for good -> safe mode -> the notifiers."""
    from tests.airflow.test_escalation import _TI
    from verl_tasks.airflow.factory import build_dag

    raw = yaml.safe_load(TINY_YAML.read_text())
    raw["storage"] = {"uri": f"file://{tmp_path}/store"}
    config = tmp_path / "exp.yaml"
    config.write_text(yaml.safe_dump(raw))
    alerts, broken = tmp_path / "alerts.jsonl", FileNotifier(str(tmp_path / "missing" / "x.jsonl"))
    dag = build_dag(config, dag_id="notified", backend="inline", gpu_pool="",
                    notifiers=[broken, FileNotifier(str(alerts))])  # a broken notifier does not silence the next
    task = dag.get_task("epoch_000.update")
    dag_run = type("DagRun", (), {"conf": {}, "run_type": "manual", "run_id": "manual__1"})()
    context = {"task": task, "ti": _TI("epoch_000.update", -1, 4), "exception": MemoryError("CUDA out of memory"),
               "dag_run": dag_run, "params": {}, "dag": dag}
    for callback in task.on_failure_callback:
        callback(context)
    sent = [json.loads(line) for line in alerts.read_text().splitlines()]
    assert len(sent) == 1 and sent[0]["kind"] == "safe_mode" and sent[0]["experiment"] == "tiny-arith"
    assert sent[0]["dag_id"] == "notified" and "failed after all its retries" in sent[0]["summary"]
    assert "verl-tasks resume" in sent[0]["what_to_do"] or "Clear" in sent[0]["what_to_do"]
