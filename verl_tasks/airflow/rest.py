"""Airflow's REST API v2 through ``apache-airflow-client``, at the api-server an Airflow connection names.

The connection (``verl_airflow_api``, or ``VERL_TASKS_AIRFLOW_API_CONN``): ``host``, ``port`` (8080 when
empty) and ``schema`` as the URL scheme (``http`` when empty). With a ``login``, its JWT comes from
``POST /auth/token`` (not part of the client): fetched once per process and reused until shortly before
its ``exp`` claim; a 401 with a reused token fetches a new one once. Without a login no token is sent
(an api-server whose auth manager makes everyone admin). The password is never logged.

The client is imported by the first call, not by this module: importing it takes more than a second,
and DAG files import the callbacks that import this module.
"""
from __future__ import annotations

import base64
import functools
import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from airflow_client.client import ApiClient

API_CONN_ID = os.environ.get("VERL_TASKS_AIRFLOW_API_CONN", "verl_airflow_api")
TIMEOUT_S = 10.0
REFRESH_BEFORE_S = 60.0  # a cached token is replaced this long before it expires (a tenth of its life at most)
T = TypeVar("T")


class NoConnection(LookupError):
    """No Airflow connection of that id is defined: the REST API is not configured."""


def describe(err: BaseException) -> str:
    """What an API call's error says without its response body: its class, and its HTTP status if it has one."""
    status, reason = getattr(err, "status", None), getattr(err, "reason", None)
    if status is None:
        return type(err).__name__
    return f"{type(err).__name__}, HTTP {status}" + (f" {reason}" if reason else "")


def _expires_at(token: str, reply: dict, now: float) -> float | None:
    """When the JWT expires (epoch seconds): its ``exp`` claim, read without verifying, else ``expires_in``."""
    try:
        payload = token.split(".")[1]
        exp = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))).get("exp")
        if isinstance(exp, int | float):
            return float(exp)
    except (IndexError, ValueError, AttributeError):  # not a JWT: an opaque token
        pass
    for key in ("expires_in", "expires_in_seconds"):
        if isinstance(reply.get(key), int | float):
            return now + float(reply[key])
    return None  # no expiry known: reused until a call answers 401


class AirflowApi:
    """One api-server: an ``ApiClient`` and, with a login, its cached JWT."""

    def __init__(self, base: str, login: str | None = None, password: str | None = None) -> None:
        from airflow_client.client import ApiClient, Configuration

        self.base = base
        self.client: ApiClient = ApiClient(Configuration(host=base))
        self._login, self._password = login, password
        self._token_until = 0.0  # the configured token is used until then (time.time()); inf: no known expiry
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"AirflowApi({self.base!r}, login={self._login!r})"

    def _fetch_token(self) -> None:
        from airflow_client.client.exceptions import ApiException

        reply = self.client.rest_client.request(
            "POST", f"{self.base}/auth/token", headers={"Content-Type": "application/json"},
            body={"username": self._login, "password": self._password or ""}, _request_timeout=TIMEOUT_S)
        if not 200 <= reply.status < 300:  # the reply's body is left out: it may echo what was sent
            raise ApiException(status=reply.status, reason=reply.reason)
        answer = json.loads(reply.read())
        now = time.time()
        token = str(answer["access_token"])
        expires = _expires_at(token, answer, now)
        self.client.configuration.access_token = token
        self._token_until = math.inf if expires is None else expires - min(REFRESH_BEFORE_S, (expires - now) / 10)

    def _authorize(self) -> bool:
        """Configure a token unless the cached one is still good; False when the cached one is kept.

        True means a 401 cannot be a stale token: it was just fetched, or no token is sent at all.
        """
        if not self._login:
            return True
        with self._lock:
            if time.time() < self._token_until:
                return False
            self._fetch_token()
            return True

    def _call(self, request: Callable[[], T]) -> T:
        from airflow_client.client.exceptions import UnauthorizedException

        fresh = self._authorize()
        try:
            return request()
        except UnauthorizedException:
            if fresh:
                raise
            with self._lock:  # the reused token was refused (the api-server's secret changed): once more
                self._token_until = 0.0
        self._authorize()
        return request()

    def pause_dag(self, dag_id: str) -> None:
        from airflow_client.client import DAGApi, DAGPatchBody

        self._call(lambda: DAGApi(self.client).patch_dag(dag_id, DAGPatchBody(is_paused=True),
                                                         _request_timeout=TIMEOUT_S))

    def newest_event_owner(self, dag_id: str, events: Iterable[str], after: datetime | None = None) -> str | None:
        """Who did the newest of ``events`` on ``dag_id`` (after ``after``), per Airflow's audit log."""
        from airflow_client.client import EventLogApi

        found = self._call(lambda: EventLogApi(self.client).get_event_logs(
            dag_id=dag_id, included_events=list(events), after=after, order_by=["-when"], limit=1,
            _request_timeout=TIMEOUT_S))
        return (found.event_logs[0].owner or None) if found.event_logs else None


@functools.lru_cache(maxsize=8)
def _api(base: str, login: str | None, password: str | None) -> AirflowApi:
    return AirflowApi(base, login, password)


def api(conn_id: str = API_CONN_ID) -> AirflowApi:
    """The client of the api-server connection ``conn_id`` names: one per process while the connection stays the same.

    Raises:
        NoConnection: no connection ``conn_id`` is defined.
    """
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        conn = BaseHook.get_connection(conn_id)
    except AirflowNotFoundException as err:
        raise NoConnection(conn_id) from err
    return _api(f"{conn.schema or 'http'}://{conn.host}:{conn.port or 8080}", conn.login or None, conn.password)
