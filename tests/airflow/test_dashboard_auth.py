"""The Training dashboard is behind Airflow's own authentication and shows only readable DAGs.

A real ``airflow api-server`` (SQLite, SimpleAuthManager with ``all_admins`` off, multi-team mode;
the ``team_api_server`` fixture, shared with the metrics-route tests) serves two experiment DAGs
from two bundles owned by two teams. Anonymous and forged requests are
refused; a token from ``POST /auth/token`` (as a bearer header or the UI's ``_token`` cookie) opens
the page, and a team's viewer sees only the experiment of its own team's DAG.
"""
from __future__ import annotations

import pytest
import requests

from tests.airflow.api_server import REPO, TEAM_OF_DAG, token

pytestmark = pytest.mark.airflow


def _shown(page: str) -> set[str]:
    return {name for name in ("vt-auth-a", "vt-auth-b") if f"<h2>{name}</h2>" in page}


def test_anonymous_and_forged_requests_are_refused(team_api_server):
    base, _ = team_api_server
    assert requests.get(f"{base}/verl-tasks/", timeout=30).status_code == 401
    forged = requests.get(f"{base}/verl-tasks/", headers={"Authorization": "Bearer not-a-jwt"}, timeout=30)
    assert forged.status_code == 403
    assert "vt-auth" not in forged.text


def test_admin_bearer_token_sees_every_experiment_with_its_events(team_api_server):
    base, passwords = team_api_server
    page = requests.get(f"{base}/verl-tasks/", headers={"Authorization": f"Bearer {token(base, passwords, 'admin')}"},
                        timeout=60)
    assert page.status_code == 200, page.text
    assert _shown(page.text) == {"vt-auth-a", "vt-auth-b"}, page.text[-3000:]
    assert page.text.count("dashboard-probe") == 2


@pytest.mark.parametrize("user,dag_id", [("alice", "vt_auth_a"), ("bob", "vt_auth_b")])
def test_team_viewer_sees_only_the_dags_it_may_read(team_api_server, user, dag_id):
    base, passwords = team_api_server
    cookies = {"_token": token(base, passwords, user)}  # what the React UI sends
    page = requests.get(f"{base}/verl-tasks/", cookies=cookies, timeout=60)
    assert page.status_code == 200, page.text
    assert _shown(page.text) == {dag_id.replace("_", "-")}, page.text[-3000:]
    other = next(d for d in TEAM_OF_DAG if d != dag_id)
    assert requests.get(f"{base}/verl-tasks/", params={"dag": other}, cookies=cookies, timeout=60).status_code == 403
    named = requests.get(f"{base}/verl-tasks/", params={"dag": other, "experiment": "x"}, cookies=cookies, timeout=60)
    assert named.status_code == 403
    mine, theirs = dag_id.replace("_", "-"), other.replace("_", "-")
    unit = requests.get(f"{base}/verl-tasks/unit", cookies=cookies, timeout=60,
                        params={"dag": dag_id, "experiment": mine, "key": f"{mine}/epochs/00002/plan"})
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
