"""Experiment trackers on the tiny model: MLflow's embedded SQLite store and TensorBoard event files."""
from __future__ import annotations

import collections
import json
import subprocess
import sys
import threading
from pathlib import Path

from verl_tasks.events import read_events
from verl_tasks.runner import make_context, run_phase, train
from verl_tasks.store.conventions import STEPS_FILE, TRAINER_STATE
from verl_tasks.store.units import quarantine, read_json, read_jsonl, read_marker

FAST = {"model.tiny.warm_start_steps": 20, "data.eval_size": 16, "evaluate.max_prompts": 16}


def _tensorboard_counts(folder: Path) -> collections.Counter:
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    return collections.Counter((value.tag, event.step) for path in folder.glob("events.out.tfevents.*")
                               for event in LegacyEventFileLoader(str(path)).Load()
                               for value in event.summary.value)


def test_one_value_per_metric_per_epoch_after_a_cleared_update_reruns(tiny_config, tmp_path):
    from mlflow.tracking import MlflowClient

    uri, board = f"sqlite:///{tmp_path}/mlflow.db", tmp_path / "tb"
    ctx = make_context(tiny_config(f"file://{tmp_path}/store", epochs=3, **FAST,
                                   **{"tracking.mlflow": uri, "tracking.tensorboard": str(board)}))
    train(ctx, 3)
    unit = ctx.layout.update(1)
    first = read_marker(ctx.store, unit)
    quarantine(ctx.store, unit, "test: clear epoch 1's update so that it is recomputed")
    before = len(read_events(ctx.store, ctx.layout))
    again = run_phase(ctx, "update", 1)
    assert again.attempt != first.attempt, "the cleared update must have been recomputed and committed again"

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(ctx.config.experiment).experiment_id])
    assert len(runs) == 1, "one MLflow run per experiment"
    run = runs[0]
    keys = set(run.data.metrics)
    expected = {"update/reward_mean", "update/actor/grad_norm", "evaluate/eval_accuracy", "base_evaluate/eval_accuracy"}
    assert expected <= keys
    for key in (k for k in keys if not k.startswith("update_step/")):  # per optimizer step: checked below
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
        assert steps == ([0] if key.startswith("base_evaluate/") else [0, 1, 2]), key
    [reward] = [m.value for m in client.get_metric_history(run.info.run_id, "update/reward_mean") if m.step == 1]
    assert reward == first.meta["metrics"]["reward_mean"]

    assert run.data.params["algorithm.lr"] == str(ctx.config.algorithm.lr)
    assert run.data.params["seed"] == str(ctx.config.seed)
    assert run.data.tags["verl_tasks.config_hash"] == ctx.config.config_hash()
    assert run.info.status == "FINISHED", "the last epoch's evaluation ends the run"
    for epoch in range(3):
        assert run.data.tags[f"snapshot/epoch_{epoch:05d}"] == ctx.store.url(ctx.layout.snapshot(epoch + 1))
    recorded = json.loads(ctx.store.get(ctx.store.list(f"{ctx.layout.root}/tracking/")[0]))
    assert recorded["run_id"] == run.info.run_id

    rerun = [e for e in read_events(ctx.store, ctx.layout)[before:] if e["kind"] == "tracked"]
    assert {e["tracker"] for e in rerun} == {"mlflow", "tensorboard"}
    assert all(e["logged"] == 0 and e["already_present"] > 0 for e in rerun), rerun

    counts = _tensorboard_counts(board)
    assert counts and set(counts.values()) == {1}, "one TensorBoard value per tag and step"
    assert {step for (tag, step) in counts if tag == "update/reward_mean"} == {0, 1, 2}
    assert {step for (tag, step) in counts if tag == "base_evaluate/eval_accuracy"} == {0}

    # Per optimizer step: the store holds each step once (in its update unit), the trackers one value each.
    total = read_json(ctx.store, read_marker(ctx.store, ctx.layout.update(2)), TRAINER_STATE)["step"]
    stored = [row["step"] for e in range(3)
              for row in read_jsonl(ctx.store, read_marker(ctx.store, ctx.layout.update(e)), STEPS_FILE)]
    assert stored == list(range(1, total + 1)) and total > 3, stored
    for key in ("update_step/actor/loss", "update_step/actor/ppo_kl", "update_step/actor/pg_clipfrac",
                "update_step/actor/entropy", "update_step/actor/grad_norm", "update_step/actor/lr"):
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
        assert steps == list(range(1, total + 1)), (key, steps)
        assert sorted(step for (tag, step) in counts if tag == key) == list(range(1, total + 1)), key


def test_a_failing_tracker_does_not_fail_training(tiny_config, tmp_path):
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_text("")
    ctx = make_context(tiny_config(f"file://{tmp_path}/store", epochs=1, **FAST,
                                   **{"tracking.mlflow": "no-such-scheme://tracker",
                                      "tracking.tensorboard": str(not_a_folder)}))
    result = train(ctx, 1)
    assert result["epochs"][0]["phases"]["update"] == "committed"
    failed = [e for e in read_events(ctx.store, ctx.layout) if e["kind"] == "tracking_failed"]
    assert {(e["tracker"], e["phase"]) for e in failed} == {(t, p) for t in ("mlflow", "tensorboard")
                                                             for p in ("update", "evaluate")}
    assert not [e for e in read_events(ctx.store, ctx.layout) if e["kind"] == "tracked"]


def test_concurrent_workers_share_one_mlflow_run(tiny_config, tmp_path):
    from mlflow.tracking import MlflowClient

    from verl_tasks.tracking import _mlflow_client, _mlflow_run

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    ctx = make_context(tiny_config(f"file://{tmp_path}/store", **{"tracking.mlflow": uri}))
    client, barrier, found = _mlflow_client(uri), threading.Barrier(2), []

    def worker() -> None:
        barrier.wait()
        found.append(_mlflow_run(ctx, client, uri))

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(found) == 2 and found[0] == found[1]
    experiment = MlflowClient(uri).get_experiment_by_name(ctx.config.experiment)
    assert [r.info.run_id for r in MlflowClient(uri).search_runs([experiment.experiment_id])] == [found[0]]


def test_tracking_imports_neither_torch_nor_a_tracker():
    probe = ("import sys, verl_tasks.tracking; "
             "print(sorted(m for m in ('torch', 'mlflow', 'tensorboard') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
