"""Fault injection for the chaos and end-to-end tests (test-only; never installed with the package).

``sitecustomize`` (next to this file) calls :func:`install` in every Python process that the
test harness starts with this folder on ``PYTHONPATH`` and ``VT_TEST_FAULTS_DIR`` set: the
Airflow components and their task processes, the Ray head and every worker Ray starts. The
plan is files in that folder, written by the test while those processes run:

* ``<experiment>.<label>.fail-once``: the next attempt of that unit fails before doing any work;
  the file becomes ``.failed`` (an atomic rename, so exactly one attempt fails);
* ``<experiment>.<label>.fail-at-commit``: the next attempt of that unit fails after all its work, just
  before its commit (the file becomes ``.failed``);
* ``<experiment>.<label>.store-fails-once``: the next attempt of that unit fails after its work, as a store
  write that did not go through would (a ``StoreError``); the file becomes ``.failed``;
* ``<experiment>.<label>.hold``: the unit's rollout writes its PID to ``.held`` after loading the
  policy and waits there, before generating, until the test removes the hold file;
  ``.hold-start`` / ``.held-start`` likewise, before the unit starts (inline backend: before its
  safe-mode check);
* ``<experiment>.e<epoch>-update.kill-rank<r>``: update worker ``r`` (a rank of the resident group) kills
  itself with SIGKILL in the middle of its first optimizer step (forward done, gradients not yet
  reduced); the file becomes ``.killed``, so exactly one worker of one attempt dies;
* ``<experiment>.e<epoch>-update.record-nodes``: each update worker writes its Ray node id and
  PID to ``<experiment>.e<epoch>-update.rank<r>.node`` (JSON) at its first step: where it ran.

``label`` is :attr:`verl_tasks.execution.UnitSpec.label`, e.g. ``e0-rollout-b1``. This module is
imported by top-level name in those processes, so it imports nothing from ``tests``.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

FAULTS_ENV = "VT_TEST_FAULTS_DIR"
HOLD_LIMIT_S = 600


class InjectedFault(RuntimeError):
    """The planned failure of one attempt."""


def unit_name(experiment: str, phase: str, epoch: int, batch: int | None = None) -> str:
    label = f"e{epoch}-{phase}" if batch is None else f"e{epoch}-{phase}-b{batch}"
    return f"{experiment}.{label}"


def _folder() -> Path | None:
    value = os.environ.get(FAULTS_ENV)
    return Path(value) if value else None


def _consume(name: str, suffix: str) -> bool:
    """Take the plan file ``name`` (renamed to ``suffix``: atomic, so exactly one caller wins); False if absent."""
    folder = _folder()
    if folder is None:
        return False
    flag = folder / name
    try:
        os.rename(flag, flag.with_suffix(suffix))
    except FileNotFoundError:
        return False
    return True


def fail_once(*, experiment: str, phase: str, epoch: int, batch: int | None = None, **_: Any) -> None:
    """``unit_start`` hook: consume the unit's ``.fail-once`` file and raise, or do nothing."""
    name = f"{unit_name(experiment, phase, epoch, batch)}.fail-once"
    if _consume(name, ".failed"):
        raise InjectedFault(f"injected fault ({name}, pid {os.getpid()}); the next attempt runs normally")


def store_write_fails(*, experiment: str, phase: str, epoch: int, batch: int | None = None, **_: Any) -> None:
    """``before_commit`` hook: consume the unit's ``.store-fails-once`` file and fail as a store write that
    did not go through would (a ``StoreError``, which the runners retry), or do nothing."""
    name = f"{unit_name(experiment, phase, epoch, batch)}.store-fails-once"
    if _consume(name, ".failed"):
        from verl_tasks.errors import StoreError

        raise StoreError(f"injected: a write to the store failed ({name}, pid {os.getpid()}); nothing was committed")


def fail_at_commit(*, experiment: str, phase: str, epoch: int, batch: int | None = None, **_: Any) -> None:
    """``before_commit`` hook: consume the unit's ``.fail-at-commit`` file and raise, or do nothing."""
    name = f"{unit_name(experiment, phase, epoch, batch)}.fail-at-commit"
    if _consume(name, ".failed"):
        raise InjectedFault(f"injected fault ({name}, pid {os.getpid()}) after the attempt's work, before its commit")


def _wait_while_held(experiment: str, epoch: int, batch: int | None, where: str) -> None:
    folder = _folder()
    if folder is None or batch is None:
        return
    name = unit_name(experiment, "rollout", epoch, batch)
    flag = folder / f"{name}.hold{where}"
    if not flag.exists():
        return
    (folder / f"{name}.held{where}").write_text(str(os.getpid()))
    deadline = time.monotonic() + HOLD_LIMIT_S
    while flag.exists() and time.monotonic() < deadline:
        time.sleep(0.1)


def hold(*, experiment: str, epoch: int, batch: int, **_: Any) -> None:
    """``rollout_generate`` hook: wait in the middle of the batch while the unit's ``.hold`` file exists."""
    _wait_while_held(experiment, epoch, batch, "")


def hold_at_start(*, experiment: str, phase: str, epoch: int, batch: int | None = None, **_: Any) -> None:
    """``unit_start`` hook: wait before a rollout's unit starts (before its safe-mode check) while the unit's
    ``.hold-start`` file exists."""
    if phase == "rollout":
        _wait_while_held(experiment, epoch, batch, "-start")


def kill_update_worker(*, experiment: str, epoch: int, rank: int, **_: Any) -> None:
    """``update_worker_step`` hook: SIGKILL this worker if the plan names its rank (once)."""
    _kill_rank(experiment, "update", epoch, rank)


def kill_critic_worker(*, experiment: str, epoch: int, rank: int = 0, **_: Any) -> None:
    """``critic_step`` hook: SIGKILL this critic worker if the plan names its rank (once)."""
    _kill_rank(experiment, "critic", epoch, rank)


def _kill_rank(experiment: str, phase: str, epoch: int, rank: int) -> None:
    import signal

    if _consume(f"{unit_name(experiment, phase, epoch)}.kill-rank{rank}", ".killed"):
        os.kill(os.getpid(), signal.SIGKILL)


def record_update_node(*, experiment: str, epoch: int, rank: int, **_: Any) -> None:
    """``update_worker_step`` hook: say once which Ray node and process update worker ``rank`` runs in."""
    folder = _folder()
    name = unit_name(experiment, "update", epoch)
    if folder is None or not (folder / f"{name}.record-nodes").exists():
        return
    out = folder / f"{name}.rank{rank}.node"
    if not out.exists():
        import ray

        out.write_text(json.dumps({"node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}))


def install() -> None:
    """Register the hooks in this process (child processes that fork inherit them)."""
    from verl_tasks import hooks

    hooks.register("unit_start", fail_once)
    hooks.register("unit_start", hold_at_start)
    hooks.register("before_commit", fail_at_commit)
    hooks.register("before_commit", store_write_fails)
    hooks.register("rollout_generate", hold)
    hooks.register("update_worker_step", kill_update_worker)
    hooks.register("critic_step", kill_critic_worker)
    hooks.register("update_worker_step", record_update_node)
