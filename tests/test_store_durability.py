"""The local store's fsync order: an attempt's files and folders are synced once, all before its marker exists."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from verl_tasks.store import local, open_store
from verl_tasks.store.units import UnitWriter, read_marker

UNIT = "exp/epochs/00000/rollout/b0000"


@pytest.fixture(autouse=True)
def no_deferred_fsyncs_from_other_tests(monkeypatch):
    """The deferred sets are process-wide: an earlier test's uncommitted attempt would show up here."""
    monkeypatch.setattr(local, "_DEFERRED", set())
    monkeypatch.setattr(local, "_DEFERRED_FILES", set())


@pytest.fixture
def synced(monkeypatch) -> list[Path]:
    """Every folder the local store fsyncs from now on, in order."""
    folders: list[Path] = []
    real = local._fsync_dir
    monkeypatch.setattr(local, "_fsync_dir", lambda folder: (folders.append(Path(folder)), real(folder))[1])
    return folders


def test_attempt_folders_are_synced_once_and_before_the_marker(tmp_path, monkeypatch):
    store = open_store(f"file://{tmp_path}/store")
    trail: list[tuple[str, str]] = []
    real_fsync_dir, real_link = local._fsync_dir, os.link
    monkeypatch.setattr(local, "_fsync_dir", lambda folder: (trail.append(("fsync_dir", str(folder))),
                                                            real_fsync_dir(folder))[1])
    real_fsync_file = local._fsync_file
    monkeypatch.setattr(local, "_fsync_file", lambda path: (trail.append(("fsync_file", str(path))),
                                                           real_fsync_file(path))[1])
    monkeypatch.setattr(os, "link", lambda src, dst: (trail.append(("link", str(dst))), real_link(src, dst))[1])
    writer = UnitWriter(store, UNIT)
    for i in range(5):
        writer.write_bytes(f"part{i}.jsonl", b"{}\n" * (i + 1))
    attempt_dir = str(store.root / UNIT / ".attempts" / writer.attempt)
    assert not [op for op, _ in trail if op == "fsync_file"], f"file data fsynced before the commit: {trail}"
    early = [folder for _, folder in trail]
    assert attempt_dir not in early, f"the attempt's own folder was fsynced before the commit: {trail}"
    # Folders other units share are synced when created: only the attempt's own entries wait.
    assert early == [str(store.root.parent)] + [str(store.root / p) for p in (
        "", "exp", "exp/epochs", "exp/epochs/00000", "exp/epochs/00000/rollout", UNIT)], trail
    record, won = writer.commit({})
    assert won and read_marker(store, UNIT).attempt == record.attempt
    link_at = trail.index(("link", str(store.root / UNIT / "_SUCCESS")))
    synced_before = [folder for op, folder in trail[:link_at] if op == "fsync_dir"]
    assert synced_before.count(attempt_dir) == 1, trail  # once for five files
    files_before = [path for op, path in trail[:link_at] if op == "fsync_file"]
    assert sorted(files_before) == [f"{attempt_dir}/part{i}.jsonl" for i in range(5)], trail
    for folder in (store.root / UNIT / ".attempts", store.root / UNIT, store.root / "exp/epochs/00000/rollout"):
        assert str(folder) in synced_before, f"{folder} (a new folder's parent) not synced before the marker: {trail}"
    assert ("fsync_dir", str(store.root / UNIT)) in trail[link_at:]  # the marker's own entry
    assert local._DEFERRED == set() and local._DEFERRED_FILES == set()


def test_a_marker_never_waits_on_folders_another_process_created_and_never_synced(tmp_path, monkeypatch, synced):
    """Two workers' units under one epoch: the first creates the shared folders, then dies before any
    marker (its deferred fsyncs die with it). The second finds those folders there; its marker must
    still not depend on entries nobody made durable."""
    store = open_store(f"file://{tmp_path}/store")
    first = UnitWriter(store, UNIT)
    first.write_bytes("samples.jsonl", b"{}\n")
    monkeypatch.setattr(local, "_DEFERRED", set())  # the first worker's process is gone, unsynced
    second = UnitWriter(store, UNIT)  # its retry (a sibling batch shares all but the unit's folders)
    second.write_bytes("samples.jsonl", b"{}\n")
    assert second.commit({})[1]
    attempt = store.root / UNIT / ".attempts" / second.attempt
    on_the_path = [attempt, *[p for p in attempt.parents if p.is_relative_to(store.root / "exp")]]
    unsynced = [f"{p.name} in {p.parent}" for p in on_the_path if p.parent not in synced]
    assert unsynced == [], f"entries on the committed unit's path never fsynced: {unsynced}"


def test_the_first_event_of_an_experiment_makes_its_folder_durable(tmp_path, synced):
    store = open_store(f"file://{tmp_path}/store")
    store.put_volatile("exp2/events/0001.json", b"{}")  # the experiment's first write: a started event
    assert store.root in synced and store.root / "exp2" in synced, synced


def test_a_plain_put_still_syncs_its_folder_at_once(tmp_path, synced):
    store = open_store(f"file://{tmp_path}/store")
    store.put("exp/snapshots/latest.json", b"{}")
    assert store.root / "exp/snapshots" in synced


def test_a_discarded_attempt_does_not_break_the_next_commit(tmp_path):
    store = open_store(f"file://{tmp_path}/store")
    lost = UnitWriter(store, UNIT)
    lost.write_bytes("a.jsonl", b"{}\n")
    lost.discard()  # its folders are gone, still listed as deferred
    writer = UnitWriter(store, "exp/epochs/00000/plan")
    writer.write_json("plan.json", {})
    assert writer.commit({})[1]


def test_a_train_worker_makes_its_share_durable_before_the_driver_commits_it(tmp_path, synced, monkeypatch):
    """An update worker writes its files into the attempt; the driver, another process, writes the
    marker. The worker cannot leave its folders' fsyncs for a marker it never writes."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from verl_tasks.models.tiny import build_tokenizer
    from verl_tasks.train.worker import save_outputs

    files: list[Path] = []
    real = local._fsync_file
    monkeypatch.setattr(local, "_fsync_file", lambda path: (files.append(Path(path)), real(path))[1])
    store = open_store(f"file://{tmp_path}/store")
    tokenizer = build_tokenizer()
    core = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=8, n_layer=1, n_head=1, n_positions=16))
    optimizer = torch.optim.AdamW(core.parameters())
    writer = UnitWriter(store, UNIT)
    save_outputs(torch.nn.Sequential(core), core, optimizer, tokenizer, writer, rank=0, world=1)
    attempt = store.root / UNIT / ".attempts" / writer.attempt
    assert {"model.safetensors", "optimizer.safetensors"} <= {p.name for p in attempt.iterdir()}
    assert attempt in synced and attempt.parent in synced, synced
    assert {p for p in attempt.iterdir()} <= set(files), files  # the data too, not only the names
    assert local._DEFERRED == set() and local._DEFERRED_FILES == set()


def test_an_attempt_creates_a_store_root_whose_parents_do_not_exist_yet(tmp_path):
    store = open_store(f"file://{tmp_path}/volume/stores/store")  # nothing below tmp_path exists
    writer = UnitWriter(store, UNIT)
    writer.write_bytes("samples.jsonl", b"{}\n")
    record, won = writer.commit({})
    assert won and read_marker(store, UNIT).attempt == record.attempt


COMMIT_TWO_UNITS = """
import json, sys, threading
from verl_tasks.store import local, open_store
from verl_tasks.store.units import UnitWriter
store = open_store(sys.argv[1])
for unit in ("exp/epochs/00000/plan", "exp/epochs/00001/plan"):
    writer = UnitWriter(store, unit)
    writer.write_bytes("a.json", unit.encode() + b"/a")
    writer.write_bytes("b.json", unit.encode() + b"/b")
    assert writer.commit({"unit": unit})[1]
alive = [t.name for t in threading.enumerate() if t.name.startswith("verl-tasks-fsync-") and t.daemon]
print(json.dumps({"fsync_threads": len(alive), "deferred": len(local._DEFERRED) + len(local._DEFERRED_FILES)}))
"""


def test_a_process_that_committed_exits_without_waiting_for_the_fsync_threads(tmp_path):
    import json
    import subprocess
    import sys

    from verl_tasks.store.units import read_bytes, verify_unit

    done = subprocess.run([sys.executable, "-c", COMMIT_TWO_UNITS, f"file://{tmp_path}/store"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and not done.stderr, done.stderr
    # The threads were still there when the process ended (daemons: nothing joined them), with no work left.
    left = json.loads(done.stdout)
    assert left["fsync_threads"] > 0 and left["deferred"] == 0, left
    # What the exit must not lose: both commits, every file of each, with the bytes their manifests name.
    store = open_store(f"file://{tmp_path}/store")
    for unit in ("exp/epochs/00000/plan", "exp/epochs/00001/plan"):
        record = read_marker(store, unit)
        assert record is not None and record.meta == {"unit": unit}, unit
        assert sorted(record.files) == ["a.json", "b.json"]
        assert verify_unit(store, record) == [], unit
        assert [read_bytes(store, record, name) for name in ("a.json", "b.json")] == [
            unit.encode() + b"/a", unit.encode() + b"/b"]


def test_a_child_forked_after_the_fsync_threads_started_commits_with_its_own(tmp_path):
    import multiprocessing

    store = open_store(f"file://{tmp_path}/store")
    writer = UnitWriter(store, "exp/epochs/00000/plan")
    writer.write_bytes("a.json", b"{}")
    writer.write_bytes("b.json", b"{}")
    assert writer.commit({})[1] and local._SYNCER, "the parent's fsync threads should exist"

    def commit_in_child() -> None:
        child = UnitWriter(store, "exp/epochs/00001/plan")
        child.write_bytes("a.json", b"{}")
        child.write_bytes("b.json", b"{}")
        child.commit({})

    proc = multiprocessing.get_context("fork").Process(target=commit_in_child)
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0, f"the forked child did not commit (exit code {proc.exitcode})"
    assert read_marker(store, "exp/epochs/00001/plan") is not None
