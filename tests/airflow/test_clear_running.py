"""Clear a *running* rollout task through the REST API.

The real stack of the end-to-end test (its ``stack`` fixture: `airflow standalone` on
PostgreSQL, a local Ray head with the test fault hooks, S3 on a moto server, and a fault-free
reference run of the same config computed inline in its own process):

1. rollout batch 1 of epoch 0 is held in its middle by the test hook (tests/faults: the worker
   actor writes its PID to ``.held`` and waits), its task deferred on its Ray job;
2. that task instance is cleared (``clearTaskInstances``, ``dry_run: false``, as the UI does):
   Airflow cancels the trigger, the trigger's ``on_kill`` stops the Ray job, the job's driver
   fences the attempt in the store and kills the actor;
3. the held actor process must be gone within ``STOP_S`` (5 s) of the clear request; the
   attempt's fence record must exist; the hold is then released for the retry;
4. the run must succeed; the unit's marker names the retry's attempt (never the killed one),
   it was committed once (one ``committed`` event), the killed attempt left no files; every
   unit committed exactly once; the final ``weights_sha256`` equals the fault-free reference.

Waits follow progress (see ``e2e_support.wait_for``) and print what they saw when they give up.

    .venv/bin/python -m pytest tests/airflow/test_clear_running.py -m "airflow and slow" -s
"""
from __future__ import annotations

import json
import secrets
import time
from collections import Counter
from pathlib import Path

import pytest

from tests import faults
from tests.airflow.e2e_support import Api, states, ti_key, wait_for
from tests.airflow.test_e2e import (  # noqa: F401 - `stack` is the fixture this test reuses
    DAG_ID,
    EXPERIMENT,
    ROLLOUT,
    Watch,
    _failing_logs,
    reference_result,
    stack,
)

STOP_S = 5.0  # the actor's work stops within 5 s of the clear
BATCH = 1


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


@pytest.mark.airflow
@pytest.mark.slow
def test_clearing_a_running_rollout_stops_its_actor_and_the_retry_commits_once(stack):  # noqa: F811 - the fixture
    from verl_tasks.config import load_config
    from verl_tasks.events import read_events
    from verl_tasks.runner import status
    from verl_tasks.store.units import ATTEMPTS, MARKER, fence_record, read_marker

    api: Api = stack["api"]
    t0 = time.monotonic()
    api.request("POST", "/api/v2/pools", {"name": "verl_gpu", "slots": 2, "description": "e2e"})
    api.request("PATCH", f"/api/v2/dags/{DAG_ID}", {"is_paused": False})

    # -- 1. hold rollout batch 1 in its middle ---------------------------------------------------
    held = faults.hold(stack["faults"], EXPERIMENT, 0, BATCH)
    run_id = "e2e_clear_running_" + secrets.token_hex(3)
    watch = Watch(stack, run_id)
    store, layout = watch.store, watch.layout
    unit = layout.rollout(0, BATCH)
    task = f"{ROLLOUT}[{BATCH}]"
    api.request("POST", f"/api/v2/dags/{DAG_ID}/dagRuns",
                {"dag_run_id": run_id, "logical_date": None, "conf": {"experiment": EXPERIMENT}})

    def started_attempts() -> list[dict]:
        return [e for e in read_events(store, layout) if e["kind"] == "started" and e.get("unit") == unit]

    def in_its_middle():
        """The held PID, the task's state and the attempt's `started` event, once all are there."""
        if not held.exists():
            return None
        tis = api.task_instances(DAG_ID, run_id)
        state = states(tis).get(task)
        if state not in ("deferred", "running"):
            return None
        started = started_attempts()
        return (int(held.read_text()), state, started) if started else None

    pid, state_at_clear, started = watch.wait(f"{task} to be held in its middle", in_its_middle)
    assert len(started) == 1, started
    killed = started[0]["attempt"]
    assert started[0]["pid"] == pid, (started[0], pid)  # the held process is the one running the attempt
    assert _alive(pid) and read_marker(store, unit) is None
    print(f"\n{task} held in its middle after {time.monotonic() - t0:.0f}s: actor pid {pid}, attempt {killed}, "
          f"task {state_at_clear}")

    # -- 2. clear that task instance while it runs ----------------------------------------------
    clear_sent = time.monotonic()
    cleared = api.clear(DAG_ID, {"task_ids": [[ROLLOUT, BATCH]], "dag_run_id": run_id, "include_downstream": False,
                                 "include_upstream": False, "only_failed": False, "reset_dag_runs": False})
    clear_answered = time.monotonic() - clear_sent
    assert [ti_key(t) for t in cleared["task_instances"]] == [task], cleared

    # -- 3. the actor's work stops within STOP_S; the attempt is fenced --------------------------
    def diagnose_stop() -> str:
        logs = "\n".join(f"--- {path}\n{text[-3000:]}"
                         for path, text in stack["airflow"].task_logs(DAG_ID, run_id).items()
                         if path.startswith(f"task_id={ROLLOUT}/map_index={BATCH}/"))
        return (f"actor pid {pid} alive={_alive(pid)}; fence={fence_record(store, unit, killed)}; "
                f"ray jobs={watch.jobs()}\n{stack['airflow'].component_tail('triggerer', 40)}\n{logs}")

    wait_for(f"actor process {pid} of the cleared attempt to be gone", lambda: not _alive(pid), 60, every=0.05,
             diagnose=diagnose_stop)
    stopped_s = time.monotonic() - clear_sent
    fence = wait_for("the cleared attempt's fence record", lambda: fence_record(store, unit, killed), 60,
                     every=0.1, diagnose=diagnose_stop)
    fenced_s = time.monotonic() - clear_sent
    print(f"clear answered in {clear_answered:.2f}s; actor process gone {stopped_s:.2f}s after the clear request; "
          f"fence record seen after {fenced_s:.2f}s: {fence}")
    faults.release(stack["faults"], EXPERIMENT, 0, BATCH)  # the retry must not be held
    assert stopped_s <= STOP_S, f"the cleared attempt's actor ran {stopped_s:.2f}s after the clear\n{diagnose_stop()}"
    assert "stopped" in fence.get("reason", ""), fence
    assert read_marker(store, unit) is None, "a marker appeared although the attempt was cancelled"

    # -- 4. the retry commits once; the run succeeds with the fault-free weights -------------------
    state, tis = watch.wait_run()
    by_key = states(tis)
    print(f"run {state} {time.monotonic() - t0:.0f}s after the trigger: {by_key}")
    assert state == "success", f"{json.dumps(by_key, indent=1)}\n{_failing_logs(stack['airflow'], run_id, tis)}"
    assert all(v == "success" for v in by_key.values()), by_key
    ti = next(t for t in tis if ti_key(t) == task)
    assert ti["try_number"] >= 2, ti  # the clear made a new try
    retry_log = "\n".join(text for path, text in stack["airflow"].task_logs(DAG_ID, run_id).items()
                          if path.startswith(f"task_id={ROLLOUT}/map_index={BATCH}/attempt=2."))
    raced = "which this try attached to, was stopped" in retry_log
    print("the new try " + ("attached to the cleared try's job before its on_kill stopped it, then submitted "
                            "the next attempt" if raced else
                            "found the cleared try's job stopped and submitted the next one"))

    record = read_marker(store, unit)
    assert record is not None and record.attempt != killed, (record, killed)
    events = read_events(store, layout)
    mine = [e for e in events if e.get("unit") == unit]
    assert Counter(e["kind"] for e in mine if e["kind"] == "committed") == {"committed": 1}, mine
    assert {e["attempt"] for e in mine if e["kind"] == "started"} == {killed, record.attempt}, mine
    assert not [e for e in mine if e["kind"] == "committed" and e.get("attempt") == killed], mine
    keys = store.list(unit + "/")
    assert not [k for k in keys if f"/{ATTEMPTS}/{killed}/" in k], f"the killed attempt left files: {keys}"
    assert fence_record(store, unit, record.attempt) is None

    committed = Counter(e["unit"] for e in events if e["kind"] == "committed")
    units = sorted(k[: -len(MARKER) - 1] for k in store.list(layout.root + "/") if k.endswith("/" + MARKER))
    assert set(committed) == set(units) and all(n == 1 for n in committed.values()), committed
    jobs = watch.jobs()
    prefix = f"vt-{EXPERIMENT}-e0-rollout-b{BATCH}-"
    assert jobs.get(prefix + "a1") == "STOPPED" and jobs.get(prefix + "a2") == "SUCCEEDED", jobs

    reference = reference_result(stack)
    cfg = load_config(stack["yaml"], {"storage.uri": stack["store_uri"]})
    latest = status(cfg, store)["latest_snapshot"]
    print(f"weights_sha256: cleared run {latest['weights_sha256']} / fault-free reference "
          f"{reference['weights_sha256']}")
    assert latest["version"] == reference["version"] == 1
    assert latest["weights_sha256"] == reference["weights_sha256"]
    print(f"whole test body: {time.monotonic() - t0:.0f}s; actor stopped {stopped_s:.2f}s after the clear")


def _ctx(experiment: str) -> dict:
    from types import SimpleNamespace

    return {"params": {"experiment": experiment},
            "dag_run": SimpleNamespace(run_type="manual", conf={}, logical_date=None, run_after=None)}


def test_a_stopped_job_the_try_only_attached_to_is_followed_by_the_next_attempt(tmp_path, monkeypatch):
    """The race the end-to-end test above met: after a Clear, the new try attached to the cleared try's
    job before that try's on_kill stopped it. The new try then submits the next attempt instead of failing;
    a job the try submitted itself that ends STOPPED still fails it."""
    from airflow.sdk.exceptions import TaskDeferred

    from tests.airflow.conftest import DAGS
    from verl_tasks.airflow.operators import VerlPhaseOperator
    from verl_tasks.errors import JobFailed
    from verl_tasks.execution.ray_jobs import JobHandle, submission_id

    monkeypatch.setenv("VERL_TASKS_STORE_ROOT", str(tmp_path))
    submitted: list[str] = []

    class NextAttempt:  # the backend's submit after attempt 1 was stopped: attempt 2
        retry_s = 0.0

        def submit(self, cfg, spec, **kwargs):
            submitted.append(submission_id(spec, 2))
            return JobHandle(submitted[-1], "PENDING", 2, True)

    op = VerlPhaseOperator(task_id="rollout", config_path=str(DAGS / "experiments" / "tiny_arith.yaml"),
                           phase="rollout", epoch=0, batch=1, backend="ray", ray_conn_id=None)
    op.__dict__["ray"] = NextAttempt()
    first = "vt-cr-1-e0-rollout-b1-a1"
    stopped = {"status": "STOPPED", "submission_id": first, "log_tail": "", "result": None}
    with pytest.raises(TaskDeferred) as deferred:
        op.execute_complete(_ctx("cr-1"), stopped, submission_id=first, attached=True)
    assert submitted == ["vt-cr-1-e0-rollout-b1-a2"]
    assert deferred.value.kwargs == {"submission_id": submitted[0], "attached": False}
    assert deferred.value.trigger.submission_id == submitted[0]
    with pytest.raises(JobFailed, match="STOPPED"):
        op.execute_complete(_ctx("cr-1"), stopped, submission_id=first, attached=False)
    assert len(submitted) == 1
