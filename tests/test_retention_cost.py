"""Retention on a long run: each pass looks only at versions its watermark has not settled.

A run of thousands of epochs must not pay one existence check (an S3 HEAD) per
older version per epoch; the watermark in ``snapshots/retention.json`` says which
versions are pruned for good. A pass that died half way, and a rollback that
brings pruned versions back unpruned, must still end with every version the
window and ``keep_best_by`` do not protect pruned.
"""
from __future__ import annotations

import pytest

from tests.test_metrics import fabricate
from verl_tasks.ops.rollback import apply_rollback, plan_rollback
from verl_tasks.phases.snapshot import apply_retention, prune, retain_after_evaluate, snapshot
from verl_tasks.runner import make_context
from verl_tasks.store.conventions import read_best, read_retention
from verl_tasks.store.units import MARKER, UnitWriter, is_pruned


def counting(store, monkeypatch) -> list[str]:
    """Every key the store is asked about (get and exists) from now on."""
    calls: list[str] = []
    cls = type(store)
    get, exists = cls.get, cls.exists
    monkeypatch.setattr(cls, "get", lambda self, key: (calls.append(key), get(self, key))[1])
    monkeypatch.setattr(cls, "exists", lambda self, key: (calls.append(key), exists(self, key))[1])
    return calls


def pruned_versions(ctx, newest: int) -> list[int]:
    return [v for v in range(1, newest + 1) if is_pruned(ctx.store, ctx.layout.snapshot(v))]


def test_a_pass_costs_the_same_at_epoch_40_as_at_epoch_10(tiny_config, monkeypatch):
    cfg = tiny_config(epochs=40, **{"storage.keep_snapshots": 2, "evaluate.every": 0})
    fabricate(cfg, 40)
    ctx = make_context(cfg)
    calls = counting(ctx.store, monkeypatch)
    per_pass = {}
    for newest in range(1, 41):
        calls.clear()
        apply_retention(ctx, newest)
        per_pass[newest] = len(calls)
    assert pruned_versions(ctx, 40) == list(range(1, 39))
    assert read_retention(ctx.store, ctx.layout) == (38, set())
    assert per_pass[40] == per_pass[10], per_pass
    calls.clear()
    assert apply_retention(ctx, 40) == []
    assert not [k for k in calls if k.endswith("/_SUCCESS") or k.endswith("/_PRUNED")], calls


def test_an_update_left_unpruned_by_a_dead_pass_is_pruned_by_the_next(tiny_config):
    cfg = tiny_config(epochs=4, **{"storage.keep_snapshots": 1, "evaluate.every": 0})
    fabricate(cfg, 4)
    ctx = make_context(cfg)
    # The pass died between the snapshot's flag and its update unit's: no watermark written.
    assert prune(ctx, ctx.layout.snapshot(1), "retention: keep 1 snapshots")
    assert not is_pruned(ctx.store, ctx.layout.update(0))
    assert apply_retention(ctx, 4) == [2, 3]
    assert all(is_pruned(ctx.store, ctx.layout.update(e)) for e in range(3))
    assert not is_pruned(ctx.store, ctx.layout.update(3))


def test_a_lost_watermark_costs_one_full_pass_and_keeps_what_it_must(tiny_config):
    cfg = tiny_config(epochs=6, **{"storage.keep_snapshots": 2, "evaluate.every": 0})
    fabricate(cfg, 6)
    ctx = make_context(cfg)
    apply_retention(ctx, 6)
    ctx.store.put(ctx.layout.retention, b"not json")
    assert read_retention(ctx.store, ctx.layout) == (0, set())
    assert apply_retention(ctx, 6) == []
    assert read_retention(ctx.store, ctx.layout) == (4, set())
    assert pruned_versions(ctx, 6) == [1, 2, 3, 4]


def test_rolled_back_versions_are_pruned_again_once_recommitted(tiny_config):
    """``keep_best_by`` keeps snapshot 1 (ties go to the older version) inside the watermark, so a
    rollback to epoch 0 un-commits versions the watermark had settled as pruned."""
    cfg = tiny_config(epochs=6, **{"storage.keep_snapshots": 1, "storage.keep_best_by": "eval_accuracy",
                                   "evaluate.every": 1})
    fabricate(cfg, 6)
    ctx = make_context(cfg)
    assert apply_retention(ctx, 6) == [2, 3, 4, 5]
    assert read_retention(ctx.store, ctx.layout) == (5, {1})
    apply_rollback(ctx.store, ctx.layout, plan_rollback(ctx.store, ctx.layout, 0))
    assert read_retention(ctx.store, ctx.layout) == (0, set())
    fabricate(cfg, 6)  # the rerun commits epochs 1-5 again, snapshots with their weights
    assert pruned_versions(ctx, 6) == []
    assert apply_retention(ctx, 6) == [2, 3, 4, 5]


def test_a_version_awaiting_its_evaluation_is_kept_without_keep_best_by(tiny_config):
    """In Airflow evaluate is a side branch: a later snapshot's pass may come first. Pruning then
    would fail that evaluate with SnapshotPruned on every retry."""
    cfg = tiny_config(epochs=3, **{"storage.keep_snapshots": 1, "evaluate.every": 1})
    fabricate(cfg, 3)
    ctx = make_context(cfg)
    marker = f"{ctx.layout.evaluate(0)}/{MARKER}"
    body = ctx.store.get(marker)
    ctx.store.delete(marker)  # evaluate(0) has not committed yet
    assert apply_retention(ctx, 3) == [2]
    assert not is_pruned(ctx.store, ctx.layout.snapshot(1)) and not is_pruned(ctx.store, ctx.layout.update(0))
    assert read_retention(ctx.store, ctx.layout) == (2, {1})
    ctx.store.put(marker, body)  # it commits
    assert retain_after_evaluate(ctx) == [1]
    assert pruned_versions(ctx, 3) == [1, 2] and read_retention(ctx.store, ctx.layout) == (2, set())


def test_a_rerun_of_an_old_snapshot_leaves_best_at_the_newest_version(tiny_config):
    """Snapshot 3 rerun (a Clear) after the run ended: its pass must rank every unsettled version, not those up to 3."""
    cfg = tiny_config(epochs=4, **{"storage.keep_snapshots": 2, "storage.keep_best_by": "eval_accuracy",
                                   "evaluate.every": 1})
    fabricate(cfg, 4)
    ctx = make_context(cfg)
    ctx.store.delete(f"{ctx.layout.evaluate(3)}/{MARKER}")
    writer = UnitWriter(ctx.store, ctx.layout.evaluate(3))
    writer.write_bytes("data.json", b"{}")
    writer.commit({"metrics": {"eval_accuracy": 0.9}})  # the newest version is the best
    assert apply_retention(ctx, 4) == [1, 2]
    best = read_best(ctx.store, ctx.layout)
    assert best["version"] == 4
    snapshot(ctx, 2)
    assert read_best(ctx.store, ctx.layout) == best and pruned_versions(ctx, 4) == [1, 2]


def test_a_pass_killed_after_the_pruned_flag_deletes_the_weights_on_the_next(tiny_config, monkeypatch):
    cfg = tiny_config(epochs=3, **{"storage.keep_snapshots": 1, "evaluate.every": 0})
    fabricate(cfg, 3)
    ctx = make_context(cfg)
    cls = type(ctx.store)
    delete = cls.delete

    def dies_once(self, key):
        monkeypatch.setattr(cls, "delete", delete)
        raise OSError(f"killed before deleting {key}")

    monkeypatch.setattr(cls, "delete", dies_once)
    with pytest.raises(OSError):
        apply_retention(ctx, 3)
    assert is_pruned(ctx.store, ctx.layout.snapshot(1))  # flagged, weights still there
    assert apply_retention(ctx, 3) == [2]
    for unit in [ctx.layout.snapshot(v) for v in (1, 2)] + [ctx.layout.update(e) for e in (0, 1)]:
        assert not [k for k in ctx.store.list(unit + "/") if k.endswith(".safetensors")], unit
    assert [k for k in ctx.store.list(ctx.layout.snapshot(3) + "/") if k.endswith(".safetensors")]
