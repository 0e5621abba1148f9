"""Chaos, verl recipes: PPO's critic update, a dynamic-sampling extra batch and a LoRA update die mid-unit and are
tried again.

PPO: the critic's update is killed (the process exits) or raises an OOM-like error; DAPO's dynamic sampling:
the process dies while committing an extra rollout batch, or an extra batch's scoring fails once; LoRA: the
adapter's update fails once. Each test
asserts what the chaos matrix asserts (every unit committed once, no sample lost or counted twice) and that
the final weights (with PPO, the policy's and the critic's) equal the fault-free run's, byte for byte: a
retried unit starts again from committed inputs, and the extra batches already committed are not redone.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import pytest

from verl_tasks.events import read_events
from verl_tasks.runner import make_context, train
from verl_tasks.store.conventions import is_critic_file
from verl_tasks.store.units import read_marker

from . import util

pytestmark = pytest.mark.chaos

PPO = {"algorithm.adv_estimator": "gae", "critic": {"lr": 1e-4}}


def critic_and_policy(ctx) -> dict[str, str]:
    """The sha256 of every critic file and of the policy weights in the newest snapshot."""
    pointer = json.loads(ctx.store.get(ctx.layout.latest))
    record = read_marker(ctx.store, ctx.layout.snapshot(pointer["version"]))
    shas = {name: entry.sha256 for name, entry in record.files.items() if is_critic_file(name)}
    return {**shas, "policy": pointer["weights_sha256"]}


@pytest.fixture(scope="module")
def ppo_reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppo-reference")
    ctx = make_context(util.config(f"file://{root}/store", **PPO))
    train(ctx, util.EPOCHS)
    weights = critic_and_policy(ctx)
    assert {"critic.model.safetensors", "critic.optimizer.safetensors"} <= set(weights), weights
    return {"weights": weights, "started": util.started_count(ctx.store, ctx.layout)}


KILL_AT_CRITIC_STEP = """
import os, sys
from verl_tasks import hooks
from verl_tasks.config import load_config
from verl_tasks.runner import make_context, train
cfg = load_config(sys.argv[1], {"storage.uri": sys.argv[2]})
epoch, step = int(sys.argv[3]), int(sys.argv[4])
def hook(**info):
    if info["epoch"] == epoch and info["step"] == step:
        os._exit(137)
hooks.register("critic_step", hook)
train(make_context(cfg), cfg.epochs)
"""


def test_critic_killed_mid_update_then_rerun(ppo_reference, tmp_path):
    """SIGKILL-like exit inside the critic's optimizer steps of a seeded epoch; a new process resumes."""
    rng = random.Random(util.SEED + 31)
    epoch_at, step_at = rng.randrange(util.EPOCHS), 1
    yaml = util.write_config(tmp_path, **PPO)
    uri = f"file://{tmp_path}/store"
    killed = subprocess.run([sys.executable, "-c", KILL_AT_CRITIC_STEP, str(yaml), uri, str(epoch_at), str(step_at)],
                            cwd=util.ROOT, capture_output=True, text=True, timeout=1200)
    assert killed.returncode == 137, killed.stderr[-3000:]
    ctx = make_context(util.config(uri, **PPO))
    assert read_marker(ctx.store, ctx.layout.critic(epoch_at)) is None, "the killed critic unit committed"
    started = time.monotonic()
    train(ctx, util.EPOCHS)
    assert critic_and_policy(ctx) == ppo_reference["weights"]
    util.assert_exactly_once(ctx.store, ctx.layout, ctx.config)
    critic_starts = [e for e in read_events(ctx.store, ctx.layout)
                     if e["kind"] == "started" and e["unit"] == ctx.layout.critic(epoch_at)]
    assert len(critic_starts) == 2, critic_starts  # the killed attempt and the one that committed
    util.record("critic_killed_mid_update", recovery_s=round(time.monotonic() - started, 2), epoch=epoch_at)


def test_critic_oom_once_then_retry(ppo_reference, tmp_path, fault_hooks):
    """The critic's update raises an OOM-like error once; the run's own retry gives the same critic and policy."""
    epoch_at = random.Random(util.SEED + 32).randrange(util.EPOCHS)
    ctx = make_context(util.config(f"file://{tmp_path}/store", **PPO, **{"fault_tolerance.retry_delay_s": 0}))
    fired = []

    def oom(**info):
        if info["epoch"] == epoch_at and info["step"] == 1 and not fired:
            fired.append(info)
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    fault_hooks["critic_step"] = oom
    train(ctx, util.EPOCHS)
    assert fired
    failed = [e["unit"] for e in read_events(ctx.store, ctx.layout) if e["kind"] == "failed"]
    assert failed == [ctx.layout.critic(epoch_at)]
    assert critic_and_policy(ctx) == ppo_reference["weights"]
    util.assert_exactly_once(ctx.store, ctx.layout, ctx.config)
    assert util.started_count(ctx.store, ctx.layout) == ppo_reference["started"] + 1


DYNAMIC = {"algorithm.filter_groups": {"enable": True, "max_batches": 8}}


@pytest.fixture(scope="module")
def dynamic_reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("dynamic-reference")
    ctx = make_context(util.config(f"file://{root}/store", **DYNAMIC))
    train(ctx, util.EPOCHS)
    extra = {e: read_marker(ctx.store, ctx.layout.top_up(e)).meta["extra_batches"] for e in range(util.EPOCHS)}
    assert any(extra.values()), f"no epoch drew an extra batch: {extra}"
    return {"sha": util.latest_sha(ctx.store, ctx.layout), "extra": extra}


KILL_AT_EXTRA_COMMIT = """
import os, sys
from verl_tasks import hooks
from verl_tasks.config import load_config
from verl_tasks.runner import make_context, train
cfg = load_config(sys.argv[1], {"storage.uri": sys.argv[2]})
epoch, batch = int(sys.argv[3]), int(sys.argv[4])
def hook(**info):
    if info["phase"] == "rollout" and info["epoch"] == epoch and info["batch"] == batch:
        os._exit(137)
hooks.register("before_commit", hook)
train(make_context(cfg), cfg.epochs)
"""


def test_dynamic_sampling_extra_batch_killed_before_its_commit_then_rerun(dynamic_reference, tmp_path):
    """The process dies after an extra batch's samples are written, before its marker; a new run redoes that
    batch alone and ends on the fault-free weights."""
    epochs = [e for e, extra in dynamic_reference["extra"].items() if extra]
    epoch_at = epochs[random.Random(util.SEED + 33).randrange(len(epochs))]
    batch_at = util.small_batches() + dynamic_reference["extra"][epoch_at] - 1  # the last extra batch drawn
    yaml = util.write_config(tmp_path, **DYNAMIC)
    uri = f"file://{tmp_path}/store"
    killed = subprocess.run([sys.executable, "-c", KILL_AT_EXTRA_COMMIT, str(yaml), uri, str(epoch_at), str(batch_at)],
                            cwd=util.ROOT, capture_output=True, text=True, timeout=1200)
    assert killed.returncode == 137, killed.stderr[-3000:]
    ctx = make_context(util.config(uri, **DYNAMIC))
    assert read_marker(ctx.store, ctx.layout.rollout(epoch_at, batch_at)) is None
    earlier = [read_marker(ctx.store, ctx.layout.rollout(epoch_at, b)).attempt
               for b in range(util.small_batches(), batch_at)]
    train(ctx, util.EPOCHS)
    assert util.latest_sha(ctx.store, ctx.layout) == dynamic_reference["sha"]
    util.assert_exactly_once(ctx.store, ctx.layout, ctx.config)
    assert [read_marker(ctx.store, ctx.layout.rollout(epoch_at, b)).attempt
            for b in range(util.small_batches(), batch_at)] == earlier  # not redone
    assert read_marker(ctx.store, ctx.layout.top_up(epoch_at)).meta["extra_batches"] == \
        dynamic_reference["extra"][epoch_at]


def test_dynamic_sampling_extra_batch_scoring_fails_once_then_retry(dynamic_reference, tmp_path, fault_hooks):
    epochs = [e for e, extra in dynamic_reference["extra"].items() if extra]
    epoch_at = epochs[random.Random(util.SEED + 34).randrange(len(epochs))]
    batch_at = util.small_batches()  # the first extra batch
    ctx = make_context(util.config(f"file://{tmp_path}/store", **DYNAMIC, **{"fault_tolerance.retry_delay_s": 0}))
    fired = []

    def fail_once(**info):
        if info["phase"] == "score" and (info["epoch"], info["batch"]) == (epoch_at, batch_at) and not fired:
            fired.append(info)
            raise ConnectionError("reward service reset the connection (injected)")

    fault_hooks["before_commit"] = fail_once
    train(ctx, util.EPOCHS)
    assert fired
    failed = [e["unit"] for e in read_events(ctx.store, ctx.layout) if e["kind"] == "failed"]
    assert ctx.layout.score(epoch_at, batch_at) in failed and ctx.layout.top_up(epoch_at) in failed, failed
    assert util.latest_sha(ctx.store, ctx.layout) == dynamic_reference["sha"]
    util.assert_exactly_once(ctx.store, ctx.layout, ctx.config)


LORA = {"model.lora": {"rank": 4, "alpha": 8}, "algorithm.lr": 1e-3}


def test_lora_update_oom_once_then_retry(tmp_path, fault_hooks):
    """LoRA: the adapter's update raises an OOM-like error once; the retried update commits the same adapter
    and optimizer bytes as a fault-free run's."""
    clean = make_context(util.config(f"file://{tmp_path}/clean", **LORA))
    train(clean, util.EPOCHS)
    epoch_at = random.Random(util.SEED + 35).randrange(util.EPOCHS)
    ctx = make_context(util.config(f"file://{tmp_path}/store", **LORA, **{"fault_tolerance.retry_delay_s": 0}))
    fired = []

    def oom(**info):
        if info["epoch"] == epoch_at and info["step"] == 1 and not fired:
            fired.append(info)
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    fault_hooks["update_step"] = oom
    train(ctx, util.EPOCHS)
    assert fired
    for epoch in range(util.EPOCHS):
        got, want = (read_marker(c.store, c.layout.update(epoch)).files for c in (ctx, clean))
        assert {n: e.sha256 for n, e in got.items() if n.endswith(".safetensors")} == \
            {n: e.sha256 for n, e in want.items() if n.endswith(".safetensors")}
    assert util.latest_sha(ctx.store, ctx.layout) == util.latest_sha(clean.store, clean.layout)
    util.assert_exactly_once(ctx.store, ctx.layout, ctx.config)
