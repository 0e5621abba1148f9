"""Publish the updated policy as snapshot ``epoch + 1``, move ``latest.json``, apply retention.

A snapshot folder is HF-loadable (config, safetensors weights, tokenizer) and
carries ``optimizer.safetensors`` and ``trainer_state.json`` (step, learning-rate
schedule state, seeds, metrics, config hash) so training resumes from it exactly.

Retention keeps the base, the newest ``storage.keep_snapshots`` versions and, with
``storage.keep_best_by``, the best evaluated version (``best.json``). Evaluate runs
after the snapshot (in Airflow on a side branch), so a version whose evaluation is
still pending is never pruned: its evaluate loads it, and it could become the best.
The watermark keeps it unsettled, so a later pass prunes it once that evaluation commits.
"""
from __future__ import annotations

import json
import logging
from typing import Any

from verl_tasks.algos import lr_at, schedule_of
from verl_tasks.events import record_event
from verl_tasks.phases.common import PhaseContext, committed, derive_seed, require, run_unit
from verl_tasks.store.conventions import (
    KEEP_WHEN_PRUNED,
    WRITTEN_BY_SNAPSHOT,
    is_critic_file,
    latest_version,
    read_retention,
    weights_sha256,
    write_best,
    write_latest,
    write_retention,
)
from verl_tasks.store.units import PRUNED, CommitRecord, UnitWriter, is_committed, is_pruned, read_json, read_marker

log = logging.getLogger(__name__)


def prune(ctx: PhaseContext, unit: str, reason: str) -> bool:
    """Delete a committed unit's weight files, keep its marker and small JSON files; True when this
    call flagged it.

    The ``_PRUNED`` flag records ``keep_snapshots`` so a later reader can say why the weights are gone.
    It is written first, so the deletes run also when it exists: a pass killed between them left weights.
    """
    record = read_marker(ctx.store, unit)
    if record is None:
        return False
    flagged = is_pruned(ctx.store, unit)
    if not flagged:
        flag = {"reason": reason, "attempt": record.attempt, "keep_snapshots": ctx.config.storage.keep_snapshots}
        ctx.store.put(f"{unit}/{PRUNED}", json.dumps(flag).encode())
    for name in record.files:
        if name not in KEEP_WHEN_PRUNED and not name.endswith(".json"):
            ctx.store.delete(record.key(name))
    return not flagged


def evaluations(ctx: PhaseContext, versions: list[int]) -> tuple[dict[int, float], set[int]]:
    """``storage.keep_best_by`` of each evaluated version among ``versions`` whose weights are still
    there (one pruned before ``keep_best_by`` was set cannot come back), and those still awaiting one."""
    metric = ctx.config.storage.keep_best_by
    values: dict[int, float] = {}
    pending: set[int] = set()
    for version in versions:
        if is_pruned(ctx.store, ctx.layout.snapshot(version)):
            continue
        record = committed(ctx, ctx.layout.evaluate(version - 1))
        if record is not None and metric in record.meta.get("metrics", {}):
            values[version] = float(record.meta["metrics"][metric])
        elif record is None and ctx.config.should_evaluate(version - 1):
            pending.add(version)
    return values, pending


def keep_best(ctx: PhaseContext, versions: list[int], horizon: int) -> set[int]:
    """Versions retention must keep beyond the window: every pending one (its evaluate loads it, and
    it could still become the best) and, with ``storage.keep_best_by``, the best evaluated one
    (``best.json`` points at it). Ties go to the older version. Without a metric only the versions up
    to ``horizon`` that expect an evaluation are read: the others are kept or need nothing."""
    metric = ctx.config.storage.keep_best_by
    if metric is None:
        return evaluations(ctx, [v for v in versions if v <= horizon and ctx.config.should_evaluate(v - 1)])[1]
    values, pending = evaluations(ctx, versions)
    if not values:
        return pending
    best = max(values, key=lambda v: (values[v], -v))
    record = committed(ctx, ctx.layout.snapshot(best))
    if record is not None and write_best(ctx.store, ctx.layout, best, metric, values[best], record):
        record_event(ctx.store, ctx.layout, "best_snapshot", version=best, metric=metric, value=values[best])
    return pending | {best}


def apply_retention(ctx: PhaseContext, newest: int) -> list[int]:
    """Keep the base, the newest ``storage.keep_snapshots`` versions and ``keep_best``'s; prune older ones.

    The watermark (``retention.json``) makes a pass look only at versions it has not settled: the
    kept ones and those that fell out of the window since, so its cost stays flat however long the run.
    """
    store, layout = ctx.store, ctx.layout
    keep = ctx.config.storage.keep_snapshots
    through, kept = read_retention(store, layout)
    horizon = newest - keep
    unsettled = sorted(kept | set(range(through + 1, newest + 1)))
    protected = keep_best(ctx, unsettled, horizon)
    still_kept = {v for v in kept if v > horizon}
    pruned = []
    for version in (v for v in unsettled if v <= horizon):
        unit = layout.snapshot(version)
        if version in protected or not is_committed(store, unit):
            still_kept.add(version)
            continue
        if prune(ctx, unit, f"retention: keep {keep} snapshots"):
            pruned.append(version)
        # Also when the snapshot was pruned by a pass that died before this line.
        prune(ctx, layout.update(version - 1), "retention: weights published and pruned")
        if ctx.config.critic is not None:
            prune(ctx, layout.critic(version - 1), "retention: critic published and pruned")
    settled = max(through, horizon)
    if (settled, still_kept) != (through, kept):
        write_retention(store, layout, settled, still_kept)
    return pruned


def retain_after_evaluate(ctx: PhaseContext) -> list[int]:
    """Retention once an evaluation is known: the best may have changed, a pending version may go."""
    newest = latest_version(ctx.store, ctx.layout)
    return apply_retention(ctx, newest) if newest else []


def snapshot(ctx: PhaseContext, epoch: int) -> CommitRecord:
    cfg = ctx.config
    version = epoch + 1

    def produce(writer: UnitWriter) -> dict[str, Any]:
        update_rec = require(ctx, ctx.layout.update(epoch), "update")
        for name in sorted(update_rec.files):
            if name not in WRITTEN_BY_SNAPSHOT:
                writer.copy_from(update_rec, name)
        if cfg.critic is not None:  # PPO: critic version epoch + 1 beside the policy of that version
            critic_rec = require(ctx, ctx.layout.critic(epoch), "critic")
            for name in sorted(n for n in critic_rec.files if is_critic_file(n)):
                writer.copy_from(critic_rec, name)
        metrics = read_json(ctx.store, update_rec, "metrics.json")
        state = read_json(ctx.store, update_rec, "trainer_state.json")
        writer.write_json(
            "trainer_state.json",
            {
                "version": version,
                "epoch": epoch,
                "step": state["step"],
                "optimizer": state["optimizer"],
                # The rate is a pure function of the global step (algos.lr_at): nothing else to restore.
                "lr_schedule": {**schedule_of(cfg.algorithm), "step": state["step"],
                                "lr": state.get("lr_schedule", {}).get("lrs", [None])[-1],
                                "next_lr": lr_at(state["step"], **schedule_of(cfg.algorithm))},
                "config_hash": cfg.config_hash(),
                "parent_version": epoch,
                # All randomness is derived from (seed, epoch, phase, batch): this is the RNG state.
                "rng": {"seed": cfg.seed, "scheme": "sha256(seed/epoch/phase/batch)",
                        "next_update_seed": derive_seed(cfg.seed, version, "update")},
                "metrics": metrics,
            },
        )
        return {"version": version, "weights_sha256": weights_sha256(update_rec), "metrics": metrics}

    record = run_unit(ctx, "snapshot", ctx.layout.snapshot(version), epoch, produce)
    write_latest(ctx.store, ctx.layout, version, record)
    # A rerun of an old epoch's snapshot must not pass its own version: the pass would rank only the
    # versions up to it and could point best.json at a worse one.
    apply_retention(ctx, max(version, latest_version(ctx.store, ctx.layout) or 0))
    return record
