"""Bad input and secrets: unsafe keys and names, planted pickles, server-side encryption, no leaked credentials."""
from __future__ import annotations

import io
import json
import logging
import os
import pickle
import re
import subprocess
import sys

import pytest

from verl_tasks.errors import ConfigError, IntegrityError, UnsafeKey
from verl_tasks.layout import Layout

from .chaos import util
from .conftest import ROOT

SECRET_ID = "AKIAVTCHAOSKEY7777"
SECRET = "vt-super-secret-9f3a1c-DO-NOT-LOG"


@pytest.mark.parametrize("key", ["../escape", "/etc/passwd", "exp/../../x", "exp/./x", "a//b", "exp\\..\\x", ""])
def test_store_refuses_unsafe_keys(store, key):
    with pytest.raises(UnsafeKey):
        store.put(key, b"x")
    with pytest.raises(UnsafeKey):
        store.get(key)


@pytest.mark.parametrize("name", ["..", "../other", "/abs", "a/b", "exp/..", ""])
def test_experiment_names_that_escape_are_refused(name):
    with pytest.raises(ConfigError):
        Layout(name)
    with pytest.raises(ConfigError):
        util.config("file:///tmp/unused", experiment=name)


@pytest.mark.parametrize("epoch", [-1, 10**6, True, "1"])
def test_rollback_epoch_is_validated(tmp_path, epoch):
    from verl_tasks.ops.rollback import plan_rollback
    from verl_tasks.store import open_store

    with pytest.raises(ConfigError):
        plan_rollback(open_store(f"file://{tmp_path}"), Layout("exp"), epoch)


def test_checkpoint_uri_cannot_climb(tmp_path):
    from verl_tasks.ops.checkpoint import refs

    # Read as root ``<tmp>/store/..`` and experiment ``..``: the name is refused, nothing is created or read.
    refused = re.escape("invalid experiment name '..': use 1-128 characters from letters, digits, '.', '_' and '-', "
                        "starting with a letter or digit, and no '..'")
    with pytest.raises(ConfigError, match=f"^{refused}$"):
        refs(f"file://{tmp_path}/store/../../snapshots/00001")
    assert not (tmp_path / "store").exists()


class Exploit:
    """Unpickling this would create a file: the test proves nothing unpickles it."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_planted_pickle_is_refused(tmp_path):
    from verl_tasks.models.checkpoint import load_policy
    from verl_tasks.ops.checkpoint import SnapshotRef, verify
    from verl_tasks.store import open_store
    from verl_tasks.store.units import UnitWriter

    sentinel = tmp_path / "pwned"
    blob = pickle.dumps(Exploit(str(sentinel)))
    store = open_store(f"file://{tmp_path}/store")
    layout = Layout("exp")
    writer = UnitWriter(store, layout.snapshot(1))
    writer.write_bytes("pytorch_model.bin", blob)
    writer.write_json("config.json", {"model_type": "gpt2"})
    writer.write_json("trainer_state.json", {"version": 1, "epoch": 0, "step": 1})
    writer.commit({"version": 1})
    verdict = verify(SnapshotRef(store, layout, 1))
    assert not verdict.ok and "pickle" in " ".join(verdict.problems)
    folder = tmp_path / "store" / writer.unit / ".attempts" / writer.attempt
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(IntegrityError, match="pickle-based"):
        load_policy(folder)
    assert not sentinel.exists()


@pytest.fixture(scope="module")
def s3_run(moto_endpoint, tmp_path_factory):
    """A tiny run (one epoch) against moto with SSE-S3 and distinctive credentials; logs captured."""
    import boto3

    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    os.environ.update(AWS_ACCESS_KEY_ID=SECRET_ID, AWS_SECRET_ACCESS_KEY=SECRET)
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setLevel(logging.DEBUG)
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.getLogger("verl_tasks").setLevel(logging.DEBUG)
    try:
        bucket = "vt-security"
        boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
        from verl_tasks.runner import make_context, train

        uri = f"s3://{bucket}/sec"
        cfg = util.config(uri, epochs=1, **{"storage.sse": "AES256", "storage.endpoint_url": moto_endpoint})
        ctx = make_context(cfg)
        result = train(ctx, 1)
        folder = tmp_path_factory.mktemp("sec")
        yaml = util.write_config(folder, epochs=1, **{"storage.sse": "AES256", "storage.endpoint_url": moto_endpoint})
        status_out = subprocess.run(
            [sys.executable, "-m", "verl_tasks.cli", "status", str(yaml), "--store", uri, "--json"],
            cwd=ROOT, capture_output=True, text=True, env={**os.environ}, check=True,
        )
        yield {"ctx": ctx, "result": result, "logs": buffer.getvalue(), "status": status_out.stdout + status_out.stderr,
               "status_json": status_out.stdout}
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_every_object_written_uses_the_configured_sse(s3_run):
    store = s3_run["ctx"].store
    keys = store.list("")
    assert len(keys) > 20
    missing = [k for k in keys if store.head(k).get("ServerSideEncryption") != "AES256"]
    assert not missing, missing[:5]


def test_credentials_never_appear_in_logs_or_status(s3_run):
    assert s3_run["logs"], "expected some log output"
    for text in (s3_run["logs"], s3_run["status"], json.dumps(s3_run["result"])):
        assert SECRET not in text and SECRET_ID not in text
    assert json.loads(s3_run["status_json"])["store"].startswith("s3://")
