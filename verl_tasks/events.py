"""The state log: one small JSON object per event under ``<experiment>/events/``.

Event keys sort by time, so ``status``, the dashboard and a person after an
incident can replay what happened in order. Writing an event never fails the
phase that reports it, and does not wait for the disk (``ObjectStore.put_volatile``):
events are telemetry, the units' ``_SUCCESS`` markers are the truth, so a power
loss may lose the newest events but never a commit.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

from verl_tasks.layout import Layout
from verl_tasks.store.base import NotFound, ObjectStore

log = logging.getLogger(__name__)


def record_event(store: ObjectStore, layout: Layout, kind: str, **fields: Any) -> None:
    """Append one event. Fields should be small: ids, durations, sizes, an error string."""
    now = time.time()
    body = {"kind": kind, "time": now, "host": socket.gethostname(), "pid": os.getpid(), **fields}
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f"{now % 1:.6f}"[1:]
    name = f"{stamp}-{kind}-{uuid.uuid4().hex[:6]}.json"
    try:
        store.put_volatile(f"{layout.events}/{name}", json.dumps(body, sort_keys=True, default=str).encode())
    except Exception as err:  # noqa: BLE001 - the log must never break training
        log.warning("could not record %s event: %s", kind, err)


def _read_event(store: ObjectStore, key: str) -> dict[str, Any] | None:
    """The event at ``key``; None, with a warning naming it, when it is gone since it was listed or is
    not a JSON object (cut short by a power loss: events are written without fsync). A store that
    fails to answer raises, as for any other read."""
    try:
        event = json.loads(store.get(key))
    except NotFound:
        log.warning("event %s was deleted after it was listed; skipped", key)
        return None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        log.warning("event %s is not readable JSON (%s); skipped", key, err)
        return None
    if not isinstance(event, dict):
        log.warning("event %s holds a %s, not an event object; skipped", key, type(event).__name__)
        return None
    return event


def read_events(store: ObjectStore, layout: Layout, limit: int | None = None) -> list[dict[str, Any]]:
    """Events in time order (the newest ``limit`` if given); an unreadable one is skipped with a warning
    (it should not hide the rest)."""
    keys = store.list(layout.events + "/")
    if limit is not None:
        keys = keys[-limit:]
    return [event for key in keys if (event := _read_event(store, key)) is not None]


def recent_events(store: ObjectStore, layout: Layout, kind: str, limit: int) -> list[dict[str, Any]]:
    """The newest ``limit`` events of ``kind``, newest first: chosen by their keys' names (which carry the
    kind), so only those events are read."""
    keys = [key for key in store.list(layout.events + "/") if f"-{kind}-" in key.rsplit("/", 1)[-1]]
    return [event for key in reversed(keys[-limit:]) if (event := _read_event(store, key)) is not None]


def follow_events(store: ObjectStore, layout: Layout, every: float = 1.0) -> Iterator[dict[str, Any]]:
    """Events as they are recorded, oldest first, forever (a process watching a run; never breaks it)."""
    seen: set[str] = set()
    while True:
        for key in store.list(layout.events + "/"):
            if key in seen:
                continue
            seen.add(key)
            event = _read_event(store, key)  # an unreadable event is skipped, like in read_events
            if event is not None:
                yield event
        time.sleep(every)

