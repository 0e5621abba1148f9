"""Retention never triggers a fallback: a pruned snapshot is unavailable, not corrupt.

``keep_snapshots: 1`` over 4 epochs prunes snapshots 1-3. Rerunning an early
``evaluate`` (its marker removed, as a late Clear does) or seeding a child from
a pruned snapshot must fail with one clear line, quarantine nothing and leave
``latest.json`` where it was; a child from the parent's latest works.
"""
from __future__ import annotations

import pytest

from verl_tasks.config import load_config
from verl_tasks.errors import SnapshotPruned
from verl_tasks.execution.lineage import latest_version, seed_base_from
from verl_tasks.layout import Layout
from verl_tasks.phases.fallback import check_resume_point
from verl_tasks.runner import make_context, run_phase, status, train
from verl_tasks.store.conventions import WEIGHTS, read_latest, write_latest
from verl_tasks.store.units import MARKER, read_marker, verify_unit

from .conftest import TINY_YAML, small_overrides

EPOCHS = 4


@pytest.fixture(scope="module")
def pruned_run(tmp_path_factory):
    """A finished 4-epoch run keeping one snapshot: 1-3 pruned, 4 kept (the base is always kept)."""
    root = tmp_path_factory.mktemp("retention")
    overrides = small_overrides(**{
        "epochs": EPOCHS, "storage.keep_snapshots": 1, "evaluate.every": 1, "evaluate.max_prompts": 8,
        # Retention is all this tests: the smallest run that still has 4 epochs.
        "rollout.batches_per_epoch": 1, "rollout.prompts_per_batch": 4, "algorithm.minibatch_size": 16,
        "data.train_size": 100, "data.eval_size": 16, "model.tiny.warm_start_steps": 50, "quality.enabled": False,
        "storage.uri": f"file://{root}/store"})
    ctx = make_context(load_config(TINY_YAML, overrides))
    train(ctx, EPOCHS)
    return ctx


def quarantine_keys(ctx) -> list[str]:
    return [k for k in ctx.store.list("") if "/.quarantine/" in k]


def test_status_shows_pruned_units_and_the_resume_point_is_left_alone(pruned_run):
    ctx = pruned_run
    st = status(ctx.config, ctx.store)
    states = {e["epoch"]: e["phases"] for e in st["epochs"]}
    assert [states[e]["snapshot"] for e in range(EPOCHS)] == ["pruned", "pruned", "pruned", "committed"]
    assert [states[e]["update"] for e in range(EPOCHS)] == ["pruned", "pruned", "pruned", "committed"]
    assert st["latest_snapshot"]["version"] == EPOCHS and st["quarantined"] == []
    assert check_resume_point(ctx) is None and quarantine_keys(ctx) == []


def test_rerun_of_an_early_evaluate_fails_clearly_and_quarantines_nothing(pruned_run):
    ctx = pruned_run
    latest = ctx.store.get(ctx.layout.latest)
    assert read_marker(ctx.store, ctx.layout.evaluate(0)) is not None
    ctx.store.delete(f"{ctx.layout.evaluate(0)}/{MARKER}")  # a late Clear: the unit runs again, reading snapshot 1
    with pytest.raises(SnapshotPruned) as err:
        run_phase(ctx, "evaluate", 0)
    message = str(err.value)
    assert message == (f"snapshot 1 of {ctx.config.experiment} was pruned by retention (keep_snapshots=1); "
                       f"rerun from snapshot {EPOCHS} (the newest kept) or raise storage.keep_snapshots")
    assert quarantine_keys(ctx) == []
    assert ctx.store.get(ctx.layout.latest) == latest
    assert read_marker(ctx.store, ctx.layout.snapshot(1)) is not None  # still committed, only its weights are gone


def test_latest_never_moves_backwards(pruned_run):
    ctx = pruned_run
    before = ctx.store.get(ctx.layout.latest)
    base = read_marker(ctx.store, ctx.layout.snapshot(0))
    assert not write_latest(ctx.store, ctx.layout, 0, base)
    assert ctx.store.get(ctx.layout.latest) == before


def test_child_from_a_pruned_parent_snapshot_fails_clearly(pruned_run):
    ctx = pruned_run
    latest = ctx.store.get(ctx.layout.latest)
    child = f"{ctx.config.experiment}-child-old"
    with pytest.raises(SnapshotPruned, match=rf"snapshot 2 of {ctx.config.experiment} was pruned by retention "
                                             rf"\(keep_snapshots=1\); rerun from snapshot {EPOCHS}"):
        seed_base_from(ctx.store, child, ctx.config.experiment, 2, seed=1)
    assert quarantine_keys(ctx) == []
    assert ctx.store.get(ctx.layout.latest) == latest
    assert read_marker(ctx.store, Layout(child).snapshot(0)) is None


def test_child_from_the_parent_latest_works(pruned_run):
    ctx = pruned_run
    version = latest_version(ctx.store, ctx.config.experiment)
    assert version == EPOCHS
    child = Layout(f"{ctx.config.experiment}-child")
    seeded = seed_base_from(ctx.store, child.experiment, ctx.config.experiment, version, seed=1)
    record = read_marker(ctx.store, child.snapshot(0))
    parent = read_marker(ctx.store, ctx.layout.snapshot(version))
    assert seeded["parent"]["version"] == version and verify_unit(ctx.store, record) == []
    latest = read_latest(ctx.store, ctx.layout)
    assert record.files[WEIGHTS].sha256 == parent.files[WEIGHTS].sha256 == latest["weights_sha256"]
    assert quarantine_keys(ctx) == []
