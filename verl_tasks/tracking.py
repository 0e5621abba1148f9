"""Experiment trackers: each committed update and evaluation logs its metrics once, keyed by step.

``tracking.mlflow`` (a tracking URI) and ``tracking.tensorboard`` (a folder) are optional
(``pip install 'verl-tasks[tracking]'``); their libraries are imported only when configured, and
this module imports no torch.

A unit commits once, but a rolled-back or quarantined unit commits again when it is recomputed.
So each tracker is first asked which (metric, step) values it already holds and only the
missing ones are written: the tracker holds at most one value per metric per step.
Metric names are ``<phase>/<metric>`` (``update/reward_mean``, ``evaluate/eval_accuracy``) at the
epoch as step; the base policy's evaluation is ``base_evaluate/...`` at step 0. Each optimizer step
of an update (its unit's ``steps.jsonl``) is ``update_step/<metric>`` (loss, KL, clip fraction,
entropy, grad norm, learning rate) at the global optimizer step, counted from 1.

TensorBoard gets one event file per committed unit: units commit from different processes and
machines, and only a file of one's own is safe to write; TensorBoard reads every event file of
the folder as one run.

MLflow: one run per experiment and tracking URI. Its id is recorded in the store under
``<experiment>/tracking/`` with a write-if-absent, so two workers never make two runs; the
run holds the hashed config as parameters and, per epoch, the URI of the snapshot the
epoch produced as a tag (``snapshot/epoch_00003``).

A tracker that fails (unreachable, not installed, a bad URI) never fails the unit: it logs a
warning and records a ``tracking_failed`` event; ``tracked`` events count what was written.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verl_tasks.config import ExperimentConfig, flatten
from verl_tasks.events import record_event
from verl_tasks.store.base import NotFound

if TYPE_CHECKING:
    from verl_tasks.phases.common import PhaseContext
    from verl_tasks.store.units import CommitRecord

log = logging.getLogger(__name__)

TRACKED_PHASES = ("update", "critic", "evaluate")
MLFLOW_PARAMS_PER_CALL = 100  # MLflow's log_batch limits
MLFLOW_METRICS_PER_CALL = 1000


def track_commit(ctx: PhaseContext, phase: str, unit: str, epoch: int, record: CommitRecord) -> None:
    """Log a just-committed update, critic update or evaluation to each configured tracker; other phases do
    nothing. A metric is named ``phase/name`` (the critic's own names start with ``critic/`` already)."""
    trackers = ctx.config.tracking
    if phase not in TRACKED_PHASES or not (trackers.mlflow or trackers.tensorboard):
        return
    base = unit == ctx.layout.base_evaluate
    prefix = "base_evaluate" if base else phase
    metrics = {name if name.startswith(f"{prefix}/") else f"{prefix}/{name}": float(value)
               for name, value in (record.meta.get("metrics") or {}).items()
               if isinstance(value, (int, float)) and not isinstance(value, bool)}
    version = 0 if base else epoch + 1
    tags = {"snapshot/base" if base else f"snapshot/epoch_{epoch:05d}": ctx.store.url(ctx.layout.snapshot(version))}
    writers = (("mlflow", trackers.mlflow, _log_mlflow), ("tensorboard", trackers.tensorboard, _log_tensorboard))
    for name, target, write in writers:
        if not target:
            continue
        try:
            points = [(epoch, metrics), *(_optimizer_steps(ctx, record) if phase == "update" else [])]
            logged, present = write(ctx, target, unit, points, tags)
        except Exception as err:  # noqa: BLE001 - a tracker must never fail a committed unit
            error = f"{type(err).__name__}: {err}"[:2000]
            if isinstance(err, ImportError):
                error += "; install the tracking extra: pip install 'verl-tasks[tracking]'"
            log.warning("%s tracking of %s failed (the unit stays committed): %s", name, unit, error)
            record_event(ctx.store, ctx.layout, "tracking_failed", tracker=name, phase=phase, unit=unit,
                         epoch=epoch, error=error)
            continue
        record_event(ctx.store, ctx.layout, "tracked", tracker=name, phase=phase, unit=unit, epoch=epoch,
                     logged=logged, already_present=present)


Points = list[tuple[int, dict[str, float]]]  # (step, metric name -> value)


def _optimizer_steps(ctx: PhaseContext, record: CommitRecord) -> Points:
    """The update unit's per-optimizer-step metrics as ``update_step/...`` points at their global step."""
    from verl_tasks.store.conventions import STEPS_FILE
    from verl_tasks.store.units import read_jsonl

    if STEPS_FILE not in record.files:
        return []
    return [(int(row["step"]), {f"update_step/{key}": float(value) for key, value in row.items() if key != "step"})
            for row in read_jsonl(ctx.store, record, STEPS_FILE)]


def _log_mlflow(ctx: PhaseContext, uri: str, unit: str, points: Points, tags: dict[str, str]) -> tuple[int, int]:
    """Write the (metric, step) values the run lacks; returns (written, already present).

    The last epoch's evaluation marks the run FINISHED (MLflow still accepts values for a
    finished run, e.g. when the experiment is resumed with more epochs).
    """
    from mlflow.entities import Metric, RunTag

    client = _mlflow_client(uri)
    run_id = _mlflow_run(ctx, client, uri)
    held: dict[str, set[int]] = {}
    for _, metrics in points:
        for key in metrics:
            if key not in held:
                held[key] = {m.step for m in client.get_metric_history(run_id, key)}
    now_ms = int(time.time() * 1000)
    missing = [Metric(key, value, now_ms, step) for step, metrics in points for key, value in metrics.items()
               if step not in held[key]]
    for start in range(0, max(1, len(missing)), MLFLOW_METRICS_PER_CALL):
        client.log_batch(run_id, metrics=missing[start: start + MLFLOW_METRICS_PER_CALL],
                         tags=[RunTag(key, value) for key, value in tags.items()] if start == 0 else [])
    if unit == ctx.layout.evaluate(ctx.config.epochs - 1):
        client.set_terminated(run_id, "FINISHED")
    total = sum(len(metrics) for _, metrics in points)
    return len(missing), total - len(missing)


@functools.lru_cache(maxsize=4)
def _mlflow_client(uri: str) -> Any:
    """One client per URI and process (a SQLite store migrates its schema on first open)."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _mlflow_run(ctx: PhaseContext, client: Any, uri: str) -> str:
    """The experiment's run id: the one recorded in the store, else a new run recorded if absent."""
    key = ctx.layout.tracking("mlflow-" + hashlib.sha256(uri.encode()).hexdigest()[:12])
    try:
        return json.loads(ctx.store.get(key))["run_id"]
    except NotFound:
        pass
    cfg = ctx.config
    run = client.create_run(
        _mlflow_experiment(client, cfg.experiment), run_name=cfg.experiment,
        tags={"verl_tasks.experiment": cfg.experiment, "verl_tasks.config_hash": cfg.config_hash(),
              "verl_tasks.store": ctx.store.url(ctx.layout.root)},
    )
    run_id = run.info.run_id
    _log_params(client, run_id, cfg)
    body = {"tracking_uri": uri, "experiment_id": run.info.experiment_id, "run_id": run_id}
    if ctx.store.put_if_absent(key, json.dumps(body, sort_keys=True).encode()):
        return run_id
    client.delete_run(run_id)  # another worker recorded its run first: use that one
    return json.loads(ctx.store.get(key))["run_id"]


def _mlflow_experiment(client: Any, name: str) -> str:
    """The id of the MLflow experiment named like ours, created if missing (tolerates a concurrent create)."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name)
    except MlflowException:
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def _log_params(client: Any, run_id: str, config: ExperimentConfig) -> None:
    """The hashed (training-relevant) config, flattened to dotted keys, as the run's parameters."""
    from mlflow.entities import Param

    params = [Param(key, json.dumps(value) if isinstance(value, (list, dict)) else str(value))
              for key, value in sorted(flatten(config.hashed_view()).items())]
    for start in range(0, len(params), MLFLOW_PARAMS_PER_CALL):
        client.log_batch(run_id, params=params[start : start + MLFLOW_PARAMS_PER_CALL])


def _log_tensorboard(ctx: PhaseContext, folder: str, unit: str, points: Points,
                     tags: dict[str, str]) -> tuple[int, int]:
    """Scalars the folder's event files lack, in one new event file for this unit (tags: MLflow only)."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    present = _tensorboard_values(Path(folder))
    missing = [(step, {key: value for key, value in metrics.items() if (key, step) not in present})
               for step, metrics in points]
    missing = [(step, metrics) for step, metrics in missing if metrics]
    if missing:
        writer = EventFileWriter(folder)
        for step, metrics in missing:
            summary = Summary(value=[Summary.Value(tag=key, simple_value=value) for key, value in metrics.items()])
            writer.add_event(Event(wall_time=time.time(), step=step, summary=summary))
        writer.close()
    written = sum(len(metrics) for _, metrics in missing)
    return written, sum(len(metrics) for _, metrics in points) - written


def _tensorboard_values(folder: Path) -> set[tuple[str, int]]:
    """(tag, step) of every scalar already written to the folder."""
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    return {(value.tag, event.step) for path in sorted(folder.glob("events.out.tfevents.*"))
            for event in LegacyEventFileLoader(str(path)).Load() for value in event.summary.value}
