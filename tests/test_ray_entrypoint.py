"""A Ray job gets its config by reference: the entrypoint names the store, the experiment and
the config hash; the job reads the pinned ``experiment.json`` and refuses a pin that changed.

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
from verl_tasks.pinning import pin_experiment
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
        pinned_config(cfg.storage.uri, "ep-changed", submitted_under, digests=key_digests(cfg.hashed_view()))
    assert refused.value.differing_keys == ["algorithm.lr"]
    with pytest.raises(ConfigMismatch) as unnamed:
        pinned_config(cfg.storage.uri, "ep-changed", submitted_under)
    assert unnamed.value.differing_keys == ["config_hash"]
    args = shlex.split(RayJobBackend(RayTarget("http://127.0.0.1:8265"), pool=False).entrypoint(
        cfg, UnitSpec("ep-changed", "plan", 0)))
    assert main(args[args.index("--store"):]) == 1
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["ok"] is False and result["error"]["type"] == "ConfigMismatch", result
    assert result["unit"] == "ep-changed/epochs/00000/plan", result
    assert result["error"]["fields"]["differing_keys"] == ["algorithm.lr"], result
    assert not store.exists(Layout("ep-changed").unit("plan", 0, None) + "/_SUCCESS")


def test_a_missing_or_altered_pin_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="not pinned"):
        pinned_config(f"file://{tmp_path}/store", "ep-none", "0" * 64)
    cfg, store = _pinned(tmp_path, "ep-altered")
    path = tmp_path / "store" / Layout("ep-altered").experiment_json
    pin = json.loads(path.read_text())
    pin["config"]["algorithm"]["lr"] = 0.9  # the recorded hash no longer describes the config
    path.write_text(json.dumps(pin))
    with pytest.raises(ConfigError, match="altered"):
        pinned_config(cfg.storage.uri, "ep-altered", cfg.config_hash())


def test_a_job_sees_the_newest_run_s_settings_outside_the_hash(tmp_path):
    """Resources, timeouts and trackers are not hashed: a later run that changes them re-writes the pin's
    config (same hash), so a job reading its config by reference runs with them, not the first run's."""
    first, store = _pinned(tmp_path, "ep-unhashed")
    later, _ = _pinned(tmp_path, "ep-unhashed", **{"fault_tolerance.timeout_s": {"rollout": 123},
                                                   "tracking.tensorboard": str(tmp_path / "tb")})
    assert later.config_hash() == first.config_hash()
    got = pinned_config(store.uri, "ep-unhashed", later.config_hash())
    assert got.fault_tolerance.timeout_s.get("rollout") == 123
    assert got.tracking.tensorboard == str(tmp_path / "tb")
