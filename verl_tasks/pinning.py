"""The config pin: ``experiment.json`` fixes the training-relevant config of an experiment.

Every unit checks the running config against the pin before it computes, so a
YAML edited in the middle of a DAG run cannot commit units under another
config. While an experiment has committed nothing but its data, its base
snapshot and plans, a changed config re-pins it (those units are set aside and
recomputed); after the first rollout the pin is final. Torch-free.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any

from verl_tasks.config import ExperimentConfig, differing_keys
from verl_tasks.errors import ConfigMismatch, StoreError
from verl_tasks.events import record_event
from verl_tasks.layout import Layout
from verl_tasks.store.base import NotFound, ObjectStore
from verl_tasks.store.units import MARKER, quarantine

log = logging.getLogger(__name__)

# (store uri, experiment, config hash) already checked by this process: one small read per process.
_CHECKED: set[tuple[str, str, str]] = set()


def _pin_body(config: ExperimentConfig, parent: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "experiment": config.experiment,
        "config_hash": config.config_hash(),
        "hashed_config": config.hashed_view(),
        "config": config.model_dump(mode="json"),
        "created_at": time.time(),
        "parent": parent,
    }


def read_pin(store: ObjectStore, layout: Layout) -> dict[str, Any] | None:
    """The pinned ``experiment.json``, or None. Raises StoreError (one line, with the fix) when it is damaged."""
    try:
        data = store.get(layout.experiment_json)
    except NotFound:
        return None
    try:
        body = json.loads(data)
        if not isinstance(body, dict) or not isinstance(body.get("config_hash"), str):
            raise ValueError("no config_hash")
        body.setdefault("hashed_config", {})
        return body
    except (ValueError, UnicodeDecodeError) as err:
        raise StoreError(
            f"{store.url(layout.experiment_json)} is damaged ({type(err).__name__}: {str(err)[:120]}); it pins the "
            f"experiment's config: restore it from a backup, or delete it to pin the current config again "
            f"(its hash is recorded in every snapshot's trainer_state.json to compare)"
        ) from None


def _only_prelude_committed(store: ObjectStore, layout: Layout) -> bool:
    """True while no unit past the plans is committed (no rollout, score, update, snapshot > 0 ...)."""
    for key in store.list(layout.root + "/epochs/"):
        if key.endswith("/" + MARKER) and not key[: -len(MARKER) - 1].endswith("/plan"):
            return False
    return not any(key.endswith("/" + MARKER) and layout.snapshot_version(key) not in (None, 0)
                   for key in store.list(layout.snapshots + "/"))


def _set_prelude_aside(store: ObjectStore, layout: Layout, keys: list[str], parent: dict[str, Any] | None) -> list[str]:
    """Quarantine data, plans and a built base snapshot, so they are recomputed under the new config."""
    units = [layout.data("train"), layout.data("eval"), layout.base_evaluate]
    units += [key[: -len(MARKER) - 1] for key in store.list(layout.root + "/epochs/") if key.endswith("/" + MARKER)]
    base = layout.snapshot(0)
    if not parent:  # a base copied from a parent experiment does not depend on this config
        units.append(base)
    reason = "config changed before any rollout: " + ", ".join(keys)
    moved = [unit for unit in units if quarantine(store, unit, reason)]
    if base in moved:
        store.delete(layout.latest)
    return moved


def pin_experiment(ctx: Any, parent: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``experiment.json`` once; afterwards refuse a config whose hashed keys differ.

    Args:
        ctx: anything with ``config``, ``store`` and ``layout`` (a PhaseContext).
        parent: the experiment/snapshot this one was forked from, recorded in the pin.
    Returns:
        The pin in force.
    Raises:
        ConfigMismatch: the experiment already computed units under another config.
        StoreError: ``experiment.json`` is damaged.
    """
    config, store, layout = ctx.config, ctx.store, ctx.layout
    body = _pin_body(config, parent)
    existing = read_pin(store, layout)
    if existing is None:
        if store.put_if_absent(layout.experiment_json, json.dumps(body, indent=1, sort_keys=True).encode()):
            _CHECKED.add((store.uri, config.experiment, body["config_hash"]))
            return body
        existing = read_pin(store, layout)
        if existing is None:  # another process pinned it first, and it is gone again
            raise StoreError(f"{store.url(layout.experiment_json)} was written by another process and deleted "
                             f"again before it could be read; is the experiment being deleted? Run again")
    if existing["config_hash"] == body["config_hash"]:
        _CHECKED.add((store.uri, config.experiment, body["config_hash"]))
        return existing
    keys = differing_keys(existing["hashed_config"], body["hashed_config"])
    if not _only_prelude_committed(store, layout):
        raise ConfigMismatch(config.experiment, keys, store.url(layout.root))
    moved = _set_prelude_aside(store, layout, keys, existing.get("parent"))
    body["parent"] = parent or existing.get("parent")
    store.put(layout.experiment_json, json.dumps(body, indent=1, sort_keys=True).encode())
    record_event(store, layout, "repinned", differing_keys=keys, set_aside=moved)
    log.warning("experiment %s had committed no rollout yet: re-pinned with the new config (changed: %s)",
                config.experiment, ", ".join(keys))
    _CHECKED.add((store.uri, config.experiment, body["config_hash"]))
    return body


def check_pinned(config: ExperimentConfig, store: ObjectStore) -> None:
    """Refuse to compute a unit under a config other than the pinned one (one read per process).

    Raises:
        ConfigMismatch: the running config differs from ``experiment.json``.
    """
    key = (store.uri, config.experiment, config.config_hash())
    if key in _CHECKED:
        return
    layout = Layout(config.experiment)
    pinned = read_pin(store, layout)
    if pinned is None:
        return  # nothing pinned yet: prepare (the first plan) pins it before any data is computed
    if pinned["config_hash"] != key[2]:
        raise ConfigMismatch(config.experiment, differing_keys(pinned["hashed_config"], config.hashed_view()),
                             store.url(layout.root))
    _CHECKED.add(key)


__all__ = ["pin_experiment", "check_pinned", "read_pin"]
