"""Operations after a fault: checkpoint verify/inspect/export-hf, rollback, gc, safe mode (CLI and library)."""
from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from verl_tasks.cli import app
from verl_tasks.errors import SafeMode
from verl_tasks.events import read_events
from verl_tasks.models.checkpoint import WEIGHTS
from verl_tasks.runner import make_context, status, train
from verl_tasks.store.units import read_marker

from .chaos import util

runner = CliRunner()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 2-epoch run (snapshots 0, 1, 2); tests copy it before changing anything."""
    root = tmp_path_factory.mktemp("ops")
    cfg = util.config(f"file://{root}/store")
    result = train(make_context(cfg), util.EPOCHS)
    return {"root": root / "store", "sha": result["latest_snapshot"]["weights_sha256"], "experiment": cfg.experiment}


@pytest.fixture
def copy(trained, tmp_path):
    """A private copy of the trained store, its config, a context and a YAML file for the CLI."""
    shutil.copytree(trained["root"], tmp_path / "store")
    uri = f"file://{tmp_path}/store"
    ctx = make_context(util.config(uri))
    return {"uri": uri, "ctx": ctx, "yaml": str(util.write_config(tmp_path)),
            "exp_uri": f"{uri}/{ctx.config.experiment}"}


def invoke(*args: str, input: str | None = None):
    return runner.invoke(app, list(args), input=input)


def weights_path(ctx, version: int):
    rec = read_marker(ctx.store, ctx.layout.snapshot(version))
    return ctx.store.root / rec.key(WEIGHTS)


def test_verify_every_snapshot_ok_then_detects_truncation(copy):
    result = invoke("checkpoint", "verify", copy["exp_uri"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 3 and all(line.startswith("OK") for line in lines), result.output

    path = weights_path(copy["ctx"], 2)
    path.write_bytes(path.read_bytes()[:1000])
    result = invoke("checkpoint", "verify", copy["exp_uri"] + "/snapshots/00002")
    assert result.exit_code == 1
    assert result.output.startswith("FAILED") and "model.safetensors" in result.output
    result = invoke("checkpoint", "verify", copy["exp_uri"], "--json")
    assert result.exit_code == 1
    assert [v["state"] for v in json.loads(result.output)] == ["OK", "OK", "FAILED"]


def test_verify_unknown_snapshot_fails(copy):
    result = invoke("checkpoint", "verify", copy["exp_uri"] + "/snapshots/00009")
    assert result.exit_code == 1 and result.output.startswith("ABSENT")


def test_inspect(copy, trained):
    result = invoke("checkpoint", "inspect", copy["exp_uri"] + "/snapshots/00002")
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["version"] == 2 and info["epoch"] == 1 and info["step"] > 0
    assert info["parent_version"] == 1 and info["parent"].endswith("/snapshots/00001")
    assert info["config_hash"] == copy["ctx"].config.config_hash()
    assert info["weights_sha256"] == trained["sha"]
    assert info["sizes"][WEIGHTS] > 0 and "reward_mean" in info["metrics"]


def test_export_hf_loads_with_transformers(copy, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = tmp_path / "hf"
    result = invoke("checkpoint", "export-hf", copy["exp_uri"] + "/snapshots/00002", str(target))
    assert result.exit_code == 0, result.output
    assert not (target / "optimizer.safetensors").exists()
    model = AutoModelForCausalLM.from_pretrained(target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    saved = load_file(str(weights_path(copy["ctx"], 2)))
    for name, tensor in model.state_dict().items():
        if name in saved:
            assert torch.equal(tensor, saved[name]), name
    assert tokenizer("1+2=")["input_ids"]
    again = invoke("checkpoint", "export-hf", copy["exp_uri"] + "/snapshots/00002", str(target))
    assert again.exit_code == 2 and "not empty" in again.output


def test_rollback_then_run_reproduces_the_same_weights_and_gc(copy, trained):
    ctx = copy["ctx"]
    layout, store = ctx.layout, ctx.store
    before = set(util.markers(store, layout))

    asked = invoke("rollback", copy["yaml"], "--store", copy["uri"], "--to-epoch", "0", input="n\n")
    assert asked.exit_code == 1 and "aborted" in asked.output
    assert layout.update(1) in asked.output and layout.snapshot(2) in asked.output
    assert set(util.markers(store, layout)) == before

    done = invoke("rollback", copy["yaml"], "--store", copy["uri"], "--to-epoch", "0", "--yes")
    assert done.exit_code == 0, done.output
    left = set(util.markers(store, layout))
    assert not [u for u in left if "/epochs/00001/" in u] and layout.snapshot(2) not in left
    assert layout.snapshot(1) in left and layout.update(0) in left
    assert json.loads(store.get(layout.latest))["version"] == 1
    assert store.list(layout.tombstones + "/")
    st = status(ctx.config, store)
    assert [e["epoch"] for e in st["epochs"]] == [0]  # epoch 1 reads as never run

    started = util.started_count(store, layout)
    result = train(ctx, util.EPOCHS)
    assert result["latest_snapshot"]["weights_sha256"] == trained["sha"]
    util.assert_exactly_once(store, layout, ctx.config)
    redone = util.started_count(store, layout) - started
    # plan, rollouts, scores, validate+update+snapshot, evaluate
    assert redone == 1 + 2 * ctx.config.rollout.batches_per_epoch + 3 + 1
    # gc: the rolled-back attempts are kept while the tombstone is young, removed after.
    dry = invoke("gc", copy["yaml"], "--store", copy["uri"], "--older-than", "1h", "--dry-run")
    assert dry.exit_code == 0 and "tombstone" not in dry.output
    dry = invoke("gc", copy["yaml"], "--store", copy["uri"], "--older-than", "0s", "--dry-run")
    assert "tombstone" in dry.output and "/epochs/00001/update/.attempts/" in dry.output
    assert store.list(layout.tombstones + "/")
    gone = invoke("gc", copy["yaml"], "--store", copy["uri"], "--older-than", "0s")
    assert gone.exit_code == 0, gone.output
    assert not store.list(layout.tombstones + "/")
    assert invoke("checkpoint", "verify", copy["exp_uri"]).exit_code == 0
    started = util.started_count(store, layout)
    train(ctx, util.EPOCHS)
    assert util.started_count(store, layout) == started


def test_a_rollback_that_died_before_repointing_latest_is_finished_by_a_rerun(tiny_config, tmp_path, monkeypatch):
    """Every marker moved, ``latest.json`` not yet: the rerun finds no unit but must still repoint it."""
    from tests.conftest import small_overrides, write_yaml
    from tests.test_metrics import fabricate
    from verl_tasks.ops import rollback as ops

    cfg = tiny_config(epochs=3, **{"evaluate.every": 1})
    fabricate(cfg, 3)
    ctx = make_context(cfg)
    yaml, uri = str(write_yaml(tmp_path, small_overrides(epochs=3, **{"evaluate.every": 1}))), cfg.storage.uri
    real = ops.write_latest

    def dies_once(*args, **kwargs):
        monkeypatch.setattr(ops, "write_latest", real)
        raise OSError("killed before repointing latest.json")

    monkeypatch.setattr(ops, "write_latest", dies_once)
    died = invoke("rollback", yaml, "--store", uri, "--to-epoch", "0", "--yes")
    assert isinstance(died.exception, OSError)
    assert json.loads(ctx.store.get(ctx.layout.latest))["version"] == 3
    assert not ops.plan_rollback(ctx.store, ctx.layout, 0).units
    done = invoke("rollback", yaml, "--store", uri, "--to-epoch", "0", "--yes")
    assert done.exit_code == 0 and "nothing to invalidate" not in done.output, done.output
    assert json.loads(ctx.store.get(ctx.layout.latest))["version"] == 1
    again = invoke("rollback", yaml, "--store", uri, "--to-epoch", "0", "--yes")
    assert again.exit_code == 0 and "nothing to invalidate" in again.output, again.output


def test_rollback_refuses_bad_epochs(copy):
    """Exit code 2 is also Click's usage error: the product's own message must name the problem and the fix,
    and the refused rollback must leave every commit, ``latest.json`` and the tombstones as they were."""
    ctx = copy["ctx"]
    store, layout = ctx.store, ctx.layout

    def committed() -> dict[str, bytes]:
        return {k: store.get(k) for k in store.list(layout.root + "/") if k.endswith("/_SUCCESS")}

    before, latest = committed(), store.get(layout.latest)
    assert before and json.loads(latest)["version"] == util.EPOCHS
    from verl_tasks.layout import MAX_EPOCH

    refusals = {
        "-1": rf"error: --to-epoch must be an integer in [0, {MAX_EPOCH}], got -1",
        "7": "error: snapshot 8 (the output of epoch 7) is not committed; roll back to an earlier epoch",
    }
    for bad, message in refusals.items():
        result = invoke("rollback", copy["yaml"], "--store", copy["uri"], "--to-epoch", bad, "--yes")
        assert result.exit_code == 2, result.output
        assert message in " ".join(result.output.split()), result.output
        assert "Usage:" not in result.output and "Traceback" not in result.output, result.output
        assert committed() == before, "a refused rollback moved a marker"
        assert store.get(layout.latest) == latest
        assert not store.list(layout.tombstones + "/")


def test_gc_removes_crashed_attempts_only_when_old(copy):
    ctx = copy["ctx"]
    store, layout = ctx.store, ctx.layout
    store.put(f"{layout.plan(0)}/.attempts/20200101T000000-deadbeef00/plan.json", b"{}")
    store.put(f"{layout.plan(1)}/.attempts/29990101T000000-feedbeef00/plan.json", b"{}")
    result = invoke("gc", copy["yaml"], "--store", copy["uri"], "--older-than", "1h")
    assert result.exit_code == 0, result.output
    assert "20200101T000000-deadbeef00" in result.output and "29990101" not in result.output
    assert not store.list(f"{layout.plan(0)}/.attempts/20200101T000000-deadbeef00/")
    assert store.list(f"{layout.plan(1)}/.attempts/29990101T000000-feedbeef00/")
    assert invoke("checkpoint", "verify", copy["exp_uri"]).exit_code == 0


def test_escalate_enters_safe_mode_and_resume_leaves_it(copy):
    from verl_tasks.ops.safe_mode import escalate

    ctx = copy["ctx"]
    summary = escalate(ctx.config, [{"unit": ctx.layout.update(2), "error": "OOM", "try_number": 4}],
                       "update failed after 3 retries", config_path=copy["yaml"])
    assert "update failed after 3 retries" in summary["summary"] and "verl-tasks resume" in summary["what_to_do"]
    with pytest.raises(SafeMode, match="safe mode"):
        train(make_context(util.config(copy["uri"], epochs=3)), 3)
    assert status(ctx.config, ctx.store)["safe_mode"]["reason"] == "update failed after 3 retries"
    shown = invoke("status", copy["yaml"], "--store", copy["uri"])
    assert "SAFE MODE" in shown.output
    result = invoke("resume", copy["yaml"], "--store", copy["uri"])
    assert result.exit_code == 0 and "left safe mode" in result.output
    assert status(ctx.config, ctx.store)["safe_mode"] is None
    kinds = [e["kind"] for e in read_events(ctx.store, ctx.layout)]
    assert kinds.index("safe_mode") < kinds.index("resumed")
    assert "was not in safe mode" in invoke("resume", copy["yaml"], "--store", copy["uri"]).output


def test_resume_point_is_verified_and_a_corrupt_snapshot_is_recomputed(copy, trained):
    from verl_tasks.phases.fallback import check_resume_point

    ctx = copy["ctx"]
    path = weights_path(ctx, 2)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    info = check_resume_point(ctx)
    assert info["fell_back_to"] == 1 and info["quarantined"] == [ctx.layout.snapshot(2)]
    st = status(ctx.config, ctx.store)
    assert st["latest_snapshot"]["version"] == 1 and "quarantined" in st["warnings"][0]
    shown = " ".join(invoke("status", copy["yaml"], "--store", copy["uri"]).output.split())
    assert f"warning: {ctx.layout.snapshot(2)} was quarantined" in shown, shown
    started = util.started_count(ctx.store, ctx.layout)
    assert train(ctx, util.EPOCHS)["latest_snapshot"]["weights_sha256"] == trained["sha"]
    assert util.started_count(ctx.store, ctx.layout) - started == 1  # only the snapshot copy is redone


def test_inspect_takes_the_config_hash_from_the_pin_and_reports_a_damaged_pin_at_warning(tmp_path, caplog):
    import logging

    from verl_tasks.layout import Layout
    from verl_tasks.ops.checkpoint import SnapshotRef, inspect
    from verl_tasks.store import LocalStore
    from verl_tasks.store.units import UnitWriter

    store, layout = LocalStore(tmp_path / "store"), Layout("exp")
    writer = UnitWriter(store, layout.snapshot(1))  # no trainer_state.json: the hash comes from the pin
    writer.write_bytes(WEIGHTS, b"weights")
    writer.commit({"metrics": {"reward_mean": 0.5}})
    ref = SnapshotRef(store, layout, 1)
    with caplog.at_level(logging.WARNING, logger="verl_tasks.ops.checkpoint"):
        assert inspect(ref)["config_hash"] is None  # nothing pinned: nothing to say
        store.put(layout.experiment_json, json.dumps({"config_hash": "abc123"}).encode())
        assert inspect(ref)["config_hash"] == "abc123"
        assert not caplog.records
        store.put(layout.experiment_json, b'{"config_ha')  # damaged
        info = inspect(ref)
    assert info["config_hash"] is None and info["metrics"] == {"reward_mean": 0.5}  # the rest is reported
    [warning] = [r for r in caplog.records if r.name == "verl_tasks.ops.checkpoint"]
    assert warning.levelno == logging.WARNING
    assert f"config hash of {layout.snapshot(1)} not reported" in warning.getMessage()
    assert "experiment.json is damaged (JSONDecodeError)" in warning.getMessage(), warning.getMessage()
