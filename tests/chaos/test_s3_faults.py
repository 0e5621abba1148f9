"""Chaos matrix, S3: transient 500/503/SlowDown and connection resets, including inside a multipart upload."""
from __future__ import annotations

import time

import boto3
import pytest

from verl_tasks.models.checkpoint import WEIGHTS
from verl_tasks.phases import PhaseContext
from verl_tasks.runner import make_context, train
from verl_tasks.store import open_store
from verl_tasks.store.units import read_marker

from . import util
from .faulty_proxy import FaultyProxy

pytestmark = [pytest.mark.chaos, pytest.mark.slow]
MULTIPART = 256 << 10


def test_04_s3_transient_failures(reference, moto_endpoint, s3_bucket, monkeypatch):
    # moto returns a multipart object's composite checksum as if it were a full-object one.
    monkeypatch.setenv("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")
    with FaultyProxy(moto_endpoint, seed=util.SEED + 4) as proxy:
        cfg = util.config(f"s3://{s3_bucket}/chaos", **{"storage.endpoint_url": proxy.url})
        s = cfg.storage
        # The store the experiment's config names, tuned through the product's own s3_options: files over
        # 256 KiB go multipart (S3Store.put_file), so the model upload is split in parts the proxy can fail.
        store = open_store(s.uri, endpoint_url=s.endpoint_url, region=s.region, sse=s.sse,
                           sse_kms_key_id=s.sse_kms_key_id, s3_options={"multipart_threshold": MULTIPART})
        ctx = PhaseContext(cfg, store)
        started = time.monotonic()
        train(ctx, util.EPOCHS)
        duration = time.monotonic() - started
    assert proxy.injected.get("multipart", 0) >= 1, proxy.injected
    assert sum(proxy.injected.values()) >= 5, proxy.injected
    # The checks read moto directly: the proxy is closed (only its kept-alive connections would still answer).
    store = make_context(util.config(f"s3://{s3_bucket}/chaos", **{"storage.endpoint_url": moto_endpoint})).store
    assert util.latest_sha(store, ctx.layout) == reference["sha"]
    # The committed weights were uploaded in parts (a multipart object's ETag ends in -<parts>).
    weights = read_marker(store, ctx.layout.snapshot(util.EPOCHS)).key(WEIGHTS)
    head = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").head_object(
        Bucket=s3_bucket, Key=f"chaos/{weights}")
    etag = head["ETag"].strip('"')
    assert head["ContentLength"] > MULTIPART and "-" in etag and etag.rsplit("-", 1)[1].isdigit(), head
    util.assert_exactly_once(store, ctx.layout, cfg)
    redone = util.started_count(store, ctx.layout) - reference["started"]
    assert redone == 0  # every fault was absorbed by the client's retries
    util.record("04_s3_transient", recovery_s=round(duration - reference["duration_s"], 2), redone_units=redone,
                run_s=round(duration, 1), requests=proxy.requests, injected=proxy.injected)
