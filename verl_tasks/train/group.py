"""The update's resident worker group: Ray actors that keep the policy and its AdamW state across units.

When ``resources.update.workers > 1`` or ``strategy: fsdp2``, the process that runs the update unit
(the experiment's update pool actor, or the inline process) drives ``workers`` Ray actors
(:class:`verl_tasks.train.worker.UpdateWorker`), each reserving the update phase's ``num_cpus``,
``num_gpus``, ``memory_mb`` and custom resources, so Ray places them on any node that has them.
They form a torch process group once (gloo on CPU, ``cpu:gloo,cuda:nccl`` on GPUs) and then
serve unit after unit, keeping the trained policy between them (see the worker's docstring for
when a resident policy is used and when the store is read).

PPO's critic, with ``resources.critic.workers > 1``, gets a group of its own the same way (keyed by
``resources.critic``; a process holds at most one group per phase). Its workers read the critic from
the store for each unit: only the policy is kept resident.

Why actors with a process group of our own rather than Ray Train: a ``TorchTrainer.fit`` is one
run. Kept alive across units it would have to serve a queue from inside its training function,
and then one unit could not be stopped without ending the fit, nor could a fit that died be told
apart from a unit that failed. With actors the driver decides: its group lives while units
succeed, and any failure of a unit dismisses it (as verl's worker groups are used, but per unit,
not per job). Placement, the process group and health checks are what Ray Train added; here
Ray places the actors, ``init_process_group`` forms the group, and Ray reports a dead actor.

The group's life, which the driver owns (the actors are its children: if the driver process
dies, Ray kills them):

* formed at the first distributed update this process runs, or whenever the experiment, store,
  worker count, strategy, per-worker resources or code differ from the group it holds;
* reused by the next unit when every rank answers that it still belongs to the group;
* dismissed (every actor killed, its resources freed) when a unit fails in any way (a rank raised
  or died, the unit's deadline passed, the driver was interrupted): a worker that dies fails the
  attempt, never a silent retry inside it, and the next attempt forms a fresh group; and when it
  has served no unit for its phase's ``idle_release_s``.

Stopping a unit: the pools kill the driver actor (its children die with it); inline, the deadline's
exception passes through :func:`train_on_workers`, which dismisses the group first.
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import verl_tasks
from verl_tasks.config import ExperimentConfig, Resources
from verl_tasks.errors import PhaseFailed
from verl_tasks.phases.common import PhaseContext
from verl_tasks.phases.update_inputs import UpdateSource
from verl_tasks.store.units import FileEntry, UnitWriter

log = logging.getLogger(__name__)

# init_process_group's timeout: also the limit of every collective (a rank stuck that long fails).
COLLECTIVE_TIMEOUT_S = 1800.0
# A dead actor answers at once (with an error); this bounds only a rank too busy or wedged to answer.
DESCRIBE_S = 60.0
WAIT_SLICE_S = 0.2


@dataclass
class WorkerGroup:
    """The actors of one formed group, in rank order, and what they were formed for."""

    key: tuple
    phase: str
    name: str
    actors: list[Any]
    ranks: list[dict[str, Any]]
    idle_release_s: float
    last_used: float = field(default_factory=time.monotonic)


_HELD: list[WorkerGroup] = []  # the groups this process drives (at most one per phase)
_LOCK = threading.RLock()
_REAPER: list[threading.Thread] = []


def group_key(config: ExperimentConfig, phase: str = "update") -> tuple:
    """What a group is formed for: a unit of another experiment, store, shape or code gets a new group."""
    from verl_tasks.execution import store_identity
    from verl_tasks.execution.pool_shape import code_fingerprint

    res = config.phase_resources(phase)
    return (phase, config.experiment, store_identity(config), res.workers, res.strategy.value, res.num_cpus,
            res.num_gpus, res.memory_mb, tuple(sorted(res.custom.items())), code_fingerprint())


def worker_resources(res: Resources) -> dict[str, Any]:
    """The actor options each worker reserves: the update phase's resources."""
    options: dict[str, Any] = {"num_cpus": res.num_cpus, "num_gpus": res.num_gpus}
    if res.memory_mb:
        options["memory"] = int(res.memory_mb * 1024 * 1024)
    if res.custom:
        options["resources"] = dict(res.custom)
    return options


def ensure_ray(config: ExperimentConfig) -> None:
    """Connect to nothing new when this process is already in a Ray cluster (a pool actor, a driver);
    otherwise (inline: tests, ``verl-tasks run``) start a private local Ray that lives as long as the process,
    with CPUs for every group the experiment's phases drive held at once (the critic's and the update's)."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep a local Ray on loopback (read at import)
    import ray

    if ray.is_initialized():
        return
    from verl_tasks.execution.local_head import LOGICAL_CPUS
    from verl_tasks.execution.pool_shape import drives_a_group

    # Logical CPUs are a placement count: enough for a later epoch's larger worker count too.
    every = [config.phase_resources(phase) for phase in ("critic", "update") if drives_a_group(config, phase)]
    workers = sum(res.workers for res in every)
    cpus = max(os.cpu_count() or 1, LOGICAL_CPUS, math.ceil(sum(res.workers * res.num_cpus for res in every)))
    # The workers import the code this process runs (a checkout may shadow the installed package).
    root = str(Path(verl_tasks.__file__).resolve().parents[1])
    pythonpath = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
    log.info("no Ray cluster connected: started a local Ray (%d logical CPUs) for %d resident workers; "
             "it stops when this process exits", cpus, workers)


def wait_all(refs: list[Any]) -> list[Any]:
    """Every ref's value, in order; the first that fails raises at once (the others are not waited for).

    Waits in short slices, back in Python between them, so a deadline's signal is handled promptly.
    """
    import ray

    values: dict[Any, Any] = {}
    pending = list(refs)
    while pending:
        try:
            ready, pending = ray.wait(pending, num_returns=1, timeout=WAIT_SLICE_S)
        except SystemError as err:  # a signal handler raised inside Ray's C wait: Ray wraps it; give it back
            if err.__context__ is not None:
                raise err.__context__ from None
            raise
        for ref in ready:
            values[ref] = ray.get(ref)
    return [values[ref] for ref in refs]


def form(config: ExperimentConfig, phase: str = "update") -> WorkerGroup:
    """Start ``resources.<phase>.workers`` actors and form their process group; returns the group."""
    import ray

    from verl_tasks.train.worker import UpdateWorker

    res = config.phase_resources(phase)
    ensure_ray(config)
    name = f"{config.experiment}-{phase}-{uuid.uuid4().hex[:8]}"
    # Ray's overloads of ``remote`` list the task options only, not the actor's ``concurrency_groups``.
    actor_class: Any = ray.remote(concurrency_groups={"work": 1, "control": 1})(UpdateWorker)  # type: ignore[call-overload]
    options = {**worker_resources(res), "max_restarts": 0}
    actors = [actor_class.options(**options).remote(rank, res.workers, name) for rank in range(res.workers)]
    group = WorkerGroup(group_key(config, phase), phase, name, actors, [], res.idle_release_s)
    started = time.monotonic()
    try:
        address = wait_all([actors[0].rendezvous.remote()])[0]
        group.ranks = wait_all([actor.join.remote(address, COLLECTIVE_TIMEOUT_S) for actor in actors])
    except BaseException:
        dismiss(group, "it could not be formed")
        raise
    where = sorted({r["node"][:8] for r in group.ranks})
    log.info("%s worker group %s formed in %.1f s: %d workers (%s, %s) on node(s) %s", phase, name,
             time.monotonic() - started, res.workers, res.strategy.value, group.ranks[0]["backend"], where)
    return group


def dismiss(group: WorkerGroup, reason: str) -> None:
    """Kill every actor of ``group`` (their resources and resident state go with them)."""
    with _LOCK:
        if group in _HELD:
            _HELD.remove(group)
    _kill(group, reason)


def _kill(group: WorkerGroup, reason: str) -> None:
    """Kill the actors of a group no longer held."""
    import ray

    for actor in group.actors:
        try:
            ray.kill(actor, no_restart=True)
        except (ValueError, ray.exceptions.RayError):  # gone already
            continue
    log.info("%s worker group %s dismissed: %s", group.phase, group.name, reason)


def release() -> None:
    """Dismiss the group this process holds, if any (the process is done with updates)."""
    with _LOCK:
        held = list(_HELD)
    for group in held:
        dismiss(group, "released")


def _alive(group: WorkerGroup) -> bool:
    """Every rank answers that it belongs to ``group`` (a restarted or replaced actor would not)."""
    import ray

    try:
        answers = ray.get([a.describe.remote() for a in group.actors], timeout=DESCRIBE_S)
    except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as err:
        log.warning("%s worker group %s is not whole (%s)", group.phase, group.name, type(err).__name__)
        return False
    return [a["group"] for a in answers] == [group.name] * len(group.actors)


def acquire(config: ExperimentConfig, phase: str = "update") -> WorkerGroup:
    """The group for ``config``'s ``phase``: the held one when it fits and is whole, else a new one. It is
    returned marked busy; the caller sets ``last_used`` when its unit is done."""
    key = group_key(config, phase)
    with _LOCK:
        held = next((g for g in _HELD if g.phase == phase), None)
        if held is not None:
            held.last_used = -1.0  # busy from here: the idle reaper leaves it alone while it is checked and used
    if held is not None:
        if held.key == key and _alive(held):
            return held
        dismiss(held, "another experiment, shape or code" if held.key != key else "a worker is gone")
    group = form(config, phase)
    group.last_used = -1.0
    with _LOCK:
        _HELD.append(group)
        if not _REAPER:
            _REAPER.append(threading.Thread(target=_release_when_idle, name="verl-tasks-worker-groups", daemon=True))
            _REAPER[0].start()
    return group


def _release_when_idle() -> None:
    while True:
        time.sleep(1.0)
        with _LOCK:  # taken out of _HELD under the lock: ``acquire`` can no longer hand them out
            idle = [g for g in _HELD if g.last_used >= 0 and time.monotonic() - g.last_used > g.idle_release_s]
            for group in idle:
                _HELD.remove(group)
        for group in idle:
            _kill(group, f"idle for {group.idle_release_s:g} s")


def train_on_workers(ctx: PhaseContext, source: UpdateSource, writer: UnitWriter, phase: str = "update"
                     ) -> dict[str, Any]:
    """Train ``source`` on ``phase``'s resident group (the policy's ``update``, or the ``critic``); the
    workers write into ``writer``'s attempt.

    Returns:
        rank 0's answer: for the update ``per_step`` (metric sums per optimizer step), ``optimizer``
        (hyperparameters), ``ran`` (device, where the policy came from, seconds), ``handover`` (the new
        weights in Ray's object store, or None); for the critic what ``UpdateWorker.critic`` returns.
        The workers' files are added to ``writer.files``.

    Raises:
        PhaseFailed: a worker raised or died; the attempt is left uncommitted and the group dismissed.
    """
    import ray

    config = ctx.config
    res = config.phase_resources(phase)
    group = acquire(config, phase)
    job = {"config": config.model_dump(mode="json"), "unit": writer.unit, "attempt": writer.attempt,
           "source": source}
    log.info("%s of epoch %d on %d resident workers (%s, group %s)", phase, source.epoch, res.workers,
             res.strategy.value, group.name)
    try:
        method = "critic" if phase == "critic" else "train"
        result = wait_all([getattr(actor, method).remote(job) for actor in group.actors])[0]
    except BaseException as err:
        dismiss(group, f"its unit failed ({type(err).__name__})")
        cause = getattr(err, "cause", None)
        if isinstance(err, ray.exceptions.RayTaskError) and isinstance(cause, PhaseFailed):
            raise type(cause)(writer.unit, cause.reason) from err  # typed as the worker raised it, for retries
        if isinstance(err, ray.exceptions.RayError):
            message = f"{phase} worker failed; attempt {writer.attempt} is not committed: {err}"
            raise PhaseFailed(writer.unit, message[:4000]) from err
        raise
    group.last_used = time.monotonic()
    for name, (size, sha) in result["files"].items():
        writer.files[name] = FileEntry(size, sha)
    return result


__all__ = ["WorkerGroup", "acquire", "dismiss", "ensure_ray", "form", "release", "train_on_workers",
           "worker_resources"]
