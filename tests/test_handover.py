"""Where a rollout or evaluation worker gets a policy's weights: Ray's object store when the update handed
them over under the committed checksum, else the store, which it reads for weights and configs only
(never the optimizer state), keeping a bounded number of versions on disk."""
from __future__ import annotations

import os
import time

import pytest
import torch
from safetensors.torch import load_file

from verl_tasks.models import handover
from verl_tasks.models.safetensors_io import unique_state, write_tensors
from verl_tasks.phases import common
from verl_tasks.runner import make_context, run_phase
from verl_tasks.store.conventions import WEIGHTS
from verl_tasks.store.units import CommitRecord, FileEntry, read_marker


@pytest.fixture(scope="module")
def local_ray():
    """A private local Ray for this module (the handover lives in its object store)."""
    import ray
    from ray._private.authentication_test_utils import reset_auth_token_state

    if ray.is_initialized():
        ray.shutdown()
    with pytest.MonkeyPatch.context() as mp:
        for key in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_TMPDIR", "RAY_ADDRESS"):
            mp.delenv(key, raising=False)
        reset_auth_token_state()
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        yield
        ray.shutdown()


def _model():
    from verl_tasks.config import TinyModelConfig
    from verl_tasks.models.tiny import build_model, build_tokenizer

    return build_model(TinyModelConfig(hidden_size=64, num_layers=1, num_heads=2, intermediate_size=64),
                       len(build_tokenizer()), seed=5)


def _record(sha: str) -> CommitRecord:
    return CommitRecord("exp/epochs/00000/update", "a1", {WEIGHTS: FileEntry(1, sha)})


def test_handed_over_weights_are_used_only_under_the_checksum_they_were_written_under(local_ray, tiny_config,
                                                                                      tmp_path):
    config = tiny_config()
    named = unique_state(_model())
    written = write_tensors(tmp_path / WEIGHTS, named, {"format": "pt"})
    handle = handover.put_weights(named, written.sha256)
    assert handle is not None
    assert handover.fetch(config, _record(written.sha256)) is None  # nothing registered yet

    assert handover.publish_weights(make_context(config), _record(written.sha256), handle)
    got = handover.fetch(config, _record(written.sha256))
    assert got is not None and got.keys() == dict(named).keys()
    assert all(torch.equal(got[name], tensor) for name, tensor in named)
    assert handover.fetch(config, _record("0" * 64)) is None  # another committed checksum: the store decides

    folder = handover.materialize(got, _record(written.sha256), tmp_path)  # an engine that loads files
    assert folder is not None and handover.local_folder(_record(written.sha256)) == folder
    assert all(torch.equal(load_file(str(folder / WEIGHTS))[name], tensor) for name, tensor in named)
    # Weights that do not hash to what the record lists are not kept (the caller reads the store).
    assert handover.materialize(got, _record("f" * 64), tmp_path) is None
    assert handover.local_folder(_record("f" * 64)) is None


def test_readers_download_weights_and_configs_only_and_keep_a_few_versions(tiny_config, moto_endpoint, s3_bucket,
                                                                           tmp_path, monkeypatch):
    """On S3 a rollout or evaluation node never downloads AdamW state; the update does. The node keeps the
    newest ``POLICY_CACHE_KEEP`` policy folders."""
    monkeypatch.setattr(common, "CACHE_DIR", tmp_path / "cache")
    config = tiny_config(f"s3://{s3_bucket}/p", **{"storage.endpoint_url": moto_endpoint, "epochs": 1,
                                                   "model.tiny.warm_start_steps": 20})
    ctx = make_context(config)
    for phase in ("plan", "rollout", "score", "validate", "update", "snapshot"):
        for batch in (range(config.rollout.batches_per_epoch) if phase in ("rollout", "score") else [None]):
            run_phase(ctx, phase, 0, batch)
    record = read_marker(ctx.store, ctx.layout.snapshot(1))
    assert any(name.startswith("optimizer.") for name in record.files)
    for stale in range(common.POLICY_CACHE_KEEP + 2):  # older folders of earlier versions on this node
        old = tmp_path / "cache" / "policies" / f"{stale:064x}"
        old.mkdir(parents=True)
        os.utime(old, (stale, stale))
    folder, _ = common.policy_folder(ctx, 1)
    names = {p.name for p in folder.iterdir()}
    assert WEIGHTS in names and "config.json" in names
    assert not {n for n in names if n.startswith("optimizer.")}, names
    assert len(list(folder.parent.iterdir())) == common.POLICY_CACHE_KEEP
    folder, _ = common.policy_folder(ctx, 1, optimizer=True)  # what the update reads
    assert {n for n in record.files if n.startswith("optimizer.")} <= {p.name for p in folder.iterdir()}


def test_handed_over_folders_in_use_or_recent_are_never_pruned(tmp_path, monkeypatch):
    """Past the newest ``HANDOVER_KEEP``, only a folder unused for ``HANDOVER_MIN_AGE_S`` is pruned: one that
    a reader found again (``local_folder``) counts as new, so an engine of another experiment on this node
    never loses the folder it loads from."""
    from verl_tasks import local_cache

    monkeypatch.setattr(local_cache, "CACHE_DIR", tmp_path / "cache")
    named = unique_state(_model())
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "config.json").write_text("{}")
    old = time.time() - handover.HANDOVER_MIN_AGE_S - 60
    records = []
    for version in range(3):  # three older versions, all past the age
        tensors = {name: tensor + version for name, tensor in named}
        sha = write_tensors(tmp_path / f"w{version}", list(tensors.items()), {"format": "pt"}).sha256
        records.append(_record(sha))
        assert handover.materialize(tensors, records[-1], configs) is not None  # recent: none pruned yet
    for version, record in enumerate(records):
        os.utime(tmp_path / "cache" / "handover" / record.files[WEIGHTS].sha256, (old + version, old + version))
    assert handover.local_folder(records[0]) is not None  # version 0 read again: now the newest
    tensors = {name: tensor + 9 for name, tensor in named}
    newest = _record(write_tensors(tmp_path / "w9", list(tensors.items()), {"format": "pt"}).sha256)
    assert handover.materialize(tensors, newest, configs) is not None
    kept = {r.files[WEIGHTS].sha256 for r in records if handover.local_folder(r) is not None}
    assert kept == {records[0].files[WEIGHTS].sha256}, kept  # 1 and 2 were the oldest, unused and aged
    assert not [p for p in (tmp_path / "cache" / "handover").iterdir() if p.name.startswith(".pruned-")]
