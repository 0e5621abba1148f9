"""A real ``airflow api-server`` for the dashboard tests: its environment, its start and stop, a login.

The dashboard, metrics-route and browser tests all reach the plugin through the api-server a
person would use (SQLite, SimpleAuthManager with a password file). The two-team server that the
auth and metrics tests share is the ``team_api_server`` fixture in ``conftest.py``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import requests

from tests.airflow.e2e_support import free_port, kill_group, wait_for

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
# Two teams, one experiment DAG each, each DAG in its own team's bundle: a viewer and a user (who may
# trigger its team's DAG, and only that one) per team.
USERS = {"admin": ("admin", None), "alice": ("viewer", "team_a"), "bob": ("viewer", "team_b"),
         "carol": ("user", "team_a"), "dave": ("user", "team_b")}
TEAM_OF_DAG = {"vt_auth_a": "team_a", "vt_auth_b": "team_b"}


def airflow_env(root: Path, users: dict[str, tuple[str, str | None]], **settings: str) -> dict[str, str]:
    """A clean Airflow environment under ``root`` (SQLite, fresh secrets); ``settings`` add or override."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "VERL_TASKS_", "RAY_"))}
    env.update({
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "AIRFLOW_HOME": str(root),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{root}/airflow.db",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": ",".join(
            f"{name}:{role}" + (f":{team}" if team else "") for name, (role, team) in users.items()),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(root / "passwords.json"),
        "AIRFLOW__API__SECRET_KEY": os.urandom(16).hex(),
        "AIRFLOW__API_AUTH__JWT_SECRET": os.urandom(32).hex(),
        "VERL_TASKS_EXPERIMENTS_DIR": str(root / "experiments"),
        **settings,
    })
    return env


def write_passwords(root: Path, users: dict) -> dict[str, str]:
    passwords = {name: f"pw-{name}-{os.urandom(4).hex()}" for name in users}
    (root / "passwords.json").write_text(json.dumps(passwords))
    return passwords


def airflow_cli(env: dict[str, str], *args: str) -> None:
    done = subprocess.run([str(VENV_BIN / "airflow"), *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"airflow {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


@contextmanager
def serving(root: Path, env: dict[str, str]) -> Iterator[str]:
    """Run ``airflow api-server`` on a free port until the block ends; yields its base URL."""
    port = free_port()
    with open(root / "api-server.log", "ab") as log:
        proc = subprocess.Popen([str(VENV_BIN / "airflow"), "api-server", "--host", "127.0.0.1", "--port", str(port),
                                 "--workers", "1"], env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for("the api-server", lambda: requests.get(f"{base}/api/v2/monitor/health", timeout=5).ok, 180,
                 diagnose=lambda: (root / "api-server.log").read_text(errors="replace")[-3000:])
        yield base
    finally:
        kill_group(proc)  # nothing checks its shutdown


def token(base: str, passwords: dict[str, str], user: str) -> str:
    """A JWT from ``POST /auth/token``, as the UI's login gets it."""
    reply = requests.post(f"{base}/auth/token", json={"username": user, "password": passwords[user]}, timeout=30)
    assert reply.status_code == 201, reply.text
    return reply.json()["access_token"]


def team_layout(root: Path) -> list[dict]:
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


# Each team's store: two fabricated epochs, then one probe event (the newest, so the page shows it).
FILL_STORE = """
import sys
from tests.test_metrics import fabricate
from verl_tasks.config import load_config
from verl_tasks.events import record_event
from verl_tasks.layout import Layout
from verl_tasks.store import store_for
cfg = load_config(sys.argv[1])
store_for(cfg).put(Layout(cfg.experiment).experiment_json, b"{}")
fabricate(cfg, 2)
record_event(store_for(cfg), Layout(cfg.experiment), "dashboard-probe", unit="probe")
"""


@dataclass
class TeamServer:
    """A running team api-server: its URL, each user's password, its Airflow home and environment."""

    base: str
    passwords: dict[str, str]
    root: Path
    env: dict[str, str]


@contextmanager
def team_server(root: Path) -> Iterator[TeamServer]:
    """The multi-team api-server (``all_admins`` off) and the environment of its Airflow (SQLite, two bundles)."""
    bundles = team_layout(root)
    passwords = write_passwords(root, USERS)
    env = airflow_env(root, USERS, AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS="False",
                      AIRFLOW__CORE__MULTI_TEAM="True",
                      AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST=json.dumps(bundles))
    airflow_cli(env, "db", "migrate")
    airflow_cli(env, "teams", "sync")
    airflow_cli(env, "dags", "reserialize")
    for dag_id in TEAM_OF_DAG:
        subprocess.run([sys.executable, "-c", FILL_STORE, str(root / "experiments" / f"{dag_id}.yaml")], check=True,
                       timeout=300, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    with serving(root, env) as base:
        yield TeamServer(base, passwords, root, env)
