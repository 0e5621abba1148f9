"""Worker pools on the Ray cluster: actors that hold a phase's resources and keep its work warm.

Each experiment has, per phase kind (``rollout``, ``score``, ``update``, ``evaluate``,
``gate`` for validate, and ``light`` for plan and snapshot), a pool of ``resources.<phase>.workers``
named, detached actors (phases that reserve no GPU and the same resources share one
``cpu`` pool, whose actor ``i`` serves each of them; the gate never does: it holds no
policy, and its start-up, importing Great Expectations, then runs beside the others'
instead of before the first unit), created with that phase's ``num_cpus``, ``num_gpus``,
``memory_mb`` and custom resources, so Ray places each on a node that has them
and the GPUs a unit computes on are the ones its actor reserved. An actor keeps
its process warm (torch imported, the policy loaded and keyed by the snapshot's
sha256, the reward workers, the quality gate); the store stays the truth, so an
actor that dies loses nothing but time.

Names tie an actor to its experiment, the exact code and the resource shape (with the
store it commits to, so two deployments of one experiment name never share actors)::

    vt:<experiment>:<kind>:<code fingerprint>:<shape digest>:<index>

Units of different experiments never share an actor, so none waits behind
another experiment's hung unit.
so a deploy of new code gets new actors, and the old ones are retired (they exit
once idle). An actor with no unit for ``idle_release_s`` exits and frees its
resources. A unit goes to an idle actor of its pool when there is one (mapped
units spread over the pool and run in parallel), else it waits in the queue of
the actor its batch index picks. A unit's timeout is enforced here: past it, the
attempt is fenced in the store (it can never commit) and its actor is killed and
restarted, so a hung unit frees its slot.
"""
from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import ray

from verl_tasks.config import ExperimentConfig
from verl_tasks.execution import UnitSpec, store_identity
from verl_tasks.execution.heap import freeze_after_imports
from verl_tasks.execution.pool_shape import (
    GATE_KIND,
    NAMESPACE,
    PREFIX,
    PoolShape,
    code_fingerprint,
    experiment_shapes,
    pool_kind,
)

log = logging.getLogger(__name__)

STATE_WAIT_S = 0.2
STATE_POLL_S = 0.5
WAIT_SLICE_S = 0.2
# How long a cancel waits for an actor to say which attempt it runs: a stopping job has ~3 s
# between Ray's SIGTERM and its SIGKILL for this, the kill and the fence.
CANCEL_STATE_WAIT_S = 1.0
ACTOR_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
# How long a unit keeps being sent again to an actor Ray is restarting: a restart is a new worker
# process importing torch (and, on a GPU pool, building an engine): seconds on a busy 2-core machine,
# tens of seconds on a GPU node. Five quick tries (7.5 s) gave up on a busy machine.
RESEND_WINDOW_S = 120.0


class _Capture(logging.Handler):
    """The unit's log lines, handed back to the caller (the job's log, the CLI)."""

    def __init__(self, thread: int) -> None:
        super().__init__(logging.INFO)
        self.thread = thread
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.thread:
            self.lines.append(self.format(record))


# One thread runs every unit, always the same one: with each call on another thread of a 64-thread
# group, torch's work ran 1.7-2.3x slower than on one thread (10k futex calls a second in the actor).
# Ray's overloads of ``remote`` list the task options only, not the actor's ``concurrency_groups``.
@ray.remote(max_restarts=-1, concurrency_groups={"work": 1, "control": 2})  # type: ignore[call-overload]
class PoolWorker:
    """Runs one unit at a time (``run`` calls wait in Ray's queue); answers ``state`` and ``retire`` meanwhile."""

    def __init__(self, kind: str, idle_release_s: float, holds_gpus: bool = False) -> None:
        from verl_tasks.quiet import quiet_own_process

        if not holds_gpus:  # a sharded engine's actor holds no GPU itself but drives workers that do
            from verl_tasks.models.device import hide_unreserved_gpus

            hide_unreserved_gpus()
        quiet_own_process()
        import verl_tasks.runner  # noqa: F401 - import the heavy modules once, now

        if kind == GATE_KIND:
            from verl_tasks.quality import suites

            suites.warm_up()  # importing GE (~2.5 s) is the worker's start-up, not its first validate's
        logging.getLogger().setLevel(logging.INFO)
        self.kind = kind
        self.idle_release_s = idle_release_s
        self.fingerprint = code_fingerprint()
        self._busy: dict[str, Any] | None = None
        self._last_used = time.monotonic()
        self._retired = False
        threading.Thread(target=self._release_when_idle, daemon=True).start()

    @ray.method(concurrency_group="work")
    def run(self, config_json: dict[str, Any], phase: str, epoch: int, batch: int | None,
            attempt: str | None = None) -> dict[str, Any]:
        from verl_tasks.config import parse_config
        from verl_tasks.execution.inline import InlineBackend, record_summary
        from verl_tasks.execution.outcome import failure_result

        label = UnitSpec(str(config_json.get("experiment")), phase, epoch, batch).label
        self._busy = {"unit": label, "attempt": attempt, "since": time.time()}
        capture = _Capture(threading.get_ident())
        root = logging.getLogger()
        root.addHandler(capture)
        started = time.time()
        placement = {"gpu_ids": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid(),
                     "node": ray.get_runtime_context().get_node_id(), "actor": self.kind}
        try:
            config = parse_config(config_json)
            spec = UnitSpec(config.experiment, phase, epoch, batch)
            record = InlineBackend().run(config, spec, attempt=attempt)
            result = {"ok": True, **record_summary(record)}
        except Exception as err:  # noqa: BLE001 - returned to the caller, which raises it typed (outcome.py)
            logging.getLogger(__name__).exception("unit %s failed", label)
            result = failure_result(err, label)
        finally:
            root.removeHandler(capture)
            freeze_after_imports()  # the worker outlives this unit: its warm heap stays out of full GCs
            self._busy = None
            self._last_used = time.monotonic()
        return {**result, "log": capture.lines, "placement": placement, "frozen_objects": gc.get_freeze_count(),
                "started_at": started, "finished_at": time.time()}

    @ray.method(concurrency_group="control")
    def state(self) -> dict[str, Any]:
        return {"busy": self._busy, "idle_s": time.monotonic() - self._last_used, "kind": self.kind,
                "fingerprint": self.fingerprint, "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid(),
                "node": ray.get_runtime_context().get_node_id()}

    @ray.method(concurrency_group="control")
    def retire(self) -> None:
        """Exit as soon as no unit runs (a newer code version took over this pool)."""
        self._retired = True

    def _release_when_idle(self) -> None:
        while True:
            time.sleep(min(1.0, max(0.05, self.idle_release_s / 4)))
            idle = self._busy is None
            if idle and (self._retired or time.monotonic() - self._last_used > self.idle_release_s):
                log.info("%s worker exits (%s)", self.kind, "retired" if self._retired else "idle")
                from verl_tasks.models import vllm_engine

                vllm_engine.shutdown()  # its engine-core process (and GPU share) goes before the worker does
                release_placement_group(ray.get_runtime_context().get_actor_name())
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                return


def release_placement_group(actor_name: str | None) -> None:
    """Free the GPUs a sharded-engine actor's placement group holds (it outlives the actor otherwise)."""
    from ray.util.placement_group import get_placement_group, remove_placement_group

    if not actor_name:
        return
    try:
        remove_placement_group(get_placement_group(f"{actor_name}:pg"))
    except ValueError:  # the actor had none
        return


def ensure_connected(address: str | None = None) -> None:
    if not ray.is_initialized():
        ray.init(address=address or "auto", namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)


_RETIRE_EVERY_S = 60.0
_retire_checked: dict[PoolShape, float] = {}


def retire_stale_now_and_then(shape: PoolShape) -> None:
    """:func:`retire_stale` at most once a minute per pool and process: it lists the cluster's named actors."""
    now = time.monotonic()
    if now - _retire_checked.get(shape, -_RETIRE_EVERY_S) >= _RETIRE_EVERY_S:
        _retire_checked[shape] = now
        retire_stale(shape)


def retire_stale(shape: PoolShape) -> list[str]:
    """Ask actors of this kind built from other code to exit once idle. Returns their names."""
    current = f"{shape.prefix}{code_fingerprint()}:"
    stale = [name for name in _named_actors() if name.startswith(shape.prefix) and not name.startswith(current)]
    for name in stale:
        try:
            ray.get_actor(name, namespace=NAMESPACE).retire.remote()
        except ValueError:  # exited meanwhile
            continue
    return stale


def _named_actors() -> list[str]:
    return [entry["name"] if isinstance(entry, dict) else entry
            for entry in ray.util.list_named_actors(all_namespaces=True)
            if not isinstance(entry, dict) or entry.get("namespace") == NAMESPACE]


def release_experiment(experiment: str) -> list[str]:
    """Kill every pool actor of ``experiment`` now (the end of a run on its own head). Returns their names."""
    prefix = f"{PREFIX}{experiment}:"
    names = [name for name in _named_actors() if name.startswith(prefix)]
    for name in names:
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        except ValueError:  # exited meanwhile
            pass
        release_placement_group(name)
    return names


_started: set[tuple[str, str]] = set()  # (experiment, store identity): its pools were started by this process


def start_cpu_pools(config: ExperimentConfig) -> None:
    """Create the experiment's pools that hold no GPU now (once per process), without waiting for them.

    Their start-up (a worker process importing torch, or Great Expectations for the gate) then
    runs side by side, and beside the first units, instead of each in turn before its first
    unit. GPU pools start with their first unit: an idle one would hold GPUs another pool waits for.
    """
    key = (config.experiment, store_identity(config))  # pool names carry the store: another store, other pools
    if key in _started:
        return
    _started.add(key)
    for shape in sorted(experiment_shapes(config), key=lambda s: s.kind):
        if shape.num_gpus == 0 and not shape.gpu_bundles:
            pool_actors(shape)


def pool_actors(shape: PoolShape) -> list[Any]:
    """The pool's actors, created (and left to Ray to place) when missing."""
    actor_class: Any = PoolWorker  # @ray.remote made it an ActorClass; mypy keeps a decorated class's own type
    return [actor_class.options(**shape.actor_options(i)).remote(shape.kind, shape.idle_release_s,
                                                                 bool(shape.num_gpus or shape.gpu_bundles))
            for i in range(shape.workers)]


def pick_actor(actors: list[Any], batch: int | None) -> int:
    """An idle actor if one answers at once, starting from the one the batch index names; else that one."""
    preferred = (batch or 0) % len(actors)
    order = [(preferred + i) % len(actors) for i in range(len(actors))]
    refs = {actors[i].state.remote(): i for i in order}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=STATE_WAIT_S)
    idle = set()
    for ref in ready:
        try:
            if ray.get(ref)["busy"] is None:
                idle.add(refs[ref])
        except ACTOR_GONE:  # restarting or being placed: not idle now
            continue
    return next((i for i in order if i in idle), preferred)


_GPUS_ASKED_EVERY_S = 60.0
_cluster_gpus: list[tuple[float, float]] = []  # (when asked, the cluster's GPU count)


def cluster_gpus() -> float:
    """The cluster's GPUs (logical ones included), asked of Ray at most once a minute per process."""
    now = time.monotonic()
    if not _cluster_gpus or now - _cluster_gpus[0][0] > _GPUS_ASKED_EVERY_S:
        _cluster_gpus[:] = [(now, float(ray.cluster_resources().get("GPU", 0.0)))]
    return _cluster_gpus[0][1]


def submit(config: ExperimentConfig, spec: UnitSpec, attempt: str | None) -> tuple[Any, Any]:
    """Hand one unit to its pool; returns (the result's ObjectRef, the actor running it)."""
    shape = PoolShape.for_phase(config, spec.phase, cluster_gpus())
    retire_stale_now_and_then(shape)
    actors = pool_actors(shape)
    actor = actors[pick_actor(actors, spec.batch)]
    return send(actor, config, spec, attempt), actor


def send(actor: Any, config: ExperimentConfig, spec: UnitSpec, attempt: str | None) -> Any:
    """Ask ``actor`` to run the unit's attempt; returns the result's ObjectRef."""
    return actor.run.remote(config.model_dump(mode="json"), spec.phase, spec.epoch, spec.batch, attempt)


def _timed_out(config: ExperimentConfig, spec: UnitSpec, attempt: str | None, actor: Any, timeout_s: float,
               store: Any = None):
    from verl_tasks.errors import UnitTimeout

    unit = cancel_unit(config, spec, attempt, actor, f"timed out after {timeout_s:g} s", store=store)
    return UnitTimeout(unit, f"timed out after {timeout_s:g} s (fault_tolerance.timeout_s.{spec.phase}); the "
                             f"attempt was fenced and its worker restarted; a retry starts a new attempt")


def run_unit(config: ExperimentConfig, spec: UnitSpec, attempt: str | None, timeout_s: float | None,
             on_submit: Callable[[Any, Any], None] | None = None,
             cancelled: Callable[[], bool] | None = None, store: Any = None) -> dict[str, Any]:
    """Submit and wait; a call that reached an actor while Ray restarted it is sent again, for up to
    ``RESEND_WINDOW_S`` after the first refusal.

    Ray fails such a call at once ("temporarily unavailable"); sending the same attempt
    again is safe: a unit that did commit is skipped, one that did not is redone to the
    same bytes. It goes to the same actor, which runs one unit at a time: were the first
    call still running there (the actor was unreachable, not restarted), the second would
    start after it, never beside it in the same attempt's folder. Not when ``cancelled()``
    says the caller killed that actor itself. ``on_submit`` hears the actor and the call's ref at
    each send (to cancel it there: :func:`cancel_unit`). ``store`` writes a timeout's fence.

    Returns the worker's result dict (``ok``, summary or error, log). Past ``timeout_s`` the attempt
    is fenced (it can never commit), its actor killed (Ray restarts it empty) and
    :class:`verl_tasks.errors.UnitTimeout` raised (:func:`wait`).
    """
    refusals = Refusals()
    ref, actor = submit(config, spec, attempt)
    if on_submit:
        on_submit(actor, ref)
    while True:
        try:
            return wait(config, spec, attempt, ref, actor, timeout_s, store)
        except ray.exceptions.ActorUnavailableError:
            if (cancelled is not None and cancelled()) or not refusals.wait_to_resend(spec, attempt):
                raise
            ref = send(actor, config, spec, attempt)
            if on_submit:
                on_submit(actor, ref)


class Refusals:
    """When a call Ray refused while it restarted the actor is sent again: after a pause growing by
    ``STATE_POLL_S`` to at most 2 s, for up to ``RESEND_WINDOW_S`` after the attempt's first refusal."""

    def __init__(self) -> None:
        self._seen: dict[str | None, tuple[float, int]] = {}  # attempt -> (first refusal, resends)

    def wait_to_resend(self, spec: UnitSpec, attempt: str | None) -> bool:
        """Pause before sending ``attempt`` again; False (at once) when its window has passed."""
        first, resends = self._seen.get(attempt, (time.monotonic(), 0))
        if time.monotonic() - first > RESEND_WINDOW_S:
            return False
        self._seen[attempt] = (first, resends + 1)
        log.info("%s reached its worker while Ray restarted it; sending it again (%d)", spec.label, resends + 1)
        time.sleep(min(2.0, STATE_POLL_S * (resends + 1)))
        return True


def wait(config: ExperimentConfig, spec: UnitSpec, attempt: str | None, ref: Any, actor: Any,
         timeout_s: float | None, store: Any = None) -> dict[str, Any]:
    """The result of a submitted unit; ``timeout_s`` after it *started* (time queued for a worker
    or its resources does not count), it is cancelled and UnitTimeout raised.

    It waits in short slices, back in Python between them: a signal (Airflow's SIGALRM timeout,
    a job's SIGTERM) is handled within a slice, not inside one long blocking ``ray.get``.
    """
    started = None if timeout_s is None else _wait_started(ref, actor, attempt)
    while True:
        try:
            ready, _ = ray.wait([ref], timeout=WAIT_SLICE_S)
        except SystemError as err:  # a signal handler raised inside Ray's C wait: Ray wraps it; give it back
            if err.__context__ is not None:
                raise err.__context__ from None
            raise
        if ready:
            return ray.get(ref)
        if started is not None and timeout_s is not None and time.time() - started > timeout_s:
            raise _timed_out(config, spec, attempt, actor, timeout_s, store)


def _wait_started(ref: Any, actor: Any, attempt: str | None) -> float:
    """When the actor began this attempt (epoch seconds); now if it already finished or cannot say."""
    while True:
        ready, _ = ray.wait([ref], timeout=STATE_POLL_S)
        if ready:
            return time.time()
        try:
            busy = ray.get(actor.state.remote(), timeout=STATE_POLL_S * 10)["busy"]
        except (ray.exceptions.GetTimeoutError, *ACTOR_GONE):
            continue  # still being placed or restarted: queued, not running
        if busy and busy.get("attempt") == attempt:
            return float(busy["since"])


def run_on_pools(ctx: Any, phase: str, epoch: int, batches: list[int | None]) -> Iterator[int | None]:
    """A unit runner for :func:`verl_tasks.runner.train`: a phase's units at once on its pool.

    Yields each batch as its unit commits. A failed unit (its worker died, a timeout, a phase
    error) follows :func:`verl_tasks.execution.outcome.after_failure`, as the inline runner
    does: each retry is a new attempt; the first failure that is not retried nor left out is
    raised once the other units finish. A call refused while Ray restarts its actor is sent
    again, as :func:`run_unit` does, without spending a try: a retry sent at once would only
    meet the same restarting actor.
    """
    from verl_tasks.errors import PhaseFailed
    from verl_tasks.execution.outcome import (
        LEAVE_OUT,
        RETRY,
        after_failure,
        describe,
        error_from_result,
        next_step_text,
    )
    from verl_tasks.phase_registry import phase as phase_spec
    from verl_tasks.store.units import new_attempt_id

    config = ctx.config
    start_cpu_pools(config)
    ft = config.fault_tolerance
    batched = phase_spec(phase).batched
    pending: dict[Any, tuple[UnitSpec, str, Any, int]] = {}

    def launch(batch: int | None, tries: int) -> None:
        spec = UnitSpec(config.experiment, phase, epoch, batch)
        attempt = new_attempt_id()
        ref, actor = submit(config, spec, attempt)
        pending[ref] = (spec, attempt, actor, tries)

    for batch in batches:
        launch(batch, 1)
    failure: Exception | None = None
    timeout_s = ft.timeout_s.get(phase)
    refusals = Refusals()
    cancelled: set[str] = set()  # attempts stopped here for their timeout: fenced, never sent again
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=None if timeout_s is None else STATE_POLL_S * 2)
        if not ready:
            cancelled |= _cancel_overdue(config, pending, timeout_s)
            continue
        spec, attempt, actor, tries = pending.pop(ready[0])
        try:
            result = ray.get(ready[0])
        except ray.exceptions.ActorUnavailableError as err:
            if attempt not in cancelled and refusals.wait_to_resend(spec, attempt):
                pending[send(actor, config, spec, attempt)] = (spec, attempt, actor, tries)
                continue
            result = {"ok": False, "error": f"worker of {spec.label} stayed unavailable for "
                                            f"{RESEND_WINDOW_S:g} s: {type(err).__name__}"}
        except ray.exceptions.RayActorError as err:
            result = {"ok": False, "error": f"worker of {spec.label} died or was cancelled: {type(err).__name__}"}
        for line in result.get("log", []):
            log.debug("[%s] %s", spec.label, line)
        if result.get("ok"):
            yield spec.batch
            continue
        error = error_from_result(result) or PhaseFailed(spec.label, describe(result))
        step = after_failure(ft, batched, error, tries)
        log.warning("%s failed (try %d of %d): %s; %s", spec.label, tries, 1 + ft.retries, error,
                    next_step_text(step, error, ft))
        if step == RETRY:
            time.sleep(ft.retry_delay_s)
            launch(spec.batch, tries + 1)  # a new attempt, as Airflow's retry would be
        elif step != LEAVE_OUT and failure is None:
            failure = error
    if failure is not None:
        raise failure


def _cancel_overdue(config: ExperimentConfig, pending: dict[Any, tuple], timeout_s: float) -> set[str]:
    """Cancel every pending unit that has run (not queued) longer than ``timeout_s``; returns their attempts."""
    overdue = set()
    for spec, attempt, actor, _tries in list(pending.values()):
        try:
            busy = ray.get(actor.state.remote(), timeout=STATE_POLL_S * 10)["busy"]
        except (ray.exceptions.GetTimeoutError, *ACTOR_GONE):
            continue
        if busy and busy.get("attempt") == attempt and time.time() - float(busy["since"]) > timeout_s:
            cancel_unit(config, spec, attempt, actor, f"timed out after {timeout_s:g} s")
            overdue.add(attempt)
    return overdue


def cancel_unit(config: ExperimentConfig, spec: UnitSpec, attempt: str | None, actor: Any | None, reason: str,
                ref: Any | None = None, store: Any = None) -> str:
    """Stop the attempt: kill (and let Ray restart) its actor if it is running it, fence the attempt so it
    can never commit, and take a call still queued (``ref``) out of the actor's queue.

    An actor runs one unit at a time and queues the rest, so the one an attempt was sent to may be
    running another unit (another batch, another task's); that one is left alone. The kill goes
    first when the attempt is running: it is one quick call, while the fence is a store write (on
    S3, with retries) that a stopping job's SIGKILL may cut short. After the fence the actor is
    asked again: an attempt that started meanwhile is killed too, and one that starts later finds
    the fence and returns at once (``phases.common.run_unit``). With no actor known yet (the unit
    was being sent) the fence alone stops it. ``store``: the caller's (an Airflow task's carries its
    connection's credentials); else one from the environment.
    """
    from verl_tasks.layout import Layout
    from verl_tasks.store import store_for
    from verl_tasks.store.units import fence_attempt

    unit = Layout(config.experiment).unit(spec.phase, spec.epoch, spec.batch)
    killed = actor is not None and _kill_if_running(actor, attempt)
    if not killed and ref is not None:
        ray.cancel(ref)  # queued behind another unit: dropped from the queue; running: only flagged
    if attempt:
        fence_attempt(store or store_for(config), unit, attempt, reason)
        if actor is not None and not killed:
            killed = _kill_if_running(actor, attempt)
    log.warning("cancelled %s (attempt %s%s): %s", unit, attempt, ", its actor killed" if killed else "", reason)
    return unit


def _kill_if_running(actor: Any, attempt: str | None) -> bool:
    """Kill ``actor`` unless it answers that it runs another unit or none, or is gone (restarting).

    An actor that does not answer within ``CANCEL_STATE_WAIT_S`` is wedged (a unit holding the GIL
    in C code starves its control thread): only a kill frees it, whatever it runs; a unit of
    another caller killed with it is sent again (``run_unit``). No attempt id: killed.
    """
    if attempt is not None:
        try:
            busy = ray.get(actor.state.remote(), timeout=CANCEL_STATE_WAIT_S)["busy"]
            if not busy or busy.get("attempt") != attempt:
                return False
        except ACTOR_GONE:
            return False
        except ray.exceptions.GetTimeoutError:
            pass
    ray.kill(actor, no_restart=False)
    return True


__all__ = ["PoolShape", "PoolWorker", "release_experiment", "submit", "wait", "run_unit", "run_on_pools",
           "cancel_unit", "pool_kind", "start_cpu_pools", "code_fingerprint", "ensure_connected", "NAMESPACE"]
