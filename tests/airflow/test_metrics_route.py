"""The plugin's ``/verl-tasks/metrics`` is behind Airflow's auth and shows only readable DAGs' experiments.

A real ``airflow api-server`` set up as in ``test_dashboard_auth`` (two teams, one experiment DAG each,
SimpleAuthManager); each experiment's store holds two fabricated epochs. The reply is parsed with
``prometheus_client``'s parser.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.airflow.e2e_support import free_port, wait_for
from tests.airflow.test_dashboard_auth import TEAM_OF_DAG, USERS, VENV_BIN, _airflow, _env, _layout, _token

pytestmark = pytest.mark.airflow

FABRICATE = """
import sys
from tests.test_metrics import fabricate
from verl_tasks.config import load_config
from verl_tasks.layout import Layout
from verl_tasks.store import store_for
cfg = load_config(sys.argv[1])
store_for(cfg).put(Layout(cfg.experiment).experiment_json, b"{}")
fabricate(cfg, 2)
"""


@pytest.fixture(scope="module")
def metrics_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics-route")
    bundles = _layout(root)
    passwords = {name: f"pw-{name}-{os.urandom(4).hex()}" for name in USERS}
    (root / "passwords.json").write_text(json.dumps(passwords))
    port = free_port()
    env = _env(root, port, bundles)
    _airflow(env, "db", "migrate")
    _airflow(env, "teams", "sync")
    _airflow(env, "dags", "reserialize")
    repo = Path(__file__).resolve().parents[2]
    for dag_id in TEAM_OF_DAG:
        subprocess.run([sys.executable, "-c", FABRICATE, str(root / "experiments" / f"{dag_id}.yaml")], check=True,
                       timeout=300, cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)})
    with open(root / "api-server.log", "ab") as log:
        proc = subprocess.Popen([str(VENV_BIN / "airflow"), "api-server", "--host", "127.0.0.1", "--port", str(port),
                                 "--workers", "1"], env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for("the api-server", lambda: requests.get(f"{base}/api/v2/monitor/health", timeout=5).ok, 180,
                 diagnose=lambda: (root / "api-server.log").read_text(errors="replace")[-3000:])
        yield base, passwords
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _versions(text: str) -> dict[str, float]:
    """Experiment -> verl_tasks_snapshot_version."""
    return {s.labels["experiment"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "verl_tasks_snapshot_version" for s in f.samples}


def test_metrics_need_a_login(metrics_server):
    base, _ = metrics_server
    assert requests.get(f"{base}/verl-tasks/metrics", timeout=30).status_code == 401
    forged = requests.get(f"{base}/verl-tasks/metrics", headers={"Authorization": "Bearer not-a-jwt"}, timeout=30)
    assert forged.status_code == 403 and "verl_tasks_" not in forged.text


def test_admin_scrapes_every_experiment_or_one(metrics_server):
    base, passwords = metrics_server
    auth = {"Authorization": f"Bearer {_token(base, passwords, 'admin')}"}
    reply = requests.get(f"{base}/verl-tasks/metrics", headers=auth, timeout=60)
    assert reply.status_code == 200, reply.text[-2000:]
    assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert _versions(reply.text) == {"vt-auth-a": 2.0, "vt-auth-b": 2.0}
    one = requests.get(f"{base}/verl-tasks/metrics", params={"experiment": "vt-auth-b"}, headers=auth, timeout=60)
    assert _versions(one.text) == {"vt-auth-b": 2.0}


@pytest.mark.parametrize("user,dag_id", [("alice", "vt_auth_a"), ("bob", "vt_auth_b")])
def test_team_viewer_scrapes_only_its_dags(metrics_server, user, dag_id):
    base, passwords = metrics_server
    cookies = {"_token": _token(base, passwords, user)}
    reply = requests.get(f"{base}/verl-tasks/metrics", cookies=cookies, timeout=60)
    assert reply.status_code == 200, reply.text[-2000:]
    assert _versions(reply.text) == {dag_id.replace("_", "-"): 2.0}
    other = next(d for d in TEAM_OF_DAG if d != dag_id)
    assert requests.get(f"{base}/verl-tasks/metrics", params={"dag": other}, cookies=cookies,
                        timeout=60).status_code == 403
