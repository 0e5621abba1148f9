"""The plugin's ``/verl-tasks/metrics`` is behind Airflow's auth and shows only readable DAGs' experiments.

The ``team_api_server`` fixture (a real ``airflow api-server``, two teams, one experiment DAG each,
SimpleAuthManager; shared with ``test_dashboard_auth``); each experiment's store holds two
fabricated epochs. The reply is parsed with
``prometheus_client``'s parser.
"""
from __future__ import annotations

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.airflow.api_server import TEAM_OF_DAG, token

pytestmark = pytest.mark.airflow


def _versions(text: str) -> dict[str, float]:
    """Experiment -> verl_tasks_snapshot_version."""
    return {s.labels["experiment"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "verl_tasks_snapshot_version" for s in f.samples}


def test_metrics_need_a_login(team_api_server):
    base, _ = team_api_server
    assert requests.get(f"{base}/verl-tasks/metrics", timeout=30).status_code == 401
    forged = requests.get(f"{base}/verl-tasks/metrics", headers={"Authorization": "Bearer not-a-jwt"}, timeout=30)
    assert forged.status_code == 403 and "verl_tasks_" not in forged.text


def test_admin_scrapes_every_experiment_or_one(team_api_server):
    base, passwords = team_api_server
    auth = {"Authorization": f"Bearer {token(base, passwords, 'admin')}"}
    reply = requests.get(f"{base}/verl-tasks/metrics", headers=auth, timeout=60)
    assert reply.status_code == 200, reply.text[-2000:]
    assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert _versions(reply.text) == {"vt-auth-a": 2.0, "vt-auth-b": 2.0}
    one = requests.get(f"{base}/verl-tasks/metrics", params={"experiment": "vt-auth-b"}, headers=auth, timeout=60)
    assert _versions(one.text) == {"vt-auth-b": 2.0}


@pytest.mark.parametrize("user,dag_id", [("alice", "vt_auth_a"), ("bob", "vt_auth_b")])
def test_team_viewer_scrapes_only_its_dags(team_api_server, user, dag_id):
    base, passwords = team_api_server
    cookies = {"_token": token(base, passwords, user)}
    reply = requests.get(f"{base}/verl-tasks/metrics", cookies=cookies, timeout=60)
    assert reply.status_code == 200, reply.text[-2000:]
    assert _versions(reply.text) == {dag_id.replace("_", "-"): 2.0}
    other = next(d for d in TEAM_OF_DAG if d != dag_id)
    assert requests.get(f"{base}/verl-tasks/metrics", params={"dag": other}, cookies=cookies,
                        timeout=60).status_code == 403
