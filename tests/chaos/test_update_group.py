"""Chaos rows for the resident update group (two ddp workers, CPU): a worker, the process that drives
the group, and the whole group between an update's commit and the next epoch are each SIGKILLed; the
run must end with the weights of the same run without the fault (bit-identical on CPU), every unit
committed once, and only the update that was hit redone.

One fault-free reference run (two workers, same config) serves the module. The local Ray the group
lives on is started by the first distributed update (``train.group.ensure_ray``), with the test
fault hooks on its workers' ``PYTHONPATH``.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

from tests.faults import harness_env, kill_update_worker, record_update_nodes
from verl_tasks.events import read_events
from verl_tasks.runner import make_context, train

from ..conftest import ROOT
from . import util

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

GROUP = {"resources.update.workers": 2, "fault_tolerance.retry_delay_s": 0.1,
         "rewards.function": "tests.reward_fixtures:shared_characters", "model.tiny.warm_start_steps": 60}
WAIT_S = 300.0


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory):
    """The fault plan folder; the local Ray this module starts carries the test hooks (set before it starts)."""
    import ray
    from ray._private.authentication_test_utils import reset_auth_token_state

    from verl_tasks.train import group

    if ray.is_initialized():
        ray.shutdown()
    plan = tmp_path_factory.mktemp("faults")
    with pytest.MonkeyPatch.context() as mp:
        for key in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_TMPDIR", "RAY_ADDRESS"):
            mp.delenv(key, raising=False)
        for key, value in harness_env(plan).items():
            mp.setenv(key, value)
        reset_auth_token_state()
        yield plan
        group.release()
        ray.shutdown()


@pytest.fixture(scope="module")
def group_reference(tmp_path_factory, plan_dir):
    """The fault-free run on two resident workers: its final weights' sha256 and its duration."""
    from verl_tasks.train import group

    root = tmp_path_factory.mktemp("group-reference")
    ctx = make_context(util.config(f"file://{root}/store", **GROUP))
    started = time.monotonic()
    result = train(ctx, util.EPOCHS)
    group.release()  # each row starts from no group, as a fresh run does
    return {"sha": result["latest_snapshot"]["weights_sha256"], "duration_s": time.monotonic() - started}


def _update_events(ctx, kind: str) -> list[dict]:
    return [e for e in read_events(ctx.store, ctx.layout) if e["kind"] == kind and e.get("phase") == "update"]


def _finish(ctx, reference: dict, fault: str, recovery_s: float) -> int:
    assert util.latest_sha(ctx.store, ctx.layout) == reference["sha"]
    util.assert_exactly_once(ctx.store, ctx.layout, ctx.config)
    assert [e["epoch"] for e in _update_events(ctx, "committed")] == list(range(util.EPOCHS))  # once each
    # Redone: the units this run started more than once (a retry in the reference run, slow on a busy
    # machine, must not cancel one out here).
    starts = Counter((e.get("phase"), e.get("epoch"), e.get("batch"), e.get("unit"))
                     for e in read_events(ctx.store, ctx.layout) if e["kind"] == "started")
    redone = sum(count - 1 for count in starts.values())
    util.record(fault, recovery_s=round(recovery_s, 2), redone_units=redone,
                reference_run_s=round(reference["duration_s"], 1))
    return redone


def test_a_worker_killed_mid_step_redoes_that_update_only(group_reference, plan_dir, tmp_path):
    from verl_tasks.train import group

    ctx = make_context(util.config(f"file://{tmp_path}/store", **GROUP))
    killed = kill_update_worker(plan_dir, ctx.config.experiment, 1, rank=1)
    started = time.monotonic()
    train(ctx, util.EPOCHS)
    group.release()
    assert killed.exists(), "worker 1 was not killed in epoch 1's update"
    failed = _update_events(ctx, "failed")
    assert [e["epoch"] for e in failed] == [1] and "update worker failed" in failed[0]["error"], failed
    assert _finish(ctx, group_reference, "update worker SIGKILL mid-step", time.monotonic() - started) == 1


def test_the_whole_group_killed_between_commit_and_next_epoch_reloads_from_the_store(group_reference, plan_dir,
                                                                                     tmp_path, fault_hooks):
    """Epoch 0's update commits, then every worker of the group dies before epoch 1 starts: epoch 1 forms a
    new group that loads the committed policy from the store."""
    from verl_tasks.train import group

    ctx = make_context(util.config(f"file://{tmp_path}/store", **GROUP))
    killed: list[int] = []

    def kill_group(*, phase: str, epoch: int, **_) -> None:  # before snapshot 0 commits: update 0 has
        if phase == "snapshot" and epoch == 0 and not killed:
            pids = [rank["pid"] for held in group._HELD for rank in held.ranks]
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            killed.extend(pids)

    fault_hooks["before_commit"] = kill_group
    started = time.monotonic()
    train(ctx, util.EPOCHS)
    group.release()
    assert len(killed) == 2
    from verl_tasks.store.units import read_marker

    sources = [read_marker(ctx.store, ctx.layout.update(e)).meta["ran"]["policy"] for e in range(util.EPOCHS)]
    assert sources == ["store", "store"], sources  # epoch 1: a new group, nothing resident
    assert _finish(ctx, group_reference, "update group SIGKILL between commit and next epoch",
                   time.monotonic() - started) == 0


DRIVER = """
import sys
from verl_tasks.config import load_config
from verl_tasks.runner import make_context, train
ctx = make_context(load_config(sys.argv[1], {"storage.uri": sys.argv[2]}))
train(ctx, ctx.config.epochs)
"""


def _descendants_alive(pids: list[int]) -> list[int]:
    return [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


def test_the_driver_killed_mid_update_loses_nothing_and_leaves_no_worker(group_reference, plan_dir, tmp_path):
    """The process driving the group (here a run in its own process) is SIGKILLed while both workers are
    in epoch 1's first step: the workers die with their owner, and a new run finishes the experiment."""
    yaml = util.write_config(tmp_path, **GROUP)
    uri = f"file://{tmp_path}/store"
    ctx = make_context(util.config(uri, **GROUP))
    where = record_update_nodes(plan_dir, ctx.config.experiment, 1)
    env = {**os.environ, **harness_env(plan_dir)}
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(yaml), uri], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + WAIT_S
    while not (where(0).exists() and where(1).exists()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, f"the run ended before epoch 1's update started: {proc.stderr.read()[-3000:]}"
    assert where(0).exists() and where(1).exists(), f"no worker reached epoch 1's first step in {WAIT_S:g} s"
    workers = [json.loads(where(rank).read_text())["pid"] for rank in (0, 1)]
    started = time.monotonic()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 60
    while _descendants_alive(workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _descendants_alive(workers) == [], "update workers outlived the process that drove them"
    Path(where(0)).unlink()
    Path(where(1)).unlink()
    subprocess.run([sys.executable, "-c", DRIVER, str(yaml), uri], cwd=ROOT, env=env, check=True,
                   capture_output=True, text=True)
    assert [e["epoch"] for e in _update_events(ctx, "committed")] == [0, 1]
    assert _finish(ctx, group_reference, "update driver SIGKILL mid-update", time.monotonic() - started) == 1
