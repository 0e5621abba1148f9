"""Events are cheap telemetry: written atomically without fsync; markers keep theirs."""
from __future__ import annotations

import logging
import os

from verl_tasks.events import read_events, record_event
from verl_tasks.layout import Layout
from verl_tasks.store import open_store
from verl_tasks.store.units import UnitWriter, read_marker


def test_events_skip_fsync_but_a_commit_does_not(tmp_path, monkeypatch):
    store, layout = open_store(f"file://{tmp_path}/store"), Layout("exp")
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    record_event(store, layout, "started", unit="u0", epoch=0)
    # The experiment's first write made its new folders durable (store root, exp, events), once.
    assert len(synced) == 3, synced
    for i in (1, 2):
        record_event(store, layout, "started", unit=f"u{i}", epoch=0)
    assert len(synced) == 3, "an event write waited for the disk"
    kinds = [(e["kind"], e["unit"]) for e in read_events(store, layout)]
    assert kinds == [("started", "u0"), ("started", "u1"), ("started", "u2")]
    assert not [k for k in store.list(layout.events + "/") if "/.tmp-" in k]
    writer = UnitWriter(store, "exp/epochs/00000/plan")
    writer.write_json("plan.json", {"epoch": 0})
    writer.commit({})
    assert len(synced) >= 4, "the unit's file, its marker and their folders must be fsynced"
    assert read_marker(store, "exp/epochs/00000/plan") is not None


def test_an_event_that_cannot_be_written_does_not_fail_the_caller(tmp_path, caplog):
    store, layout = open_store(f"file://{tmp_path}/store"), Layout("exp")
    (tmp_path / "store" / "exp").mkdir(parents=True)
    blocker = tmp_path / "store" / "exp" / "events"
    blocker.write_text("a file where the folder should be")
    with caplog.at_level(logging.WARNING, logger="verl_tasks.events"):
        assert record_event(store, layout, "started", unit="u0") is None  # returned: nothing raised
    warnings = [r for r in caplog.records if r.name == "verl_tasks.events"]
    assert [r.levelno for r in warnings] == [logging.WARNING], warnings
    message = warnings[0].getMessage()
    assert message.startswith("could not record started event: ") and "Not a directory" in message, message
    assert str(blocker) in message, message  # names where it tried to write
    assert blocker.read_text() == "a file where the folder should be"  # nothing overwritten
    assert sorted(p.name for p in blocker.parent.iterdir()) == ["events"]  # no temporary file left
    # The caller goes on: a unit of the same experiment still commits.
    writer = UnitWriter(store, "exp/epochs/00000/plan")
    writer.write_json("plan.json", {"epoch": 0})
    assert writer.commit({})[1] and read_marker(store, "exp/epochs/00000/plan") is not None
