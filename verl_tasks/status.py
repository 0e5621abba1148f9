"""An experiment's state, read from its store alone: what ``verl-tasks status``, the dashboard and the metrics show.

This module imports neither torch nor Airflow, so a status answers in well under
a second. It reads the store with one listing per prefix (the epochs, the
snapshots, and data/ and base/ for their quarantine records) and one marker per
committed update and evaluation, read a few at a time so that an S3 store does
not pay one round trip after another.
"""
from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from verl_tasks.config import ExperimentConfig
from verl_tasks.errors import IntegrityError, StoreError
from verl_tasks.layout import Layout
from verl_tasks.ops.safe_mode import read_safe_mode
from verl_tasks.phase_registry import phases_for
from verl_tasks.store.base import ObjectStore
from verl_tasks.store.conventions import quarantine_records, read_best, read_latest, read_skipped
from verl_tasks.store.units import MARKER, PRUNED, is_committed, read_marker

# An evaluation the run does not make after this epoch (evaluate.every): not missing.
NOT_PLANNED = "not planned"
READERS = 8  # concurrent marker reads (S3 round trips overlap; a local disk does not mind)
UPDATE_METRICS = ("reward_mean", "reward_std", "actor/loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm",
                  "actor/entropy")


def epoch_done(config: ExperimentConfig, store: ObjectStore, layout: Layout, epoch: int, total_epochs: int) -> bool:
    """Epoch ``epoch`` of a run of ``total_epochs`` left nothing to do: its snapshot (every other unit
    of the epoch is its input) and, when the run evaluates after it, its evaluation are committed."""
    if not is_committed(store, layout.snapshot(epoch + 1)):
        return False
    return not config.should_evaluate(epoch, total_epochs) or is_committed(store, layout.evaluate(epoch))


def epoch_units(config: ExperimentConfig, layout: Layout, epoch: int) -> dict[str, list[str]]:
    """Each phase's unit keys in ``epoch`` (one per batch for the batched phases), in execution order."""
    batches = range(config.rollout.batches_per_epoch)
    return {name: [spec.unit(layout, epoch, b) for b in batches] if spec.batched else [spec.unit(layout, epoch)]
            for name, spec in phases_for(config).items()}


def phase_state(phase: str, units: list[str], keys: set[str]) -> str:
    """``committed``, ``absent``, ``K/N committed``, or ``pruned`` (retention deleted the weights; not corrupt)."""
    done = sum(f"{unit}/{MARKER}" in keys for unit in units)
    if phase in ("snapshot", "update", "critic") and done and f"{units[0]}/{PRUNED}" in keys:
        return "pruned"
    if done == len(units):
        return "committed"
    return "absent" if done == 0 else f"{done}/{len(units)} committed"


def marker_metrics(store: ObjectStore, units: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Unit -> the ``metrics`` of its marker (empty when absent or unreadable), read concurrently."""
    units = list(units)

    def read(unit: str) -> dict[str, Any]:
        try:
            record = read_marker(store, unit)
        except IntegrityError:
            return {}
        return dict(record.meta.get("metrics", {})) if record else {}

    if len(units) <= 1:
        return {unit: read(unit) for unit in units}
    with ThreadPoolExecutor(max_workers=min(READERS, len(units))) as pool:
        return dict(zip(units, pool.map(read, units), strict=True))


def latest_snapshot(store: ObjectStore, layout: Layout) -> dict[str, Any] | None:
    """The ``latest.json`` pointer as the status shows it (epoch, version, uri, weights_sha256), or None."""
    pointer = read_latest(store, layout)
    if not pointer:
        return None
    return {"epoch": pointer["version"] - 1 if pointer["version"] else None, "version": pointer["version"],
            "uri": pointer.get("uri"), "weights_sha256": pointer.get("weights_sha256")}


def status(config: ExperimentConfig, store: ObjectStore, events: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Per epoch, each phase's state and metrics; the latest snapshot; the base policy's metrics.

    ``events``: the event log, when the caller read it already (it is then not listed again).

    Returns:
        ``experiment``, ``phases`` (the experiment's, in order), ``store`` (URI), ``epochs`` (rows with
        ``epoch``, ``phases``: phase -> state,
        ``metrics``, ``skipped_batches`` when the epoch went on without some), ``latest_snapshot``,
        ``best_snapshot`` (``best.json`` with ``storage.keep_best_by``, else None), ``base`` (``metrics``,
        and ``parent``: ``{"experiment", "version", ...}`` of the snapshot a fork or a scheduled child
        started from, else None),
        ``quarantined``, ``warnings``, ``safe_mode`` (the record while the experiment is halted, else None),
        ``failures`` (``open_failures``) and ``finished`` (every epoch left nothing to do: a run would compute nothing).
    """
    layout = Layout(config.experiment)
    keys = set(store.list(layout.root + "/epochs/")) | set(store.list(layout.snapshots + "/"))
    rows: list[dict[str, Any]] = []
    for epoch in range(config.epochs):
        phases = {phase: phase_state(phase, units, keys) for phase, units in epoch_units(config, layout, epoch).items()}
        if phases["evaluate"] == "absent" and not config.should_evaluate(epoch):
            phases["evaluate"] = NOT_PLANNED
        if any(state != "absent" for state in phases.values()):
            rows.append({"epoch": epoch, "phases": phases, "metrics": {}})
            if f"{layout.skipped(epoch)}/{MARKER}" in keys:  # batches the epoch went on without
                rows[-1]["skipped_batches"] = read_skipped(store, layout, epoch)
    wanted = [layout.base_evaluate]
    for row in rows:
        if row["phases"]["update"] in ("committed", "pruned"):
            wanted.append(layout.update(row["epoch"]))
        if row["phases"].get("critic") in ("committed", "pruned"):
            wanted.append(layout.critic(row["epoch"]))
        if row["phases"]["evaluate"] == "committed":
            wanted.append(layout.evaluate(row["epoch"]))
    metrics = marker_metrics(store, wanted)
    for row in rows:
        update = metrics.get(layout.update(row["epoch"]), {})
        row["metrics"].update({k: update[k] for k in UPDATE_METRICS if k in update})
        row["metrics"].update({k: v for k, v in metrics.get(layout.critic(row["epoch"]), {}).items()
                               if k.startswith("critic/")})
        row["metrics"].update({k: v for k, v in metrics.get(layout.evaluate(row["epoch"]), {}).items()
                               if k.startswith("eval_")})
    base_metrics = metrics.get(layout.base_evaluate, {})
    regression = accuracy_regression(base_metrics.get("eval_accuracy"),
                                     [(row["epoch"], row["metrics"].get("eval_accuracy")) for row in rows],
                                     config.evaluate.regression_margin)
    # A re-pin quarantines the data and base/evaluate units too.
    prelude = set(store.list(layout.root + "/data/")) | set(store.list(layout.root + "/base/"))
    quarantined = quarantine_records(store, keys | prelude)
    return {
        "experiment": config.experiment,
        "phases": list(phases_for(config)),
        "quarantined": quarantined,
        "warnings": [
            f"{q['unit']} was quarantined ({q['reason']})"
            + ("; recomputed since" if q["recovered"] else "; not recomputed yet")
            for q in quarantined
        ] + ([regression_text(regression, config)] if regression else []),
        "store": store.uri,
        "epochs": rows,
        "latest_snapshot": latest_snapshot(store, layout),
        "best_snapshot": read_best(store, layout) if config.storage.keep_best_by else None,
        "base": {"metrics": {k: v for k, v in metrics[layout.base_evaluate].items() if k.startswith("eval_")},
                 "parent": base_origin(store, config.experiment)},
        "safe_mode": read_safe_mode(store, layout),
        "failures": open_failures(store, layout, events),
        # epoch_done's rule, read off the listing above instead of one store call per epoch.
        "finished": all(f"{layout.snapshot(e + 1)}/{MARKER}" in keys and (
            not config.should_evaluate(e, config.epochs) or f"{layout.evaluate(e)}/{MARKER}" in keys)
            for e in range(config.epochs)),
    }


def accuracy_regression(base: float | None, evaluated: list[tuple[int, float | None]], margin: float
                        ) -> dict[str, Any] | None:
    """The newest two evaluations in a row whose held-out accuracy is more than ``margin`` below the
    base's, as ``{"base", "margin", "epochs": [(epoch, accuracy), (epoch, accuracy)]}``; None otherwise.
    ``evaluated``: (epoch, accuracy or None) in epoch order; epochs without an evaluation are passed over."""
    scored = [(epoch, acc) for epoch, acc in evaluated if acc is not None]
    if base is None or len(scored) < 2:
        return None
    below = [acc < base - margin for _epoch, acc in scored]
    for i in range(len(scored) - 1, 0, -1):
        if below[i] and below[i - 1]:
            return {"base": base, "margin": margin, "epochs": [scored[i - 1], scored[i]]}
    return None


def regression_text(found: dict[str, Any], config: ExperimentConfig) -> str:
    (e1, a1), (e2, a2) = found["epochs"]
    return (f"held-out accuracy is more than {found['margin']:g} below the base's {found['base']:.3f} for two "
            f"evaluations in a row (epoch {e1}: {a1:.3f}, epoch {e2}: {a2:.3f}); check algorithm.lr "
            f"({config.algorithm.lr:g}) and the KL settings, and roll back to a better snapshot if it persists "
            f"(verl-tasks rollback; evaluate.regression_margin sets this warning)")


FAILURES_READ = 50  # the newest failed attempts looked at


def open_failures(store: ObjectStore, layout: Layout, events: list[dict[str, Any]] | None = None
                  ) -> list[dict[str, Any]]:
    """The newest failed attempt of each unit that is still not committed (a prepare that could not read
    its data, a plan, a batch out of its retries), newest first: ``unit``, ``phase``, ``attempt``, ``error``.
    ``events``: the log in time order, when the caller has read it already (else the failed ones are read)."""
    from verl_tasks.events import recent_events

    failed = ([e for e in reversed(events) if e.get("kind") == "failed"][:FAILURES_READ] if events is not None
              else recent_events(store, layout, "failed", FAILURES_READ))
    found: dict[str, dict[str, Any]] = {}
    for event in failed:
        unit = event.get("unit")
        if isinstance(unit, str) and unit not in found and not is_committed(store, unit):
            found[unit] = {"unit": unit, "phase": event.get("phase"), "attempt": event.get("attempt"),
                           "error": str(event.get("error", ""))[:500], "time": event.get("time")}
    return list(found.values())


def base_origin(store: ObjectStore, experiment: str) -> dict[str, Any] | None:
    """The parent snapshot the experiment's version 0 is a copy of (its base marker's record, else its
    pin's), or None: it starts from its configured model, or the record cannot be read."""
    from verl_tasks.execution.lineage import recorded_origin

    try:
        origin = recorded_origin(store, experiment)
    except StoreError:
        return None
    return origin if isinstance(origin, dict) and origin.get("experiment") else None


__all__ = ["status", "accuracy_regression", "base_origin", "open_failures", "epoch_units", "phase_state",
           "marker_metrics", "latest_snapshot"]
