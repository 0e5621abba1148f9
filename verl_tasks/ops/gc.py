"""Garbage collection: attempt folders no marker names, and tombstones/quarantine records past an age.

An attempt folder is removed only when it is older than ``older_than`` (an
attempt that is still running has no marker yet) and no younger tombstone or
quarantine record names it (rolled-back data is kept for that long).
"""
from __future__ import annotations

import calendar
import json
import logging
import re
import time
from dataclasses import dataclass, field

from verl_tasks.errors import ConfigError
from verl_tasks.events import record_event
from verl_tasks.layout import Layout
from verl_tasks.ops.rollback import tombstone_units
from verl_tasks.store.base import ObjectStore
from verl_tasks.store.units import ATTEMPTS, QUARANTINE, garbage_attempts

log = logging.getLogger(__name__)

_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_age(text: str) -> float:
    """Seconds in ``"90"``, ``"30s"``, ``"15m"``, ``"1h"``, ``"2d"``, ``"1w"``."""
    match = _AGE.match(str(text))
    if not match:
        raise ConfigError(f"--older-than {text!r}: use a number with s, m, h, d or w (e.g. 1h)")
    return float(match.group(1)) * _UNITS[match.group(2)]


def stamp_time(name: str) -> float | None:
    """Epoch seconds of a ``YYYYmmddTHHMMSS...`` attempt id or tombstone stamp, or None."""
    try:
        return float(calendar.timegm(time.strptime(name[:15], "%Y%m%dT%H%M%S")))
    except ValueError:
        return None


@dataclass
class GcReport:
    attempts: list[str] = field(default_factory=list)
    tombstones: list[str] = field(default_factory=list)
    quarantine_records: list[str] = field(default_factory=list)
    kept_recent: int = 0
    deleted_keys: int = 0

    def lines(self) -> list[str]:
        return ([f"attempt    {p}" for p in self.attempts] + [f"tombstone  {p}" for p in self.tombstones]
                + [f"quarantine {k}" for k in self.quarantine_records])


def collect(store: ObjectStore, layout: Layout, older_than_s: float, dry_run: bool = False,
            now: float | None = None) -> GcReport:
    """Find (and unless ``dry_run`` delete) garbage of one experiment."""
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
    keys = store.list(layout.root + "/epochs/") + store.list(layout.snapshots + "/") + store.list(layout.root + "/data/")
    for key in keys:
        at = key.find(f"/{QUARANTINE}/")
        if at < 0:
            continue
        created = stamp_time(key.rsplit("/", 1)[-1]) or now
        if created <= cutoff:
            report.quarantine_records.append(key)
            continue
        try:
            attempt = json.loads(json.loads(store.get(key))["marker"])["attempt"]
            protected.add(f"{key[:at]}/{ATTEMPTS}/{attempt}/")
        except (KeyError, ValueError, TypeError):
            pass
    for prefix in garbage_attempts(store, layout.root + "/"):
        attempt = prefix.rstrip("/").rsplit("/", 1)[-1]
        started = stamp_time(attempt)
        if prefix in protected or (started is not None and started > cutoff):
            report.kept_recent += 1
            continue
        report.attempts.append(prefix)
    if not dry_run:
        for prefix in report.attempts + report.tombstones:
            report.deleted_keys += store.delete_prefix(prefix)
        for key in report.quarantine_records:
            store.delete(key)
            report.deleted_keys += 1
        if report.deleted_keys:
            record_event(store, layout, "gc", attempts=len(report.attempts), tombstones=len(report.tombstones),
                         quarantine_records=len(report.quarantine_records), deleted_keys=report.deleted_keys)
    log.info("gc %s: %d attempt folder(s), %d tombstone(s), %d quarantine record(s)%s", layout.experiment,
             len(report.attempts), len(report.tombstones), len(report.quarantine_records),
             " (dry run)" if dry_run else "")
    return report
