"""Retention on a long run: each pass looks only at versions its watermark has not settled.

A run of thousands of epochs must not pay one existence check (an S3 HEAD) per
older version per epoch; the watermark in ``snapshots/retention.json`` says which
versions are pruned for good. A pass that died half way, and a rollback that
brings pruned versions back unpruned, must still end with every version the
window and ``keep_best_by`` do not protect pruned.
"""
from __future__ import annotations

from verl_tasks.ops.rollback import apply_rollback, plan_rollback
from verl_tasks.phases.snapshot import apply_retention, prune
from verl_tasks.runner import make_context
from verl_tasks.store.conventions import read_retention
from verl_tasks.store.units import is_pruned
from tests.test_metrics import fabricate


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
