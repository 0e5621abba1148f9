"""Airflow connections: an undefined one means "use the defaults"; any other failure to read one is raised."""
from __future__ import annotations

import json

import pytest

from verl_tasks.airflow.connections import S3Access, s3_access


def test_an_undefined_connection_falls_back_and_a_defined_one_is_read(monkeypatch):
    monkeypatch.delenv("AIRFLOW_CONN_VT_UNDEFINED", raising=False)
    assert s3_access("vt_undefined") == S3Access()  # boto3's default chain
    monkeypatch.setenv("AIRFLOW_CONN_VT_S3", json.dumps({
        "conn_type": "aws", "login": "key-id-1", "password": "secret-value-1",
        "extra": {"endpoint_url": "http://127.0.0.1:9", "region_name": "eu-west-1"}}))
    access = s3_access("vt_s3")
    assert (access.endpoint_url, access.region) == ("http://127.0.0.1:9", "eu-west-1")
    assert access.credentials == {"aws_access_key_id": "key-id-1", "aws_secret_access_key": "secret-value-1"}


def test_a_backend_that_fails_is_raised_even_when_its_message_says_not_found(monkeypatch):
    """Only Airflow's own "not defined" means absent: an error of the backend is not read as one by its text."""
    from airflow.sdk import BaseHook

    def refused(conn_id):
        raise PermissionError(f"secrets backend: path for {conn_id} not found or access denied")

    monkeypatch.setattr(BaseHook, "get_connection", staticmethod(refused))
    with pytest.raises(PermissionError, match="access denied"):
        s3_access("vt_s3")
