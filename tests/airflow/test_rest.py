"""The REST client of the escalation (``verl_tasks.airflow.rest``) against a real api-server: it pauses a DAG,
finds who cleared one in the audit log, asks ``/auth/token`` once for several calls, and says plainly what it
could not do (no connection: once, at INFO; an API error: at WARNING, with class and status, never the password)."""
from __future__ import annotations

import base64
import http.client
import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

import pytest
import requests

from tests.airflow.api_server import token
from verl_tasks.airflow import callbacks, rest

HOP = {"connection", "keep-alive", "transfer-encoding", "content-length"}


class CountingProxy:
    """An HTTP proxy (127.0.0.1) in front of the api-server that records each request's method and path."""

    def __init__(self, upstream: str):
        target = urlparse(upstream)
        self.requests: list[str] = []
        seen = self.requests

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _forward(self):
                seen.append(f"{self.command} {self.path.split('?')[0]}")
                body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
                conn.request(self.command, self.path, body=body or None,
                             headers={k: v for k, v in self.headers.items() if k.lower() not in HOP})
                reply = conn.getresponse()
                data = reply.read()
                conn.close()
                self.send_response(reply.status)
                for key, value in reply.getheaders():
                    if key.lower() not in HOP:
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PATCH = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]

    def __enter__(self) -> CountingProxy:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def _connection(monkeypatch, conn_id: str, port: int, login: str, password: str) -> str:
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(
        {"conn_type": "http", "host": "127.0.0.1", "port": port, "login": login, "password": password}))
    return conn_id


class _Said(logging.Handler):
    """What the callbacks log, as (level, message): Airflow's logging setup sends records past pytest's caplog."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))


@pytest.fixture
def said():
    handler, logger = _Said(), logging.getLogger(callbacks.__name__)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_pause_and_who_cleared_through_one_token(team_airflow, monkeypatch):
    base, passwords = team_airflow.base, team_airflow.passwords
    since = time.time() - 1
    carol = {"Authorization": f"Bearer {token(base, passwords, 'carol')}"}  # a user of vt_auth_a's team
    cleared = requests.post(f"{base}/api/v2/dags/vt_auth_a/clearTaskInstances", headers=carol, timeout=60,
                            json={"dry_run": False, "only_failed": False})
    assert cleared.ok, cleared.text
    with CountingProxy(base) as proxy:
        conn_id = _connection(monkeypatch, "vt_rest_admin", proxy.port, "admin", passwords["admin"])
        assert callbacks.cleared_by("vt_auth_a", since, conn_id) == "carol"
        assert callbacks.cleared_by("vt_auth_a", time.time() + 60, conn_id) is None  # none after that
        assert callbacks.cleared_by("vt_auth_b", since, conn_id) is None
        assert callbacks.pause_dag("vt_auth_a", conn_id) == (True, "DAG vt_auth_a paused")
    assert proxy.requests.count("POST /auth/token") == 1, proxy.requests
    assert proxy.requests[1:] == ["GET /api/v2/eventLogs"] * 3 + ["PATCH /api/v2/dags/vt_auth_a"], proxy.requests


def test_an_api_error_is_a_warning_with_its_status_and_no_password(team_airflow, monkeypatch, said):
    wrong = "not-the-password-" + team_airflow.passwords["admin"]
    conn_id = _connection(monkeypatch, "vt_rest_wrong", int(urlparse(team_airflow.base).port or 0), "admin", wrong)
    assert callbacks.cleared_by("vt_auth_a", None, conn_id) is None
    paused, detail = callbacks.pause_dag("vt_auth_a", conn_id)
    assert not paused and detail == "DAG vt_auth_a not paused (ApiException, HTTP 401 Unauthorized); " \
                                    "the safe-mode file halts it"
    assert said == [
        ("WARNING", "who cleared vt_auth_a is not known: Airflow's REST API call failed "
                    "(ApiException, HTTP 401 Unauthorized)"),
        ("WARNING", "DAG vt_auth_a not paused: Airflow's REST API call failed (ApiException, HTTP 401 Unauthorized)"),
    ]
    assert not any(wrong in line for _, line in said) and wrong not in repr(rest.api(conn_id))


def test_no_connection_is_said_once_per_process(monkeypatch, said):
    monkeypatch.delenv("AIRFLOW_CONN_VT_REST_NONE", raising=False)
    for dag_id in ("tiny_fail", "tiny_fail", "tiny_arith"):
        assert callbacks.cleared_by(dag_id, None, "vt_rest_none") is None
    assert callbacks.pause_dag("tiny_fail", "vt_rest_none") == (
        False, "DAG tiny_fail not paused (no Airflow connection 'vt_rest_none'); the safe-mode file halts it")
    assert said == [
        ("INFO", "who cleared DAG runs is not recorded: no Airflow connection 'vt_rest_none' "
                 "(add one to record the user)")]


def _jwt(claims: dict) -> str:
    encode = lambda part: base64.urlsafe_b64encode(json.dumps(part).encode()).rstrip(b"=").decode()  # noqa: E731
    return f"{encode({'alg': 'HS512', 'typ': 'JWT'})}.{encode(claims)}.c2lnbmF0dXJl"


def test_a_token_is_kept_until_shortly_before_its_exp():
    now = 1_800_000_000.0
    assert rest._expires_at(_jwt({"sub": "admin", "exp": int(now) + 86400}), {}, now) == now + 86400
    assert rest._expires_at("opaque", {"expires_in": 300}, now) == now + 300
    assert rest._expires_at("opaque", {"expires_in_seconds": 600}, now) == now + 600
    assert rest._expires_at("opaque", {}, now) is None
