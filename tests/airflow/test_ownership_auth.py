"""Experiments belong to the DAG that made them, through Airflow, with two users and two DAGs in one store.

The ``team_airflow`` fixture: a real ``airflow api-server`` (SimpleAuthManager, multi-team) serving
``vt_auth_a`` (team_a) and ``vt_auth_b`` (team_b), two copies of the tiny YAML sharing one store. carol
may trigger only ``vt_auth_a`` and dave only ``vt_auth_b`` (role ``user``); alice and bob are their
teams' viewers. Runs are triggered through the REST API as those users, and their ``configure`` task
is run by Airflow's task runner (``airflow tasks test DAG configure RUN_ID``: the triggered run, with
its conf; no scheduler, so nothing after ``configure`` runs and nothing is trained). dave makes
``b-private`` in ``vt_auth_b`` (pinned, data and base snapshot committed: only its prelude); then carol,
through ``vt_auth_a``, can neither fork it, nor re-pin it under another ``lr``, nor see it in the Training
page or the metrics route, although her runs name it.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from itertools import count

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.airflow.api_server import VENV_BIN, token

pytestmark = pytest.mark.airflow

PRIVATE = "b-private"
# removed afterwards: the store is shared with the other team-server tests
MADE = (PRIVATE, "b-child", "a-child", "a-big")
_RUN = count()


def trigger(served, user: str, dag_id: str, conf: dict) -> requests.Response:
    """``POST /api/v2/dags/{dag_id}/dagRuns`` as ``user``, as the UI's trigger form does."""
    n = next(_RUN)
    body = {"dag_run_id": f"{user}-{n}", "logical_date": f"2026-02-01T00:{n // 60:02d}:{n % 60:02d}Z", "conf": conf}
    return requests.post(f"{served.base}/api/v2/dags/{dag_id}/dagRuns", json=body, timeout=60,
                         headers={"Authorization": f"Bearer {token(served.base, served.passwords, user)}"})


def run_configure(served, dag_id: str, run_id: str) -> tuple[str, str]:
    """``airflow tasks test DAG configure RUN``: Airflow's task runner runs the triggered run's ``configure``
    with that run's conf (no scheduler: the epochs are not trained). (its state, the command's output)."""
    done = subprocess.run([str(VENV_BIN / "airflow"), "tasks", "test", dag_id, "configure", run_id], env=served.env,
                          capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    admin = {"Authorization": f"Bearer {token(served.base, served.passwords, 'admin')}"}
    reply = requests.get(f"{served.base}/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/configure",
                         headers=admin, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["state"], output


def triggered_and_run(served, user: str, dag_id: str, conf: dict) -> tuple[str, str]:
    reply = trigger(served, user, dag_id, conf)
    assert reply.status_code == 200, reply.text
    return run_configure(served, dag_id, reply.json()["dag_run_id"])


@pytest.fixture(scope="module")
def private(team_airflow):
    """dave's ``b-private`` in vt_auth_b: pinned by its configure, then its data and base snapshot committed."""
    from verl_tasks.layout import Layout
    from verl_tasks.store import open_store
    from verl_tasks.store.conventions import WEIGHTS, write_latest
    from verl_tasks.store.units import UnitWriter

    served = team_airflow
    store = open_store(f"file://{served.root / 'store'}")
    try:
        state, output = triggered_and_run(served, "dave", "vt_auth_b", {"experiment": PRIVATE, "epochs": 1})
        assert state == "success", output[-5000:]
        layout = Layout(PRIVATE)
        for unit in (layout.data("train"), layout.data("eval")):
            writer = UnitWriter(store, unit)
            writer.write_bytes("prompts.jsonl", b'{"prompt": "1+1=", "ground_truth": "2"}\n')
            writer.commit()
        writer = UnitWriter(store, layout.snapshot(0))
        writer.write_bytes(WEIGHTS, b"b-private base weights")
        writer.write_json("config.json", {"model_type": "tiny"})
        write_latest(store, layout, 0, writer.commit({"version": 0})[0])
        yield served, store
    finally:
        for name in MADE:
            shutil.rmtree(served.root / "store" / name, ignore_errors=True)


def test_each_user_may_trigger_only_its_teams_dag(team_airflow):
    assert trigger(team_airflow, "carol", "vt_auth_b", {"experiment": "x"}).status_code == 403
    assert trigger(team_airflow, "dave", "vt_auth_a", {"experiment": "x"}).status_code == 403


def test_experiment_json_records_the_dag_that_made_it(private):
    from verl_tasks.layout import Layout

    _, store = private
    assert json.loads(store.get(Layout(PRIVATE).experiment_json))["dag_id"] == "vt_auth_b"


def test_a_fork_from_another_dags_experiment_is_refused(private):
    from verl_tasks.layout import Layout
    from verl_tasks.store.units import read_marker

    served, store = private
    state, output = triggered_and_run(served, "carol", "vt_auth_a", {
        "experiment": "a-child", "resume": "snapshot", "parent": PRIVATE, "epochs": 1})
    assert state == "failed", output[-5000:]
    assert "may not start from experiment 'b-private', which belongs to DAG 'vt_auth_b'" in output, output[-5000:]
    assert "adds 'vt_auth_b' to access.fork_from" in output and "vt_auth_a" in output
    assert not store.list("a-child/")  # nothing copied, nothing pinned
    # the same fork from its own DAG works: the base is b-private's snapshot 0
    state, output = triggered_and_run(served, "dave", "vt_auth_b", {
        "experiment": "b-child", "resume": "snapshot", "parent": PRIVATE, "epochs": 1})
    assert state == "success", output[-5000:]
    weights = {name: read_marker(store, Layout(name).snapshot(0)).files["model.safetensors"].sha256
               for name in (PRIVATE, "b-child")}
    assert weights["b-child"] == weights[PRIVATE]


def test_a_re_pin_of_another_dags_experiment_is_refused_and_nothing_is_quarantined(private):
    from verl_tasks.layout import Layout
    from verl_tasks.store.units import is_committed

    served, store = private
    layout = Layout(PRIVATE)
    pinned = store.get(layout.experiment_json)
    before = sorted(store.list(layout.root + "/"))
    state, output = triggered_and_run(served, "carol", "vt_auth_a", {"experiment": PRIVATE, "lr": 0.0005, "epochs": 1})
    assert state == "failed", output[-5000:]
    assert "experiment 'b-private' belongs to DAG 'vt_auth_b'; a run of DAG 'vt_auth_a' may not write to it" in output
    assert "adds 'vt_auth_b' to access.write_to" in output
    assert store.get(layout.experiment_json) == pinned  # same lr, same owner
    assert sorted(store.list(layout.root + "/")) == before  # no event, no quarantine, no safe mode
    assert not [key for key in before if "/.quarantine/" in key]
    assert all(is_committed(store, unit) for unit in (layout.data("train"), layout.data("eval"), layout.snapshot(0)))


def test_the_trigger_forms_bounds_hold_for_a_rest_trigger(team_airflow):
    """A form field over its bound is refused by Airflow at the trigger; a key in ``overrides`` by ``configure``."""
    from verl_tasks.store import open_store

    over_form = trigger(team_airflow, "carol", "vt_auth_a", {"experiment": "a-big", "group_size": 10**6})
    assert over_form.status_code == 400 and "group_size" in over_form.text, over_form.text
    state, output = triggered_and_run(team_airflow, "carol", "vt_auth_a", {
        "experiment": "a-big", "overrides": {"algorithm.ppo_epochs": 10**9}})
    assert state == "failed", output[-5000:]
    assert "algorithm.ppo_epochs=1000000000 exceeds its bound 4 (4 x the DAG's 1)" in output, output[-5000:]
    assert not open_store(f"file://{team_airflow.root / 'store'}").list("a-big/")


def _shown(page: str) -> set[str]:
    import re

    return set(re.findall(r"<h2>([^<]+)</h2>", page))


def _experiments(metrics: str) -> set[str]:
    return {s.labels["experiment"] for f in text_string_to_metric_families(metrics) for s in f.samples
            if "experiment" in s.labels}


def test_the_dashboard_and_metrics_hide_the_other_dags_experiment_although_a_run_names_it(private):
    served, _ = private
    reply = trigger(served, "carol", "vt_auth_a", {"experiment": PRIVATE, "epochs": 1})  # the run names it
    assert reply.status_code == 200, reply.text
    base = served.base
    for viewer, mine, theirs in (("alice", "vt-auth-a", PRIVATE), ("bob", "vt-auth-b", "vt-auth-a")):
        cookies = {"_token": token(base, served.passwords, viewer)}
        page = requests.get(f"{base}/verl-tasks/", cookies=cookies, timeout=60)
        assert page.status_code == 200, page.text[-2000:]
        assert mine in _shown(page.text) and theirs not in _shown(page.text), (viewer, _shown(page.text))
        searched = requests.get(f"{base}/verl-tasks/", params={"experiment": theirs}, cookies=cookies, timeout=60)
        assert _shown(searched.text) == set(), searched.text[-2000:]
        metrics = requests.get(f"{base}/verl-tasks/metrics", cookies=cookies, timeout=60)
        assert metrics.status_code == 200 and mine in _experiments(metrics.text), metrics.text[-2000:]
        assert theirs not in _experiments(metrics.text)
        one = requests.get(f"{base}/verl-tasks/metrics", params={"experiment": theirs}, cookies=cookies, timeout=60)
        assert _experiments(one.text) == set()
    bob = {"_token": token(base, served.passwords, "bob")}
    assert PRIVATE in _shown(requests.get(f"{base}/verl-tasks/", cookies=bob, timeout=60).text)
    assert PRIVATE in _experiments(requests.get(f"{base}/verl-tasks/metrics", cookies=bob, timeout=60).text)
