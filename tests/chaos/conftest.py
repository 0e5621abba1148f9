"""The fault-free reference run, computed once per session."""
from __future__ import annotations

import time

import pytest

from verl_tasks.runner import make_context, train

from . import util


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """weights_sha256, started-event count and duration of the fault-free chaos config."""
    root = tmp_path_factory.mktemp("reference")
    ctx = make_context(util.config(f"file://{root}/store"))
    started = time.monotonic()
    result = train(ctx, util.EPOCHS)
    return {
        "sha": result["latest_snapshot"]["weights_sha256"],
        "started": util.started_count(ctx.store, ctx.layout),
        "duration_s": time.monotonic() - started,
        "store": root / "store",
        "config": ctx.config,
    }
