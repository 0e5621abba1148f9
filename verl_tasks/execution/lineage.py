"""Start an experiment from another experiment's snapshot (continual training, forks).

The new experiment's base snapshot (version 0) becomes a copy of the parent's
snapshot ``version``: weights, model config and tokenizer are copied server-side,
the optimizer starts fresh and ``trainer_state.json`` records the parent. The
copy is an ordinary unit commit, so it is idempotent: a retried or re-run
``configure`` task finds the marker and does nothing. Belongs in the core
library (``phases/prepare.py``) eventually; it only uses the store's commit protocol.
"""
from __future__ import annotations

import logging
from typing import Any

from verl_tasks.errors import ConfigError
from verl_tasks.layout import Layout
from verl_tasks.store import conventions
from verl_tasks.store.base import ObjectStore
from verl_tasks.store.conventions import NOT_COPIED, WEIGHTS
from verl_tasks.store.units import CommitRecord, UnitWriter, read_marker

log = logging.getLogger(__name__)


def latest_version(store: ObjectStore, experiment: str) -> int | None:
    """The parent's newest published snapshot version, or None when it has none."""
    return conventions.latest_version(store, Layout(experiment))


def parent_snapshot(store: ObjectStore, experiment: str, version: int) -> CommitRecord:
    """The committed, unpruned snapshot ``version`` of ``experiment``.

    Raises:
        ConfigError: it is not committed.
        SnapshotPruned: retention deleted its weights (the message names the newest kept one).
    """
    layout = Layout(experiment)
    unit = layout.snapshot(version)
    record = read_marker(store, unit)
    if record is None:
        raise ConfigError(f"experiment {experiment!r} has no committed snapshot {version} ({unit})")
    conventions.check_not_pruned(store, layout, version)
    return record


def seed_base_from(store: ObjectStore, experiment: str, parent: str, version: int, seed: int) -> dict[str, Any]:
    """Commit ``experiment``'s snapshot 0 as a copy of ``parent``'s snapshot ``version`` (once)."""
    target = Layout(experiment).snapshot(0)
    existing = read_marker(store, target)
    if existing is not None:
        origin = existing.meta.get("parent")
        if origin and (origin.get("experiment"), origin.get("version")) != (parent, version):
            raise ConfigError(f"experiment {experiment!r} already starts from {origin}; use a new experiment name")
        return {"unit": target, "attempt": existing.attempt, "parent": origin}
    source = parent_snapshot(store, parent, version)
    origin = {"experiment": parent, "version": version, "unit": source.unit, "attempt": source.attempt,
              "weights_sha256": source.files[WEIGHTS].sha256 if WEIGHTS in source.files else None}
    writer = UnitWriter(store, target)
    for name in sorted(source.files):
        if name not in NOT_COPIED:
            writer.copy_from(source, name)
    writer.write_json("trainer_state.json", {"version": 0, "step": 0, "epoch": None, "seed": seed, "parent": origin})
    record, won = writer.commit({"version": 0, "source": "parent", "parent": origin})
    log.info("base snapshot of %s %s from %s snapshot %d", experiment, "seeded" if won else "was already seeded", parent, version)
    return {"unit": target, "attempt": record.attempt, "parent": origin}
