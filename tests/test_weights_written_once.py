"""An epoch writes the policy's weights once: the update writes them in place in its attempt, and the
snapshot that publishes them is a hard link on a local store. Damage to those bytes on disk therefore
shows under both names; the fallback recomputes both units, and training ends on the same weights."""
from __future__ import annotations

from tests.chaos import util
from verl_tasks.models.checkpoint import WEIGHTS
from verl_tasks.phases.fallback import check_resume_point
from verl_tasks.runner import make_context, train
from verl_tasks.store.conventions import OPTIMIZER
from verl_tasks.store.units import read_marker


def test_an_epoch_writes_the_weights_once_and_damage_on_disk_recomputes_update_and_snapshot(tiny_config):
    ctx = make_context(tiny_config(epochs=1))
    sha = train(ctx, 1)["latest_snapshot"]["weights_sha256"]
    update, snapshot = read_marker(ctx.store, ctx.layout.update(0)), read_marker(ctx.store, ctx.layout.snapshot(1))
    for name in (WEIGHTS, OPTIMIZER):
        written, published = ctx.store.root / update.key(name), ctx.store.root / snapshot.key(name)
        assert written.stat().st_ino == published.stat().st_ino, name
    assert not list((ctx.store.root / update.unit / ".attempts").glob("*/.tmp-*"))  # no staging folder left

    weights = ctx.store.root / snapshot.key(WEIGHTS)
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))  # in place: the update's name holds the same bytes
    fallback = check_resume_point(ctx)
    assert fallback["fell_back_to"] == 0
    assert fallback["quarantined"] == [ctx.layout.snapshot(1), ctx.layout.update(0)]
    started = util.started_count(ctx.store, ctx.layout)
    assert train(ctx, 1)["latest_snapshot"]["weights_sha256"] == sha
    assert util.started_count(ctx.store, ctx.layout) - started == 2  # the update and its snapshot, nothing else
