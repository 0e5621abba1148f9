"""The Training dashboard is behind Airflow's own authentication and shows only readable DAGs.

A real ``airflow api-server`` (SQLite, SimpleAuthManager with ``all_admins`` off, multi-team mode)
serves two experiment DAGs from two bundles owned by two teams. Anonymous and forged requests are
refused; a token from ``POST /auth/token`` (as a bearer header or the UI's ``_token`` cookie) opens
the page, and a team's viewer sees only the experiment of its own team's DAG.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from tests.airflow.e2e_support import free_port, wait_for

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
USERS = {"admin": ("admin", None), "alice": ("viewer", "team_a"), "bob": ("viewer", "team_b")}
TEAM_OF_DAG = {"vt_auth_a": "team_a", "vt_auth_b": "team_b"}

pytestmark = pytest.mark.airflow


def _layout(root: Path) -> list[dict]:
    """Two experiment YAMLs in one experiments folder, each DAG file in its own team's bundle."""
    base = (REPO / "dags" / "experiments" / "tiny_arith.yaml").read_text()
    bundles = []
    for dag_id, team in TEAM_OF_DAG.items():
        yaml_path = root / "experiments" / f"{dag_id}.yaml"
        yaml_path.parent.mkdir(parents=True, exist_ok=True)
        yaml_path.write_text(base.replace("experiment: tiny-arith", f"experiment: {dag_id.replace('_', '-')}")
                             .replace("uri: file://.store", f"uri: file://{root / 'store'}"))
        folder = root / f"dags_{team}"
        folder.mkdir()
        (folder / f"{dag_id}.py").write_text(
            f"from verl_tasks.airflow.factory import build_dag\ndag = build_dag({str(yaml_path)!r})\n")
        bundles.append({"name": f"bundle_{team}", "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
                        "kwargs": {"path": str(folder)}, "team_name": team})
    return bundles


def _env(root: Path, port: int, bundles: list[dict]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "VERL_TASKS_", "RAY_"))}
    env.update({
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "AIRFLOW_HOME": str(root),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{root}/airflow.db",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": ",".join(
            f"{name}:{role}" + (f":{team}" if team else "") for name, (role, team) in USERS.items()),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(root / "passwords.json"),
        "AIRFLOW__CORE__MULTI_TEAM": "True",
        "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST": json.dumps(bundles),
        "AIRFLOW__API__SECRET_KEY": os.urandom(16).hex(),
        "AIRFLOW__API_AUTH__JWT_SECRET": os.urandom(32).hex(),
        "VERL_TASKS_EXPERIMENTS_DIR": str(root / "experiments"),
    })
    return env


def _airflow(env: dict[str, str], *args: str) -> None:
    done = subprocess.run([str(VENV_BIN / "airflow"), *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"airflow {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


def _record_event(root: Path, experiment: str) -> None:
    """One event in the experiment's store, so the page shows real content from it."""
    code = ("import sys\nfrom verl_tasks.events import record_event\nfrom verl_tasks.layout import Layout\n"
            "from verl_tasks.store import open_store\n"
            "record_event(open_store(sys.argv[1]), Layout(sys.argv[2]), 'dashboard-probe', unit='probe')\n")
    subprocess.run([sys.executable, "-c", code, f"file://{root / 'store'}", experiment], check=True, timeout=120)


@pytest.fixture(scope="module")
def api_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("dashboard-auth")
    bundles = _layout(root)
    passwords = {name: f"pw-{name}-{os.urandom(4).hex()}" for name in USERS}
    (root / "passwords.json").write_text(json.dumps(passwords))
    port = free_port()
    env = _env(root, port, bundles)
    _airflow(env, "db", "migrate")
    _airflow(env, "teams", "sync")
    _airflow(env, "dags", "reserialize")
    for dag_id in TEAM_OF_DAG:
        _record_event(root, dag_id.replace("_", "-"))
    log = open(root / "api-server.log", "ab")
    proc = subprocess.Popen([str(VENV_BIN / "airflow"), "api-server", "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "1"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
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
        shutil.rmtree(root / "store", ignore_errors=True)


def _token(base: str, passwords: dict[str, str], user: str) -> str:
    reply = requests.post(f"{base}/auth/token", json={"username": user, "password": passwords[user]}, timeout=30)
    assert reply.status_code == 201, reply.text
    return reply.json()["access_token"]


def _shown(page: str) -> set[str]:
    return {name for name in ("vt-auth-a", "vt-auth-b") if f"<h2>{name}</h2>" in page}


def test_anonymous_and_forged_requests_are_refused(api_server):
    base, _ = api_server
    assert requests.get(f"{base}/verl-tasks/", timeout=30).status_code == 401
    forged = requests.get(f"{base}/verl-tasks/", headers={"Authorization": "Bearer not-a-jwt"}, timeout=30)
    assert forged.status_code == 403
    assert "vt-auth" not in forged.text


def test_admin_bearer_token_sees_every_experiment_with_its_events(api_server):
    base, passwords = api_server
    page = requests.get(f"{base}/verl-tasks/", headers={"Authorization": f"Bearer {_token(base, passwords, 'admin')}"},
                        timeout=60)
    assert page.status_code == 200, page.text
    assert _shown(page.text) == {"vt-auth-a", "vt-auth-b"}, page.text[-3000:]
    assert page.text.count("dashboard-probe") == 2


@pytest.mark.parametrize("user,dag_id", [("alice", "vt_auth_a"), ("bob", "vt_auth_b")])
def test_team_viewer_sees_only_the_dags_it_may_read(api_server, user, dag_id):
    base, passwords = api_server
    cookies = {"_token": _token(base, passwords, user)}  # what the React UI sends
    page = requests.get(f"{base}/verl-tasks/", cookies=cookies, timeout=60)
    assert page.status_code == 200, page.text
    assert _shown(page.text) == {dag_id.replace("_", "-")}, page.text[-3000:]
    other = next(d for d in TEAM_OF_DAG if d != dag_id)
    assert requests.get(f"{base}/verl-tasks/", params={"dag": other}, cookies=cookies, timeout=60).status_code == 403
    named = requests.get(f"{base}/verl-tasks/", params={"dag": other, "experiment": "x"}, cookies=cookies, timeout=60)
    assert named.status_code == 403
    mine, theirs = dag_id.replace("_", "-"), other.replace("_", "-")
    unit = requests.get(f"{base}/verl-tasks/unit", cookies=cookies, timeout=60,
                        params={"dag": dag_id, "experiment": mine, "key": f"{mine}/epochs/00000/plan"})
    assert unit.status_code == 200 and "not committed" in unit.text, unit.text[-2000:]
    assert requests.get(f"{base}/verl-tasks/unit", cookies=cookies, timeout=60, params={
        "dag": other, "experiment": theirs, "key": f"{theirs}/epochs/00000/plan"}).status_code == 403
    assert requests.get(f"{base}/verl-tasks/unit", cookies=cookies, timeout=60, params={
        "dag": dag_id, "experiment": theirs, "key": f"{theirs}/epochs/00000/plan"}).status_code == 404


def test_render_lists_each_prefix_once_and_reads_each_event_once(tmp_path):
    from verl_tasks.airflow.dashboard import EVENTS_SHOWN, experiment_view
    from verl_tasks.config import parse_config
    from verl_tasks.events import record_event
    from verl_tasks.layout import Layout
    from verl_tasks.store.local import LocalStore

    class CountingStore(LocalStore):
        """The real local store, counting the calls the page makes."""

        def __init__(self, root):
            super().__init__(root)
            self.listed: list[str] = []
            self.read: list[str] = []

        def list(self, prefix):
            self.listed.append(prefix)
            return super().list(prefix)

        def get(self, key):
            self.read.append(key)
            return super().get(key)

    store = CountingStore(tmp_path / "store")
    cfg = parse_config({**_tiny_raw(), "experiment": "bounded"}, {"storage.uri": f"file://{tmp_path / 'store'}"})
    for i in range(EVENTS_SHOWN * 3):
        record_event(store, Layout(cfg.experiment), "tick", unit=f"u{i}")
    store.listed.clear()
    view = experiment_view(cfg, store)
    assert len(store.listed) == len(set(store.listed)), store.listed
    assert [e["kind"] for e in view["events"]] == ["tick"] * EVENTS_SHOWN
    events = [k for k in store.read if "/events/" in k]
    assert len(events) == len(set(events)) == EVENTS_SHOWN * 3
    store.read.clear()
    experiment_view(cfg, store)  # events never change: a second page reads none of them again
    assert not [k for k in store.read if "/events/" in k]


def _tiny_raw() -> dict:
    import yaml

    return yaml.safe_load((REPO / "dags" / "experiments" / "tiny_arith.yaml").read_text())
