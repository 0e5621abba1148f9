"""The commit protocol on both backends: visibility, races, corruption, missing files, gc, keys, errors."""
from __future__ import annotations

import json
import os
import stat
import threading
import time

import pytest

from verl_tasks.errors import IntegrityError, StoreError, UnsafeKey
from verl_tasks.layout import Layout
from verl_tasks.ops.gc import IDLE_MARGIN_S, collect, garbage_attempts
from verl_tasks.store import LocalStore, open_store
from verl_tasks.store.units import (
    MARKER,
    UnitWriter,
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


def test_gc_collects_losers_at_once_and_uncommitted_attempts_only_when_idle(store):
    crashed = UnitWriter(store, UNIT)
    crashed.write_bytes("a", b"half")  # the process died before the marker
    done = UnitWriter(store, UNIT)
    done.write_bytes("a", b"whole")
    done.commit()
    other = UnitWriter(store, "exp/epochs/00000/rollout/b0001")
    other.write_bytes("a", b"orphan")  # not committed: maybe still running
    loser = f"{UNIT}/.attempts/{crashed.attempt}/"
    orphan = f"exp/epochs/00000/rollout/b0001/.attempts/{other.attempt}/"
    assert garbage_attempts(store, "exp/") == [loser]
    later = time.time() + IDLE_MARGIN_S + 60
    assert garbage_attempts(store, "exp/", now=later) == sorted([loser, orphan])
    assert garbage_attempts(store, "exp/", now=later, idle_limit=lambda unit: 2 * IDLE_MARGIN_S) == [loser]


def test_gc_keeps_a_young_attempt_with_an_old_id_and_a_live_unit(store):
    """An attempt id stamped long ago says nothing about liveness; the last write does."""
    layout = Layout("exp")
    running = UnitWriter(store, layout.update(0), attempt="20200101T000000-0123456789")
    running.write_bytes("model.safetensors", b"still writing")
    report = collect(store, layout, older_than_s=0, timeouts={"update": 7200})
    assert report.attempts == []
    assert store.list(f"{layout.update(0)}/.attempts/")
    running.write_bytes("metrics.json", b"{}")
    record, won = running.commit()
    assert won and verify_unit(store, record) == []
    dead = UnitWriter(store, layout.update(1), attempt="20200101T000000-9876543210")
    dead.write_bytes("model.safetensors", b"died")
    idle = time.time() + 7200 + IDLE_MARGIN_S + 60
    assert collect(store, layout, 0, dry_run=True, now=idle, timeouts={"update": 7200}).attempts == [
        f"{layout.update(1)}/.attempts/{dead.attempt}/"]
    assert collect(store, layout, 0, dry_run=True, now=idle, timeouts={"update": 9999}).attempts == []


def test_gc_keeps_a_base_evaluate_attempt_while_its_quarantine_record_is_young(store):
    """A re-pin quarantines ``base/evaluate``; its set-aside attempt stays as long as the record does."""
    layout = Layout("exp")
    old = UnitWriter(store, layout.base_evaluate, attempt="20200101T000000-0123456789")
    old.write_bytes("metrics.json", b"{}")
    old.commit()
    quarantine(store, layout.base_evaluate, "config changed before any rollout: seed")
    again = UnitWriter(store, layout.base_evaluate)
    again.write_bytes("metrics.json", b"{}")
    again.commit()  # recomputed: the set-aside attempt is now a loser, older than the horizon
    report = collect(store, layout, older_than_s=3600)
    assert report.attempts == [] and report.kept_recent == 1
    assert store.list(f"{layout.base_evaluate}/.attempts/{old.attempt}/")


def test_commit_refuses_when_a_listed_file_is_gone(store):
    writer = UnitWriter(store, UNIT)
    writer.write_bytes("a", b"one")
    writer.write_bytes("b", b"two")
    store.delete(f"{UNIT}/.attempts/{writer.attempt}/b")  # e.g. a gc that raced the task
    with pytest.raises(StoreError, match=r"lost files before commit \(b: missing\)"):
        writer.commit()
    assert read_marker(store, UNIT) is None


def test_commit_of_a_loser_whose_files_are_gone_returns_the_winner(store):
    loser = UnitWriter(store, UNIT)
    loser.write_bytes("a", b"x")
    winner = UnitWriter(store, UNIT)
    winner.write_bytes("a", b"y")
    winner.commit()
    store.delete(f"{UNIT}/.attempts/{loser.attempt}/a")
    record, won = loser.commit()
    assert not won and record.attempt == winner.attempt


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


def test_local_files_and_folders_are_group_readable(tmp_path):
    old = os.umask(0o022)
    try:
        store = LocalStore(tmp_path / "store")
        UnitWriter(store, UNIT).write_bytes("a", b"x")
        assert store.put_if_absent(f"{UNIT}/{MARKER}", b"{}")
        store.put_file("exp/file.bin", tmp_path / "store" / UNIT / MARKER)
    finally:
        os.umask(old)
    for path in (tmp_path / "store" / UNIT / MARKER, tmp_path / "store" / "exp/file.bin"):
        mode = path.stat().st_mode
        assert mode & stat.S_IRGRP and mode & stat.S_IROTH and not mode & stat.S_IWGRP, oct(mode)
    assert (tmp_path / "store" / UNIT).stat().st_mode & stat.S_IXGRP


def test_local_store_fsyncs_the_folder_after_rename_and_link(tmp_path, monkeypatch):
    """A unit test of the store: the OS call is observed, since a power loss cannot be."""
    store = LocalStore(tmp_path / "store")
    synced: list[int] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            synced.append(info.st_ino)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    store.put("exp/a/one", b"1")
    folder = (tmp_path / "store/exp/a").stat().st_ino
    assert folder in synced and (tmp_path / "store/exp").stat().st_ino in synced  # new folder's entry too
    synced.clear()
    assert store.put_if_absent("exp/a/marker", b"m")
    assert synced == [folder]


def test_gc_sweeps_stale_temp_files_and_keeps_fresh_ones(tmp_path):
    store = LocalStore(tmp_path / "store")
    layout = Layout("exp")
    UnitWriter(store, layout.plan(0)).write_bytes("plan.json", b"{}")
    folder = tmp_path / "store" / layout.plan(0)
    stale, fresh = folder / ".tmp-crashedwriter", folder / ".tmp-writingnow"
    stale.write_bytes(b"half")
    fresh.write_bytes(b"half")
    past = time.time() - IDLE_MARGIN_S - 60
    os.utime(stale, (past, past))
    assert collect(store, layout, 0, dry_run=True).temp_files == [f"{layout.plan(0)}/.tmp-crashedwriter"]
    report = collect(store, layout, 0)
    assert report.temp_files == [f"{layout.plan(0)}/.tmp-crashedwriter"]
    assert not stale.exists() and fresh.exists()


@pytest.fixture
def no_aws_credentials(tmp_path, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(name, raising=False)
    for name in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        empty = tmp_path / name.lower()
        empty.write_text("")
        monkeypatch.setenv(name, str(empty))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def test_s3_without_credentials_is_one_line_naming_the_fix(moto_endpoint, s3_bucket, no_aws_credentials):
    store = open_store(f"s3://{s3_bucket}/prefix", endpoint_url=moto_endpoint)
    with pytest.raises(StoreError) as err:
        store.get("exp/experiment.json")
    message = str(err.value)
    assert "\n" not in message and f"s3://{s3_bucket}/prefix/exp/experiment.json" in message
    assert "no usable AWS credentials" in message and "storage.aws_conn_id" in message
    assert "AWS_ACCESS_KEY_ID" in message


def test_s3_access_denied_is_one_line_naming_the_fix(moto_endpoint, s3_bucket, monkeypatch):
    from moto import settings

    store = open_store(f"s3://{s3_bucket}/prefix", endpoint_url=moto_endpoint,
                       credentials={"aws_access_key_id": "AKIAUNKNOWNKEY000000", "aws_secret_access_key": "wrong"})
    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # the server now checks keys: a real 403
    for call in (lambda: store.put("exp/k", b"x"), lambda: store.list("exp/"), lambda: store.exists("exp/k"),
                 lambda: store.put_if_absent("exp/m", b"x")):
        with pytest.raises(StoreError) as err:
            call()
        message = str(err.value)
        assert "\n" not in message and "S3 refused access" in message
        assert "InvalidAccessKeyId" in message or "403" in message
        assert f"bucket {s3_bucket}" in message and "storage.aws_conn_id" in message


def test_s3_delete_prefix_raises_on_keys_it_could_not_delete(moto_endpoint, s3_bucket):
    """``delete_objects`` reports per-key failures in its answer instead of raising: gc must not count them."""
    store = open_store(f"s3://{s3_bucket}/prefix", endpoint_url=moto_endpoint)
    for name in ("a", "b"):
        store.put(f"exp/x/.attempts/1/{name}", b"x")
    real = store.client.delete_objects

    def refuses_the_first(*, Bucket, Delete):
        first, *rest = Delete["Objects"]
        real(Bucket=Bucket, Delete={**Delete, "Objects": rest})
        return {"Errors": [{"Key": first["Key"], "Code": "AccessDenied", "Message": "Access Denied"}]}

    store.client.delete_objects = refuses_the_first
    with pytest.raises(StoreError) as err:
        store.delete_prefix("exp/x/")
    assert "exp/x/.attempts/1/a (AccessDenied)" in str(err.value)
    assert store.list("exp/x/") == ["exp/x/.attempts/1/a"]


def test_a_loser_whose_files_cannot_be_deleted_still_returns_the_winner(moto_endpoint, s3_bucket):
    """A role without s3:DeleteObject (or an S3 SlowDown) must not turn a lost race into a failed task:
    the winner committed; the loser's files are garbage that gc reports."""
    from verl_tasks.store.units import UnitWriter

    store = open_store(f"s3://{s3_bucket}/prefix", endpoint_url=moto_endpoint)
    unit = "exp/epochs/00000/rollout/b0000"
    winner, loser = UnitWriter(store, unit), UnitWriter(store, unit)
    for writer in (winner, loser):
        writer.write_bytes("samples.jsonl", b"{}\n")
    won, _ = winner.commit({})
    store.client.delete_objects = lambda *, Bucket, Delete: {
        "Errors": [{"Key": o["Key"], "Code": "AccessDenied", "Message": "Access Denied"} for o in Delete["Objects"]]}
    record, lost = loser.commit({})
    assert not lost and record.attempt == won.attempt
    assert any(f"/.attempts/{loser.attempt}/" in key for key in store.list(unit + "/"))


def test_gc_removes_fence_records_past_the_horizon_only(store):
    """A fence refuses a cancelled attempt's late commit; once older than gc's horizon it is garbage."""
    from verl_tasks.store.units import fence_attempt

    layout = Layout("exp")
    units = [layout.rollout(0, 0), layout.snapshot(1), layout.base_evaluate]  # any unit may be fenced
    for unit in units:
        fence_attempt(store, unit, "20261130T000000-aaaaaaaaaa", "cleared in the UI")
    fenced = sorted(k for unit in units for k in store.list(unit + "/") if "/.fenced/" in k)
    assert len(fenced) == 3
    assert collect(store, layout, older_than_s=3600).fence_records == []  # young: kept
    report = collect(store, layout, older_than_s=3600, now=time.time() + 7200)
    assert report.fence_records == fenced
    assert not [k for unit in units for k in store.list(unit + "/") if "/.fenced/" in k]


def test_a_local_copy_is_a_hard_link_and_a_rewrite_of_the_source_leaves_it(tmp_path):
    """A snapshot publishing its update's weights writes nothing; the store never changes a file in place."""
    store = LocalStore(tmp_path / "store")
    writer = UnitWriter(store, UNIT)
    writer.write_bytes("model.safetensors", b"weights v1")
    record, _ = writer.commit()
    target = UnitWriter(store, "exp/snapshots/00001")
    target.copy_from(record, "model.safetensors")
    copied, _ = target.commit()
    source = tmp_path / "store" / record.key("model.safetensors")
    linked = tmp_path / "store" / copied.key("model.safetensors")
    assert source.stat().st_ino == linked.stat().st_ino and source.stat().st_nlink == 2
    store.put(record.key("model.safetensors"), b"weights v2")  # a new file renamed over the old name
    assert linked.read_bytes() == b"weights v1" and verify_unit(store, copied) == []


def test_staged_files_join_the_attempt_only_when_the_block_ends(store):
    writer = UnitWriter(store, UNIT)
    writer.write_json("meta.json", {"a": 1})
    with writer.folder() as out:
        (out / "model.safetensors").write_bytes(b"w" * 1000)
        (out / "config.json").write_text("{}")
        assert store.list(UNIT) == [f"{UNIT}/.attempts/{writer.attempt}/meta.json"]  # staged files are in flight
    assert sorted(writer.files) == ["config.json", "meta.json", "model.safetensors"]
    record, won = writer.commit()
    assert won and verify_unit(store, record) == [] and read_bytes(store, record, "model.safetensors") == b"w" * 1000
    assert store.temp_files(UNIT) == {}  # the staging folder is gone

    failed = UnitWriter(store, "exp/epochs/00000/update")
    with pytest.raises(RuntimeError, match="trainer crashed"):
        with failed.folder() as out:
            (out / "model.safetensors").write_bytes(b"half")
            raise RuntimeError("trainer crashed")
    assert failed.files == {} and store.list("exp/epochs/00000/update") == []


def test_no_space_while_a_library_writes_into_the_staging_folder_is_the_stores_clear_error(tmp_path):
    import errno

    store = LocalStore(tmp_path / "store")
    writer = UnitWriter(store, UNIT)
    with pytest.raises(StoreError, match="no space left .* nothing was committed"):
        with writer.folder() as out:
            (out / "model.safetensors").write_bytes(b"half")
            raise OSError(errno.ENOSPC, "No space left on device")  # what safetensors raises on a full disk
    assert writer.files == {} and store.list(UNIT) == [] and store.temp_files(UNIT) == {}


def test_a_second_copy_of_an_attempt_that_committed_keeps_the_files_when_fenced(store):
    """Ray may run one call twice (an actor unreachable, the call sent again with its attempt id). If
    one copy committed before the attempt was fenced, the other copy's commit must not discard the
    committed files: the marker names this attempt, so the commit is this attempt's success."""
    from verl_tasks.errors import AttemptFenced
    from verl_tasks.store.units import fence_attempt

    unit = Layout("exp").rollout(0, 0)
    first = UnitWriter(store, unit)
    first.write_bytes("samples.jsonl", b"{}\n")
    record, won = first.commit({})
    fence_attempt(store, unit, first.attempt, "timed out after 60 s")
    late = UnitWriter(store, unit, first.attempt)
    late.write_bytes("samples.jsonl", b"{}\n")
    again, won_again = late.commit({})
    assert won and won_again and again.attempt == record.attempt
    assert read_bytes(store, read_marker(store, unit), "samples.jsonl") == b"{}\n"
    other = Layout("exp").rollout(0, 1)  # a fenced attempt that did not commit is still refused
    fence_attempt(store, other, "20261201T000000-bbbbbbbbbb", "cleared in the UI")
    refused = UnitWriter(store, other, "20261201T000000-bbbbbbbbbb")
    refused.write_bytes("samples.jsonl", b"{}\n")
    with pytest.raises(AttemptFenced):
        refused.commit({})
    assert read_marker(store, other) is None and not [k for k in store.list(other + "/") if "/.attempts/" in k]
