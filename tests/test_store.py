"""The commit protocol on both backends: visibility, races, corruption, missing files, gc, keys."""
from __future__ import annotations

import json
import threading

import pytest

from verl_tasks.errors import IntegrityError, UnsafeKey
from verl_tasks.store.units import (
    MARKER,
    UnitWriter,
    garbage_attempts,
    quarantine,
    read_bytes,
    read_marker,
    verify_unit,
)

UNIT = "exp/epochs/00000/rollout/b0000"


def test_uncommitted_unit_is_invisible_then_commit_publishes(store):
    writer = UnitWriter(store, UNIT)
    writer.write_bytes("samples.jsonl", b'{"a": 1}\n')
    assert read_marker(store, UNIT) is None
    record, won = writer.commit({"samples": 1})
    assert won
    again = read_marker(store, UNIT)
    assert again == record
    assert read_bytes(store, again, "samples.jsonl") == b'{"a": 1}\n'
    assert again.files["samples.jsonl"].size == 9


def test_race_exactly_one_winner_loser_returns_winner(store):
    results = []
    barrier = threading.Barrier(4)

    def attempt(i: int) -> None:
        writer = UnitWriter(store, UNIT)
        writer.write_bytes("data.bin", f"attempt-{i}".encode())
        barrier.wait()
        results.append(writer.commit({"i": i}))

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [rec for rec, won in results if won]
    assert len(winners) == 1
    assert {rec.attempt for rec, _ in results} == {winners[0].attempt}
    # losers removed their attempt folders; only the winner's data remains
    attempts = {k.split("/.attempts/")[1].split("/")[0] for k in store.list(UNIT + "/") if "/.attempts/" in k}
    assert attempts == {winners[0].attempt}


def test_corrupt_marker_is_reported_not_ignored(store):
    writer = UnitWriter(store, UNIT)
    writer.write_bytes("x", b"1")
    writer.commit()
    store.put(f"{UNIT}/{MARKER}", b"{not json")
    with pytest.raises(IntegrityError, match="corrupt _SUCCESS"):
        read_marker(store, UNIT)
    # quarantine moves it aside; the unit reads as absent and can be committed again
    assert quarantine(store, UNIT, "test")
    assert read_marker(store, UNIT) is None
    again = UnitWriter(store, UNIT)
    again.write_bytes("x", b"1")
    assert again.commit()[1]


def test_missing_and_altered_files_fail_verification(store):
    writer = UnitWriter(store, UNIT)
    writer.write_bytes("a", b"alpha")
    writer.write_bytes("b", b"beta")
    record, _ = writer.commit()
    assert verify_unit(store, record) == []
    store.delete(record.key("a"))
    store.put(record.key("b"), b"BETA")
    problems = verify_unit(store, record)
    assert problems == ["a: missing", "b: sha256 differs from manifest"]
    with pytest.raises(IntegrityError, match="a: missing"):
        read_bytes(store, record, "a")
    with pytest.raises(IntegrityError, match="mismatch"):
        read_bytes(store, record, "b")


def test_marker_lists_sizes_and_hashes(store):
    writer = UnitWriter(store, UNIT)
    writer.write_json("meta.json", {"k": 1})
    record, _ = writer.commit()
    body = json.loads(store.get(f"{UNIT}/{MARKER}"))
    assert body["attempt"] == record.attempt
    assert set(body["files"]["meta.json"]) == {"size", "sha256"}


def test_gc_finds_only_unreferenced_attempts(store):
    crashed = UnitWriter(store, UNIT)
    crashed.write_bytes("a", b"half")  # the process died before the marker
    done = UnitWriter(store, UNIT)
    done.write_bytes("a", b"whole")
    done.commit()
    other = UnitWriter(store, "exp/epochs/00000/rollout/b0001")
    other.write_bytes("a", b"orphan")  # never committed at all
    garbage = garbage_attempts(store, "exp/")
    assert garbage == sorted([f"{UNIT}/.attempts/{crashed.attempt}/", f"exp/epochs/00000/rollout/b0001/.attempts/{other.attempt}/"])


@pytest.mark.parametrize("key", ["/abs", "a/../b", "../x", "a//b", "a/./b", ""])
def test_unsafe_keys_are_refused(store, key):
    with pytest.raises(UnsafeKey):
        store.put(key, b"x")


def test_put_if_absent(store):
    assert store.put_if_absent("k/marker", b"one")
    assert not store.put_if_absent("k/marker", b"two")
    assert store.get("k/marker") == b"one"


def test_large_file_roundtrip_and_copy(store, tmp_path):
    big = tmp_path / "big.bin"
    big.write_bytes(bytes(range(256)) * 40000)  # ~10 MB
    writer = UnitWriter(store, UNIT)
    writer.write_file("weights.safetensors", big)
    record, _ = writer.commit()
    target = UnitWriter(store, "exp/snapshots/00001")
    target.copy_from(record, "weights.safetensors")
    copied, _ = target.commit()
    assert verify_unit(store, copied) == []
