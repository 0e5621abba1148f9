"""Thin operators: resolve the run's config, check the unit's marker, hand the unit to a backend.

``VerlPhaseOperator`` runs one unit (a phase of an epoch, a batch for rollout/score):

1. the unit's ``_SUCCESS`` marker exists -> return its summary at once (Clear is safe);
2. ``backend="ray"``: submit through :class:`RayJobBackend` (attaching to a live job of the
   unit if there is one) and defer to :class:`RayJobTrigger`; ``execute_complete`` raises
   the job's typed error (rebuilt from its result line, the job id and log tail as its
   cause) or :class:`JobFailed`, else reads the marker;
3. ``backend="ray-driver"``: the task process joins the cluster as a Ray driver (once per
   process) and runs the unit on its pool itself, waiting without deferral: no job driver
   to start, for units of seconds (see :mod:`verl_tasks.execution.driver`); ``on_kill`` and
   Airflow's timeout fence the attempt and kill its actor;
4. ``backend="inline"``: run the phase in the worker (tests, ``airflow dags test``).

Every unit that runs logs one ``verl-tasks timing {...}`` line: the task's own store calls
and, on Ray, connect / submit / queue / compute / return seconds (``benchmarks/demo_split.py``).

A deterministic error (bad config or input, a failed quality gate, safe mode; see
:mod:`verl_tasks.execution.outcome`) fails the task at once with ``AirflowFailException``
naming the unit: retrying cannot help. Other errors are retried by Airflow.
S3 keys of the Airflow connection serve the Airflow side only (the marker check);
Ray jobs reach storage with the Ray nodes' own credentials.

XCom gets ``{"unit", "attempt", "metrics"}`` only: keys and small numbers, no credentials.
"""
from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cached_property
from typing import TYPE_CHECKING, Any, NoReturn

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from verl_tasks.airflow import runconfig
from verl_tasks.airflow.callbacks import lift_safe_mode_if_cleared
from verl_tasks.airflow.connections import s3_access
from verl_tasks.airflow.links import RayJobLink, StoreUnitLink
from verl_tasks.errors import ConfigError, JobFailed, PhaseFailed, SafeMode
from verl_tasks.execution import UnitSpec
from verl_tasks.execution.inline import record_summary
from verl_tasks.execution.outcome import describe, error_from_result, is_deterministic
from verl_tasks.layout import Layout
from verl_tasks.ownership import DagAccess, check_may_write
from verl_tasks.pinning import publish_run_config

if TYPE_CHECKING:  # pragma: no cover - typing only (the driver imports Ray)
    from verl_tasks.execution.driver import Running

log = logging.getLogger(__name__)
BACKENDS = ("ray", "ray-driver", "inline")
_EPOCH_TASK = re.compile(r"^epoch_(\d+)\.")


def default_backend() -> str:
    return os.environ.get("VERL_TASKS_BACKEND", "ray")


class _RunConfigMixin:
    config_path: str
    aws_conn_id: str | None

    def resolve(self, context: Any):
        """(config, S3Access) of this run; the connection named in the YAML wins over the operator's."""
        raw_conn = (runconfig.read_yaml(self.config_path).get("storage") or {}).get("aws_conn_id")
        access = s3_access(raw_conn or self.aws_conn_id)
        cfg = runconfig.resolve(self.config_path, context.get("params"), context.get("dag_run"), access.endpoint_url)
        return cfg, access

    def dag_access(self, context: Any, cfg) -> DagAccess | None:
        """The DAG of this run and what its YAML's ``access`` permits (:mod:`verl_tasks.ownership`);
        None for an operator executed outside any DAG run, which is as ungoverned as the CLI."""
        dag_id = run_dag_id(context, self)
        if dag_id is None:
            return None
        raw = runconfig.read_yaml(self.config_path)
        return DagAccess(dag_id, str(raw["experiment"]), self.config_path, cfg.schedule.parent, cfg.access)

    @staticmethod
    def store(cfg, access):
        from verl_tasks.store import open_store

        s = cfg.storage
        return open_store(s.uri, endpoint_url=s.endpoint_url or access.endpoint_url, region=s.region or access.region,
                          sse=s.sse, sse_kms_key_id=s.sse_kms_key_id, credentials=access.credentials)


class ConfigureExperimentOperator(_RunConfigMixin, BaseOperator):
    """Validate the trigger form and pin the experiment before any compute.

    * ``resume=latest``: pin the config; a changed hyperparameter under an existing
      experiment name fails with :class:`ConfigMismatch` listing the differing keys.
    * ``resume=fresh``: the experiment name must be new.
    * ``resume=snapshot``: a new experiment whose base is snapshot ``from_snapshot`` (default:
      the latest) of ``parent`` (default: the YAML's experiment), in the same store.
    * scheduled / asset-triggered runs: a new experiment per run (``<experiment>-<timestamp>``).
    * ``schedule.parent`` (continual training): on any run type, scheduled or manual, an
      experiment's first run seeds its base from the parent's latest snapshot; an experiment
      that already started keeps its base (a manual ``resume=snapshot`` names its own parent).

    The policy is :func:`verl_tasks.execution.lineage.start_experiment`, which
    ``verl-tasks run --resume-from`` uses too. An experiment in safe mode is refused,
    unless this try is the first after a person's Clear (which lifts safe mode).

    Experiments belong to the DAG that made them (:mod:`verl_tasks.ownership`): a run may
    write only to its own DAG's experiments (or to those of DAGs its YAML lists in
    ``access.write_to``) and fork only from those ``access.fork_from`` permits; anything
    else fails here with :class:`~verl_tasks.errors.NotPermitted`, before anything is written.
    The trigger form's values were checked against their bounds by :func:`runconfig.resolve`.
    """

    ui_color = "#e8f0fe"

    def __init__(self, *, config_path: str, aws_conn_id: str | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.config_path = str(config_path)
        self.aws_conn_id = aws_conn_id

    def execute(self, context: Any) -> dict[str, Any]:
        from verl_tasks.execution.lineage import start_experiment
        from verl_tasks.ops.safe_mode import halted_message, read_safe_mode
        from verl_tasks.rewards.sandbox import preflight
        from verl_tasks.status import epoch_done

        params = dict(context.get("params") or {})
        cfg, access = self.resolve(context)
        store = self.store(cfg, access)
        dag = self.dag_access(context, cfg)
        check_may_write(store, cfg.experiment, dag)  # before lifting safe mode: another DAG's is never touched
        lift_safe_mode_if_cleared(context, cfg, store)
        halted = read_safe_mode(store, Layout(cfg.experiment))
        if halted is not None:
            raise SafeMode(halted_message(cfg.experiment, halted))
        preflight(cfg.rewards)  # the reward function imports in its sandbox here, before any compute
        mode = params.get("resume") or "latest"
        parent = params.get("parent") or runconfig.default_parent(runconfig.read_yaml(self.config_path))
        version = params.get("from_snapshot")
        started = start_experiment(store, cfg, resume=mode, parent=parent if mode == "snapshot" else None,
                                   version=None if version is None else int(version),
                                   scheduled_parent=cfg.schedule.parent, dag=dag)
        result = {**started, "epochs": cfg.epochs, "store": cfg.storage.uri}
        layout = Layout(cfg.experiment)
        done = [epoch for epoch in range(cfg.epochs) if epoch_done(cfg, store, layout, epoch, cfg.epochs)]
        unevaluated = [epoch for epoch in range(cfg.epochs) if not cfg.should_evaluate(epoch, cfg.epochs)]
        self._skip_epochs(context, cfg.epochs, cfg.rollout.batches_per_epoch, done, result, unevaluated)
        return result

    def _skip_epochs(self, context: Any, epochs: int, batches: int, done: list[int], result: dict[str, Any],
                     unevaluated: list[int]) -> None:
        """Skip, here and all at once, the tasks of epochs this run has nothing to do in: those beyond
        its ``epochs``, and those whose units are all committed (a rerun, a Clear of the whole run);
        and the ``evaluate`` of the ``unevaluated`` epochs (every epoch has one; the run's
        ``evaluate.every`` and last epoch say which it runs).

        Left to their own operators, each of those tasks would start, resolve the run's config and find
        its marker (about 0.5 s a task under ``airflow dags test``); left to trigger rules, later epochs
        are skipped one dependency level per scheduling loop (about 40 s for 6 idle epochs). An epoch's
        ``plan`` runs when the epoch before it was skipped (``none_failed``). A skipped task that is
        cleared on its own still runs, and still finds its marker (or, for an evaluate, skips again).
        """
        dag = self.dag if self.has_dag() else None
        finished, no_evaluation = set(done), set(unevaluated)
        tasks = [(task, epoch) for task in (dag.tasks if dag is not None else [])
                 if (epoch := epoch_of(task.task_id)) is not None and (epoch >= epochs or epoch in finished or (
                     epoch in no_evaluation and task.task_id.endswith(".evaluate")))]
        if not tasks:
            return
        committed = sum(1 for _, epoch in tasks if epoch in finished)
        later = sum(1 for _, epoch in tasks if epoch >= epochs)
        # A mapped task not yet expanded is one instance (map index -1); once expanded (a Clear of a run
        # that ran), one per batch: both are named, and a name no instance has is ignored.
        names = [task.task_id for task, _ in tasks] + [
            (task.task_id, index) for task, _ in tasks if task.is_mapped for index in range(batches)]
        from airflow.sdk.exceptions import DownstreamTasksSkipped

        ti = context.get("ti")
        if ti is not None:
            ti.xcom_push(key="return_value", value=result)  # the skip path does not push the return value
        if committed:
            self.log.info("epoch(s) %s left nothing to do (every unit committed): skipping their %d tasks",
                          ", ".join(map(str, done)), committed)
        if len(tasks) > committed + later:
            self.log.info("this run evaluates after epoch(s) %s only: skipping %d other evaluate task(s)",
                          ", ".join(str(e) for e in range(epochs) if e not in no_evaluation),
                          len(tasks) - committed - later)
        if later:
            self.log.info("this run trains %d epoch(s): skipping the %d tasks of the DAG's later epochs", epochs, later)
        raise DownstreamTasksSkipped(tasks=names)


class VerlPhaseOperator(_RunConfigMixin, BaseOperator):
    """Run one phase unit; skip it when committed. See the module docstring.

    Args:
        config_path: the experiment YAML the DAG was built from.
        phase: plan, rollout, score, validate, update, snapshot or evaluate.
        epoch: the epoch index.
        batch: the batch index (rollout and score; usually mapped with ``expand``).
        backend: ``ray`` (default, env ``VERL_TASKS_BACKEND``), ``ray-driver`` or ``inline``.
        ray_conn_id: connection holding the Ray dashboard address and token.
        aws_conn_id: AWS connection for S3 (the YAML's ``storage.aws_conn_id`` wins).
        ray_retry_s: how long transient Ray dashboard errors are retried (submit, status,
            the trigger's polls); default ``VERL_TASKS_RAY_RETRY_S`` or 120.
        snapshot_asset: for the snapshot task, the Asset whose event announces the new snapshot.
    """

    ui_color = "#fdf1e1"
    template_fields = ()
    operator_extra_links = (StoreUnitLink(), RayJobLink())

    def __init__(self, *, config_path: str, phase: str, epoch: int, batch: int | None = None,
                 backend: str | None = None, ray_conn_id: str | None = "ray_default",
                 aws_conn_id: str | None = None, ray_retry_s: float | None = None, poll_interval: float = 0.5,
                 snapshot_asset: Any = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.config_path = str(config_path)
        self.phase = phase
        self.epoch = epoch
        self.batch = batch
        self.backend = backend or default_backend()
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend {self.backend!r}; use one of {BACKENDS}")
        self.ray_conn_id = ray_conn_id
        self.aws_conn_id = aws_conn_id
        self.ray_retry_s = ray_retry_s
        self.poll_interval = poll_interval
        self.snapshot_asset = snapshot_asset
        self._job_id: str | None = None
        self._running: Running | None = None  # the unit in flight (ray-driver backend)

    # -- helpers -------------------------------------------------------------------
    def _spec(self, cfg) -> UnitSpec:
        return UnitSpec(cfg.experiment, self.phase, self.epoch, self.batch)

    @cached_property
    def ray(self):
        from verl_tasks.airflow.connections import ray_target
        from verl_tasks.execution.ray_jobs import RayJobBackend

        return RayJobBackend(ray_target(self.ray_conn_id), retry_s=self.ray_retry_s)

    def _skip_reason(self, cfg) -> str | None:
        if self.epoch >= cfg.epochs:
            return f"this run trains {cfg.epochs} epoch(s); epoch {self.epoch} is not part of it"
        if self.phase == "evaluate" and not cfg.should_evaluate(self.epoch, cfg.epochs):
            return f"evaluate.every={cfg.evaluate.every}: no evaluation after epoch {self.epoch}"
        return None

    def _finish(self, context: Any, cfg, store, record) -> dict[str, Any]:
        summary = record_summary(record)
        if self.phase == "snapshot" and self.snapshot_asset is not None:
            events = context.get("outlet_events")
            if events is not None:
                events[self.snapshot_asset].extra = {
                    "experiment": cfg.experiment, "version": self.epoch + 1, "uri": store.url(record.unit),
                    "weights_sha256": (record.meta or {}).get("weights_sha256"),
                }
        return summary

    # -- Airflow entry points ----------------------------------------------------
    def execute(self, context: Any) -> dict[str, Any]:
        from verl_tasks.store.units import read_marker

        began = time.monotonic()
        with fail_fast(f"task {self.task_id}"):  # a bad YAML or trigger form fails the same way on every try
            cfg, access = self.resolve(context)
        reason = self._skip_reason(cfg)
        if reason:
            raise AirflowSkipException(reason)
        store = self.store(cfg, access)
        with fail_fast(f"task {self.task_id}"):  # configure refused it already, unless it was marked success
            check_may_write(store, cfg.experiment, self.dag_access(context, cfg))
        lift_safe_mode_if_cleared(context, cfg, store)
        spec = self._spec(cfg)
        unit = Layout(cfg.experiment).unit(self.phase, self.epoch, self.batch)
        record = read_marker(store, unit)
        if record is not None:
            self.log.info("%s is committed (attempt %s): nothing to do", unit, record.attempt)
            return self._finish(context, cfg, store, record)
        timing = {"store_s": time.monotonic() - began}
        if self.backend == "inline":
            from verl_tasks.execution.inline import InlineBackend

            started = time.monotonic()
            with fail_fast(unit):
                record = InlineBackend().run(cfg, spec, access.credentials)
            self._log_timing(context, unit, {**timing, "compute_s": time.monotonic() - started})
            return self._finish(context, cfg, store, record)
        if self.backend == "ray-driver":
            return self._run_as_driver(context, cfg, store, spec, unit, timing)
        publish_run_config(store, Layout(cfg.experiment), cfg)  # the job reads this run's settings by digest
        handle = self.ray.submit(cfg, spec)
        if handle.status == "SUCCEEDED":
            record = read_marker(store, unit)
            if record is not None:
                self.log.info("Ray job %s already committed %s", handle.submission_id, unit)
                return self._finish(context, cfg, store, record)
            handle = self.ray.submit(cfg, spec, resubmit_succeeded=True)
        self._defer_on(handle, unit)

    def _defer_on(self, handle, unit: str) -> NoReturn:
        """Wait for the job in the triggerer; ``attached``: this try found the job live, it did not submit it."""
        from verl_tasks.airflow.triggers import RayJobTrigger

        self._job_id = handle.submission_id
        self.log.info("%s Ray job %s for %s", "submitted" if handle.submitted else "attached to",
                      handle.submission_id, unit)
        self.defer(
            trigger=RayJobTrigger(handle.submission_id, self.ray_conn_id, self.poll_interval, self.ray.retry_s),
            method_name="execute_complete",
            kwargs={"submission_id": handle.submission_id, "attached": not handle.submitted},
            timeout=self.execution_timeout,
        )

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None,
                         submission_id: str | None = None, attached: bool = False) -> dict[str, Any]:
        from verl_tasks.store.units import read_marker

        event = event or {}
        job_id = event.get("submission_id") or submission_id or "?"
        if event.get("status") == "STOPPED" and attached:
            # A Clear re-runs the task at once, often before the triggerer cancels the cleared try's
            # trigger; this try then found that try's job still running and attached to it, and the
            # cleared try's on_kill stopped it. That stop was meant for the old try: start the next attempt.
            cfg, access = self.resolve(context)
            unit = Layout(cfg.experiment).unit(self.phase, self.epoch, self.batch)
            self.log.info("Ray job %s, which this try attached to, was stopped (its try was cleared or marked); "
                          "submitting the next attempt of %s", job_id, unit)
            publish_run_config(self.store(cfg, access), Layout(cfg.experiment), cfg)
            return self._defer_on(self.ray.submit(cfg, self._spec(cfg)), unit)
        if event.get("status") != "SUCCEEDED":
            raise_job_error(job_id, event)
        cfg, access = self.resolve(context)
        store = self.store(cfg, access)
        unit = Layout(cfg.experiment).unit(self.phase, self.epoch, self.batch)
        record = read_marker(store, unit)
        if record is None:
            raise PhaseFailed(unit, f"Ray job {job_id} succeeded but the unit has no _SUCCESS marker")
        self.log.info("Ray job %s committed %s (attempt %s)", job_id, unit, record.attempt)
        return self._finish(context, cfg, store, record)

    def _run_as_driver(self, context: Any, cfg, store, spec: UnitSpec, unit: str, timing: dict) -> dict[str, Any]:
        """Run the unit on its pool from this process (see :mod:`verl_tasks.execution.driver`)."""
        from verl_tasks.airflow.connections import ray_gcs_address
        from verl_tasks.execution import driver
        from verl_tasks.store.units import read_marker

        address = ray_gcs_address(self.ray_conn_id)
        running = self._running = driver.start(cfg, spec, store)
        self.log.info("running %s on its worker pool (attempt %s)", unit, running.attempt)
        outcome = driver.run(running, address)
        for line in outcome.result.get("log", []):
            self.log.info("[worker] %s", line)
        if not outcome.result.get("ok"):
            raise_job_error(f"pool unit {unit} attempt {running.attempt}",
                            {"status": "FAILED", "result": {**outcome.result, "unit": unit}})
        began = time.monotonic()
        record = read_marker(store, unit)
        if record is None:
            raise PhaseFailed(unit, f"attempt {running.attempt} returned ok but the unit has no _SUCCESS marker")
        timing["store_s"] += time.monotonic() - began
        self._log_timing(context, unit, {**timing, **outcome.timing})
        return self._finish(context, cfg, store, record)

    def _log_timing(self, context: Any, unit: str, timing: dict[str, float]) -> None:
        """One machine-readable line per unit that ran: where the task's time went."""
        ti = context.get("ti")
        line = {"task_id": self.task_id, "map_index": getattr(ti, "map_index", -1), "unit": unit,
                "backend": self.backend, **{k: round(v, 4) for k, v in timing.items()}}
        self.log.info("verl-tasks timing %s", json.dumps(line))

    def resume_execution(self, next_method: str, next_kwargs: dict[str, Any] | None, context: Any) -> Any:
        """A deferral past ``execution_timeout`` comes back as ``__fail__``, and Airflow calls no
        ``on_kill`` for it: stop the unit's live Ray jobs first (their drivers fence the attempt), so a
        timed-out attempt neither runs on holding its resources nor commits later."""
        from airflow.sdk.bases.operator import TRIGGER_FAIL_REPR, TriggerFailureReason

        timed_out = (next_method == TRIGGER_FAIL_REPR
                     and (next_kwargs or {}).get("error") == TriggerFailureReason.TRIGGER_TIMEOUT)
        if timed_out and self.backend == "ray":  # a failed trigger (not a timeout) leaves the job to its retry
            self._stop_live_jobs(context)
        return super().resume_execution(next_method, next_kwargs, context)

    def _stop_live_jobs(self, context: Any) -> None:
        from verl_tasks.execution.ray_jobs import LIVE

        try:
            cfg, _access = self.resolve(context)
            for job in self.ray.unit_jobs(self._spec(cfg)):
                if job.status in LIVE:
                    self.log.warning("the wait for Ray job %s timed out: stopping it", job.submission_id)
                    self.ray.stop(job.submission_id)
        except Exception:  # noqa: BLE001 - the timeout fails the task all the same; say why the job may run on
            self.log.exception("could not stop the live Ray jobs of this unit after its timeout")

    def on_kill(self) -> None:
        if self._job_id and self.backend == "ray":
            self.log.info("stopping Ray job %s", self._job_id)
            self.ray.stop(self._job_id)
        if self._running is not None and self.backend == "ray-driver":
            from verl_tasks.execution import driver

            driver.cancel(self._running, "the Airflow task was killed (clear, mark failed or timeout)")


def run_dag_id(context: Any, operator: Any) -> str | None:
    """The id of the DAG this task runs in: its run's, else its own DAG's; None outside any DAG."""
    for holder in (context.get("dag_run"), context.get("ti"), context.get("dag")):
        dag_id = getattr(holder, "dag_id", None)
        if isinstance(dag_id, str) and dag_id:
            return dag_id
    return operator.dag_id if operator.has_dag() else None


def epoch_of(task_id: str) -> int | None:
    """The epoch of a task in an ``epoch_NNN`` task group, else None."""
    match = _EPOCH_TASK.match(task_id)
    return int(match.group(1)) if match else None


@contextmanager
def fail_fast(unit: str) -> Iterator[None]:
    """Turn a deterministic error into ``AirflowFailException`` (no retries; the typed error is its cause)."""
    try:
        yield
    except Exception as err:
        if is_deterministic(err):
            raise AirflowFailException(f"{unit}: {type(err).__name__}: {err} (not retried: it fails the same way "
                                       "until the cause is fixed)") from err
        raise


def raise_job_error(job_id: str, event: dict[str, Any]) -> None:
    """Raise the failed job's typed error, its cause a :class:`JobFailed` with the log tail.

    Raises:
        AirflowFailException: the job's error is deterministic (see :func:`fail_fast`).
        VerlTasksError: the job's typed error, for Airflow to retry.
        JobFailed: the job named no error class of :mod:`verl_tasks.errors` (killed, unreachable, ...).
    """
    status = str(event.get("status", "unknown event"))
    failed = JobFailed(job_id, f"{status} ({event['error']})" if event.get("error") else status,
                       event.get("log_tail", ""))
    result = event.get("result")
    typed = error_from_result(result)
    if typed is None or result is None:  # a typed error comes only from a result
        if result:
            log.info("Ray job %s failed with %s", job_id, describe(result))
        raise failed
    with fail_fast(f"{result.get('unit') or job_id} (Ray job {job_id})"):
        raise typed from failed
