"""The config pin: ``experiment.json`` fixes the training-relevant config of an experiment.

Every unit checks the running config against the pin before it computes, and
its commit checks again (``UnitWriter.commit``), so a YAML edited in the middle
of a DAG run cannot commit units under another config. While an experiment has committed nothing but its data, its base
snapshot and plans, a changed config re-pins it (those units are set aside and
recomputed); after the first rollout the pin is final. Torch-free.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from typing import Any

from verl_tasks.config import ExperimentConfig, differing_keys
from verl_tasks.errors import ConfigError, ConfigMismatch, StoreError
from verl_tasks.events import record_event
from verl_tasks.layout import Layout
from verl_tasks.ownership import OWNER, DagAccess, check_write, claim_fields
from verl_tasks.store.base import NotFound, ObjectStore
from verl_tasks.store.units import MARKER, quarantine

log = logging.getLogger(__name__)

# Tries of a pin decision whose conditional write met another process's change of experiment.json.
_PIN_TRIES = 5


def _pin_body(config: ExperimentConfig, parent: dict[str, Any] | None, dag_id: str | None) -> dict[str, Any]:
    return {
        "experiment": config.experiment,
        "dag_id": dag_id,  # the Airflow DAG that owns it; None: made by the CLI (verl_tasks.ownership)
        "config_hash": config.config_hash(),
        "hashed_config": config.hashed_view(),
        "config": config.model_dump(mode="json"),
        "created_at": time.time(),
        "parent": parent,
    }


def read_pin(store: ObjectStore, layout: Layout) -> dict[str, Any] | None:
    """The pinned ``experiment.json``, or None. Raises StoreError (one line, with the fix) when it is damaged."""
    return _read_versioned(store, layout)[0]


def _read_versioned(store: ObjectStore, layout: Layout) -> tuple[dict[str, Any] | None, str]:
    """The pin and its version, for a compare-and-swap of it (``put_if_match``); (None, "") when absent."""
    try:
        data, version = store.get_versioned(layout.experiment_json)
    except NotFound:
        return None, ""
    try:
        body = json.loads(data)
        if not isinstance(body, dict) or not isinstance(body.get("config_hash"), str):
            raise ValueError("no config_hash")
        body.setdefault("hashed_config", {})
        return body, version
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


def run_config_body(config: ExperimentConfig) -> tuple[str, bytes]:
    """(sha256, canonical JSON) of the whole config: what ``configs/<sha256>.json`` holds."""
    body = json.dumps(config.model_dump(mode="json"), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(body).hexdigest(), body


def publish_run_config(store: ObjectStore, layout: Layout, config: ExperimentConfig) -> str:
    """Write the run's whole config under its digest, once, and return the digest.

    A Ray job reads the settings outside the config hash (resources, timeouts, trackers) from there by the
    digest its submitter sends, so two runs of one experiment with different such settings, at once, each
    submit their jobs with their own (a task that finds another run's live job of its unit attaches to that
    job, and its settings). Content-addressed: a file of that name always holds those bytes.
    """
    digest, body = run_config_body(config)
    key = layout.run_config(digest)
    if not store.exists(key):
        store.put_if_absent(key, body)
    return digest


def read_run_config(store: ObjectStore, layout: Layout, digest: str) -> dict[str, Any]:
    """The config published under ``digest``. Raises ConfigError when it is missing or not those bytes."""
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise ConfigError(f"{digest!r} is not a config digest (64 hex digits)")
    where = store.url(layout.run_config(digest))
    try:
        body = store.get(layout.run_config(digest))
    except NotFound:
        raise ConfigError(f"{where} does not exist: the run's config is published before its jobs are submitted "
                          f"(verl_tasks.pinning.publish_run_config); submit the unit again") from None
    if hashlib.sha256(body).hexdigest() != digest:
        raise ConfigError(f"{where} does not hash to its name: it was altered; nothing was computed")
    return json.loads(body)


def pin_experiment(ctx: Any, parent: dict[str, Any] | None = None, dag: DagAccess | None = None) -> dict[str, Any]:
    """Write ``experiment.json`` once; afterwards refuse a config whose hashed keys differ.

    Args:
        ctx: anything with ``config``, ``store`` and ``layout`` (a PhaseContext).
        parent: the experiment/snapshot this one was forked from, recorded in the pin.
        dag: the Airflow DAG whose run pins it (None: the CLI or a phase). A new pin records it as the owner;
            an existing one refuses it unless it may write there, and one without an owner is claimed
            when its YAML names it (:mod:`verl_tasks.ownership`). A re-pin keeps the recorded owner.
    Returns:
        The pin in force.
    Raises:
        NotPermitted: the experiment belongs to another DAG (checked before anything is written).
        ConfigMismatch: the experiment already computed units under another config.
        StoreError: ``experiment.json`` is damaged, or kept changing under every try.
    """
    store, layout = ctx.store, ctx.layout
    for _ in range(_PIN_TRIES):
        pinned = _pin_once(ctx.config, store, layout, parent, dag)
        if pinned is not None:
            publish_run_config(store, layout, ctx.config)
            return pinned
    raise StoreError(f"{store.url(layout.experiment_json)} changed under each of {_PIN_TRIES} tries to pin it "
                     f"(other runs of the experiment pinning or deleting it at once?); nothing was re-pinned: "
                     f"run again")


def _pin_once(config: ExperimentConfig, store: ObjectStore, layout: Layout, parent: dict[str, Any] | None,
              dag: DagAccess | None) -> dict[str, Any] | None:
    """One decision of ``pin_experiment``. Every write of the pin is conditional on the version it was
    decided on: None when another process changed (or created) ``experiment.json`` meanwhile."""
    body = _pin_body(config, parent, dag.dag_id if dag else None)
    existing, version = _read_versioned(store, layout)
    if existing is None:
        return body if store.put_if_absent(layout.experiment_json, _encoded(body)) else None
    claimant = dag if check_write(existing, config.experiment, dag) else None
    _keep_owner(body, existing, claimant)
    if existing["config_hash"] == body["config_hash"]:
        if PENDING in existing:  # a re-pin stopped between its pin and its set-aside: finish it first
            return _finish_set_aside(store, layout, existing, version)
        # The settings outside the hash (resources, timeouts, trackers, ...) recorded are the newest run's; a
        # Ray job reads its own run's from configs/<sha256>.json (publish_run_config).
        updated = {**existing, "config": body["config"]}
        if claimant is not None:
            updated.update(claim_fields(existing, claimant, time.time()))
        if updated != existing:
            if not store.put_if_match(layout.experiment_json, _encoded(updated), version):
                return None
            if claimant is not None:
                record_event(store, layout, "claimed", dag_id=claimant.dag_id)
        return updated
    keys = differing_keys(existing["hashed_config"], body["hashed_config"])
    if not _only_prelude_committed(store, layout):
        raise ConfigMismatch(config.experiment, keys, store.url(layout.root))
    body["parent"] = parent or existing.get("parent")
    # The pin before the set-aside: a unit committing under the old config meanwhile either has its marker
    # before the set-aside's scan (set aside there) or reads the new pin after its marker (``UnitWriter.commit``).
    # The pin says the set-aside is pending until it is done: a re-pin killed in between is finished by the
    # next pin_experiment, never taken for a finished one.
    body[PENDING] = {"differing_keys": keys, "old_parent": existing.get("parent")}
    if not store.put_if_match(layout.experiment_json, _encoded(body), version):
        return None
    _, version = _read_versioned(store, layout)
    return _finish_set_aside(store, layout, body, version)


PENDING = "set_aside_pending"


def _finish_set_aside(store: ObjectStore, layout: Layout, pin: dict[str, Any], version: str) -> dict[str, Any] | None:
    """Set aside what the old config computed (idempotent), then drop the pending mark from the pin."""
    pending = pin[PENDING]
    keys = list(pending.get("differing_keys") or [])
    moved = _set_prelude_aside(store, layout, keys, pending.get("old_parent"))
    done = {k: v for k, v in pin.items() if k != PENDING}
    if not store.put_if_match(layout.experiment_json, _encoded(done), version):
        return None  # the pin changed meanwhile: decide again against it
    record_event(store, layout, "repinned", differing_keys=keys, set_aside=moved)
    log.warning("experiment %s had committed no rollout yet: re-pinned with the new config (changed: %s)",
                pin.get("experiment"), ", ".join(keys))
    return done


def _encoded(pin: dict[str, Any]) -> bytes:
    return json.dumps(pin, indent=1, sort_keys=True).encode()


def _keep_owner(body: dict[str, Any], existing: dict[str, Any], claimant: DagAccess | None) -> None:
    """A re-pin keeps the owner ``existing`` records (absent stays absent), or records the claiming DAG."""
    if claimant is not None:
        body.update(claim_fields(existing, claimant, time.time()))
    elif OWNER in existing:
        body.update({key: existing[key] for key in (OWNER, "claimed") if key in existing})
    else:
        body.pop(OWNER, None)


def check_pinned(config: ExperimentConfig, store: ObjectStore) -> None:
    """Refuse to compute a unit under a config other than the pinned one. One small read per unit, never
    cached: the experiment may have been re-pinned since this process last looked (the commit checks again).

    Raises:
        ConfigMismatch: the running config differs from ``experiment.json``.
    """
    layout = Layout(config.experiment)
    pinned = read_pin(store, layout)
    if pinned is None:
        return  # nothing pinned yet: prepare (the first plan) pins it before any data is computed
    if pinned["config_hash"] != config.config_hash():
        raise ConfigMismatch(config.experiment, differing_keys(pinned["hashed_config"], config.hashed_view()),
                             store.url(layout.root))


__all__ = ["pin_experiment", "check_pinned", "read_pin", "publish_run_config", "read_run_config", "run_config_body"]
