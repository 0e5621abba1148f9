"""Airflow connections -> what the store and the Ray backend need. Nothing secret leaves this module
except into the store / Ray client objects (never into XCom, task logs or trigger arguments).

* S3: an AWS-type connection (``aws_conn_id``): login = access key id, password = secret key,
  extras ``endpoint_url`` (MinIO, moto), ``region_name``, ``aws_session_token``. Its keys serve
  the Airflow side only (marker checks, inline runs); they are never sent to Ray, whose nodes
  reach storage with their own credential chain (a Ray job's environment is public to token holders).
* Ray: a connection (``ray_default``) whose host/port are the dashboard's; schema ``https``
  switches the scheme; the password, when set, is the Ray auth token. Without the connection
  the environment is used (``VERL_TASKS_RAY_ADDRESS`` / ``RAY_ADDRESS``, ``RAY_AUTH_TOKEN[_PATH]``).
  The ``ray-driver`` backend also needs the GCS address: extra ``gcs_address`` or
  ``VERL_TASKS_RAY_GCS_ADDRESS``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from verl_tasks.execution.ray_jobs import RayTarget, normalise_address, read_token

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class S3Access:
    endpoint_url: str | None = None
    region: str | None = None
    credentials: dict[str, str] | None = field(default=None, repr=False)


def _get_connection(conn_id: str):
    """The connection, or None when it is not defined anywhere (DB, secrets backend, env)."""
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        return BaseHook.get_connection(conn_id)
    except AirflowNotFoundException:  # no backend defines it; any other error (a refused backend) is raised
        return None


def s3_access(aws_conn_id: str | None) -> S3Access:
    """Credentials and endpoint from an AWS connection; empty (boto3's default chain) without one."""
    if not aws_conn_id:
        return S3Access()
    conn = _get_connection(aws_conn_id)
    if conn is None:
        log.info("AWS connection %r is not defined; using the default credential chain", aws_conn_id)
        return S3Access()
    extra = conn.extra_dejson or {}
    creds = {}
    if conn.login:
        creds["aws_access_key_id"] = conn.login
    if conn.password:
        creds["aws_secret_access_key"] = conn.password
    if extra.get("aws_session_token"):
        creds["aws_session_token"] = extra["aws_session_token"]
    endpoint = extra.get("endpoint_url") or (extra.get("service_config", {}).get("s3", {}) or {}).get("endpoint_url")
    return S3Access(endpoint, extra.get("region_name"), creds or None)


def ray_target(ray_conn_id: str | None = "ray_default") -> RayTarget:
    """The Ray dashboard address and token: the connection if defined, else the environment.

    Raises:
        RayUnavailable: neither is configured.
    """
    conn = _get_connection(ray_conn_id) if ray_conn_id else None
    if conn is None or not conn.host:
        return RayTarget.from_env()
    host = conn.host
    if "://" not in host:
        scheme = "https" if (conn.schema or "").lower() == "https" else "http"
        host = f"{scheme}://{host}"
    address = normalise_address(f"{host}:{conn.port}" if conn.port else host)
    token = conn.password or read_token((conn.extra_dejson or {}).get("token_file"))
    return RayTarget(address, token)


def ray_gcs_address(ray_conn_id: str | None = "ray_default") -> str:
    """The cluster's GCS address for the ``ray-driver`` backend: the connection's extra, else the env.

    Raises:
        RayUnavailable: neither names one.
    """
    from verl_tasks.execution.driver import gcs_address

    conn = _get_connection(ray_conn_id) if ray_conn_id else None
    return gcs_address((conn.extra_dejson or {}).get("gcs_address") if conn is not None else None)
