"""Safe mode: the experiment is halted until a person resumes it.

While ``<experiment>/control/safe_mode.json`` exists, ``run_unit`` refuses to
start any unit (``SafeMode``). Committed units stay valid; resuming only
removes the file, so the next run (or DAG run) continues where it stopped.

A person resumes in one of two ways, both recorded as a ``resumed`` event:

* ``verl-tasks resume CONFIG --experiment NAME --store URI`` (the record holds the
  exact command, runnable as printed);
* a **Clear** of any task of the experiment in Airflow: the first try after a clear
  lifts safe mode (:func:`first_try_after_clear`). Airflow's automatic retries never do.

What drives safe mode is not read from the event log (its writes are best-effort and
unsynced): each failed try of a batch is a durable record of its own
(:func:`record_failed_try`, ``put_if_absent``, so one try reported twice is one record)
under ``control/failures/<epoch>/g<generation>/``, and :func:`failed_batches` counts one
epoch's from one listing. Leaving safe mode moves ``control/generation.json`` on, so the
failures before it no longer count toward ``fault_tolerance.max_failed_batch_fraction``.
The ``task_failed`` and ``resumed`` events are still written, for people.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import shlex
import time
import uuid
from pathlib import Path
from typing import Any

from verl_tasks.config import ExperimentConfig
from verl_tasks.events import record_event
from verl_tasks.layout import Layout
from verl_tasks.store.base import NotFound, ObjectStore

log = logging.getLogger(__name__)
SAFE_MODE = "safe_mode"
RESUMED = "resumed"
# A failure record's name: b<batch>-<phase>-try<n>[-final]-<which task instance>.json
_FAILURE_NAME = re.compile(r"^b(\d{4})-[^/]+?-try(\d+)(-final)?-[0-9a-f]+\.json$")


def read_safe_mode(store: ObjectStore, layout: Layout) -> dict[str, Any] | None:
    """The safe-mode record, or None when the experiment is not halted."""
    try:
        return json.loads(store.get(layout.safe_mode))
    except NotFound:
        return None


def cli_command(verb: str, config: ExperimentConfig, config_path: str | Path, *extra: str) -> str:
    """``verl-tasks VERB CONFIG --experiment NAME --store URI ...``: reaches this experiment from any shell.

    The store is spelled out because the YAML's relative ``file://`` URI depends on the
    working directory; an S3 endpoint that came from an Airflow connection is passed as
    ``VERL_TASKS_S3_ENDPOINT``.
    """
    words = ["verl-tasks", *verb.split(), str(config_path), "--experiment", config.experiment,
             "--store", config.storage.uri, *extra]
    line = " ".join(shlex.quote(w) for w in words)
    endpoint = config.storage.endpoint_url
    if endpoint and config.storage.uri.startswith("s3://"):
        line = f"VERL_TASKS_S3_ENDPOINT={shlex.quote(endpoint)} {line}"
    return line


def runbook(record: dict[str, Any]) -> str:
    """What a person does next, from the record: every command runs as printed; advice follows what happened."""
    commands = record.get("commands") or {}
    steps = [f"1. Inspect: `{commands.get('status')}` and the failed task logs.",
             f"2. Fix the cause (data, reward function, resources, storage); if a snapshot is suspect: "
             f"`{commands.get('verify')}`."]
    dag_id = record.get("dag_id")
    if not dag_id:
        steps.append(f"3. Leave safe mode: `{commands.get('resume')}`, then `{commands.get('run')}`. "
                     "Committed units are kept; only missing ones rerun.")
        return "\n".join(steps)
    unpause = f"unpause the DAG (`airflow dags unpause {dag_id}` or the toggle in the UI), then " \
        if record.get("dag_paused") else ""
    steps.append(f"3. Continue: {unpause}Clear the failed task(s) in the Airflow UI with Downstream checked; the "
                 f"clear is the confirmation and lifts safe mode (the event log records it). Or run "
                 f"`{commands.get('resume')}` first, then Clear. Committed units are kept; only missing ones rerun.")
    return "\n".join(steps)


def halted_message(experiment: str, record: dict[str, Any]) -> str:
    """One line for a refused unit or run: why it is halted and the command that resumes it."""
    resume = (record.get("commands") or {}).get("resume")
    how = f"`{resume}`" if resume else "verl-tasks resume with this experiment's YAML, --experiment and --store"
    clear = " (or Clear the failed task in Airflow)" if record.get("dag_id") else ""
    return (f"experiment {experiment!r} is in safe mode: {record.get('summary', 'halted')}; fix the cause, then "
            f"run {how}{clear}")


def after_resume(record: dict[str, Any], run_command: str) -> str:
    """What to do once ``verl-tasks resume`` removed ``record``: matches whether a DAG runs it and was paused."""
    dag_id = record.get("dag_id")
    if not dag_id:
        return f"continue with `{run_command}`"
    unpause = f"unpause the DAG (`airflow dags unpause {dag_id}`), then " if record.get("dag_paused") else ""
    return f"{unpause}Clear the failed task(s) of DAG {dag_id} in the Airflow UI, or trigger a new run"


def enter_safe_mode(store: ObjectStore, layout: Layout, summary: dict[str, Any]) -> dict[str, Any]:
    """Halt the experiment: write ``control/safe_mode.json`` and a ``safe_mode`` event.

    Args:
        summary: JSON-serialisable; should hold ``summary`` (one line), ``reason``,
            ``failed_units``, ``commands`` and ``what_to_do``.
    Returns:
        The record written (``summary`` plus ``entered_at``).
    """
    body = {**summary, "experiment": layout.experiment, "entered_at": time.time()}
    store.put(layout.safe_mode, json.dumps(body, indent=1, sort_keys=True, default=str).encode())
    record_event(store, layout, SAFE_MODE, summary=str(body.get("summary", ""))[:2000],
                 failed_units=[u.get("unit") for u in body.get("failed_units", []) if isinstance(u, dict)])
    log.warning("experiment %s is now in safe mode: %s", layout.experiment, body.get("summary"))
    return body


def note_dag_pause(store: ObjectStore, layout: Layout, paused: bool, detail: str) -> dict[str, Any] | None:
    """Record whether the DAG was really paused, so the runbook only says "unpause" when it was."""
    record = read_safe_mode(store, layout)
    if record is None:
        return None
    record.update(dag_paused=paused, pause=detail)
    record["what_to_do"] = runbook(record)
    store.put(layout.safe_mode, json.dumps(record, indent=1, sort_keys=True, default=str).encode())
    return record


def leave_safe_mode(store: ObjectStore, layout: Layout, by: str = "verl-tasks resume",
                    **details: Any) -> dict[str, Any] | None:
    """Remove the safe-mode file and record a ``resumed`` event.

    Args:
        by: who or what resumed (``verl-tasks resume``, ``clear``).
        details: small JSON values for the event (user, task, try number).
    Returns:
        The record that was removed (by this call or by a concurrent lift of the same halt, which then
        records the event), or None when the experiment was not halted.
    """
    raw = _current(store, layout)
    if raw is None:
        return None
    previous = json.loads(raw)
    # The tasks of one Clear of a run start together and may all find the halt: the one that claims its lift
    # records it; every one removes it (a crash after the claim leaves the next one to remove it).
    halt = repr(previous.get("entered_at")).encode() if previous.get("entered_at") else raw  # kept by rewrites
    claim = layout.safe_mode_lift(hashlib.sha256(halt).hexdigest()[:32])
    won = store.put_if_absent(claim, json.dumps({"by": by, "time": time.time()}, default=str).encode())
    if not won and _current(store, layout) != raw:
        return previous  # the lift that claimed it removed it; a new halt since is never touched here
    # Before the file goes: a crash in between leaves it halted with fresh counts, never resumed with stale ones.
    _next_generation(store, layout)
    store.delete(layout.safe_mode)
    if not won:
        return previous  # the claimant records the lift (one resumed event per halt)
    record_event(store, layout, RESUMED, by=by, was=str(previous.get("summary", ""))[:2000], **details)
    log.info("experiment %s left safe mode (%s)", layout.experiment, by)
    return previous


def _current(store: ObjectStore, layout: Layout) -> bytes | None:
    try:
        return store.get(layout.safe_mode)
    except NotFound:
        return None


def first_try_after_clear(try_number: int, max_tries: int, retries: int) -> bool:
    """Whether a task instance's try is the first one after a person cleared it.

    Airflow starts a task instance with ``max_tries = retries``, and a clear sets
    ``max_tries = try_number + retries``; so the first try of the current clear is
    ``max_tries - retries + 1`` (Airflow's own ``first_try_number``). It is above 1 only
    after a clear; automatic retries have a higher try number. A task cleared while
    it was running (state ``restarting``) keeps its ``max_tries`` and is not counted.
    """
    first = max_tries - retries + 1
    return first > 1 and try_number == first


def generation(store: ObjectStore, layout: Layout) -> int:
    """How many times the experiment left safe mode: the failure records of this generation are the ones that count."""
    try:
        value = json.loads(store.get(layout.generation)).get("generation", 0)
    except NotFound:
        return 0
    except (ValueError, AttributeError) as err:  # written durably by put: only a hand edit breaks it
        raise ValueError(f"{store.url(layout.generation)} is not a generation record: {err}") from err
    return int(value)


def _next_generation(store: ObjectStore, layout: Layout) -> int:
    """Start a fresh count of failures (two people resuming at once both start one: still fresh)."""
    value = generation(store, layout) + 1
    store.put(layout.generation, json.dumps({"generation": value, "time": time.time()}).encode())
    return value


def record_failed_try(store: ObjectStore, layout: Layout, *, epoch: int, batch: int, phase: str,
                      try_number: int | None, final: bool = False, instance: str | None = None,
                      **details: Any) -> str:
    """Record durably (``put_if_absent``: fsynced like a commit marker) that a try of a batch failed.

    Args:
        instance: what names the task instance (DAG run, task id, map index); with ``try_number``
            it names the try, so the same try reported twice is one record. Without either, each
            report is a record of its own.
        details: small JSON values for a person (error, task id).
    Returns:
        The record's key.
    """
    if try_number is None or instance is None:
        tag, tries = uuid.uuid4().hex[:16], 0
    else:
        tag, tries = hashlib.sha256(instance.encode()).hexdigest()[:16], int(try_number)
    name = f"b{batch:04d}-{phase}-try{tries:03d}{'-final' if final else ''}-{tag}.json"
    key = f"{layout.failures(epoch, generation(store, layout))}/{name}"
    body = {"epoch": epoch, "batch": batch, "phase": phase, "try_number": try_number, "final": final,
            "instance": instance, "time": time.time(), **details}
    store.put_if_absent(key, json.dumps(body, sort_keys=True, default=str).encode())
    return key


def failed_batches(store: ObjectStore, layout: Layout, epoch: int, *, final_only: bool = False) -> set[int]:
    """The batches of ``epoch`` with a failed try (``final_only``: one that failed after all its retries)
    since the experiment last left safe mode: one listing of that epoch's records, none read."""
    prefix = layout.failures(epoch, generation(store, layout)) + "/"
    batches = set()
    for key in store.list(prefix):
        found = _FAILURE_NAME.match(key[len(prefix):])
        if found and (found.group(3) or not final_only):
            batches.add(int(found.group(1)))
    return batches


def escalate(config: ExperimentConfig, failed_units: list[dict[str, Any]], reason: str,
             store: ObjectStore | None = None, *, config_path: str | Path, dag_id: str | None = None) -> dict[str, Any]:
    """Put an experiment in safe mode after its retries are exhausted; return the summary for a callback.

    Args:
        config: the experiment.
        failed_units: one dict per failed unit, e.g. ``{"unit": ..., "error": ..., "try_number": ...}``.
        reason: why the experiment is halted (e.g. "update failed after 3 retries").
        store: the experiment's store (built from the config when not given).
        config_path: the experiment's YAML, for the commands of the runbook.
        dag_id: the Airflow DAG that runs it (its runbook says Clear), if any.
    Returns:
        The safe-mode record: ``summary`` (a short text), ``what_to_do`` (a runbook text),
        ``commands`` (each runnable as printed), ``failed_units``, ``reason``, ``experiment``,
        ``dag_id``, ``entered_at``.
    """
    from verl_tasks.store import store_for

    store = store or store_for(config)
    layout = Layout(config.experiment)
    names = ", ".join(str(u.get("unit", "?")) for u in failed_units) or "none named"
    errors = "; ".join(f"{u.get('unit', '?')}: {str(u.get('error', ''))[:300]}" for u in failed_units)
    commands = {verb: cli_command(verb, config, config_path) for verb in ("status", "resume", "run")}
    endpoint = config.storage.endpoint_url if config.storage.uri.startswith("s3://") else None
    commands["verify"] = " ".join(shlex.quote(w) for w in ["verl-tasks", "checkpoint", "verify",
                                                            store.url(layout.snapshots)]
                                  + (["--endpoint-url", endpoint] if endpoint else []))
    summary = {
        "summary": f"{config.experiment} halted: {reason} (failed units: {names})",
        "reason": reason,
        "failed_units": failed_units,
        "errors": errors,
        "commands": commands,
        "dag_id": dag_id,
    }
    summary["what_to_do"] = runbook(summary)
    return enter_safe_mode(store, layout, summary)
