"""Routine care of a whole store: verify each experiment's newest snapshots, collect its garbage, say what is wrong.

For every experiment of the store (a top-level folder holding ``experiment.json``):

1. the newest ``verify_newest`` committed snapshots whose weights retention kept are verified
   (:func:`verl_tasks.ops.checkpoint.verify`: every file's sha256 against the manifest, then,
   with ``forward``, the policy loaded and one forward pass run);
2. :func:`verl_tasks.ops.gc.collect` removes garbage older than ``older_than_s``, with its
   safety rules: an attempt of an uncommitted unit is kept until it was idle for its phase's
   ``fault_tolerance.timeout_s`` (read from the experiment's pinned config) plus a margin.

A failed verification, an unreadable ``experiment.json`` or a gc error is a *problem*; the
caller (the maintenance DAG of :mod:`verl_tasks.airflow.maintenance`) fails and notifies on
any. Each experiment's event log gets a ``maintenance`` event with the verdicts and gc counts.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from verl_tasks.errors import VerlTasksError
from verl_tasks.events import record_event
from verl_tasks.layout import Layout
from verl_tasks.ops.gc import GcReport, collect
from verl_tasks.pinning import read_pin
from verl_tasks.store.base import ObjectStore
from verl_tasks.store.conventions import snapshot_versions
from verl_tasks.store.units import is_pruned

log = logging.getLogger(__name__)
EXPERIMENT_JSON = "experiment.json"


@dataclass
class ExperimentCare:
    """What maintenance found and did in one experiment."""

    experiment: str
    verified: list[dict[str, Any]] = field(default_factory=list)  # version, state, problems
    gc: GcReport | None = None
    problems: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [f"{self.experiment}: snapshot {v['version']} {v['state']}" + (": " + "; ".join(v["problems"])
                                                                             if v["problems"] else "")
               for v in self.verified]
        if self.gc is not None:
            out.append(f"{self.experiment}: gc removed {len(self.gc.lines())} item(s) ({self.gc.deleted_keys} keys), "
                       f"kept {self.gc.kept_recent} recent attempt(s)")
        return out + [f"{self.experiment}: PROBLEM {p}" for p in self.problems]


@dataclass
class StoreCare:
    """What maintenance found and did in one store."""

    uri: str
    experiments: list[ExperimentCare] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        return [f"{care.experiment}: {problem}" for care in self.experiments for problem in care.problems]

    def lines(self) -> list[str]:
        return [line for care in self.experiments for line in care.lines()]

    def summary(self) -> dict[str, Any]:
        """Small and JSON-serialisable (an Airflow XCom)."""
        return {"store": self.uri, "experiments": len(self.experiments), "problems": self.problems[:20],
                "verified": sum(len(c.verified) for c in self.experiments),
                "gc_deleted_keys": sum(c.gc.deleted_keys for c in self.experiments if c.gc is not None)}


def list_experiments(store: ObjectStore) -> list[str]:
    """Experiments of a store: the top-level folders holding ``experiment.json``."""
    keys = store.list("")
    return sorted(key.split("/", 1)[0] for key in keys if key.count("/") == 1 and key.endswith("/" + EXPERIMENT_JSON))


def newest_versions(store: ObjectStore, layout: Layout, count: int) -> list[int]:
    """The newest ``count`` committed snapshots whose weights retention kept, newest first."""
    out: list[int] = []
    for version in reversed(snapshot_versions(store, layout)):
        if len(out) == count:
            break
        if not is_pruned(store, layout.snapshot(version)):
            out.append(version)
    return out


def care_for(store: ObjectStore, experiment: str, *, verify_newest: int, forward: bool,
             older_than_s: float) -> ExperimentCare:
    """Verify and collect one experiment; problems are collected, never raised."""
    from verl_tasks.ops.checkpoint import SnapshotRef, verify

    layout, care = Layout(experiment), ExperimentCare(experiment)
    for version in newest_versions(store, layout, verify_newest):
        verdict = verify(SnapshotRef(store, layout, version), forward=forward)
        care.verified.append({"version": version, "state": verdict.state, "problems": verdict.problems})
        if not verdict.ok:
            care.problems.append(f"snapshot {version} ({store.url(verdict.unit)}) failed verification: "
                                 + "; ".join(verdict.problems))
    try:
        pin = read_pin(store, layout) or {}
        timeouts = ((pin.get("config") or {}).get("fault_tolerance") or {}).get("timeout_s") or {}
        care.gc = collect(store, layout, older_than_s, timeouts=timeouts)
    except (VerlTasksError, OSError) as err:
        care.problems.append(f"gc not run: {type(err).__name__}: {err}")
    record_event(store, layout, "maintenance", verified=care.verified, problems=care.problems,
                 gc_deleted_keys=care.gc.deleted_keys if care.gc else None)
    return care


def maintain_store(store: ObjectStore, *, verify_newest: int = 1, forward: bool = True,
                   older_than_s: float = 86400.0) -> StoreCare:
    """Care for every experiment of ``store`` (see the module docstring); never raises for one experiment's problem."""
    care = StoreCare(store.uri)
    for experiment in list_experiments(store):
        care.experiments.append(care_for(store, experiment, verify_newest=verify_newest, forward=forward,
                                         older_than_s=older_than_s))
    log.info("maintenance of %s: %d experiment(s), %d problem(s)", care.uri, len(care.experiments), len(care.problems))
    return care
