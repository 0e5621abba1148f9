"""Training controls: the learning-rate schedule, keep-best retention and skippable batches.

- ``algorithm.lr_schedule``: the rate of step ``k`` is ``lr_at(k)``, so a run killed
  mid-way and resumed ends with the weights of an uninterrupted one, and every
  update's recorded rates follow the formula over contiguous global steps.
- ``storage.keep_best_by``: with ``keep_snapshots: 1`` the best evaluated snapshot
  survives the retention that would have pruned it, also when its evaluation commits
  after the next snapshot (as Airflow's side branch does), and ``best.json`` names it.
- ``fault_tolerance.min_committed_batch_fraction``: one of 4 batches failing for good
  with 0.75 lets the epoch finish and the status names it; with 1.0 the run fails.
"""
from __future__ import annotations

import json
import math
import signal
import subprocess
import time

import pytest

from verl_tasks.algos import lr_at
from verl_tasks.config import load_config
from verl_tasks.errors import BatchesMissing, ConfigError, DataError
from verl_tasks.events import read_events
from verl_tasks.layout import Layout
from verl_tasks.ops.rollback import apply_rollback, plan_rollback
from verl_tasks.phases.snapshot import apply_retention
from verl_tasks.runner import make_context, run_phase, status, train
from verl_tasks.store import open_store
from verl_tasks.store.conventions import WEIGHTS, forget_best_above, read_best, read_skipped, write_best
from verl_tasks.store.units import MARKER, is_committed, is_pruned, read_json, read_marker

from .conftest import ROOT, TINY_YAML, small_overrides, write_yaml
from .test_training import _cli, _status_json

# ---------------------------------------------------------------- the learning-rate schedule


def test_lr_at_follows_the_formula():
    base = {"lr": 1.0, "warmup_steps": 2, "total_steps": 10, "min_lr_ratio": 0.1}
    assert [lr_at(k, **base, schedule="constant") for k in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert [lr_at(k, **base, schedule="linear") for k in (0, 1, 2, 6, 10, 50)] == pytest.approx(
        [0.5, 1.0, 1.0, 1.0 - 0.5 * 0.9, 0.1, 0.1])
    cosine = [lr_at(k, **base, schedule="cosine") for k in (2, 6, 10, 11)]
    assert cosine == pytest.approx([1.0, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)), 0.1, 0.1])
    assert lr_at(3, lr=2e-3) == 2e-3
    with pytest.raises(ValueError, match="unknown lr schedule 'step'"):
        lr_at(0, lr=1.0, schedule="step")


def test_total_steps_is_derived_and_hashed_and_default_configs_keep_their_hash():
    plain = load_config(TINY_YAML, small_overrides())
    assert "lr_schedule" not in plain.hashed_view()["algorithm"]  # experiments pinned before still resume
    cosine = load_config(TINY_YAML, small_overrides(**{"algorithm.lr_schedule": "cosine"}))
    assert cosine.algorithm.total_steps == cosine.epochs * cosine.optimizer_steps_per_epoch == 2 * 2
    longer = load_config(TINY_YAML, small_overrides(**{"algorithm.lr_schedule": "cosine", "epochs": 3}))
    assert longer.config_hash() != cosine.config_hash()  # a longer run is another schedule: refused on resume
    pinned = load_config(TINY_YAML, small_overrides(**{"algorithm.lr_schedule": "cosine", "epochs": 3,
                                                        "algorithm.total_steps": 4}))
    assert pinned.config_hash() == cosine.config_hash()
    with pytest.raises(ConfigError, match=r"algorithm.warmup_steps \(9\) exceeds algorithm.total_steps \(4\)"):
        load_config(TINY_YAML, small_overrides(**{"algorithm.lr_schedule": "linear", "algorithm.warmup_steps": 9}))


SCHEDULED = {"epochs": 2, "algorithm.minibatch_size": 16, "algorithm.lr_schedule": "cosine",
             "algorithm.warmup_steps": 3, "algorithm.min_lr_ratio": 0.1, "evaluate.every": 0, "evaluate.max_prompts": 8}


def _wait_for(path, proc, timeout_s=600.0):
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, "the run ended before the point to kill it"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


@pytest.mark.slow
def test_cosine_schedule_resumes_exactly_after_sigkill(tmp_path):
    config = write_yaml(tmp_path, small_overrides(**SCHEDULED))
    reference = f"file://{tmp_path}/reference"
    subprocess.run(_cli("run", str(config), "--store", reference), check=True, cwd=ROOT, capture_output=True)
    expected = _status_json(config, reference)["latest_snapshot"]["weights_sha256"]

    killed = tmp_path / "killed"
    proc = subprocess.Popen(_cli("run", str(config), "--store", f"file://{killed}"), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:  # epoch 1's plan is committed: the second update (steps 4-7 of the schedule) is under way or next
        _wait_for(killed / "tiny-arith" / "epochs" / "00001" / "plan" / MARKER, proc)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not (killed / "tiny-arith" / "snapshots" / "00002" / MARKER).exists(), "killed before the end"
    subprocess.run(_cli("run", str(config), "--store", f"file://{killed}"), check=True, cwd=ROOT, capture_output=True)
    assert _status_json(config, f"file://{killed}")["latest_snapshot"]["weights_sha256"] == expected

    cfg = load_config(config, {"storage.uri": f"file://{killed}"})
    store, layout, algo = open_store(cfg.storage.uri), Layout(cfg.experiment), cfg.algorithm
    schedule = {"lr": algo.lr, "schedule": "cosine", "warmup_steps": 3, "total_steps": 8, "min_lr_ratio": 0.1}
    for epoch in range(2):
        update = read_marker(store, layout.update(epoch))
        state = read_json(store, update, "trainer_state.json")
        steps = range(4 * epoch, 4 * epoch + 4)
        assert state["step"] == 4 * (epoch + 1)
        assert state["lr_schedule"]["lrs"] == [lr_at(k, **schedule) for k in steps]
        assert read_json(store, update, "metrics.json")["actor/lr"] == lr_at(steps[-1], **schedule)
    snap = read_json(store, read_marker(store, layout.snapshot(2)), "trainer_state.json")["lr_schedule"]
    assert snap["step"] == 8 and snap["lr"] == lr_at(7, **schedule) and snap["next_lr"] == algo.lr * 0.1
    assert lr_at(0, **schedule) < lr_at(2, **schedule) == algo.lr > lr_at(5, **schedule)  # warm-up, then decay


# ---------------------------------------------------------------- keep the best snapshot

EPOCHS = 4


@pytest.fixture(scope="module")
def best_run(tmp_path_factory):
    """4 epochs keeping one snapshot and the best by eval accuracy; each evaluation commits after the
    next epoch's snapshot (Airflow's side branch), so retention meets pending evaluations."""
    root = tmp_path_factory.mktemp("best")
    overrides = small_overrides(**{
        "epochs": EPOCHS, "storage.keep_snapshots": 1, "storage.keep_best_by": "eval_accuracy", "evaluate.every": 1,
        "evaluate.max_prompts": 16, "rollout.batches_per_epoch": 1, "rollout.prompts_per_batch": 4,
        "algorithm.minibatch_size": 16, "data.train_size": 100, "data.eval_size": 16,
        "model.tiny.warm_start_steps": 50, "quality.enabled": False, "storage.uri": f"file://{root}/store"})
    ctx = make_context(load_config(TINY_YAML, overrides))
    kept_while_pending = []
    for epoch in range(EPOCHS):
        for phase in ("plan", "rollout", "score", "validate", "update", "snapshot"):
            run_phase(ctx, phase, epoch, 0 if phase in ("rollout", "score") else None)
        if epoch:
            kept_while_pending.append(not is_pruned(ctx.store, ctx.layout.snapshot(epoch)))
            run_phase(ctx, "evaluate", epoch - 1)
    run_phase(ctx, "evaluate", EPOCHS - 1)
    return ctx, kept_while_pending


def test_best_snapshot_survives_retention_and_best_json_names_it(best_run):
    ctx, kept_while_pending = best_run
    assert kept_while_pending == [True] * (EPOCHS - 1), "a version whose evaluation is pending is never pruned"
    accuracy = {e + 1: read_marker(ctx.store, ctx.layout.evaluate(e)).meta["metrics"]["eval_accuracy"]
                for e in range(EPOCHS)}
    best = max(accuracy, key=lambda v: (accuracy[v], -v))
    assert best < EPOCHS, f"the scenario needs an older best than the newest snapshot: {accuracy}"
    pruned = {v for v in range(1, EPOCHS + 1) if is_pruned(ctx.store, ctx.layout.snapshot(v))}
    assert pruned == set(range(1, EPOCHS)) - {best}
    record = read_marker(ctx.store, ctx.layout.snapshot(best))
    assert ctx.store.exists(record.key(WEIGHTS))
    pointer = read_best(ctx.store, ctx.layout)
    assert pointer == {"version": best, "metric": "eval_accuracy", "value": accuracy[best], "unit": record.unit,
                       "weights_sha256": record.files[WEIGHTS].sha256, "uri": ctx.store.url(record.unit)}
    assert status(ctx.config, ctx.store)["best_snapshot"] == pointer


def test_checkpoint_inspect_and_verify_show_the_best(best_run):
    ctx, _ = best_run
    best = read_best(ctx.store, ctx.layout)["version"]
    uri = ctx.store.url(ctx.layout.snapshot(best))
    out = subprocess.run(_cli("checkpoint", "inspect", uri), cwd=ROOT, capture_output=True, text=True, check=True)
    info = json.loads(out.stdout)
    assert info["best"] is True and info["version"] == best
    subprocess.run(_cli("checkpoint", "verify", uri), cwd=ROOT, capture_output=True, text=True, check=True)


def test_keep_best_set_later_picks_among_the_snapshots_still_there(best_run):
    ctx, _ = best_run
    later = make_context(ctx.config.model_copy(update={"storage": ctx.config.storage.model_copy(
        update={"keep_best_by": "eval_reward_mean"})}))
    kept = [v for v in range(1, EPOCHS + 1) if not is_pruned(ctx.store, ctx.layout.snapshot(v))]
    assert apply_retention(later, EPOCHS) == []
    reward = {v: read_marker(ctx.store, ctx.layout.evaluate(v - 1)).meta["metrics"]["eval_reward_mean"] for v in kept}
    pointer = read_best(ctx.store, ctx.layout)
    assert pointer["metric"] == "eval_reward_mean" and pointer["version"] == max(kept, key=lambda v: (reward[v], -v))


def test_rollback_forgets_a_best_snapshot_it_invalidates(best_run):
    ctx, _ = best_run
    kept = min(v for v in range(1, EPOCHS) if not is_pruned(ctx.store, ctx.layout.snapshot(v)))  # the old best
    newest = read_marker(ctx.store, ctx.layout.snapshot(EPOCHS))
    write_best(ctx.store, ctx.layout, EPOCHS, "eval_accuracy", 1.0, newest)
    kept_best = read_best(ctx.store, ctx.layout)
    assert not forget_best_above(ctx.store, ctx.layout, EPOCHS) and read_best(ctx.store, ctx.layout) == kept_best
    plan = plan_rollback(ctx.store, ctx.layout, kept - 1)
    apply_rollback(ctx.store, ctx.layout, plan)
    assert read_best(ctx.store, ctx.layout) is None, "best.json named a rolled-back snapshot"


# ---------------------------------------------------------------- skippable batches


class BatchFault(RuntimeError):
    """A reward that fails for good on one batch: every try raises."""


SKIPPABLE = {"epochs": 1, "rollout.batches_per_epoch": 4, "rollout.prompts_per_batch": 4,
             "algorithm.minibatch_size": 32,
             "evaluate.every": 0, "evaluate.max_prompts": 8, "model.tiny.warm_start_steps": 50,
             "fault_tolerance.retries": 1, "fault_tolerance.retry_delay_s": 0}


def _faulty(tiny_config, fault_hooks, store: str, fraction: float, bad: set[int]):
    ctx = make_context(tiny_config(store, **SKIPPABLE, **{"fault_tolerance.min_committed_batch_fraction": fraction}))
    tries = []

    def fail_scores(phase, batch, **_):
        if phase == "score" and batch in bad:
            tries.append(batch)
            raise BatchFault(f"score of batch {batch} fails for good")

    fault_hooks["before_commit"] = fail_scores
    return ctx, tries


def test_a_batch_failing_for_good_is_skipped_and_named(tiny_config, fault_hooks, tmp_path):
    ctx, tries = _faulty(tiny_config, fault_hooks, f"file://{tmp_path}/skip", 0.75, {2})
    result = train(ctx, 1)
    assert tries == [2, 2], "1 + fault_tolerance.retries tries, then left out"
    epoch = result["epochs"][0]
    assert epoch["skipped_batches"] == [2]
    assert epoch["phases"]["score"] == "3/4 committed" and epoch["phases"]["snapshot"] == "committed"
    assert read_marker(ctx.store, ctx.layout.update(0)).meta["metrics"]["samples"] == 3 * 4 * 4
    out = subprocess.run(_cli("status", str(write_yaml(tmp_path, small_overrides(**SKIPPABLE))), "--store",
                              ctx.config.storage.uri), cwd=ROOT, capture_output=True, text=True, check=True)
    assert "skipped batches [2]" in out.stdout

    fault_hooks.clear()  # the fault is gone: a rerun computes the batch but the epoch keeps its recorded set
    run_phase(ctx, "score", 0, 2)
    ctx.store.delete(f"{ctx.layout.validate(0)}/{MARKER}")
    run_phase(ctx, "validate", 0)
    assert read_skipped(ctx.store, ctx.layout, 0) == [2]
    assert read_json(ctx.store, read_marker(ctx.store, ctx.layout.validate(0)), "report.json")["rows"] == 48


def test_with_fraction_one_the_failing_batch_stops_the_run(tiny_config, fault_hooks, tmp_path):
    ctx, tries = _faulty(tiny_config, fault_hooks, f"file://{tmp_path}/strict", 1.0, {2})
    with pytest.raises(BatchFault):
        train(ctx, 1)
    assert tries == [2, 2], "retried as on the pools, then raised: nothing is left out at fraction 1"
    assert not is_committed(ctx.store, ctx.layout.validate(0))


def test_a_deterministic_error_is_not_retried(tiny_config, fault_hooks, tmp_path):
    ctx, _ = _faulty(tiny_config, fault_hooks, f"file://{tmp_path}/strict", 0.75, set())
    tries = []

    def bad_input(phase, batch, **_):
        if phase == "score" and batch == 1:
            tries.append(batch)
            raise DataError("batch 1 holds a malformed row (injected)")

    fault_hooks["before_commit"] = bad_input
    with pytest.raises(DataError, match="malformed row"):
        train(ctx, 1)
    assert tries == [1], "a person must change something first: neither retried nor left out"


def test_too_many_failed_batches_fail_validate_naming_the_setting(tiny_config, fault_hooks, tmp_path):
    ctx, _ = _faulty(tiny_config, fault_hooks, f"file://{tmp_path}/many", 0.75, {1, 2})
    with pytest.raises(BatchesMissing, match=r"batches \[1, 2\] of epoch 0 are not committed .* lower "
                                             r"fault_tolerance.min_committed_batch_fraction \(0.75\)"):
        train(ctx, 1)
    assert read_skipped(ctx.store, ctx.layout, 0) == []
    tried = [e for e in read_events(ctx.store, ctx.layout)
             if e["kind"] == "started" and e["unit"] == ctx.layout.validate(0)]
    assert len(tried) == 1, "validate again cannot bring the batches back: not retried"


def test_a_cancelled_validate_never_records_which_batches_the_epoch_goes_without(tiny_config, fault_hooks, tmp_path):
    """The skipped set is committed once for good: a validate attempt fenced (timed out, or cleared
    while a late batch was still scoring) must not write it, or the batch would stay out after it commits."""
    from verl_tasks.errors import AttemptFenced
    from verl_tasks.store.units import fence_attempt, new_attempt_id

    ctx, _ = _faulty(tiny_config, fault_hooks, f"file://{tmp_path}/fenced", 0.75, set())
    run_phase(ctx, "plan", 0)
    for batch in range(4):
        run_phase(ctx, "rollout", 0, batch)
    for batch in (0, 1, 3):  # batch 2 is still being scored
        run_phase(ctx, "score", 0, batch)
    ctx.attempt = new_attempt_id()
    fence_attempt(ctx.store, ctx.layout.validate(0), ctx.attempt, "cleared in the UI")
    with pytest.raises(AttemptFenced):
        run_phase(ctx, "validate", 0)
    assert read_skipped(ctx.store, ctx.layout, 0) == [] and not is_committed(ctx.store, ctx.layout.validate(0))
    run_phase(ctx, "score", 0, 2)  # the late batch commits; the next validate attempt reads all four
    ctx.attempt = None
    run_phase(ctx, "validate", 0)
    assert read_skipped(ctx.store, ctx.layout, 0) == []
    assert read_json(ctx.store, read_marker(ctx.store, ctx.layout.validate(0)), "report.json")["rows"] == 64
