"""Integrity of a commit under faults: gc beside live attempts, a re-pin mid-attempt, S3 409s on the marker."""
from __future__ import annotations

import json
import os
import threading
import time
from types import SimpleNamespace

import pytest

from tests.chaos.faulty_proxy import FaultyProxy
from verl_tasks.errors import ConfigMismatch, ConfigRepinned, StoreError, WriteConflict
from verl_tasks.layout import Layout
from verl_tasks.ops.gc import collect, parse_age
from verl_tasks.pinning import check_pinned, pin_experiment
from verl_tasks.runner import make_context, run_phase
from verl_tasks.store import LocalStore, open_store
from verl_tasks.store.units import MARKER, ConfigPin, UnitWriter, read_marker, verify_unit

LAYOUT = Layout("exp")
HOUR = 3600.0
FAST = {"model.tiny.warm_start_steps": 20}


def _age(path, seconds: float) -> None:
    past = time.time() - seconds
    os.utime(path, (past, past))


def _attempt_keys(store, unit: str) -> list[str]:
    return [k for k in store.list(unit + "/") if "/.attempts/" in k]


# --- gc: .tmp- files follow the attempts' liveness rule -------------------------------------------------------


def test_gc_keeps_a_finished_shard_waiting_in_a_live_attempts_staging_folder(tmp_path):
    """The issue's case: ``--older-than 7d``, a shard finished 2 h ago in a staging folder whose attempt is
    still writing. gc must neither delete it nor let the unit commit without it."""
    store = LocalStore(tmp_path / "store")
    unit = LAYOUT.update(0)
    writer = UnitWriter(store, unit)
    writer.expect("optimizer.rank00000.safetensors", "optimizer.rank00001.safetensors")
    with writer.folder() as out:
        shard = out / "optimizer.rank00000.safetensors"
        shard.write_bytes(b"rank 0 rows")
        _age(shard, 2 * HOUR)
        report = collect(store, LAYOUT, parse_age("7d"), timeouts={"update": 4 * HOUR})
        assert report.temp_files == [] and report.attempts == [] and shard.exists()
        (out / "optimizer.rank00001.safetensors").write_bytes(b"rank 1 rows")
    record, won = writer.commit()
    assert won and verify_unit(store, record) == []
    assert sorted(record.files) == ["optimizer.rank00000.safetensors", "optimizer.rank00001.safetensors"]


def test_staged_writes_keep_an_attempt_live_and_its_staged_files_go_only_with_it(tmp_path):
    store = LocalStore(tmp_path / "store")
    unit = LAYOUT.update(0)
    writer = UnitWriter(store, unit, attempt="20200101T000000-0123456789")
    writer.write_json("meta.json", {})
    folder = tmp_path / "store" / unit / ".attempts" / writer.attempt
    _age(folder / "meta.json", 3 * HOUR)
    (folder / ".tmp-0123abcd").mkdir()  # a staging folder, as its writer (live, or killed) leaves it
    (folder / ".tmp-0123abcd" / "model.safetensors").write_bytes(b"being written now")
    prefix = f"{unit}/.attempts/{writer.attempt}/"
    assert collect(store, LAYOUT, 0, dry_run=True).attempts == []  # the staged write is the attempt's
    later = time.time() + 2 * HOUR
    report = collect(store, LAYOUT, 0, now=later)
    assert report.attempts == [prefix] and report.temp_files == [f"{prefix}.tmp-0123abcd/model.safetensors"]
    assert report.deleted_keys == 2 and not (tmp_path / "store" / unit).exists()


def test_gc_sweeps_a_stray_temp_file_only_past_the_horizon_and_the_phase_timeout(tmp_path):
    store = LocalStore(tmp_path / "store")
    UnitWriter(store, LAYOUT.plan(0)).write_bytes("plan.json", b"{}")
    stray = tmp_path / "store" / LAYOUT.plan(0) / ".tmp-crashedwriter"
    stray.write_bytes(b"half")
    _age(stray, 2 * HOUR)
    key = f"{LAYOUT.plan(0)}/.tmp-crashedwriter"
    assert collect(store, LAYOUT, parse_age("7d"), dry_run=True).temp_files == []  # younger than --older-than
    assert collect(store, LAYOUT, 0, dry_run=True, timeouts={"plan": 2 * HOUR}).temp_files == []  # may be live
    assert collect(store, LAYOUT, parse_age("1h")).temp_files == [key]
    assert not stray.exists()


def test_gc_sweeps_a_temp_file_left_in_a_committed_attempt_once_idle(tmp_path):
    store = LocalStore(tmp_path / "store")
    writer = UnitWriter(store, LAYOUT.plan(0))
    writer.write_bytes("plan.json", b"{}")
    record, _ = writer.commit()
    left = tmp_path / "store" / LAYOUT.plan(0) / ".attempts" / record.attempt / ".tmp-duplicatecopy"
    left.write_bytes(b"half")
    assert collect(store, LAYOUT, 0, dry_run=True).temp_files == []
    _age(left, 2 * HOUR)
    assert collect(store, LAYOUT, 0).temp_files == [f"{record.key('plan.json').rsplit('/', 1)[0]}/.tmp-duplicatecopy"]
    assert verify_unit(store, record) == []


def test_commit_refuses_a_manifest_without_an_expected_file(store):
    """A shard deleted from a staging folder never reaches the manifest: the listing check cannot see it."""
    writer = UnitWriter(store, LAYOUT.update(0))
    writer.expect("model.safetensors", "optimizer.rank00001.safetensors")
    with writer.folder() as out:
        (out / "model.safetensors").write_bytes(b"w")
        (out / "optimizer.rank00001.safetensors").write_bytes(b"rows")
        (out / "optimizer.rank00001.safetensors").unlink()  # what the old gc did to a finished shard
    with pytest.raises(StoreError, match=r"optimizer.rank00001.safetensors: never written"):
        writer.commit()
    assert read_marker(store, LAYOUT.update(0)) is None


# --- the config pin: conditional re-pin, checked inside commit -----------------------------------------------------


def _pin(store, config_hash: str) -> None:
    store.put(LAYOUT.experiment_json, json.dumps({"config_hash": config_hash, "hashed_config": {}}).encode())


def test_commit_refuses_an_attempt_computed_under_the_old_pin(store):
    _pin(store, "a" * 64)
    writer = UnitWriter(store, LAYOUT.rollout(0, 0), pin=ConfigPin(LAYOUT.experiment_json, "a" * 64))
    writer.write_bytes("samples.jsonl", b"{}\n")
    _pin(store, "b" * 64)  # re-pinned while the attempt computed
    with pytest.raises(ConfigRepinned, match="rerun the task"):
        writer.commit()
    assert read_marker(store, LAYOUT.rollout(0, 0)) is None and _attempt_keys(store, LAYOUT.rollout(0, 0)) == []


def test_a_repin_landing_right_after_the_marker_sets_the_unit_aside(store):
    """The re-pin reaches the store between the pin check and the marker: the check after the marker sees it."""
    unit = LAYOUT.rollout(0, 0)
    _pin(store, "a" * 64)
    real = store.put_if_absent

    def marker_then_repin(key: str, data: bytes) -> bool:
        written = real(key, data)
        if key.endswith("/" + MARKER):
            _pin(store, "b" * 64)
        return written

    store.put_if_absent = marker_then_repin
    writer = UnitWriter(store, unit, pin=ConfigPin(LAYOUT.experiment_json, "a" * 64))
    writer.write_bytes("samples.jsonl", b"{}\n")
    with pytest.raises(ConfigRepinned):
        writer.commit()
    assert read_marker(store, unit) is None
    assert [k for k in store.list(unit + "/") if "/.quarantine/" in k]


def test_put_if_match_is_a_compare_and_swap(store):
    """moto server honours ``IfMatch`` on PutObject (412 on a stale ETag, 404 on a missing key), as AWS does."""
    store.put("exp/k", b"one")
    data, version = store.get_versioned("exp/k")
    assert data == b"one"
    store.put("exp/k", b"two")
    assert not store.put_if_match("exp/k", b"three", version)
    assert store.get("exp/k") == b"two"
    data, version = store.get_versioned("exp/k")
    assert store.put_if_match("exp/k", b"three", version) and store.get("exp/k") == b"three"
    assert not store.put_if_match("exp/missing", b"x", version) and not store.exists("exp/missing")


def test_local_put_if_match_loses_no_update_between_threads(tmp_path):
    store = LocalStore(tmp_path / "store")
    store.put("exp/count", b"0")

    def add_one() -> None:
        while True:
            data, version = store.get_versioned("exp/count")
            if store.put_if_match("exp/count", str(int(data) + 1).encode(), version):
                return

    threads = [threading.Thread(target=add_one) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert store.get("exp/count") == b"8"


def test_a_repin_while_a_rollout_computes_refuses_its_commit(tiny_config, fault_hooks):
    """The issue's case end to end: the experiment is re-pinned (no rollout committed yet) while a rollout
    under the old config computes; that rollout must not commit under the old hash."""
    ctx = make_context(tiny_config(**FAST))
    run_phase(ctx, "plan", 0)
    changed = make_context(tiny_config(**FAST, seed=3))
    fault_hooks["before_commit"] = lambda **info: pin_experiment(changed)
    with pytest.raises(ConfigRepinned):
        run_phase(ctx, "rollout", 0, 0)
    unit = ctx.layout.rollout(0, 0)
    assert read_marker(ctx.store, unit) is None and _attempt_keys(ctx.store, unit) == []
    assert json.loads(ctx.store.get(ctx.layout.experiment_json))["config_hash"] == changed.config.config_hash()
    with pytest.raises(ConfigMismatch):  # and no process-wide cache lets the old config compute again
        check_pinned(ctx.config, ctx.store)


def test_a_repin_never_overwrites_a_pin_that_changed_after_it_was_read(tiny_config):
    """Another process re-pins and commits a rollout after this one read the pin and found only the prelude:
    the conditional write fails, and the decision taken again against the pin in force refuses."""
    first, second, third = (make_context(tiny_config(**FAST, seed=seed)) for seed in (1, 2, 3))
    pin_experiment(first)
    store, layout = first.store, first.layout
    other_process = LocalStore(store.root)
    real = store.list
    raced = []

    def scan_then_race(prefix: str) -> list[str]:
        found = real(prefix)
        if prefix == layout.snapshots + "/" and not raced:  # the prelude check's last listing
            raced.append(pin_experiment(SimpleNamespace(config=second.config, store=other_process, layout=layout)))
            rollout = UnitWriter(other_process, layout.rollout(0, 0),
                                 pin=ConfigPin(layout.experiment_json, second.config.config_hash()))
            rollout.write_bytes("samples.jsonl", b"{}\n")
            rollout.commit()
        return found

    store.list = scan_then_race
    with pytest.raises(ConfigMismatch):
        pin_experiment(SimpleNamespace(config=third.config, store=store, layout=layout))
    assert raced and json.loads(store.get(layout.experiment_json))["config_hash"] == second.config.config_hash()
    assert read_marker(store, layout.rollout(0, 0)) is not None


def test_a_claim_never_reverts_a_repin_it_did_not_read(tiny_config):
    """A DAG claiming an unowned experiment rewrites its pin: conditionally, or a re-pin landing between the
    claim's read and write would be reverted to the old config without its units being set aside."""
    from verl_tasks.ownership import DagAccess

    first, second = make_context(tiny_config(**FAST, seed=1)), make_context(tiny_config(**FAST, seed=2))
    pin_experiment(first)  # by the CLI: no owner
    store, layout = first.store, first.layout
    other_process = LocalStore(store.root)
    real = store.get_versioned
    raced = []

    def read_then_race(key: str):
        got = real(key)
        if key == layout.experiment_json and not raced:
            raced.append(pin_experiment(SimpleNamespace(config=second.config, store=other_process, layout=layout)))
        return got

    store.get_versioned = read_then_race
    dag = DagAccess("tiny_dag", experiment=first.config.experiment)
    pinned = pin_experiment(SimpleNamespace(config=first.config, store=store, layout=layout), dag=dag)
    assert pinned["dag_id"] == "tiny_dag" and pinned["config_hash"] == first.config.config_hash()
    kinds = [json.loads(store.get(k))["kind"] for k in store.list(layout.events + "/")]
    assert kinds.count("repinned") == 2  # the racer's, then the claim's own: decided against the racer's pin


# --- S3: a 409 on the conditional marker put --------------------------------------------------------------------


class ConflictingProxy(FaultyProxy):
    """Answers ``409 ConditionalRequestConflict`` to the first ``conflicts`` PUTs of a commit marker, before
    forwarding them (what S3 answers while another conditional write of the key is in flight)."""

    def __init__(self, upstream: str, conflicts: int):
        super().__init__(upstream, seed=0, rate=0.0, multipart_faults=0)
        self.conflicts = conflicts

    def decide(self, method: str, path: str):
        with self.lock:
            self.requests += 1
            if method == "PUT" and path.split("?")[0].endswith("/" + MARKER) and self.conflicts > 0:
                self.conflicts -= 1
                return self._count((409, "ConditionalRequestConflict", "A conflicting conditional operation "
                                    "is currently in progress against this resource. Please try again."))
            return None


def _s3_through(proxy: FaultyProxy, bucket: str):
    store = open_store(f"s3://{bucket}/prefix", endpoint_url=proxy.url)
    store.conflict_backoff_s = 0.01
    return store


def test_s3_409_on_the_marker_is_retried_with_backoff(moto_endpoint, s3_bucket):
    unit = LAYOUT.rollout(0, 0)
    with ConflictingProxy(moto_endpoint, conflicts=3) as proxy:
        writer = UnitWriter(_s3_through(proxy, s3_bucket), unit)
        writer.write_bytes("samples.jsonl", b"{}\n")
        record, won = writer.commit()
    assert proxy.injected == {"ConditionalRequestConflict": 3}
    store = open_store(f"s3://{s3_bucket}/prefix", endpoint_url=moto_endpoint)
    assert won and read_marker(store, unit).attempt == writer.attempt and verify_unit(store, record) == []


def test_s3_409_through_every_backoff_discards_the_attempt(moto_endpoint, s3_bucket):
    unit = LAYOUT.rollout(0, 0)
    with ConflictingProxy(moto_endpoint, conflicts=1000) as proxy:
        store = _s3_through(proxy, s3_bucket)
        writer = UnitWriter(store, unit)
        writer.write_bytes("samples.jsonl", b"{}\n")
        with pytest.raises(WriteConflict, match="nothing was committed: rerun the task"):
            writer.commit()
    assert proxy.injected == {"ConditionalRequestConflict": store.conflict_tries}
    direct = open_store(f"s3://{s3_bucket}/prefix", endpoint_url=moto_endpoint)
    assert read_marker(direct, unit) is None and _attempt_keys(direct, unit) == []
