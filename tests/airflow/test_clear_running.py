"""After a Clear, the new try of a task attached to the cleared try's Ray job, which the cleared try's
on_kill then stopped: the new try submits the next attempt. The end-to-end test that met this race
(clearing a running rollout) is in test_e2e.py, on its shared stack."""
from __future__ import annotations

import pytest


def _ctx(experiment: str) -> dict:
    from types import SimpleNamespace

    return {"params": {"experiment": experiment},
            "dag_run": SimpleNamespace(run_type="manual", conf={}, logical_date=None, run_after=None)}


def test_a_stopped_job_the_try_only_attached_to_is_followed_by_the_next_attempt(tmp_path, monkeypatch):
    """The race test_e2e's clear of a running rollout met: after a Clear, the new try attached to the cleared try's
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
