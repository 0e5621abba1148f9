"""Publish the updated policy as snapshot ``epoch + 1``, move ``latest.json``, apply retention.

A snapshot folder is HF-loadable (config, safetensors weights, tokenizer) and
carries ``optimizer.safetensors`` and ``trainer_state.json`` (step, seeds,
metrics, config hash) so training resumes from it exactly.
"""
from __future__ import annotations

import json
import logging
from typing import Any

from verl_tasks.phases.common import PhaseContext, derive_seed, require, run_unit
from verl_tasks.store.conventions import KEEP_WHEN_PRUNED, WEIGHTS, WRITTEN_BY_SNAPSHOT, write_latest
from verl_tasks.store.units import PRUNED, CommitRecord, UnitWriter, is_committed, is_pruned, read_json, read_marker

log = logging.getLogger(__name__)


def prune(ctx: PhaseContext, unit: str, reason: str) -> bool:
    """Delete a committed unit's weight files, keep its marker and small JSON files.

    The ``_PRUNED`` flag records ``keep_snapshots`` so a later reader can say why the weights are gone.
    """
    record = read_marker(ctx.store, unit)
    if record is None or is_pruned(ctx.store, unit):
        return False
    flag = {"reason": reason, "attempt": record.attempt, "keep_snapshots": ctx.config.storage.keep_snapshots}
    ctx.store.put(f"{unit}/{PRUNED}", json.dumps(flag).encode())
    for name in record.files:
        if name not in KEEP_WHEN_PRUNED and not name.endswith(".json"):
            ctx.store.delete(record.key(name))
    return True


def apply_retention(ctx: PhaseContext, newest: int) -> list[int]:
    """Keep the base and the newest ``storage.keep_snapshots`` versions; prune older ones."""
    keep = ctx.config.storage.keep_snapshots
    pruned = []
    for version in range(1, newest - keep + 1):
        unit = ctx.layout.snapshot(version)
        if is_committed(ctx.store, unit) and prune(ctx, unit, f"retention: keep {keep} snapshots"):
            prune(ctx, ctx.layout.update(version - 1), "retention: weights published and pruned")
            pruned.append(version)
    return pruned


def snapshot(ctx: PhaseContext, epoch: int) -> CommitRecord:
    cfg = ctx.config
    version = epoch + 1

    def produce(writer: UnitWriter) -> dict[str, Any]:
        update_rec = require(ctx, ctx.layout.update(epoch), "update")
        for name in sorted(update_rec.files):
            if name not in WRITTEN_BY_SNAPSHOT:
                writer.copy_from(update_rec, name)
        metrics = read_json(ctx.store, update_rec, "metrics.json")
        state = read_json(ctx.store, update_rec, "trainer_state.json")
        writer.write_json(
            "trainer_state.json",
            {
                "version": version,
                "epoch": epoch,
                "step": state["step"],
                "optimizer": state["optimizer"],
                "config_hash": cfg.config_hash(),
                "parent_version": epoch,
                # All randomness is derived from (seed, epoch, phase, batch): this is the RNG state.
                "rng": {"seed": cfg.seed, "scheme": "sha256(seed/epoch/phase/batch)", "next_update_seed": derive_seed(cfg.seed, version, "update")},
                "metrics": metrics,
            },
        )
        return {"version": version, "weights_sha256": update_rec.files[WEIGHTS].sha256, "metrics": metrics}

    record = run_unit(ctx, "snapshot", ctx.layout.snapshot(version), epoch, produce)
    write_latest(ctx.store, ctx.layout, version, record)
    apply_retention(ctx, version)
    return record
