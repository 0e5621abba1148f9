"""Chaos matrix, S3: transient 500/503/SlowDown and connection resets, including inside a multipart upload."""
from __future__ import annotations

import time

import pytest
from boto3.s3.transfer import TransferConfig

from verl_tasks.runner import make_context, train

from . import util
from .faulty_proxy import FaultyProxy

pytestmark = [pytest.mark.chaos, pytest.mark.slow]


def test_04_s3_transient_failures(reference, moto_endpoint, s3_bucket, monkeypatch):
    # moto returns a multipart object's composite checksum as if it were a full-object one.
    monkeypatch.setenv("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")
    with FaultyProxy(moto_endpoint, seed=util.SEED + 4) as proxy:
        cfg = util.config(f"s3://{s3_bucket}/chaos", **{"storage.endpoint_url": proxy.url})
        ctx = make_context(cfg)
        # Files over 256 KiB go multipart, so the model upload is split in parts the proxy can fail.
        small = TransferConfig(multipart_threshold=256 << 10, multipart_chunksize=256 << 10)
        store = ctx.store

        def put_file(key, path):
            store.client.upload_file(str(path), store.bucket, store._key(key),
                                     ExtraArgs=dict(store.sse_args) or None, Config=small)

        store.put_file = put_file
        started = time.monotonic()
        train(ctx, util.EPOCHS)
        duration = time.monotonic() - started
    assert proxy.injected.get("multipart", 0) >= 1, proxy.injected
    assert sum(proxy.injected.values()) >= 5, proxy.injected
    # The checks read moto directly: the proxy is closed (only its kept-alive connections would still answer).
    store = make_context(util.config(f"s3://{s3_bucket}/chaos", **{"storage.endpoint_url": moto_endpoint})).store
    assert util.latest_sha(store, ctx.layout) == reference["sha"]
    util.assert_exactly_once(store, ctx.layout, cfg)
    redone = util.started_count(store, ctx.layout) - reference["started"]
    assert redone == 0  # every fault was absorbed by the client's retries
    util.record("04_s3_transient", recovery_s=round(duration - reference["duration_s"], 2), redone_units=redone,
                run_s=round(duration, 1), requests=proxy.requests, injected=proxy.injected)
