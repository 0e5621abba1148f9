"""Resume from the newest snapshot that verifies: a corrupt one is quarantined and recomputed.

A committed snapshot whose files no longer match its manifest (truncated or
altered after commit) is detected when it is loaded. Its marker is moved to
``.quarantine/`` (so the unit reads as absent), the update unit it was copied
from is quarantined too when its own weights are bad or were pruned (and so is a PPO run's critic unit), and
``latest.json`` goes back to the previous valid snapshot. Every input of the
lost units is still committed, so the next run recomputes them and, being
deterministic, produces the same bytes.

A snapshot pruned by retention is not corrupt: readers raise ``SnapshotPruned``
before they get here, and nothing in this module treats a pruned one as bad.
"""
from __future__ import annotations

import logging
from typing import Any

from verl_tasks.errors import IntegrityError
from verl_tasks.events import record_event
from verl_tasks.store.conventions import check_not_pruned, has_policy, latest_version, snapshot_versions, write_latest
from verl_tasks.store.units import PRUNED, committed_record, is_pruned, quarantine, read_marker, verify_unit

log = logging.getLogger(__name__)


def _weights_ok(ctx, unit: str) -> bool:
    try:
        record = read_marker(ctx.store, unit)
    except IntegrityError:
        return False
    if record is None or is_pruned(ctx.store, unit):
        return False
    return not verify_unit(ctx.store, record)


def newest_valid_version(ctx, below: int) -> int | None:
    """The newest snapshot version < ``below`` that is committed, not pruned and verifies."""
    for version in range(below - 1, -1, -1):
        if _weights_ok(ctx, ctx.layout.snapshot(version)):
            return version
    return None


def fall_back(ctx, version: int, problems: list[str]) -> dict[str, Any]:
    """Quarantine corrupt snapshot ``version`` (and its update unit if needed); point latest at the previous valid one.

    Returns the ``fallback`` event's fields. Snapshot 0 (the base) is quarantined
    too; ``prepare`` rebuilds it on the next run, re-seeding a forked experiment's from
    the parent snapshot its pin records (never from the configured model).

    Raises:
        SnapshotPruned: ``version`` was pruned by retention; nothing is quarantined.
    """
    layout, store = ctx.layout, ctx.store
    check_not_pruned(store, layout, version)  # retention's work, not corruption: never quarantined
    snap = layout.snapshot(version)
    reason = f"snapshot {version} failed verification: " + "; ".join(problems)
    quarantined = []
    if quarantine(store, snap, reason):
        quarantined.append(snap)
    if version > 0:
        update_unit = layout.update(version - 1)
        if not _weights_ok(ctx, update_unit) and read_marker(store, update_unit) is not None:
            quarantine(store, update_unit, f"weights of snapshot {version} are bad and this unit's copy is unusable")
            store.delete(f"{update_unit}/{PRUNED}")
            quarantined.append(update_unit)
        critic_unit = layout.critic(version - 1)  # PPO: the snapshot's critic files are copies of this unit's
        if not _weights_ok(ctx, critic_unit) and read_marker(store, critic_unit) is not None:
            quarantine(store, critic_unit, f"snapshot {version} is bad and this unit's copy of the critic is unusable")
            store.delete(f"{critic_unit}/{PRUNED}")
            quarantined.append(critic_unit)
    previous = newest_valid_version(ctx, version)
    pointed = latest_version(store, layout)
    if previous is not None and pointed is not None and pointed >= version:
        write_latest(store, layout, previous, committed_record(store, layout.snapshot(previous)), allow_lower=True)
    fields = {"unit": snap, "version": version, "problems": problems, "quarantined": quarantined,
              "fell_back_to": previous}
    log.warning(
        "snapshot %d of %s is corrupt (%s); quarantined %s and fell back to snapshot %s; "
        "the next run recomputes the lost units", version, layout.experiment, "; ".join(problems),
        ", ".join(quarantined), previous,
    )
    record_event(store, layout, "quarantined", **fields)
    record_event(store, layout, "fallback", **fields)
    return fields


def check_resume_point(ctx) -> dict[str, Any] | None:
    """Verify the newest committed snapshot (the one a resume reads); fall back if it is corrupt.

    Loops until the newest snapshot verifies. Returns the last fallback's fields, or None.
    A pruned newest snapshot is left alone: the phase that needs it raises ``SnapshotPruned``.
    """
    result = None
    while True:
        versions = snapshot_versions(ctx.store, ctx.layout)
        if not versions:
            return result
        newest = versions[-1]
        unit = ctx.layout.snapshot(newest)
        record = read_marker(ctx.store, unit)
        if is_pruned(ctx.store, unit):
            return result
        problems = verify_unit(ctx.store, record) if record is not None and has_policy(record) else []
        if not problems:
            return result
        result = fall_back(ctx, newest, problems)
