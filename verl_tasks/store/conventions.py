"""The store's conventions beyond one unit, in one torch-free place.

What the phases, the runner, the ops commands, lineage and the Airflow
operators agree on: the snapshot file names and which of them each copy takes,
the ``latest.json`` pointer (which only moves forward), the ``best.json`` pointer
of ``storage.keep_best_by``, retention's ``_PRUNED`` flag (a pruned snapshot is
unavailable, not corrupt) and its watermark, an epoch's skipped batches and
quarantine records.
"""
from __future__ import annotations

import json
from typing import Any

from verl_tasks.errors import IntegrityError, SnapshotPruned
from verl_tasks.layout import Layout
from verl_tasks.store.base import NotFound, ObjectStore
from verl_tasks.store.units import MARKER, PRUNED, QUARANTINE, CommitRecord, UnitWriter, read_marker, stamp_time

WEIGHTS = "model.safetensors"
# A LoRA snapshot's policy (``model.lora``): the adapter (PEFT's files) on the base snapshot's weights.
ADAPTER = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
BASE_JSON = "base.json"  # a LoRA snapshot's: the sha256 of the base weights its adapter applies to
OPTIMIZER = "optimizer.safetensors"
TRAINER_STATE = "trainer_state.json"
STEPS_FILE = "steps.jsonl"  # the update unit's per-optimizer-step metrics, one JSON object per step
METRICS = "metrics.json"
# An update unit's files the snapshot writes itself instead of copying.
WRITTEN_BY_SNAPSHOT = (TRAINER_STATE, METRICS)
# A child's base snapshot starts a fresh optimizer and its own state, so these stay with the parent.
NOT_COPIED = (OPTIMIZER, TRAINER_STATE, METRICS)
# Retention keeps these (and every other .json file) of a pruned unit.
KEEP_WHEN_PRUNED = (METRICS, TRAINER_STATE, STEPS_FILE)
# Left out of an HF export.
TRAINING_ONLY = (OPTIMIZER, TRAINER_STATE)


def weights_file(record: CommitRecord) -> str:
    """The file that is a snapshot's (or an update's) policy: ``model.safetensors``, or a LoRA snapshot's
    adapter, whose sha256 then names the policy version (its base is snapshot 0, kept by retention).

    Raises:
        IntegrityError: the unit lists neither.
    """
    for name in (WEIGHTS, ADAPTER):
        if name in record.files:
            return name
    raise IntegrityError(record.unit, [f"neither {WEIGHTS} nor {ADAPTER} is listed"])


def weights_sha256(record: CommitRecord) -> str:
    return record.files[weights_file(record)].sha256


def is_adapter(record: CommitRecord) -> bool:
    """A LoRA snapshot or update: its policy is an adapter on the base snapshot."""
    return ADAPTER in record.files and WEIGHTS not in record.files


def has_policy(record: CommitRecord) -> bool:
    """The unit holds a policy: whole weights or a LoRA adapter."""
    return WEIGHTS in record.files or ADAPTER in record.files


def check_adapter_base(store: ObjectStore, adapter: CommitRecord, base: CommitRecord) -> None:
    """Refuse a LoRA adapter whose ``base.json`` names other base weights than snapshot 0 holds (a base rebuilt
    from a model whose files changed): merged onto them it would be another policy.

    Raises:
        ConfigError: naming both checksums and the ways on (not retried: the bytes will not change).
    """
    from verl_tasks.errors import ConfigError
    from verl_tasks.store.units import read_json

    named = read_json(store, adapter, BASE_JSON).get("base_weights_sha256")
    held = base.files[WEIGHTS].sha256 if WEIGHTS in base.files else None
    if named != held:
        raise ConfigError(f"{adapter.unit}: its LoRA adapter was trained on base weights {str(named)[:16]}, but the "
                          f"base snapshot {base.unit} holds {str(held)[:16]} (rebuilt from a model whose files "
                          f"changed?); restore that base, or start a new experiment from an exported merged "
                          f"snapshot (verl-tasks checkpoint export-hf URI FOLDER --merge)")


def is_optimizer_state(name: str) -> bool:
    """``optimizer.safetensors``, fsdp2's per-worker shards and their index (``optimizer.json``)."""
    return name.startswith("optimizer.")


# PPO's critic, in a critic unit and in the snapshot of the same version: ``critic.model.safetensors``, ...
CRITIC_PREFIX = "critic."


def is_critic_file(name: str) -> bool:
    return name.startswith(CRITIC_PREFIX)


def is_critic_optimizer_state(name: str) -> bool:
    """The critic's AdamW state: a fork's base copies the critic's weights, not its optimizer (as the policy's)."""
    return is_critic_file(name) and is_optimizer_state(name.removeprefix(CRITIC_PREFIX))


def optimizer_state_id(record: CommitRecord) -> str | None:
    """The checksums of a unit's optimizer state files, as one string; None when it has none.

    An update and the snapshot that publishes it list the same bytes, so both give the same id.
    """
    return optimizer_state_of({name: [entry.size, entry.sha256] for name, entry in record.files.items()})


def optimizer_state_of(files: dict[str, Any]) -> str | None:
    """``optimizer_state_id`` of files listed as ``{name: [size, sha256]}`` (what the update's workers wrote)."""
    names = sorted(name for name in files if is_optimizer_state(name))
    return " ".join(f"{name}:{files[name][1]}" for name in names) or None


def read_latest(store: ObjectStore, layout: Layout) -> dict[str, Any] | None:
    """The ``latest.json`` pointer (``version``, ``unit``, ``attempt``, ``weights_sha256``, ``uri``), or None."""
    try:
        body = json.loads(store.get(layout.latest))
        int(body["version"])
        return body
    except (NotFound, ValueError, KeyError, TypeError):
        return None


def latest_version(store: ObjectStore, layout: Layout) -> int | None:
    pointer = read_latest(store, layout)
    return int(pointer["version"]) if pointer else None


def write_latest(store: ObjectStore, layout: Layout, version: int, record: CommitRecord,
                 *, allow_lower: bool = False) -> bool:
    """Point ``latest.json`` at ``version``; returns False (and writes nothing) when it points at one as new.

    Only rollback and the fallback from a corrupt snapshot pass ``allow_lower``:
    they remove the newer snapshots, so the pointer must follow them back.
    """
    current = latest_version(store, layout)
    if current is not None and current >= version and not allow_lower:
        return False
    body = {"version": version, "unit": record.unit, "attempt": record.attempt,
            "weights_sha256": weights_sha256(record), "uri": store.url(record.unit)}
    store.put(layout.latest, json.dumps(body, indent=1, sort_keys=True).encode())
    return True


def read_best(store: ObjectStore, layout: Layout) -> dict[str, Any] | None:
    """The ``best.json`` pointer (``version``, ``metric``, ``value``, ``uri``, ``weights_sha256``), or None."""
    try:
        body = json.loads(store.get(layout.best))
        int(body["version"])
        return body
    except (NotFound, ValueError, KeyError, TypeError):
        return None


def write_best(store: ObjectStore, layout: Layout, version: int, metric: str, value: float,
               record: CommitRecord) -> bool:
    """Point ``best.json`` at snapshot ``version``, the best by ``metric``; False when it already says so."""
    body = {"version": version, "metric": metric, "value": value, "unit": record.unit,
            "weights_sha256": weights_sha256(record), "uri": store.url(record.unit)}
    if read_best(store, layout) == body:
        return False
    store.put(layout.best, json.dumps(body, indent=1, sort_keys=True).encode())
    return True


def forget_best_above(store: ObjectStore, layout: Layout, version: int) -> bool:
    """Delete ``best.json`` when it names a snapshot newer than ``version`` (rolled back); the next
    evaluation's retention points it again. Returns whether it was deleted."""
    best = read_best(store, layout)
    if best is None or int(best["version"]) <= version:
        return False
    store.delete(layout.best)
    return True


def read_retention(store: ObjectStore, layout: Layout) -> tuple[int, set[int]]:
    """Retention's watermark ``(through, kept)``: every snapshot version up to ``through`` that is not
    in ``kept`` is pruned, with its update unit, for good. ``(0, set())`` (look at every version) when
    absent or unreadable, so a lost or damaged watermark costs one full pass, never a kept version."""
    try:
        body = json.loads(store.get(layout.retention))
        return int(body["through"]), {int(v) for v in body["kept"]}
    except (NotFound, ValueError, KeyError, TypeError):
        return 0, set()


def write_retention(store: ObjectStore, layout: Layout, through: int, kept: set[int]) -> None:
    """Record that versions up to ``through`` outside ``kept`` are pruned. True once written (pruning is
    final, and the flags are durable first), so not synced: a crash may bring back an older, also true one."""
    store.put_volatile(layout.retention, json.dumps({"through": through, "kept": sorted(kept)}).encode())


def forget_retention(store: ObjectStore, layout: Layout) -> None:
    """Drop the watermark (rollback: versions it covered may be committed again, unpruned)."""
    store.delete(layout.retention)


def read_skipped(store: ObjectStore, layout: Layout, epoch: int) -> list[int]:
    """The batches epoch ``epoch`` went on without (its committed ``skipped`` unit), else []."""
    try:
        record = read_marker(store, layout.skipped(epoch))
    except IntegrityError:
        return []  # a damaged marker is read as absent, like any unit's
    return sorted(int(b) for b in record.meta.get("skipped", [])) if record else []


def write_skipped(store: ObjectStore, layout: Layout, epoch: int, skipped: list[int], batches: int,
                  fraction: float, attempt: str | None = None) -> list[int]:
    """Commit epoch ``epoch``'s skipped batches once; returns the committed set (an earlier winner's if any).

    Written once, so a rerun of the epoch's validate and update reads the same batches.
    """
    body = {"epoch": epoch, "skipped": sorted(skipped), "batches": batches, "min_committed_batch_fraction": fraction}
    writer = UnitWriter(store, layout.skipped(epoch), attempt)
    writer.write_json("skipped.json", body)
    record, _ = writer.commit(body)
    return sorted(int(b) for b in record.meta["skipped"])


def snapshot_versions(store: ObjectStore, layout: Layout) -> list[int]:
    """Versions with a committed marker, ascending."""
    versions = {layout.snapshot_version(k) for k in store.list(layout.snapshots + "/") if k.endswith("/" + MARKER)}
    return sorted(v for v in versions if v is not None)


def newest_kept(store: ObjectStore, layout: Layout) -> int | None:
    """The newest committed snapshot whose weights retention kept."""
    keys = set(store.list(layout.snapshots + "/"))
    kept = [layout.snapshot_version(k) for k in keys
            if k.endswith("/" + MARKER) and k[: -len(MARKER)] + PRUNED not in keys]
    return max((v for v in kept if v is not None), default=None)


def pruned_flag(store: ObjectStore, unit: str) -> dict[str, Any] | None:
    """Retention's ``_PRUNED`` record of ``unit`` (``reason``, ``attempt``, ``keep_snapshots``), or None."""
    try:
        data = store.get(f"{unit}/{PRUNED}")
    except NotFound:
        return None
    try:
        return dict(json.loads(data))
    except (ValueError, TypeError):
        return {}


def check_not_pruned(store: ObjectStore, layout: Layout, version: int) -> None:
    """Raise SnapshotPruned when retention deleted snapshot ``version``'s weights."""
    flag = pruned_flag(store, layout.snapshot(version))
    if flag is not None:
        keep = flag.get("keep_snapshots")
        raise SnapshotPruned(layout.experiment, version, keep if isinstance(keep, int) else None,
                             newest_kept(store, layout))


def quarantine_records(store: ObjectStore, keys: list[str] | set[str]) -> list[dict[str, Any]]:
    """Each ``<unit>/.quarantine/<stamp>.json`` among ``keys``: unit, record key, reason, attempt, created, recovered.

    ``recovered`` says whether the unit has been committed again since (its marker is among ``keys``).
    """
    present = set(keys)
    out = []
    for key in sorted(present):
        at = key.find(f"/{QUARANTINE}/")
        if at < 0:
            continue
        unit = key[:at]
        reason, attempt = "", None
        try:
            body = json.loads(store.get(key))
            reason = str(body.get("reason", ""))
            attempt = json.loads(body["marker"]).get("attempt")
        except (NotFound, ValueError, TypeError, AttributeError, KeyError):
            pass  # an unreadable record still names its unit
        out.append({"unit": unit, "record": key, "reason": reason, "attempt": attempt,
                    "created": stamp_time(key.rsplit("/", 1)[-1]), "recovered": f"{unit}/{MARKER}" in present})
    return out
