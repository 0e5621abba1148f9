"""Shared fixtures: a project-local Airflow home (SQLite), a Ray head and a two-team api-server, each started once."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DAGS = REPO / "dags"


@pytest.fixture(scope="session", autouse=True)
def _airflow_env(tmp_path_factory):
    home = tmp_path_factory.mktemp("airflow-home")
    env = {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "True",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield home
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory):
    """A project-local Ray head on free ports (one per test process: parallel workers each start their own),
    stopped (SIGTERM to its PID) at the end."""
    from verl_tasks.execution import local_head
    from verl_tasks.execution.cli_cluster import _free_ports

    state = tmp_path_factory.mktemp("ray-head")
    port, dashboard = _free_ports()
    info = local_head.start(state, port=port, dashboard_port=dashboard, num_cpus=8)
    yield info
    local_head.stop(state, timeout_s=0)  # at once: with actors alive a SIGTERMed head outlasts the 30 s grace


@pytest.fixture(scope="session")
def team_airflow(tmp_path_factory):
    """The two-team ``airflow api-server`` with its Airflow home and environment (``api_server.TeamServer``)."""
    from tests.airflow.api_server import team_server

    with team_server(tmp_path_factory.mktemp("team-api-server")) as served:
        yield served


@pytest.fixture(scope="session")
def team_api_server(team_airflow):
    """The two-team api-server of the dashboard-auth and metrics-route tests: (base URL, passwords)."""
    return team_airflow.base, team_airflow.passwords
