"""Garbage collection: dead attempt folders, stale temp files, and tombstones/quarantine records past an age.

An attempt folder is removed only when it can never be committed and no
running task may still be writing it: its unit has a marker naming another
attempt, or nothing was written in it for the phase's timeout plus a margin
(``garbage_attempts``). It must also be older than ``older_than``, and no
younger tombstone or quarantine record may name it (rolled-back data is kept
for that long). A local store's ``.tmp-`` files follow the same rule: those in
an attempt folder (half-written files, and finished ones waiting in a staging
folder for the rest) count as its writes and go only with it; any other goes
when idle for its phase's timeout plus the margin and older than ``older_than``.
"""
from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from verl_tasks.errors import ConfigError, IntegrityError
from verl_tasks.events import record_event
from verl_tasks.layout import Layout
from verl_tasks.ops.rollback import tombstone_units
from verl_tasks.store.base import ObjectStore
from verl_tasks.store.conventions import quarantine_records
from verl_tasks.store.units import ATTEMPTS, FENCED, MARKER, read_marker, stamp_time

log = logging.getLogger(__name__)

_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
# Past its phase's timeout, an attempt idle this much longer belongs to a dead task.
IDLE_MARGIN_S = 3600.0


def attempt_of(key: str) -> tuple[str, str] | None:
    """(unit, attempt id) of a key inside an attempt folder, staged files included; else None."""
    at = key.find(f"/{ATTEMPTS}/")
    if at < 0:
        return None
    return key[:at], key[at + len(ATTEMPTS) + 2 :].split("/", 1)[0]


def garbage_attempts(store: ObjectStore, prefix: str, *, now: float | None = None,
                     idle_limit: Callable[[str], float] = lambda unit: IDLE_MARGIN_S) -> list[str]:
    """Attempt folders under ``prefix`` that can never be committed, or whose writer is surely dead.

    A folder no marker names is garbage when its unit has a marker naming
    another attempt (a loser), or when no file in it was written for
    ``idle_limit(unit)`` seconds (a crashed attempt). A young attempt of an
    uncommitted unit may still be running: it is kept, whatever its age.
    Files in flight (a local store's ``.tmp-`` files and staging folders) count
    as the attempt's writes.
    """
    now = time.time() if now is None else now
    # Staged and half-written files are the attempt's writes too: a library filling a staging folder keeps it live.
    modified = {**store.temp_files(prefix), **store.list_modified(prefix)}
    markers: dict[str, str | None] = {}
    newest: dict[tuple[str, str], float] = {}
    for key, mtime in modified.items():
        if key.endswith("/" + MARKER):
            unit = key[: -len(MARKER) - 1]
            try:
                rec = read_marker(store, unit)
                markers[unit] = rec.attempt if rec else None
            except IntegrityError:
                markers[unit] = None
        folder = attempt_of(key)
        if folder is not None:
            newest[folder] = max(newest.get(folder, mtime), mtime)
    garbage = []
    for (unit, attempt), mtime in newest.items():
        named = markers.get(unit)
        if named == attempt:
            continue
        if named is not None or now - mtime > idle_limit(unit):
            garbage.append(f"{unit}/{ATTEMPTS}/{attempt}/")
    return sorted(garbage)


def parse_age(text: str) -> float:
    """Seconds in ``"90"``, ``"30s"``, ``"15m"``, ``"1h"``, ``"2d"``, ``"1w"``."""
    match = _AGE.match(str(text))
    if not match:
        raise ConfigError(f"--older-than {text!r}: use a number with s, m, h, d or w (e.g. 1h)")
    return float(match.group(1)) * _UNITS[match.group(2)]


def phase_of(layout: Layout, unit: str) -> str:
    """The phase (task) that writes ``unit``: its timeout bounds how long a live attempt stays idle."""
    parts = unit[len(layout.root) + 1 :].split("/")
    if parts[0] == "epochs" and len(parts) > 2:
        return parts[2]
    if parts[0] == "snapshots":
        return "snapshot" if parts[1:2] != ["00000"] else "plan"
    return "evaluate" if parts[0] == "base" else "plan"  # data/ and the base snapshot: the first plan


def _dead_temp_files(store: ObjectStore, dead_attempts: list[str], cutoff: float, now: float,
                     idle_limit: Callable[[str], float], prefix: str) -> list[str]:
    """``.tmp-`` files whose writer is surely gone. One in an uncommitted attempt's folder goes with that
    attempt, never alone: a finished file may wait hours in a live attempt's staging folder for the rest."""
    dead = {attempt_of(folder) for folder in dead_attempts}
    out = []
    for key, mtime in store.temp_files(prefix).items():
        owner = attempt_of(key)
        idle = mtime <= cutoff and now - mtime > idle_limit(key.rsplit("/", 1)[0])
        # Else only beside the units, or left in a committed attempt by a writer that died.
        if owner in dead or (idle and (owner is None or _committed_as(store, *owner))):
            out.append(key)
    return sorted(out)


def _committed_as(store: ObjectStore, unit: str, attempt: str) -> bool:
    try:
        record = read_marker(store, unit)
    except IntegrityError:
        return False
    return record is not None and record.attempt == attempt


@dataclass
class GcReport:
    attempts: list[str] = field(default_factory=list)
    tombstones: list[str] = field(default_factory=list)
    quarantine_records: list[str] = field(default_factory=list)
    temp_files: list[str] = field(default_factory=list)
    fence_records: list[str] = field(default_factory=list)
    kept_recent: int = 0
    deleted_keys: int = 0

    def lines(self) -> list[str]:
        return ([f"attempt    {p}" for p in self.attempts] + [f"tombstone  {p}" for p in self.tombstones]
                + [f"quarantine {k}" for k in self.quarantine_records] + [f"temp file  {k}" for k in self.temp_files]
                + [f"fence      {k}" for k in self.fence_records])


def collect(store: ObjectStore, layout: Layout, older_than_s: float, dry_run: bool = False,
            now: float | None = None, timeouts: dict[str, float] | None = None,
            margin_s: float = IDLE_MARGIN_S) -> GcReport:
    """Find (and unless ``dry_run`` delete) garbage of one experiment.

    Args:
        timeouts: ``fault_tolerance.timeout_s`` (per phase); an attempt idle for its
            phase's timeout plus ``margin_s`` belongs to a dead task.
    """
    timeouts = timeouts or {}
    now = time.time() if now is None else now
    cutoff = now - older_than_s
    report = GcReport()
    protected: set[str] = set()
    for prefix, entry in tombstone_units(store, layout).items():
        created = entry["created_at"] or stamp_time(prefix.rsplit("/", 1)[-1]) or now
        if created <= cutoff:
            report.tombstones.append(prefix + "/")
        else:
            protected.update(f"{unit}/{ATTEMPTS}/{att}/" for unit, att in entry["attempts"].items())
    # Every folder that holds units: a re-pin quarantines data/ and base/evaluate too.
    keys = [key for folder in ("epochs", "snapshots", "data", "base") for key in store.list(f"{layout.root}/{folder}/")]
    for record in quarantine_records(store, keys):
        if (record["created"] or now) <= cutoff:
            report.quarantine_records.append(record["record"])
        elif record["attempt"]:
            protected.add(f"{record['unit']}/{ATTEMPTS}/{record['attempt']}/")

    def idle_limit(unit: str) -> float:
        return timeouts.get(phase_of(layout, unit), 0.0) + margin_s

    for prefix in garbage_attempts(store, layout.root + "/", now=now, idle_limit=idle_limit):
        attempt = prefix.rstrip("/").rsplit("/", 1)[-1]
        started = stamp_time(attempt)
        if prefix in protected or (started is not None and started > cutoff):
            report.kept_recent += 1
            continue
        report.attempts.append(prefix)
    report.temp_files = _dead_temp_files(store, report.attempts, cutoff, now, idle_limit, layout.root + "/")
    # A fence outlives its attempt only to refuse a late commit; past the horizon that attempt is long dead.
    # Any unit may be fenced (a snapshot's, the base evaluation's too), not only an epoch's.
    report.fence_records = sorted(k for k, mtime in store.list_modified(layout.root + "/").items()
                                  if f"/{FENCED}/" in k and mtime <= cutoff)
    if not dry_run:
        for prefix in report.attempts + report.tombstones:
            report.deleted_keys += store.delete_prefix(prefix)
        for key in report.quarantine_records + report.temp_files + report.fence_records:
            store.delete(key)
            report.deleted_keys += 1
        if report.deleted_keys:
            record_event(store, layout, "gc", attempts=len(report.attempts), tombstones=len(report.tombstones),
                         quarantine_records=len(report.quarantine_records), temp_files=len(report.temp_files),
                         fence_records=len(report.fence_records),
                         deleted_keys=report.deleted_keys)
    log.info("gc %s: %d attempt folder(s), %d tombstone(s), %d quarantine record(s), %d temp file(s)%s",
             layout.experiment, len(report.attempts), len(report.tombstones), len(report.quarantine_records),
             len(report.temp_files), " (dry run)" if dry_run else "")
    return report
