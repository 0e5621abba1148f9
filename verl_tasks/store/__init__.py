"""Object storage: the only door to S3 and the disk."""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict
from urllib.parse import urlparse

from verl_tasks.store.base import NotFound, ObjectStore, check_key
from verl_tasks.store.local import LocalStore
from verl_tasks.store.units import CommitRecord, UnitWriter, read_marker

if TYPE_CHECKING:  # pragma: no cover - typing only
    from verl_tasks.config import ExperimentConfig

__all__ = ["absolute_uri", "NotFound", "ObjectStore", "LocalStore", "CommitRecord", "UnitWriter", "read_marker",
           "check_key", "open_store", "store_for", "S3Options"]


class S3Options(TypedDict, total=False):
    """Tuning of the S3 client (``S3Store``'s keyword arguments of the same names)."""

    max_attempts: int
    connect_timeout: float
    read_timeout: float
    multipart_threshold: int


def absolute_uri(uri: str, root: str | os.PathLike | None = None) -> str:
    """``file://.store`` -> ``file:///abs/.store``, resolved against ``root`` (default
    ``VERL_TASKS_STORE_ROOT``, else the working folder), so a worker's own cwd does not matter.
    Other URIs are returned unchanged."""
    if uri.startswith("file://") and not uri.startswith("file:///"):
        base = Path(root if root is not None else os.environ.get("VERL_TASKS_STORE_ROOT", os.getcwd()))
        return "file://" + str((base / uri[len("file://"):]).resolve())
    return uri


def open_store(
    uri: str,
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    sse: str = "none",
    sse_kms_key_id: str | None = None,
    credentials: dict[str, str] | None = None,
    s3_options: S3Options | None = None,
) -> ObjectStore:
    """A store for ``file://PATH`` (relative paths from the working directory) or ``s3://BUCKET/PREFIX``.

    For S3 the endpoint falls back to ``VERL_TASKS_S3_ENDPOINT`` / ``AWS_ENDPOINT_URL_S3``;
    credentials to boto3's default chain. ``s3_options`` tunes the client (``max_attempts``,
    ``connect_timeout``, ``read_timeout``): a web page gives up sooner than training does.
    """
    if uri.startswith("file://"):
        return LocalStore(uri[len("file://") :] or ".")
    if uri.startswith("s3://"):
        from verl_tasks.store.s3 import S3Store

        parsed = urlparse(uri)
        endpoint = endpoint_url or os.environ.get("VERL_TASKS_S3_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL_S3")
        return S3Store(
            parsed.netloc,
            parsed.path,
            endpoint_url=endpoint,
            region=region or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
            sse=sse,
            sse_kms_key_id=sse_kms_key_id,
            credentials=credentials,
            **(s3_options or {}),
        )
    raise ValueError(f"unsupported store URI {uri!r}: use file://PATH or s3://BUCKET/PREFIX")


def store_for(config: ExperimentConfig, credentials: dict[str, str] | None = None) -> ObjectStore:
    """The store an experiment's ``storage`` section names (credentials from an Airflow connection, if given)."""
    s = config.storage
    return open_store(s.uri, endpoint_url=s.endpoint_url, region=s.region, sse=s.sse,
                      sse_kms_key_id=s.sse_kms_key_id, credentials=credentials)
