"""Retention on a long run: a version already pruned costs one existence check per epoch, not marker reads."""
from __future__ import annotations

from verl_tasks.phases.snapshot import apply_retention
from verl_tasks.runner import make_context
from verl_tasks.store.units import is_pruned
from tests.test_metrics import fabricate


def test_already_pruned_versions_are_skipped_without_reading_their_markers(tiny_config, monkeypatch):
    cfg = tiny_config(epochs=8, **{"storage.keep_snapshots": 2, "evaluate.every": 0})
    fabricate(cfg, 8)
    ctx = make_context(cfg)
    assert apply_retention(ctx, 8) == [1, 2, 3, 4, 5, 6]
    assert all(is_pruned(ctx.store, ctx.layout.snapshot(v)) for v in range(1, 7))
    reads: list[str] = []
    get = type(ctx.store).get
    monkeypatch.setattr(type(ctx.store), "get", lambda self, key: (reads.append(key), get(self, key))[1])
    assert apply_retention(ctx, 8) == []
    assert not [k for k in reads if "/snapshots/" in k and k.endswith("/_SUCCESS")], reads
