"""Prometheus metrics of experiments, computed from their stores alone (the golden signals first).

Stateless and torch-free: the plugin's ``/verl-tasks/metrics`` route and ``verl-tasks metrics``
(for a node exporter's textfile collector) compute the same text from the store. Per experiment,
one call lists three prefixes (the snapshots, the current epoch, the events) and reads a bounded
number of objects: a few markers, every fault event (``failed``, ``task_failed``, ``fallback``,
``quarantined``: rare by nature, at most ``MAX_FAULT_EVENTS``) and the newest
``MAX_COMMITTED_EVENTS`` ``committed`` events for the duration histograms. An event's kind and
time are in its key, so counting and ageing events needs no reads.

Every metric is named ``verl_tasks_*`` and labelled ``experiment``. The histograms describe the
newest committed units, not everything since the start: read them with ``histogram_quantile``
directly, not through ``rate()``.
"""
from __future__ import annotations

import json
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from verl_tasks.config import ExperimentConfig
from verl_tasks.errors import IntegrityError
from verl_tasks.layout import Layout
from verl_tasks.ops.safe_mode import read_safe_mode
from verl_tasks.phase_registry import BATCHED, PHASES
from verl_tasks.status import READERS, epoch_units
from verl_tasks.store.base import NotFound, ObjectStore
from verl_tasks.store.conventions import read_skipped
from verl_tasks.store.units import MARKER, CommitRecord, read_marker, stamp_time

log = logging.getLogger(__name__)

# The classic text format: every Prometheus 2.x and 3.x scrapes it (the names here are plain ASCII).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_COMMITTED_EVENTS = 256
MAX_FAULT_EVENTS = 1000
RETRY_EVENTS = ("failed", "task_failed")
FAULT_EVENTS = RETRY_EVENTS + ("fallback", "quarantined")
DURATION_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
COMMIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
UNIT_STATES = ("committed", "failed", "pending", "skipped")

# Gauges that are one number per experiment: name -> help. Absent values are left out, not zero.
GAUGES = {
    "current_epoch": "The epoch in progress (the oldest one not finished; the last one once all are).",
    "pending_ratio": "Share of the current epoch's units still to commit (failed or pending; skipped batches not).",
    "safe_mode": "1 while the experiment is halted in safe mode (control/safe_mode.json exists), else 0.",
    "snapshot_version": "Version of the newest committed snapshot (0: the base policy).",
    "seconds_since_snapshot": "Seconds since the newest committed snapshot was committed.",
    "seconds_since_commit": "Seconds since the newest committed event of any unit (progress).",
    "state_log_lag_seconds": "Seconds since the newest event of the state log (now minus its time).",
    "last_epoch": "The newest epoch with a committed snapshot: the epoch the throughput and reward describe.",
    "samples_per_second": "Samples generated per second over the last epoch (plan start to snapshot commit).",
    "tokens_per_second": "Response tokens generated per second over the last epoch (plan start to snapshot commit).",
    "reward_mean": "Mean training reward of the last epoch's samples (its update's metrics).",
    "reward_std": "Standard deviation of the last epoch's training rewards.",
    "response_length_mean": "Mean response length, in tokens, of the last epoch's samples.",
    "policy_loss": "The last epoch's policy loss, averaged over its optimizer steps.",
    "approx_kl": "Approximate KL between the policy before and after the last epoch's update (mean over steps).",
    "clip_fraction": "Share of the last epoch's response tokens whose ratio was clipped (mean over steps).",
    "entropy": "Mean token entropy of the policy over the last epoch's responses (mean over steps).",
    "grad_norm": "Gradient norm before clipping, averaged over the last epoch's optimizer steps.",
    "learning_rate": "Learning rate of the last epoch's final optimizer step.",
    "eval_accuracy": "Held-out accuracy of the newest evaluated policy (the base policy's before any epoch).",
}


# Gauges read from the last epoch's update metrics: gauge -> key in its metrics.json.
UPDATE_GAUGES = {"reward_mean": "reward_mean", "reward_std": "reward_std",
                 "response_length_mean": "response_length_mean", "policy_loss": "actor/loss",
                 "approx_kl": "actor/ppo_kl", "clip_fraction": "actor/pg_clipfrac", "entropy": "actor/entropy",
                 "grad_norm": "actor/grad_norm", "learning_rate": "actor/lr"}


@dataclass
class ExperimentMetrics:
    """What one experiment's store says, ready to be written as Prometheus families."""

    experiment: str
    gauges: dict[str, float] = field(default_factory=dict)
    units: dict[tuple[str, str], int] = field(default_factory=dict)  # (phase, state) -> units
    retries: Counter = field(default_factory=Counter)  # (phase, event) -> failed tries
    fallbacks: Counter = field(default_factory=Counter)  # phase -> fallback events
    quarantined: Counter = field(default_factory=Counter)  # phase -> units quarantined (to be rebuilt)
    events: Counter = field(default_factory=Counter)  # kind -> events in the state log
    durations: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # phase -> seconds
    commits: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # phase -> seconds


# --- reading the store -----------------------------------------------------------------------------


def event_key_info(key: str) -> tuple[float, str] | None:
    """(time, kind) from an event key ``.../YYYYmmddTHHMMSS.ffffff-<kind>-<id>.json``, or None."""
    name = key.rsplit("/", 1)[-1]
    if not name.endswith(".json") or name.count("-") < 2:
        return None
    stamp, rest = name[: -len(".json")].split("-", 1)
    seconds = stamp_time(stamp)
    if seconds is None:
        return None
    try:
        fraction = float(stamp[15:] or 0)
    except ValueError:
        fraction = 0.0
    return seconds + fraction, rest.rsplit("-", 1)[0]


def read_objects(store: ObjectStore, keys: list[str]) -> list[dict[str, Any]]:
    """The JSON objects at ``keys`` (unreadable ones skipped), read a few at a time."""

    def read(key: str) -> dict[str, Any] | None:
        try:
            body = json.loads(store.get(key))
        except (NotFound, ValueError):
            return None
        return body if isinstance(body, dict) else None

    if not keys:
        return []
    with ThreadPoolExecutor(max_workers=min(READERS, len(keys))) as pool:
        return [body for body in pool.map(read, keys) if body is not None]


def phase_of(layout: Layout, unit: str) -> str:
    """The phase a unit key belongs to (``epochs/N/<phase>/...``, ``snapshots/N``, ``base/<phase>``)."""
    parts = unit[len(layout.root) + 1:].split("/") if unit.startswith(layout.root + "/") else []
    if len(parts) >= 3 and parts[0] == "epochs":
        return parts[2]
    if parts and parts[0] == "snapshots":
        return "snapshot"
    if len(parts) >= 2 and parts[0] == "base":
        return parts[1]
    return "other"


def _marker(store: ObjectStore, unit: str) -> CommitRecord | None:
    try:
        return read_marker(store, unit)
    except IntegrityError:
        return None


def _snapshot_versions(layout: Layout, keys: Iterable[str]) -> list[int]:
    versions = {layout.snapshot_version(k) for k in keys if k.endswith("/" + MARKER)}
    return sorted(v for v in versions if v is not None)


def current_epoch(config: ExperimentConfig, store: ObjectStore, layout: Layout, newest: int | None) -> int:
    """The oldest epoch not finished (snapshot and, when due, evaluation committed); the last one once all are."""
    if not newest:
        return 0
    last = newest - 1  # snapshot N is the policy after epoch N-1
    if last < config.epochs and config.should_evaluate(last) and \
            not store.exists(f"{layout.evaluate(last)}/{MARKER}"):
        return last
    return min(newest, config.epochs - 1)


def _skipped_units(store: ObjectStore, layout: Layout, epoch: int, keys: set[str]) -> set[str]:
    """The batched units of the batches ``epoch`` went on without (``fault_tolerance.min_committed_batch_fraction``)."""
    if f"{layout.skipped(epoch)}/{MARKER}" not in keys:
        return set()
    return {PHASES[phase].unit(layout, epoch, batch)
            for phase in BATCHED for batch in read_skipped(store, layout, epoch)}


def _units(config: ExperimentConfig, store: ObjectStore, layout: Layout, epoch: int, snapshot_keys: set[str],
           failed_units: set[str], out: ExperimentMetrics) -> None:
    """Units per phase and state of ``epoch``, and the pending ratio (failed or pending units over all)."""
    keys = set(store.list(layout.epoch(epoch) + "/")) | snapshot_keys
    skipped = _skipped_units(store, layout, epoch, keys)

    def state(unit: str) -> str:
        if f"{unit}/{MARKER}" in keys:
            return "committed"
        if unit in skipped:
            return "skipped"
        return "failed" if unit in failed_units else "pending"

    phases = epoch_units(config, layout, epoch)
    if not config.should_evaluate(epoch):
        phases.pop("evaluate")
    counts: Counter = Counter()
    for phase, units in phases.items():
        states = Counter(state(unit) for unit in units)
        counts.update(states)
        out.units.update({(phase, name): states[name] for name in UNIT_STATES})
    total = sum(counts.values())
    out.gauges["current_epoch"] = epoch
    out.gauges["pending_ratio"] = (counts["failed"] + counts["pending"]) / total if total else 0.0


def _events(store: ObjectStore, layout: Layout, now: float, out: ExperimentMetrics) -> list[dict[str, Any]]:
    """Count events by kind, age the log, fill the histograms; returns the fault events' bodies."""
    listed = [(key, info) for key in store.list(layout.events + "/") if (info := event_key_info(key))]
    for _, (_, kind) in listed:
        out.events[kind] += 1
    if listed:
        out.gauges["state_log_lag_seconds"] = max(0.0, now - max(at for _, (at, _) in listed))
    committed = [key for key, (_, kind) in listed if kind == "committed"]
    if committed:
        newest = max(info[0] for _, info in listed if info[1] == "committed")
        out.gauges["seconds_since_commit"] = max(0.0, now - newest)
    for body in read_objects(store, committed[-MAX_COMMITTED_EVENTS:]):
        phase = str(body.get("phase") or phase_of(layout, str(body.get("unit", ""))))
        if isinstance(body.get("duration_s"), (int, float)):
            out.durations[phase].append(float(body["duration_s"]))
        if isinstance(body.get("commit_s"), (int, float)):
            out.commits[phase].append(float(body["commit_s"]))
    faults = [key for key, (_, kind) in listed if kind in FAULT_EVENTS]
    return read_objects(store, faults[-MAX_FAULT_EVENTS:])


def _faults(layout: Layout, bodies: list[dict[str, Any]], out: ExperimentMetrics) -> set[str]:
    """Retries, fallbacks and quarantined units per phase; returns the units that ever failed a try."""
    failed_units = set()
    for body in bodies:
        kind, unit = body.get("kind"), str(body.get("unit", ""))
        phase = str(body.get("phase") or phase_of(layout, unit))
        if kind in RETRY_EVENTS and body.get("refused"):
            continue  # safe mode refused the try: the unit did not run, nor fail
        if kind in RETRY_EVENTS:
            out.retries[(phase, kind)] += 1
            failed_units.add(unit)
        elif kind == "fallback":
            out.fallbacks[phase] += 1
        elif kind == "quarantined":
            for lost in body.get("quarantined") or [unit]:
                out.quarantined[phase_of(layout, str(lost))] += 1
    return failed_units


def _last_epoch(config: ExperimentConfig, store: ObjectStore, layout: Layout, newest: int | None, now: float,
                out: ExperimentMetrics) -> None:
    """Snapshot age, and the throughput, reward and accuracy of the newest finished epoch."""
    snapshot = _marker(store, layout.snapshot(newest)) if newest is not None else None
    if snapshot is not None and newest is not None:
        out.gauges["snapshot_version"] = newest
        out.gauges["seconds_since_snapshot"] = max(0.0, now - snapshot.committed_at)
    evaluated = [layout.base_evaluate]
    if newest and snapshot is not None:
        last = newest - 1
        out.gauges["last_epoch"] = last
        update, plan = _marker(store, layout.update(last)), _marker(store, layout.plan(last))
        metrics = dict(update.meta.get("metrics", {})) if update else {}
        out.gauges.update({gauge: float(metrics[key]) for gauge, key in UPDATE_GAUGES.items()
                           if isinstance(metrics.get(key), (int, float))})
        started = stamp_time(plan.attempt) if plan else None
        if started is not None and snapshot.committed_at > started and "samples" in metrics:
            wall = snapshot.committed_at - started
            out.gauges["samples_per_second"] = metrics["samples"] / wall
            if "response_length_mean" in metrics:
                out.gauges["tokens_per_second"] = metrics["samples"] * metrics["response_length_mean"] / wall
        due = islice((e for e in range(last, -1, -1) if config.should_evaluate(e)), 2)  # pending, or done
        evaluated = [layout.evaluate(e) for e in due] + evaluated
    for unit in evaluated:
        record = _marker(store, unit)
        accuracy = record.meta.get("metrics", {}).get("eval_accuracy") if record else None
        if isinstance(accuracy, (int, float)):
            out.gauges["eval_accuracy"] = float(accuracy)
            return


def experiment_metrics(config: ExperimentConfig, store: ObjectStore, now: float | None = None) -> ExperimentMetrics:
    """Everything the exposition says about one experiment, from its store (bounded reads; see the module doc).

    Raises:
        StoreError, OSError, botocore errors: the store cannot be listed or read.
    """
    now = time.time() if now is None else now
    layout = Layout(config.experiment)
    out = ExperimentMetrics(config.experiment)
    snapshot_keys = set(store.list(layout.snapshots + "/"))
    versions = _snapshot_versions(layout, snapshot_keys)
    newest = versions[-1] if versions else None
    failed_units = _faults(layout, _events(store, layout, now, out), out)
    _units(config, store, layout, current_epoch(config, store, layout, newest), snapshot_keys, failed_units, out)
    _last_epoch(config, store, layout, newest, now, out)
    out.gauges["safe_mode"] = 1.0 if read_safe_mode(store, layout) is not None else 0.0
    return out


# --- the exposition --------------------------------------------------------------------------------


def _histogram(name: str, doc: str, buckets: tuple[float, ...], items: list[ExperimentMetrics],
               values: str) -> HistogramMetricFamily:
    family = HistogramMetricFamily(f"verl_tasks_{name}", doc, labels=["experiment", "phase"])
    for item in items:
        for phase, seconds in sorted(getattr(item, values).items()):
            counts = [(repr(le), sum(v <= le for v in seconds)) for le in buckets] + [("+Inf", len(seconds))]
            family.add_metric([item.experiment, phase], counts, sum_value=sum(seconds))
    return family


def families(items: list[ExperimentMetrics]) -> Iterator[Any]:
    """The metric families of ``items`` (one family per name; one sample per experiment and label set)."""
    for name, doc in GAUGES.items():
        gauge = GaugeMetricFamily(f"verl_tasks_{name}", doc, labels=["experiment"])
        for item in items:
            if name in item.gauges:
                gauge.add_metric([item.experiment], item.gauges[name])
        yield gauge
    units = GaugeMetricFamily("verl_tasks_units", "Units of the current epoch per phase and state (failed: not "
                              "committed and a try failed; skipped: a batch the epoch went on without).",
                              labels=["experiment", "phase", "state"])
    retries = CounterMetricFamily("verl_tasks_retries", "Failed tries of units per phase (each is retried, or halts "
                                  "the experiment after the last): event=failed from the unit itself, "
                                  "event=task_failed from Airflow's retry/failure callbacks.",
                                  labels=["experiment", "phase", "event"])
    fallbacks = CounterMetricFamily("verl_tasks_fallbacks", "Fallbacks from a corrupt snapshot to the previous valid "
                                    "one (fallback events).", labels=["experiment", "phase"])
    quarantined = CounterMetricFamily("verl_tasks_quarantined_units", "Units quarantined to be rebuilt (a corrupt "
                                      "snapshot, its update, a corrupt marker), per phase.",
                                      labels=["experiment", "phase"])
    events = CounterMetricFamily("verl_tasks_events", "Events in the state log, per kind.",
                                 labels=["experiment", "kind"])
    for item in items:
        for (phase, state), count in sorted(item.units.items()):
            units.add_metric([item.experiment, phase, state], count)
        # Every phase has its counters from the start: an alert on increase() sees the first fault.
        for phase, event in sorted({(p, e) for p in PHASES for e in RETRY_EVENTS} | set(item.retries)):
            retries.add_metric([item.experiment, phase, event], item.retries[(phase, event)])
        for phase in sorted(set(PHASES) | set(item.fallbacks)):
            fallbacks.add_metric([item.experiment, phase], item.fallbacks[phase])
        for phase in sorted(set(PHASES) | set(item.quarantined)):
            quarantined.add_metric([item.experiment, phase], item.quarantined[phase])
        for kind, count in sorted(item.events.items()):
            events.add_metric([item.experiment, kind], count)
    yield from (units, retries, fallbacks, quarantined, events)
    yield _histogram("unit_duration_seconds", f"Wall time of the newest {MAX_COMMITTED_EVENTS} committed units, "
                     "per phase (start to commit).", DURATION_BUCKETS, items, "durations")
    yield _histogram("store_commit_seconds", f"Store commit latency of the newest {MAX_COMMITTED_EVENTS} committed "
                     "units, per phase (check the attempt's files, write the marker).", COMMIT_BUCKETS, items,
                     "commits")


class _Fixed(Collector):
    """A collector over values computed once (a registry per exposition, nothing global)."""

    def __init__(self, items: list[ExperimentMetrics]):
        self.items = items

    def collect(self) -> Iterator[Any]:
        return families(self.items)


def registry_for(items: list[ExperimentMetrics]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(items))
    return registry


def render_metrics(experiments: Iterable[tuple[ExperimentConfig, ObjectStore]], now: float | None = None) -> str:
    """Prometheus text exposition (format 0.0.4) of each (config, store) pair's experiment.

    Raises:
        The store's errors: an experiment whose store cannot be read fails the whole call.
    """
    items = [experiment_metrics(config, store, now) for config, store in experiments]
    return generate_latest(registry_for(items)).decode()


def render_reachable(experiments: Iterable[tuple[ExperimentConfig, ObjectStore]]) -> str:
    """Like :func:`render_metrics`, but an experiment whose store fails is logged and left out.

    For the plugin's route: one scrape covers many stores, and one unreachable store must not
    blank the others (its series go absent, which an ``absent()`` alert can catch).
    """
    items = []
    for config, store in experiments:
        try:
            items.append(experiment_metrics(config, store))
        except Exception as err:  # noqa: BLE001 - S3, disk and parse errors alike: leave this one out
            log.warning("no metrics for %s (%s): %s: %s", config.experiment, store.uri, type(err).__name__, err)
    return generate_latest(registry_for(items)).decode()


def write_metrics(path: Path, experiments: Iterable[tuple[ExperimentConfig, ObjectStore]]) -> None:
    """Write the exposition to ``path`` atomically (a temporary file renamed over it), for a textfile collector."""
    items = [experiment_metrics(config, store) for config, store in experiments]
    write_to_textfile(str(path), registry_for(items))


__all__ = ["CONTENT_TYPE", "ExperimentMetrics", "experiment_metrics", "families", "render_metrics", "render_reachable",
           "write_metrics", "GAUGES"]
