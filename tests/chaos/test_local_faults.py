"""Chaos matrix, local store: each test injects one fault at a seeded point and checks the recovery.

Every test asserts: the run finishes, each unit is committed exactly once with
no sample lost or duplicated, and the final weights equal the fault-free
reference (``reference`` fixture). Measurements go to benchmarks/results/chaos.json
when VT_CHAOS_RECORD=1.
"""
from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from verl_tasks.errors import PhaseFailed, RewardFailureRate, StoreError
from verl_tasks.events import read_events
from verl_tasks.models.checkpoint import WEIGHTS
from verl_tasks.runner import epoch_units, make_context, run_phase, status, train
from verl_tasks.store.units import read_marker, verify_unit

from ..conftest import ROOT, default_sigint
from . import util

pytestmark = pytest.mark.chaos


def all_units(ctx) -> list[tuple[str, int, int | None]]:
    return [(phase, e, b) for e in range(util.EPOCHS) for phase, b in epoch_units(ctx, e, util.EPOCHS)]


def finish(ctx, reference, fault: str, recovery_s: float, **extra) -> None:
    assert util.latest_sha(ctx.store, ctx.layout) == reference["sha"]
    util.assert_exactly_once(ctx.store, ctx.layout, ctx.config)
    redone = util.started_count(ctx.store, ctx.layout) - reference["started"]
    util.record(fault, recovery_s=round(recovery_s, 2), redone_units=redone,
                reference_run_s=round(reference["duration_s"], 1), **extra)
    return redone


# Rows whose fault outlasts the in-process retries (a damaged snapshot, a reward outage, a full
# disk) run with no retries: the run stops with the same error, without waiting out the retry delays.
STOPS_AT_ONCE = {"fault_tolerance.retries": 0}


KILL_SCRIPT = """
import os, sys
from verl_tasks import hooks
from verl_tasks.config import load_config
from verl_tasks.runner import make_context, train
import json
cfg = load_config(sys.argv[1], {"storage.uri": sys.argv[2]})
ctx = make_context(cfg)
target = int(sys.argv[3])
seen = []
def hook(**info):
    seen.append(info)
    if len(seen) == target:
        open(sys.argv[4], "w").write(json.dumps(info))
        os._exit(137)
hooks.register("before_commit", hook)
train(ctx, cfg.epochs)
"""


@pytest.mark.slow
def test_02_killed_between_files_and_marker(reference, tmp_path):
    """The committing process dies after its files are written and before the marker."""
    yaml = util.write_config(tmp_path)
    uri = f"file://{tmp_path}/store"
    ctx = make_context(util.config(uri))
    target = random.Random(util.SEED + 2).randrange(4, len(all_units(ctx)) + 3)
    info_path = tmp_path / "killed.json"
    proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(yaml), uri, str(target), str(info_path)],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 137, proc.stderr[-2000:]
    killed = json.loads(info_path.read_text())
    assert read_marker(ctx.store, killed["unit"]) is None
    assert ctx.store.list(killed["unit"] + "/.attempts/"), "the dead attempt's files should still be there"
    started = time.monotonic()
    train(ctx, util.EPOCHS)
    redone = finish(ctx, reference, "02_kill_before_marker", time.monotonic() - started, killed_unit=killed["unit"])
    assert redone == 1  # only the unit that died


def test_03_zombie_and_retry_race(reference, tmp_path, fault_hooks):
    """A zombie attempt reaches its commit after its retry committed: it loses and discards its files."""
    ctx = make_context(util.config(f"file://{tmp_path}/store"))
    phase, epoch, batch = random.Random(util.SEED + 3).choice([u for u in all_units(ctx) if u[0] != "evaluate"])
    unit = ctx.layout.unit(phase, epoch, batch)
    retry_ctx = make_context(ctx.config)
    zombie_attempt = {}

    def hook(**info):
        if info["unit"] == unit and not zombie_attempt:
            zombie_attempt["at"] = time.monotonic()
            retry = threading.Thread(target=run_phase, args=(retry_ctx, phase, epoch, batch))
            retry.start()
            retry.join()

    fault_hooks["before_commit"] = hook
    train(ctx, util.EPOCHS)
    races = [e for e in read_events(ctx.store, ctx.layout) if e["kind"] == "lost_race"]
    assert [e["unit"] for e in races] == [unit]
    record = read_marker(ctx.store, unit)
    assert record.attempt == races[0]["winner"] != races[0]["attempt"]
    attempts = list(ctx.store.list(unit + "/.attempts/"))
    assert attempts == [k for k in attempts if record.attempt in k]
    redone = finish(ctx, reference, "03_zombie_retry_race", time.monotonic() - zombie_attempt["at"], raced_unit=unit)
    assert redone == 1


def test_05_snapshot_corrupted_after_commit(reference, tmp_path, fault_hooks):
    """A committed snapshot is truncated or altered; loading it detects, quarantines and falls back."""
    rng = random.Random(util.SEED + 5)
    mode = rng.choice(["truncate", "alter"])
    ctx = make_context(util.config(f"file://{tmp_path}/store", **STOPS_AT_ONCE))
    target_version, done = 1, []

    def corrupt(**info):
        if info["phase"] == "plan" and info["epoch"] == target_version and not done:
            done.append(info["unit"])
            rec = read_marker(ctx.store, ctx.layout.snapshot(target_version))
            path = ctx.store.root / rec.key(WEIGHTS)
            data = bytearray(path.read_bytes())
            if mode == "truncate":
                data = data[: len(data) // 2]
            else:
                data[rng.randrange(len(data) // 2, len(data))] ^= 0xFF
            path.write_bytes(bytes(data))

    fault_hooks["before_commit"] = corrupt
    with pytest.raises(PhaseFailed, match="failed verification"):
        train(ctx, util.EPOCHS)
    detected = time.monotonic()
    st = status(ctx.config, ctx.store)
    assert st["latest_snapshot"]["version"] == 0
    # On a local store the snapshot's weights are a hard link to its update's (written once per epoch):
    # bytes damaged in place spoil both, and both units are quarantined to be recomputed.
    assert sorted(q["unit"] for q in st["quarantined"]) == [ctx.layout.update(0), ctx.layout.snapshot(1)]
    assert st["warnings"]
    kinds = [e for e in read_events(ctx.store, ctx.layout) if e["kind"] == "fallback"]
    assert kinds and kinds[0]["fell_back_to"] == 0
    fault_hooks.clear()
    train(ctx, util.EPOCHS)
    st = status(ctx.config, ctx.store)
    assert all(q["recovered"] for q in st["quarantined"]) and "recomputed since" in st["warnings"][0]
    redone = finish(ctx, reference, "05_snapshot_corrupted", time.monotonic() - detected, mode=mode)
    assert redone <= 3  # the update and its snapshot, plus the unit that found the damage


def test_06_reward_function_raises_hangs_and_crashes(reference, tmp_path, monkeypatch, allow_process_isolation):
    """An outage (every call raises) fails the batch on the threshold; single raise/hang/crash get the default."""
    flags = tmp_path / "flags"
    flags.mkdir()
    outage_over = tmp_path / "outage-over"
    monkeypatch.setenv("VT_CHAOS_REWARD_DIR", str(flags))
    monkeypatch.setenv("VT_CHAOS_REWARD_OUTAGE", str(outage_over))
    ctx = make_context(util.config(f"file://{tmp_path}/store", **{
        "rewards.function": "tests.reward_fixtures:chaos_exact", "rewards.timeout_s": 2, **STOPS_AT_ONCE,
        # The fault injection keeps its flags in this test's folder, which a namespaced sandbox cannot see.
        "rewards.isolation": "process"}))
    with pytest.raises(RewardFailureRate, match="could not be scored"):
        train(ctx, util.EPOCHS)
    assert read_marker(ctx.store, ctx.layout.score(0, 0)) is None
    outage_over.touch()  # the reward service is back
    started = time.monotonic()
    train(ctx, util.EPOCHS)
    failed = {sid for e in range(util.EPOCHS) for b in range(2)
              for sid in read_marker(ctx.store, ctx.layout.score(e, b)).meta.get("failed_samples", [])}
    assert len(failed) == 3 and sorted(os.listdir(flags)) == ["crash", "hang", "raise"]
    finish(ctx, reference, "06_reward_raise_hang_crash", time.monotonic() - started, default_scored=len(failed))


def test_07_update_oom_once_then_retry(reference, tmp_path, fault_hooks):
    """The update raises an OOM-like error once; the run's own retry starts from the same committed inputs."""
    rng = random.Random(util.SEED + 7)
    epoch_at, step_at = rng.randrange(util.EPOCHS), 1
    ctx = make_context(util.config(f"file://{tmp_path}/store", **{"fault_tolerance.retry_delay_s": 0}))
    fired, inputs = [], {}

    def oom(**info):
        if info["epoch"] == epoch_at and info["step"] == step_at and not fired:
            fired.append(time.monotonic())
            for unit in [ctx.layout.validate(epoch_at), ctx.layout.rollout(epoch_at, 0)]:
                inputs[unit] = read_marker(ctx.store, unit).attempt
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    fault_hooks["update_step"] = oom
    train(ctx, util.EPOCHS)  # not raised: the update is tried again in the run, as on the pools
    assert fired and {u: read_marker(ctx.store, u).attempt for u in inputs} == inputs
    failed = [e for e in read_events(ctx.store, ctx.layout) if e["kind"] == "failed"]
    assert [e["unit"] for e in failed] == [ctx.layout.update(epoch_at)]
    redone = finish(ctx, reference, "07_update_oom_once", time.monotonic() - fired[0], epoch=epoch_at)
    assert redone == 1


def test_08_enospc_on_local_store(reference, tmp_path, monkeypatch):
    """A write fails with ENOSPC: a clear error, nothing partial visible, a rerun after freeing space finishes."""
    from verl_tasks.store import local

    ctx = make_context(util.config(f"file://{tmp_path}/store", **STOPS_AT_ONCE))
    target = random.Random(util.SEED + 8).randrange(5, 60)
    original, real_fsync = local.LocalStore._write_temp, local.os.fsync
    writes = []

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    def write_temp(self, target_path, data=None, source=None, **options):
        if "/events/" not in str(target_path):
            writes.append(str(target_path))
            if len(writes) == target:
                monkeypatch.setattr(local.os, "fsync", no_space)
                try:
                    return original(self, target_path, data, source, **options)
                finally:
                    monkeypatch.setattr(local.os, "fsync", real_fsync)
        return original(self, target_path, data, source, **options)

    monkeypatch.setattr(local.LocalStore, "_write_temp", write_temp)
    with pytest.raises(StoreError, match="no space left") as err:
        train(ctx, util.EPOCHS)
    failed_at = time.monotonic()
    assert "nothing was committed" in str(err.value)
    monkeypatch.setattr(local.LocalStore, "_write_temp", original)
    for key in ctx.store.list(ctx.config.experiment + "/"):
        assert "/.tmp-" not in key
        if key.endswith("/_SUCCESS"):
            assert not verify_unit(ctx.store, read_marker(ctx.store, key[: -len("/_SUCCESS")])), key
    train(ctx, util.EPOCHS)
    failed_write = writes[target - 1].split("/store/")[-1]
    redone = finish(ctx, reference, "08_enospc", time.monotonic() - failed_at, failed_write=failed_write)
    assert redone <= 1


@pytest.mark.slow
def test_11_sigterm_or_sigint_during_run(reference, tmp_path):
    """`verl-tasks run` stops within seconds on SIGTERM/SIGINT; each unit is committed or absent."""
    import signal

    rng = random.Random(util.SEED + 11)
    sig = rng.choice([signal.SIGTERM, signal.SIGINT])
    commits_before_signal = rng.randrange(4, 10)  # of about 20: the run takes seconds once warm
    yaml = util.write_config(tmp_path)
    uri = f"file://{tmp_path}/store"
    ctx = make_context(util.config(uri))
    proc = subprocess.Popen(util.cli("run", str(yaml), "--store", uri), cwd=ROOT, preexec_fn=default_sigint,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        # The events' file names carry their kind: counting names is cheap enough to poll often.
        events = Path(ctx.store.root) / ctx.layout.events
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            names = os.listdir(events) if events.is_dir() else []
            if sum("-committed-" in name for name in names) >= commits_before_signal:
                break
            time.sleep(0.05)
        assert proc.poll() is None, f"the run ended before {commits_before_signal} commits were seen"
        sent = time.monotonic()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
        stop_s = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert stop_s < 10
    for unit in util.markers(ctx.store, ctx.layout):
        assert not verify_unit(ctx.store, read_marker(ctx.store, unit)), unit
    started = time.monotonic()
    train(ctx, util.EPOCHS)
    redone = finish(ctx, reference, "11_sigterm_sigint", time.monotonic() - started, signal=sig.name,
                    stop_s=round(stop_s, 2))
    assert redone <= 1
