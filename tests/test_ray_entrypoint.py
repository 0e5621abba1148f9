"""A Ray job gets its config by reference: the entrypoint names the store, the experiment, the config
hash and the digest of the whole config; the job reads its submitter's config (``configs/<digest>.json``)
and refuses to run when the experiment's pin changed.

No Ray head here: ``tests/airflow/test_ray_backend.py`` checks the same on a real cluster."""
from __future__ import annotations

import base64
import json
import shlex
from types import SimpleNamespace

import pytest

from tests.airflow.conftest import DAGS
from verl_tasks.config import load_config
from verl_tasks.errors import ConfigError, ConfigMismatch
from verl_tasks.execution import UnitSpec
from verl_tasks.execution.entry import key_digests, main, pinned_config, public_location
from verl_tasks.execution.ray_jobs import RayJobBackend, RayTarget
from verl_tasks.layout import Layout
from verl_tasks.pinning import pin_experiment, publish_run_config, run_config_body
from verl_tasks.store import store_for

TINY = str(DAGS / "experiments" / "tiny_arith.yaml")
TRACKING = "https://mlflow.internal.example:5000/vt-tracking-7f3a"
KMS = "arn:aws:kms:eu-west-1:111122223333:key/vt-kms-0b9d-never-on-ray"


def _pinned(tmp_path, name="ep-1", **overrides):
    cfg = load_config(TINY, {"experiment": name, "storage.uri": f"file://{tmp_path}/store", **overrides})
    store = store_for(cfg)
    pin_experiment(SimpleNamespace(config=cfg, store=store, layout=Layout(name)))
    return cfg, store


def test_the_entrypoint_names_the_pin_and_nothing_of_the_config():
    cfg = load_config(TINY, {"experiment": "ep-s3", "storage.uri": "s3://vt-bucket/prefix",
                             "storage.endpoint_url": "https://ops:hunter2@minio.internal:9000",
                             "storage.sse": "aws:kms", "storage.sse_kms_key_id": KMS, "tracking.mlflow": TRACKING})
    entrypoint = RayJobBackend(RayTarget("http://127.0.0.1:8265"), pool=True).entrypoint(
        cfg, UnitSpec("ep-s3", "rollout", 3, 7))
    args = shlex.split(entrypoint)
    assert args[args.index("--store") + 1] == "s3://vt-bucket/prefix"
    assert args[args.index("--experiment") + 1] == "ep-s3"
    assert args[args.index("--config-hash") + 1] == cfg.config_hash()
    assert args[args.index("--config-digest") + 1] == run_config_body(cfg)[0]
    assert args[args.index("--endpoint-url") + 1] == "https://minio.internal:9000"
    for secret in (TRACKING, "mlflow.internal", KMS, "vt-kms", "hunter2", "ops:", "--config-b64"):
        assert secret not in entrypoint, secret
    for arg in args:  # no argument decodes to a config
        try:
            decoded = base64.urlsafe_b64decode(arg + "=" * (-len(arg) % 4))
        except ValueError:
            continue
        assert b"experiment" not in decoded and b"storage" not in decoded, arg
    assert len(entrypoint) < 600  # names and hashes only


def test_public_location_drops_userinfo():
    assert public_location("https://u:p@host:9000/x") == "https://host:9000/x"
    assert public_location("s3://bucket/prefix") == "s3://bucket/prefix"
    assert public_location(None) is None


def test_the_job_reads_the_pin_and_runs_a_unit(tmp_path, capsys):
    cfg, store = _pinned(tmp_path, "ep-run", **{"tracking.tensorboard": str(tmp_path / "tb")})
    args = shlex.split(RayJobBackend(RayTarget("http://127.0.0.1:8265"), pool=False).entrypoint(
        cfg, UnitSpec("ep-run", "plan", 0)))
    assert main(args[args.index("--store"):]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["ok"] is True, result
    assert store.exists(Layout("ep-run").unit("plan", 0, None) + "/_SUCCESS")


def test_a_changed_pin_is_refused(tmp_path, capsys):
    cfg, store = _pinned(tmp_path, "ep-changed")
    submitted_under = cfg.config_hash()
    # Re-pinned meanwhile (nothing but the prelude committed): the job must not run under the new config.
    other = load_config(TINY, {"experiment": "ep-changed", "storage.uri": f"file://{tmp_path}/store",
                               "algorithm.lr": 0.5})
    pin_experiment(SimpleNamespace(config=other, store=store, layout=Layout("ep-changed")))
    with pytest.raises(ConfigMismatch) as refused:
        pinned_config(cfg.storage.uri, "ep-changed", submitted_under, run_config_body(cfg)[0],
                      digests=key_digests(cfg.hashed_view()))
    assert refused.value.differing_keys == ["algorithm.lr"]
    with pytest.raises(ConfigMismatch) as unnamed:
        pinned_config(cfg.storage.uri, "ep-changed", submitted_under, run_config_body(cfg)[0])
    assert unnamed.value.differing_keys == ["config_hash"]
    args = shlex.split(RayJobBackend(RayTarget("http://127.0.0.1:8265"), pool=False).entrypoint(
        cfg, UnitSpec("ep-changed", "plan", 0)))
    assert main(args[args.index("--store"):]) == 1
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["ok"] is False and result["error"]["type"] == "ConfigMismatch", result
    assert result["unit"] == "ep-changed/epochs/00000/plan", result
    assert result["error"]["fields"]["differing_keys"] == ["algorithm.lr"], result
    assert not store.exists(Layout("ep-changed").unit("plan", 0, None) + "/_SUCCESS")


def test_a_missing_pin_or_a_missing_or_altered_run_config_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="not pinned"):
        pinned_config(f"file://{tmp_path}/store", "ep-none", "0" * 64, "0" * 64)
    cfg, store = _pinned(tmp_path, "ep-altered")
    digest = run_config_body(cfg)[0]
    other = load_config(TINY, {"experiment": "ep-altered", "storage.uri": f"file://{tmp_path}/store",
                               "torch_threads": 1})
    with pytest.raises(ConfigError, match="does not exist: the run's config is published before"):
        pinned_config(cfg.storage.uri, "ep-altered", cfg.config_hash(), run_config_body(other)[0])
    with pytest.raises(ConfigError, match="is not a config digest"):
        pinned_config(cfg.storage.uri, "ep-altered", cfg.config_hash(), "../experiment")
    # A published config, untouched, of another hash: not the one the pin and the job name.
    assert other.config_hash() != cfg.config_hash()
    publish_run_config(store, Layout("ep-altered"), other)
    with pytest.raises(ConfigError, match=f"with config hash {other.config_hash()[:12]}, not 'ep-altered' with"):
        pinned_config(cfg.storage.uri, "ep-altered", cfg.config_hash(), run_config_body(other)[0])
    path = tmp_path / "store" / Layout("ep-altered").run_config(digest)
    body = json.loads(path.read_text())
    body["algorithm"]["lr"] = 0.9
    path.write_text(json.dumps(body))
    with pytest.raises(ConfigError, match="does not hash to its name: it was altered"):
        pinned_config(cfg.storage.uri, "ep-altered", cfg.config_hash(), digest)


def test_each_job_runs_with_its_own_run_s_settings_outside_the_hash(tmp_path):
    """Resources, timeouts and trackers are not hashed: two runs of one experiment that set them differently
    share the pin (same hash), and each one's jobs run with that run's settings, whichever pinned last."""
    first, store = _pinned(tmp_path, "ep-unhashed")
    later, _ = _pinned(tmp_path, "ep-unhashed", **{"fault_tolerance.timeout_s": {"rollout": 123},
                                                   "tracking.tensorboard": str(tmp_path / "tb")})
    assert later.config_hash() == first.config_hash()
    got = pinned_config(store.uri, "ep-unhashed", later.config_hash(), run_config_body(later)[0])
    assert got.fault_tolerance.timeout_s.get("rollout") == 123
    assert got.tracking.tensorboard == str(tmp_path / "tb")
    earlier = pinned_config(store.uri, "ep-unhashed", first.config_hash(), run_config_body(first)[0])
    assert earlier.fault_tolerance.timeout_s.get("rollout") is None and earlier.tracking.tensorboard is None
    assert earlier.model_dump(mode="json") == first.model_dump(mode="json")
