"""A store in an S3 bucket (AWS, MinIO, moto) through boto3.

Credentials come from the caller (an Airflow connection) or boto3's default
chain (environment, instance role); this class never logs them.
"""
from __future__ import annotations

import builtins
import functools
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import boto3
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError

from verl_tasks.errors import StoreError, WriteConflict
from verl_tasks.store.base import NotFound, ObjectStore, check_key

log = logging.getLogger(__name__)
_MISSING = {"404", "NoSuchKey", "NotFound"}
_EXISTS = {"PreconditionFailed", "412"}
# S3 answers 409 ConditionalRequestConflict while another conditional write (or a delete) of the
# key is in flight: undecided, not "exists". The write is retried with backoff (botocore does not).
_RACE = {"ConditionalRequestConflict", "409"}
# Wrong or missing permission: retrying cannot help, a person must fix credentials or the bucket policy.
_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
           "AllAccessDisabled", "AccountProblem", "403", "Forbidden"}

_Method = TypeVar("_Method", bound=Callable[..., Any])


def _explained(method: _Method) -> _Method:
    """Turn missing credentials and 403s into one StoreError line naming the object, the problem and the fix."""

    @functools.wraps(method)
    def wrapper(self: S3Store, *args: Any, **kwargs: Any) -> Any:
        key = args[0] if args and isinstance(args[0], str) else ""
        try:
            return method(self, *args, **kwargs)
        except (NoCredentialsError, PartialCredentialsError) as err:
            raise StoreError(
                f"no usable AWS credentials to reach {self.url(key)} ({err}): set storage.aws_conn_id to an Airflow "
                f"connection that holds them, or export AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or use an "
                f"instance role)"
            ) from None
        except (ClientError, S3UploadFailedError) as err:
            client_err = err if isinstance(err, ClientError) else err.__context__
            code = S3Store._code(client_err) if isinstance(client_err, ClientError) else ""
            if code not in _DENIED:
                raise
            raise StoreError(
                f"S3 refused access to {self.url(key)} ({code}): check the credentials (storage.aws_conn_id or "
                f"AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY) and that the policy of bucket {self.bucket} lets them "
                f"get, put, delete and list objects under {self.uri}"
            ) from None

    return wrapper  # type: ignore[return-value]


class S3Store(ObjectStore):
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        sse: str = "none",
        sse_kms_key_id: str | None = None,
        credentials: dict[str, str] | None = None,
        max_attempts: int = 10,
        connect_timeout: float = 10,
        read_timeout: float = 60,
        multipart_threshold: int = 64 << 20,
    ):
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}".rstrip("/")
        config = Config(
            retries={"max_attempts": max_attempts, "mode": "standard"},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            signature_version="s3v4",
        )
        session = boto3.session.Session(**(credentials or {}))
        self.client = session.client("s3", endpoint_url=endpoint_url, region_name=region, config=config)
        self.transfer = TransferConfig(multipart_threshold=multipart_threshold, multipart_chunksize=multipart_threshold)
        self.sse_args: dict[str, Any] = {}
        if sse != "none":
            self.sse_args["ServerSideEncryption"] = sse
            if sse == "aws:kms" and sse_kms_key_id:
                self.sse_args["SSEKMSKeyId"] = sse_kms_key_id

    def __repr__(self) -> str:
        return f"S3Store({self.uri!r})"

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _strip(self, full: str) -> str:
        return full[len(self.prefix) + 1 :] if self.prefix else full

    @staticmethod
    def _code(err: ClientError) -> str:
        return str(err.response.get("Error", {}).get("Code", ""))

    @_explained
    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **self.sse_args)

    @_explained
    def put_if_absent(self, key: str, data: bytes) -> bool:
        """``IfNoneMatch="*"``. Raises WriteConflict when every try got a 409 (see ``_conditional_put``)."""
        return self._conditional_put(key, data, IfNoneMatch="*")

    @_explained
    def get_versioned(self, key: str) -> tuple[bytes, str]:
        """The bytes and the ETag they were read with."""
        try:
            resp = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as err:
            if self._code(err) in _MISSING:
                raise NotFound(key) from None
            raise
        return resp["Body"].read(), str(resp["ETag"])

    @_explained
    def put_if_match(self, key: str, data: bytes, version: str) -> bool:
        """``IfMatch=<ETag>`` (AWS S3 since 2024-11, MinIO and moto server honour it): False when the
        object changed (412) or is gone (404). Raises WriteConflict when every try got a 409."""
        return self._conditional_put(key, data, IfMatch=version)

    # Tries of a conditional write answered 409, and the first backoff (doubled each time, jittered):
    # 0.05 + 0.1 + ... + 1.6 s, about 3 s in all before the write is reported undecided.
    conflict_tries = 7
    conflict_backoff_s = 0.05

    def _conditional_put(self, key: str, data: bytes, **condition: str) -> bool:
        """One conditional ``put_object``: True when written, False when the condition failed (412, or 404
        for ``IfMatch`` on a missing object).

        A 409 ConditionalRequestConflict decides nothing (a concurrent conditional write or delete of the
        key was in flight, possibly this client's own earlier try whose reply was lost): the write is tried
        again after a jittered, doubling backoff; the next try then meets the finished write's object (412)
        or writes.

        Raises:
            WriteConflict: every one of ``conflict_tries`` tries was answered 409; nothing is known to be written.
            StoreError: any other refusal.
        """
        delay = self.conflict_backoff_s
        for attempt in range(1, self.conflict_tries + 1):
            try:
                self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **condition,
                                       **self.sse_args)
                return True
            except ClientError as err:
                code = self._code(err)
                if code in _EXISTS or ("IfMatch" in condition and code in _MISSING):
                    return False
                if code in _DENIED:
                    raise
                if code not in _RACE:
                    raise StoreError(f"conditional write of {self.url(key)} failed: {code}") from err
            if attempt < self.conflict_tries:
                log.info("conditional write of %s: 409 ConditionalRequestConflict (try %d), again in %.2f s",
                         self.url(key), attempt, delay)
                time.sleep(delay * random.uniform(0.5, 1.0))
                delay *= 2
        raise WriteConflict(key, f"conditional write of {self.url(key)} undecided: S3 answered 409 "
                                 f"ConditionalRequestConflict to all {self.conflict_tries} tries (another write "
                                 f"of the key kept being in flight); nothing is known to be written: retry")

    @_explained
    def put_file(self, key: str, path: Path) -> None:
        self.client.upload_file(
            str(path), self.bucket, self._key(key), ExtraArgs=dict(self.sse_args) or None, Config=self.transfer
        )

    @_explained
    def get(self, key: str) -> bytes:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except ClientError as err:
            if self._code(err) in _MISSING:
                raise NotFound(key) from None
            raise

    @_explained
    def get_file(self, key: str, path: Path) -> None:
        try:
            self.client.download_file(self.bucket, self._key(key), str(path), Config=self.transfer)
        except ClientError as err:
            if self._code(err) in _MISSING:
                raise NotFound(key) from None
            raise

    def _head(self, key: str) -> dict | None:
        try:
            return self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as err:
            if self._code(err) in _MISSING:
                return None
            raise

    @_explained
    def exists(self, key: str) -> bool:
        return self._head(key) is not None

    @_explained
    def size(self, key: str) -> int:
        head = self._head(key)
        if head is None:
            raise NotFound(key)
        return int(head["ContentLength"])

    @_explained
    def head(self, key: str) -> dict | None:
        """Object metadata (used to check server-side encryption)."""
        return self._head(key)

    @_explained
    def list(self, prefix: str) -> list[str]:
        full = self._key(prefix) if prefix else (self.prefix + "/" if self.prefix else "")
        paginator = self.client.get_paginator("list_objects_v2")
        keys: list[str] = []
        for page in paginator.paginate(Bucket=self.bucket, Prefix=full):
            keys.extend(self._strip(item["Key"]) for item in page.get("Contents", []))
        return sorted(keys)

    @_explained
    def folders(self, limit: int) -> builtins.list[str]:  # builtins: ``list`` is the method above
        root = self.prefix + "/" if self.prefix else ""
        paginator = self.client.get_paginator("list_objects_v2")
        names: builtins.list[str] = []
        pages = paginator.paginate(Bucket=self.bucket, Prefix=root, Delimiter="/",
                                   PaginationConfig={"MaxItems": limit, "PageSize": min(limit, 1000)})
        for page in pages:
            names.extend(item["Prefix"][len(root):].rstrip("/") for item in page.get("CommonPrefixes", []))
        return sorted(names)[:limit]

    @_explained
    def sizes(self, prefix: str) -> dict[str, int]:
        """One listing (1000 keys a page), not a HEAD per key."""
        full = self._key(prefix) if prefix else (self.prefix + "/" if self.prefix else "")
        paginator = self.client.get_paginator("list_objects_v2")
        return {self._strip(item["Key"]): int(item["Size"])
                for page in paginator.paginate(Bucket=self.bucket, Prefix=full) for item in page.get("Contents", [])}

    @_explained
    def list_modified(self, prefix: str) -> dict[str, float]:
        full = self._key(prefix) if prefix else (self.prefix + "/" if self.prefix else "")
        paginator = self.client.get_paginator("list_objects_v2")
        return {self._strip(item["Key"]): item["LastModified"].timestamp()
                for page in paginator.paginate(Bucket=self.bucket, Prefix=full) for item in page.get("Contents", [])}

    @_explained
    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    @_explained
    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix``, 1000 per request; returns how many.

        Raises:
            StoreError: S3 answered the request but could not delete some keys (it reports them, not raises).
        """
        keys = self.list(prefix)
        for start in range(0, len(keys), 1000):
            chunk = [{"Key": self._key(k)} for k in keys[start : start + 1000]]
            resp = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": chunk, "Quiet": True})
            failed = resp.get("Errors", [])
            if failed:
                named = ", ".join(f"{self._strip(e.get('Key', ''))} ({e.get('Code')})" for e in failed[:3])
                raise StoreError(f"could not delete {len(failed)} object(s) under {self.url(prefix)}: {named}"
                                 + (", ..." if len(failed) > 3 else ""))
        return len(keys)

    @_explained
    def copy(self, src: str, dst: str) -> None:
        try:
            self.client.copy(
                {"Bucket": self.bucket, "Key": self._key(src)},
                self.bucket,
                self._key(dst),
                ExtraArgs=dict(self.sse_args) or None,
                Config=self.transfer,
            )
        except ClientError as err:
            if self._code(err) in _MISSING:
                raise NotFound(src) from None
            raise
