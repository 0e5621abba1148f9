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


def test_an_unreadable_event_is_skipped_with_a_warning_naming_it_and_a_failing_store_raises(tmp_path, caplog):
    import itertools

    import pytest

    from verl_tasks.errors import StoreError
    from verl_tasks.events import follow_events
    from verl_tasks.store import LocalStore

    class Listed(LocalStore):
        """Lists one event more than it holds (deleted between the listing and the read)."""

        def list(self, prefix: str) -> list[str]:
            return sorted([*super().list(prefix), f"{layout.events}/20000101T000000.000000-started-gone.json"])

    store, layout = Listed(tmp_path / "store"), Layout("exp")
    record_event(store, layout, "started", unit="u0")
    store.put(f"{layout.events}/20000101T000001.000000-started-cut.json", b'{"kind": "sta')  # a power loss
    store.put(f"{layout.events}/20000101T000002.000000-started-list.json", b"[1, 2]")
    record_event(store, layout, "committed", unit="u0")
    with caplog.at_level(logging.WARNING, logger="verl_tasks.events"):
        assert [e["kind"] for e in read_events(store, layout)] == ["started", "committed"]
    messages = [r.getMessage() for r in caplog.records if r.name == "verl_tasks.events"]
    assert all(r.levelno == logging.WARNING for r in caplog.records if r.name == "verl_tasks.events")
    assert len(messages) == 3 and "started-gone.json was deleted after it was listed" in messages[0], messages
    assert "started-cut.json is not readable JSON" in messages[1], messages
    assert "started-list.json holds a list, not an event object" in messages[2], messages
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="verl_tasks.events"):
        followed = list(itertools.islice(follow_events(store, layout, every=0.01), 2))
    assert [e["kind"] for e in followed] == ["started", "committed"]
    assert len([r for r in caplog.records if r.name == "verl_tasks.events"]) == 3

    class Failing(LocalStore):
        def get(self, key: str) -> bytes:
            raise StoreError(f"{key}: the store did not answer")

    with pytest.raises(StoreError, match="did not answer"):  # not mistaken for one unreadable event
        read_events(Failing(tmp_path / "store"), layout)
