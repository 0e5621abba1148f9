"""A store in an S3 bucket (AWS, MinIO, moto) through boto3.

Credentials come from the caller (an Airflow connection) or boto3's default
chain (environment, instance role); this class never logs them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import ClientError

from verl_tasks.errors import StoreError
from verl_tasks.store.base import NotFound, ObjectStore, check_key

_MISSING = {"404", "NoSuchKey", "NotFound"}
_EXISTS = {"PreconditionFailed", "412"}
# S3 answers 409 ConditionalRequestConflict when two conditional writes race; the
# loser must read the winner's marker, so it is treated like "already exists".
_RACE = {"ConditionalRequestConflict", "409"}


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

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **self.sse_args)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        try:
            self.client.put_object(
                Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*", **self.sse_args
            )
            return True
        except ClientError as err:
            if self._code(err) in _EXISTS or self._code(err) in _RACE:
                return False
            raise StoreError(f"conditional write of {key} failed: {self._code(err)}") from err

    def put_file(self, key: str, path: Path) -> None:
        self.client.upload_file(
            str(path), self.bucket, self._key(key), ExtraArgs=dict(self.sse_args) or None, Config=self.transfer
        )

    def get(self, key: str) -> bytes:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except ClientError as err:
            if self._code(err) in _MISSING:
                raise NotFound(key) from None
            raise

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

    def exists(self, key: str) -> bool:
        return self._head(key) is not None

    def size(self, key: str) -> int:
        head = self._head(key)
        if head is None:
            raise NotFound(key)
        return int(head["ContentLength"])

    def head(self, key: str) -> dict | None:
        """Object metadata (used to check server-side encryption)."""
        return self._head(key)

    def list(self, prefix: str) -> list[str]:
        full = self._key(prefix) if prefix else (self.prefix + "/" if self.prefix else "")
        paginator = self.client.get_paginator("list_objects_v2")
        keys = []
        for page in paginator.paginate(Bucket=self.bucket, Prefix=full):
            keys.extend(self._strip(item["Key"]) for item in page.get("Contents", []))
        return sorted(keys)

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def delete_prefix(self, prefix: str) -> int:
        keys = self.list(prefix)
        for start in range(0, len(keys), 1000):
            chunk = [{"Key": self._key(k)} for k in keys[start : start + 1000]]
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": chunk, "Quiet": True})
        return len(keys)

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
