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
from verl_tasks.store.base import ObjectStore

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


def read_events(store: ObjectStore, layout: Layout, limit: int | None = None) -> list[dict[str, Any]]:
    """Events in time order (the newest ``limit`` if given)."""
    keys = store.list(layout.events + "/")
    if limit is not None:
        keys = keys[-limit:]
    out = []
    for key in keys:
        try:
            out.append(json.loads(store.get(key)))
        except Exception:  # noqa: BLE001 - one unreadable event should not hide the rest
            continue
    return out


def follow_events(store: ObjectStore, layout: Layout, every: float = 1.0) -> Iterator[dict[str, Any]]:
    """Events as they are recorded, oldest first, forever (a process watching a run; never breaks it)."""
    seen: set[str] = set()
    while True:
        for key in store.list(layout.events + "/"):
            if key in seen:
                continue
            seen.add(key)
            try:
                yield json.loads(store.get(key))
            except Exception:  # noqa: BLE001 - an unreadable event is skipped, like in read_events
                continue
        time.sleep(every)

