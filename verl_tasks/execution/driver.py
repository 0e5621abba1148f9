"""The Airflow task process as a Ray driver: hand a unit straight to its pool, no Ray job between.

A Ray job per unit costs a driver process (Python, ``import ray``, ``ray.init``; 1.4 s
on an idle 2-core head, 2-4 s under load) and, deferred, a second start of the task;
for units that compute for a second that is most of the task. With the ``ray-driver``
backend the task process joins the cluster once (the connection is kept for the
process: ``airflow dags test`` runs every task in one) and calls the experiment's pool
as a job's driver would: a fresh attempt id, the phase's timeout enforced from the
moment the actor starts the unit, and on cancellation the attempt fenced and its actor
killed. The price: the Airflow worker must reach the cluster's GCS port (it is a Ray
driver, same Ray and Python versions), not only the dashboard's HTTP port, and it holds
its slot while the unit runs (no deferral). Long units belong on the ``ray`` backend.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from verl_tasks.config import ExperimentConfig
from verl_tasks.errors import PhaseFailed, UnitTimeout
from verl_tasks.execution import UnitSpec
from verl_tasks.execution.ray_jobs import RayUnavailable

log = logging.getLogger(__name__)

GCS_ADDRESS_ENV = "VERL_TASKS_RAY_GCS_ADDRESS"


def gcs_address(configured: str | None = None) -> str:
    """The cluster's GCS address (``host:port``): the connection's ``gcs_address`` extra, else the env.

    Raises:
        RayUnavailable: neither names one.
    """
    address = configured or os.environ.get(GCS_ADDRESS_ENV)
    if not address:
        raise RayUnavailable(f"the ray-driver backend joins the cluster as a Ray driver and needs its GCS address: "
                             f"set {GCS_ADDRESS_ENV}=host:6379 (or the ray_default connection's extra "
                             f'{{"gcs_address": "host:6379"}}), or use backend "ray" (Ray Jobs, dashboard only)')
    return address.removeprefix("ray://")


@dataclass
class Running:
    """What a cancellation needs: the unit, its attempt, where it was sent ((actor, call ref) of each
    send) and the store to fence it in (the task's, with its connection's credentials)."""

    config: ExperimentConfig
    spec: UnitSpec
    attempt: str
    store: Any = None
    sent: list[tuple[Any, Any]] = field(default_factory=list)
    done: bool = False
    cancelled: str | None = None  # why, once cancelled


@dataclass
class Outcome:
    """The worker's result and where the time went (seconds)."""

    result: dict[str, Any]
    timing: dict[str, float]


def start(config: ExperimentConfig, spec: UnitSpec, store: Any = None) -> Running:
    from verl_tasks.store.units import new_attempt_id

    return Running(config, spec, new_attempt_id(), store)


def run(running: Running, address: str) -> Outcome:
    """Run the unit on its pool and wait; any exception on the way (Airflow's timeout included) cancels it."""
    from verl_tasks.execution import pools

    began = time.time()
    pools.ensure_connected(address)  # once per process; token auth from RAY_AUTH_TOKEN[_PATH]
    connected = time.time()
    submitted: list[float] = []

    def sent(actor: Any, ref: Any) -> None:
        submitted.append(time.time())
        running.sent.append((actor, ref))

    timeout_s = running.config.fault_tolerance.timeout_s.get(running.spec.phase)
    try:
        result = pools.run_unit(running.config, running.spec, running.attempt, timeout_s, on_submit=sent,
                                cancelled=lambda: running.cancelled is not None, store=running.store)
    except UnitTimeout:
        running.done = True  # the pool enforced the timeout: fenced and killed already
        raise
    except BaseException as err:
        if running.cancelled is not None:
            raise PhaseFailed(running.spec.label, f"attempt {running.attempt} cancelled: {running.cancelled}") from err
        cancel(running, "the Airflow task stopped waiting (timeout, kill or error)")
        raise
    running.done = True
    returned = time.time()
    return Outcome(result, split(began, connected, submitted[-1] if submitted else connected, result, returned))


def split(began: float, connected: float, submitted: float, result: dict[str, Any],
          returned: float) -> dict[str, float]:
    """Where a unit's time went between the task and its worker (the worker reports its own clock)."""
    started = float(result.get("started_at") or submitted)
    finished = float(result.get("finished_at") or returned)
    return {
        "connect_s": round(connected - began, 4),
        "submit_s": round(submitted - connected, 4),
        "queue_s": round(max(0.0, started - submitted), 4),
        "compute_s": round(max(0.0, finished - started), 4),
        "return_s": round(max(0.0, returned - finished), 4),
    }


def cancel(running: Running, reason: str) -> None:
    """Fence the attempt and stop it where it was sent (:func:`pools.cancel_unit`); a no-op once the unit returned."""
    if running.done:
        return
    from verl_tasks.execution import pools

    running.done = True
    running.cancelled = reason
    actor, ref = running.sent[-1] if running.sent else (None, None)
    try:
        pools.cancel_unit(running.config, running.spec, running.attempt, actor, reason, ref, running.store)
    except Exception:  # noqa: BLE001 - cancelling is best effort; the fence is what guarantees no commit
        log.exception("cancelling %s (attempt %s) failed", running.spec.label, running.attempt)


__all__ = ["GCS_ADDRESS_ENV", "Outcome", "Running", "cancel", "gcs_address", "run", "split", "start"]
