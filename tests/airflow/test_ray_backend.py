"""The Ray backend against a real local Ray head (token auth on): ids, attach, next attempt, deferral."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from tests import faults
from tests.airflow.conftest import DAGS
from verl_tasks.config import load_config
from verl_tasks.execution import UnitSpec
from verl_tasks.execution.ray_jobs import RayJobBackend, RayTarget, RayUnavailable, read_token, submission_id

pytestmark = pytest.mark.slow
TINY = str(DAGS / "experiments" / "tiny_arith.yaml")


def test_submission_ids_are_deterministic():
    assert submission_id(UnitSpec("tiny-arith", "rollout", 3, 7), 2) == "vt-tiny-arith-e3-rollout-b7-a2"
    assert submission_id(UnitSpec("x", "update", 0), 1) == "vt-x-e0-update-a1"


def test_without_token_the_head_refuses(ray_head):
    with pytest.raises((RayUnavailable, RuntimeError, Exception)):
        RayJobBackend(RayTarget(ray_head.address, None)).client.list_jobs()


def test_retry_attaches_then_next_attempt(ray_head, fault_plan, tmp_path):
    backend = RayJobBackend(RayTarget(ray_head.address, read_token(ray_head.token_file)))
    cfg = load_config(TINY, {"experiment": "rb-1", "storage.uri": f"file://{tmp_path}/store"})
    spec = UnitSpec("rb-1", "plan", 0)
    first = backend.submit(cfg, spec)
    again = backend.submit(cfg, spec)  # an Airflow retry while the first job is still live
    assert first.submitted and not again.submitted
    assert first.submission_id == again.submission_id == "vt-rb-1-e0-plan-a1"
    ids = [j.submission_id for j in backend.client.list_jobs() if j.submission_id.startswith("vt-rb-1-e0-plan-")]
    assert ids == ["vt-rb-1-e0-plan-a1"], ids
    assert backend.wait(first.submission_id, timeout_s=300) == "SUCCEEDED", backend.logs(first.submission_id)[-3000:]
    assert (tmp_path / "store/rb-1/epochs/00000/plan/_SUCCESS").is_file()
    done = backend.submit(cfg, spec)
    assert done.status == "SUCCEEDED" and not done.submitted
    # a failed attempt -> the next submission is attempt 2 (the test's fault hook in the Ray worker)
    spec_b = UnitSpec("rb-1", "rollout", 0, 1)
    fired = faults.fail_once(fault_plan, "rb-1", "rollout", 0, 1)
    failed = backend.submit(cfg, spec_b)
    assert backend.wait(failed.submission_id, timeout_s=120) == "FAILED"
    assert "injected fault" in backend.logs(failed.submission_id) and fired.exists()
    retry = backend.submit(cfg, spec_b)
    assert retry.submission_id == "vt-rb-1-e0-rollout-b1-a2" and retry.submitted
    assert backend.wait(retry.submission_id, timeout_s=300) == "SUCCEEDED"


def test_operator_defers_and_completes_through_the_trigger(ray_head, fault_plan, tmp_path, monkeypatch):
    from airflow.sdk.exceptions import TaskDeferred

    from verl_tasks.airflow.operators import VerlPhaseOperator
    from verl_tasks.errors import JobFailed

    for key, value in ray_head.client_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("VERL_TASKS_STORE_ROOT", str(tmp_path))
    faults.fail_once(fault_plan, "rb-2", "plan", 0)
    ctx = {"params": {"experiment": "rb-2"},
           "dag_run": SimpleNamespace(run_type="manual", logical_date=None, run_after=None, conf={})}
    op = VerlPhaseOperator(task_id="plan", config_path=TINY, phase="plan", epoch=0, backend="ray", ray_conn_id=None,
                           poll_interval=0.5)

    async def drain(trigger):
        async for event in trigger.run():
            return event.payload

    with pytest.raises(TaskDeferred) as deferred:
        op.execute(ctx)
    trigger = deferred.value.trigger
    assert trigger.serialize()[0] == "verl_tasks.airflow.triggers.RayJobTrigger"
    assert "token" not in str(trigger.serialize()[1]).lower()
    event = asyncio.run(drain(trigger))
    with pytest.raises(JobFailed) as failed:
        op.execute_complete(ctx, event, **deferred.value.kwargs)
    assert failed.value.submission_id == "vt-rb-2-e0-plan-a1" and "injected fault" in failed.value.log_tail
    started = time.monotonic()
    with pytest.raises(TaskDeferred) as deferred:  # the Airflow retry: attempt 2
        op.execute(ctx)
    event = asyncio.run(drain(deferred.value.trigger))
    out = op.execute_complete(ctx, event, **deferred.value.kwargs)
    assert out["unit"] == "rb-2/epochs/00000/plan" and event["submission_id"] == "vt-rb-2-e0-plan-a2"
    print(f"plan as a Ray job through the trigger: {time.monotonic() - started:.1f}s")
    assert op.execute(ctx)["attempt"] == out["attempt"]  # cleared later: returns from the marker
