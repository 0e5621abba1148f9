"""Roll an experiment back to epoch K: the units of later epochs read as absent again.

Each invalidated unit's ``_SUCCESS`` marker (and ``_PRUNED`` flag) moves to
``<experiment>/tombstones/<stamp>/<unit>/``; its attempt data stays until
``gc`` removes tombstones older than a given age. ``latest.json`` then points
at snapshot K+1, so the next run continues with epoch K+1 and, being
deterministic, reproduces the same units.
"""
from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any

from verl_tasks.errors import ConfigError, StoreError
from verl_tasks.events import record_event
from verl_tasks.layout import MAX_EPOCH, Layout
from verl_tasks.store.base import ObjectStore
from verl_tasks.store.conventions import forget_best_above, forget_retention, latest_version, read_best, write_latest
from verl_tasks.store.units import MARKER, PRUNED, committed_record, is_pruned, read_marker

log = logging.getLogger(__name__)

_EPOCH_UNIT = re.compile(r"^epochs/(\d{5})/")
_SNAPSHOT_UNIT = re.compile(r"^snapshots/(\d{5})/")


@dataclass
class RollbackPlan:
    """What a rollback to ``to_epoch`` invalidates (unit keys), and where ``latest.json`` will point.

    ``repoint``: ``latest.json`` or ``best.json`` still needs moving, also when no unit is left to
    invalidate (a rollback that died after moving the markers), so a rerun finishes it.
    """

    experiment: str
    to_epoch: int
    units: list[str] = field(default_factory=list)
    latest_version: int = 0
    repoint: bool = False

    def describe(self) -> str:
        lines = [f"rollback of {self.experiment} to epoch {self.to_epoch}: {len(self.units)} unit(s) invalidated, "
                 f"latest.json -> snapshot {self.latest_version}"]
        lines += [f"  {unit}" for unit in self.units]
        return "\n".join(lines)


def plan_rollback(store: ObjectStore, layout: Layout, to_epoch: int) -> RollbackPlan:
    """The committed units of epochs > ``to_epoch`` and snapshots > ``to_epoch + 1``.

    Raises:
        ConfigError: ``to_epoch`` is not an integer in [0, MAX_EPOCH].
        StoreError: snapshot ``to_epoch + 1`` is absent or pruned, so training could not continue from it.
    """
    if isinstance(to_epoch, bool) or not isinstance(to_epoch, int) or not 0 <= to_epoch <= MAX_EPOCH:
        raise ConfigError(f"--to-epoch must be an integer in [0, {MAX_EPOCH}], got {to_epoch!r}")
    keep = layout.snapshot(to_epoch + 1)
    if read_marker(store, keep) is None:
        raise StoreError(f"snapshot {to_epoch + 1} (the output of epoch {to_epoch}) is not committed; "
                         f"roll back to an earlier epoch")
    if is_pruned(store, keep):
        raise StoreError(f"snapshot {to_epoch + 1} was pruned by retention (storage.keep_snapshots); "
                         f"its weights are gone, so training cannot continue from it")
    best = read_best(store, layout)
    plan = RollbackPlan(layout.experiment, to_epoch, latest_version=to_epoch + 1,
                        repoint=latest_version(store, layout) != to_epoch + 1
                        or (best is not None and int(best["version"]) > to_epoch + 1))
    prefix = layout.root + "/"
    for key in store.list(layout.root + "/epochs/") + store.list(layout.snapshots + "/"):
        if not key.endswith("/" + MARKER):
            continue
        rel = key[len(prefix):]
        epoch = _EPOCH_UNIT.match(rel)
        snap = _SNAPSHOT_UNIT.match(rel)
        if (epoch and int(epoch.group(1)) > to_epoch) or (snap and int(snap.group(1)) > to_epoch + 1):
            plan.units.append(key[: -len(MARKER) - 1])
    return plan


def apply_rollback(store: ObjectStore, layout: Layout, plan: RollbackPlan) -> str:
    """Move the planned units' markers under a new tombstone folder; repoint ``latest.json``.

    Returns the tombstone prefix.
    """
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    tomb = f"{layout.tombstones}/{stamp}"
    n = 0
    while store.list(tomb + "/"):
        n += 1
        tomb = f"{layout.tombstones}/{stamp}-{n}"
    rel = len(layout.root) + 1
    # First: the rolled-back versions will be committed again unpruned, which the watermark must not hide.
    forget_retention(store, layout)
    store.put(f"{tomb}/rollback.json", json.dumps(
        {"to_epoch": plan.to_epoch, "units": plan.units, "created_at": time.time()}, indent=1).encode())
    # Newest first: a crash half way leaves a prefix of epochs, which a rerun of rollback completes.
    for unit in sorted(plan.units, reverse=True):
        for name in (MARKER, PRUNED):
            key = f"{unit}/{name}"
            try:
                data = store.get(key)
            except KeyError:
                continue
            store.put(f"{tomb}/{unit[rel:]}/{name}", data)
            store.delete(key)
    # The one place besides the corrupt-snapshot fallback where latest.json moves back, on purpose.
    write_latest(store, layout, plan.latest_version, committed_record(store, layout.snapshot(plan.latest_version)),
                 allow_lower=True)
    forget_best_above(store, layout, plan.latest_version)
    record_event(store, layout, "rollback", to_epoch=plan.to_epoch, units=len(plan.units), tombstone=tomb)
    log.info("rolled %s back to epoch %d: %d unit(s) tombstoned under %s", layout.experiment, plan.to_epoch,
             len(plan.units), tomb)
    return tomb


def tombstone_units(store: ObjectStore, layout: Layout) -> dict[str, dict[str, Any]]:
    """Every tombstone folder -> its units and markers (``{prefix: {"created_at", "attempts": {unit: attempt}}}``)."""
    out: dict[str, dict[str, Any]] = {}
    rel = len(layout.tombstones) + 1
    for key in store.list(layout.tombstones + "/"):
        stamp = key[rel:].split("/", 1)[0]
        prefix = f"{layout.tombstones}/{stamp}"
        entry = out.setdefault(prefix, {"created_at": None, "attempts": {}})
        if key.endswith("/rollback.json"):
            try:
                entry["created_at"] = json.loads(store.get(key))["created_at"]
            except (KeyError, ValueError):
                pass
        elif key.endswith("/" + MARKER):
            unit = f"{layout.root}/{key[len(prefix) + 1 : -len(MARKER) - 1]}"
            try:
                entry["attempts"][unit] = json.loads(store.get(key))["attempt"]
            except (KeyError, ValueError):
                pass
    return out
