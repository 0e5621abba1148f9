"""The Ray backend against a real local Ray head (token auth on): ids, attach, next attempt, deferral,
typed errors across the job boundary, dashboard blips, and no credentials on the Ray side."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.airflow.conftest import DAGS
from tests.airflow.dashboard_proxy import DashboardProxy
from verl_tasks.config import load_config
from verl_tasks.execution import UnitSpec
from verl_tasks.execution.outcome import parse_result
from verl_tasks.execution.ray_jobs import RayJobBackend, RayTarget, RayUnavailable, read_token, submission_id

pytestmark = pytest.mark.slow
TINY = str(DAGS / "experiments" / "tiny_arith.yaml")
SECRET_ID = "AKIAVTH3RAYSIDE0001"
SECRET = "vt-h3-secret-7c2e9b-never-on-ray"


def _backend(ray_head, **kwargs) -> RayJobBackend:
    return RayJobBackend(RayTarget(ray_head.address, read_token(ray_head.token_file)), **kwargs)


def _pinned(cfg):
    """Pin ``cfg`` in its store, as the configure task does before any unit is submitted; pinning publishes the
    run's config, which a job reads by its digest (``entry.pinned_config``)."""
    from verl_tasks.layout import Layout
    from verl_tasks.pinning import pin_experiment
    from verl_tasks.store import store_for

    pin_experiment(SimpleNamespace(config=cfg, store=store_for(cfg), layout=Layout(cfg.experiment)))
    return cfg


def _ctx(**params):
    return {"params": params, "dag_run": SimpleNamespace(run_type="manual", conf={}, logical_date=None, run_after=None)}


def _drain(trigger) -> dict:
    async def first():
        async for event in trigger.run():
            return event.payload

    return asyncio.run(first())


@pytest.fixture
def client_env(ray_head, tmp_path, monkeypatch):
    for key, value in ray_head.client_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("VERL_TASKS_STORE_ROOT", str(tmp_path))
    return tmp_path


def test_submission_ids_are_deterministic():
    assert submission_id(UnitSpec("tiny-arith", "rollout", 3, 7), 2) == "vt-tiny-arith-e3-rollout-b7-a2"
    assert submission_id(UnitSpec("x", "update", 0), 1) == "vt-x-e0-update-a1"


def test_without_token_the_head_refuses(ray_head):
    with pytest.raises(RayUnavailable, match="token"):
        RayJobBackend(RayTarget(ray_head.address, None)).client.list_jobs()


def test_retry_attaches_then_next_attempt(ray_head, tmp_path):
    backend = _backend(ray_head)
    cfg = load_config(TINY, {"experiment": "rb-1", "storage.uri": f"file://{tmp_path}/store"})
    spec = UnitSpec("rb-1", "plan", 0)
    blocker = tmp_path / "store" / "rb-1" / "data"  # a file where the prompts' folder must go: a real failure
    blocker.parent.mkdir(parents=True)
    blocker.write_text("not a folder")
    _pinned(cfg)
    first = backend.submit(cfg, spec)
    again = backend.submit(cfg, spec)  # an Airflow retry while the first job is still live
    assert first.submitted and not again.submitted
    assert first.submission_id == again.submission_id == "vt-rb-1-e0-plan-a1"
    ids = [j.submission_id for j in backend.client.list_jobs() if j.submission_id.startswith("vt-rb-1-e0-plan-")]
    assert ids == ["vt-rb-1-e0-plan-a1"], ids
    assert backend.wait(first.submission_id, timeout_s=300) == "FAILED"
    result = parse_result(backend.logs(first.submission_id))
    assert result["ok"] is False and result["unit"] == "rb-1/epochs/00000/plan" and result["error"]["type"], result
    blocker.unlink()
    retry = backend.submit(cfg, spec)  # the newest job failed -> attempt 2
    assert retry.submission_id == "vt-rb-1-e0-plan-a2" and retry.submitted
    assert backend.wait(retry.submission_id, timeout_s=300) == "SUCCEEDED", backend.logs(retry.submission_id)[-3000:]
    assert parse_result(backend.logs(retry.submission_id))["ok"] is True
    assert (tmp_path / "store/rb-1/epochs/00000/plan/_SUCCESS").is_file()
    done = backend.submit(cfg, spec)
    assert done.status == "SUCCEEDED" and not done.submitted


def test_a_job_that_reserved_no_gpu_sees_none(ray_head, tmp_path):
    """Without pools the unit runs in the job's own process, which Ray leaves every GPU of its node
    unless it reserved some: one that reserved none is given ``CUDA_VISIBLE_DEVICES=""``."""
    backend = _backend(ray_head, pool=False)
    cfg = _pinned(load_config(TINY, {"experiment": "rb-gpu", "storage.uri": f"file://{tmp_path}/store"}))
    job = backend.submit(cfg, UnitSpec("rb-gpu", "plan", 0))
    assert backend.wait(job.submission_id, timeout_s=300) == "SUCCEEDED", backend.logs(job.submission_id)[-3000:]
    info = backend.client.get_job_info(job.submission_id)
    assert info.runtime_env["env_vars"]["CUDA_VISIBLE_DEVICES"] == ""


def test_a_job_gets_its_config_by_reference(ray_head, tmp_path):
    """The Jobs API shows a job's entrypoint, runtime_env and metadata to every token holder: they name the
    store, the experiment and the config's digests, never the tracking URI, the KMS key id or the config
    itself; the job reads its run's config from the store and still runs its unit."""
    tracking, kms = "http://mlflow.vt-internal.example:5000", "arn:aws:kms:eu-west-1:1:key/vt-kms-never-on-ray"
    backend = _backend(ray_head, pool=False)
    cfg = _pinned(load_config(TINY, {"experiment": "rb-ref", "storage.uri": f"file://{tmp_path}/store",
                                     "storage.sse_kms_key_id": kms, "tracking.mlflow": tracking}))
    job = backend.submit(cfg, UnitSpec("rb-ref", "plan", 0))
    assert backend.wait(job.submission_id, timeout_s=300) == "SUCCEEDED", backend.logs(job.submission_id)[-3000:]
    assert parse_result(backend.logs(job.submission_id))["ok"] is True
    assert (tmp_path / "store/rb-ref/epochs/00000/plan/_SUCCESS").is_file()
    info = backend.client.get_job_info(job.submission_id)
    shown = json.dumps([info.entrypoint, info.runtime_env, info.metadata], default=str)
    for text in (tracking, "mlflow.vt-internal", kms, "vt-kms", "--config-b64"):
        assert text not in shown, text
    assert cfg.config_hash() in info.entrypoint and "--experiment rb-ref" in info.entrypoint
    assert len(info.entrypoint) < 600  # no encoded config


def test_deterministic_job_error_fails_the_task_without_retries(client_env):
    from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

    from verl_tasks.airflow.operators import ConfigureExperimentOperator, VerlPhaseOperator
    from verl_tasks.errors import ConfigMismatch, JobFailed

    ConfigureExperimentOperator(task_id="configure", config_path=TINY).execute(_ctx(experiment="rb-3", lr=0.001))
    op = VerlPhaseOperator(task_id="validate", config_path=TINY, phase="validate", epoch=0, backend="ray",
                           ray_conn_id=None, poll_interval=0.5)
    changed = _ctx(experiment="rb-3", lr=0.005)  # the YAML was edited after the experiment was pinned
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(changed)
    event = _drain(deferred.value.trigger)
    assert event["status"] == "FAILED" and event["result"]["error"]["type"] == "ConfigMismatch", event
    with pytest.raises(AirflowFailException, match="rb-3/epochs/00000/validate") as failed:
        op.execute_complete(changed, event, **deferred.value.kwargs)
    cause = failed.value.__cause__
    assert isinstance(cause, ConfigMismatch) and cause.differing_keys == ["algorithm.lr"]
    assert isinstance(cause.__cause__, JobFailed) and cause.__cause__.submission_id == "vt-rb-3-e0-validate-a1"


LIST_WORKERS = """
import json, sys
from ray.util.state import list_actors
alive = list_actors(address=sys.argv[1], filters=[("class_name", "=", "PoolWorker"), ("state", "=", "ALIVE")])
print(json.dumps([actor.pid for actor in alive]))
"""


def _resident_worker_environments(ray_head) -> list[bytes]:
    """The environment of every live PoolWorker actor of this head, read from /proc.

    The state API is asked from a fresh process: Ray reads its token settings once per process.
    """
    env = {**os.environ, **ray_head.client_env(), "RAY_AUTH_MODE": "token"}
    out = subprocess.run([sys.executable, "-c", LIST_WORKERS, ray_head.address], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    return [Path(f"/proc/{pid}/environ").read_bytes() for pid in json.loads(out.strip().splitlines()[-1])]


def test_operator_defers_and_completes_without_sending_credentials(client_env, ray_head, monkeypatch):
    """An AWS connection with keys exists on the Airflow side only; nothing on the Ray side may show them."""
    from airflow.sdk.exceptions import TaskDeferred

    from verl_tasks.airflow.operators import ConfigureExperimentOperator, VerlPhaseOperator

    monkeypatch.setenv("AIRFLOW_CONN_VT_SECRET_S3", json.dumps({"conn_type": "aws", "login": SECRET_ID,
                                                                "password": SECRET}))
    ctx = _ctx(experiment="rb-2")
    ConfigureExperimentOperator(task_id="configure", config_path=TINY).execute(ctx)  # pins: jobs read the pin
    op = VerlPhaseOperator(task_id="plan", config_path=TINY, phase="plan", epoch=0, backend="ray", ray_conn_id=None,
                           aws_conn_id="vt_secret_s3", poll_interval=0.5)
    assert op.resolve(ctx)[1].credentials["aws_secret_access_key"] == SECRET  # the Airflow side has the keys
    started = time.monotonic()
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(ctx)
    trigger = deferred.value.trigger
    assert trigger.serialize()[0] == "verl_tasks.airflow.triggers.RayJobTrigger"
    assert "token" not in str(trigger.serialize()[1]).lower() and SECRET not in str(trigger.serialize()[1])
    event = _drain(trigger)
    out = op.execute_complete(ctx, event, **deferred.value.kwargs)
    assert out["unit"] == "rb-2/epochs/00000/plan" and event["submission_id"] == "vt-rb-2-e0-plan-a1"
    print(f"plan as a Ray job through the trigger: {time.monotonic() - started:.1f}s")
    assert op.execute(ctx)["attempt"] == out["attempt"]  # cleared later: returns from the marker

    client = _backend(ray_head).client  # a plain JobSubmissionClient with the token
    jobs = client.list_jobs()
    assert any(job.submission_id == "vt-rb-2-e0-plan-a1" for job in jobs)
    details = json.dumps([client.get_job_info(job.submission_id).dict() for job in jobs if job.submission_id] +
                         [job.dict() for job in jobs], default=str)
    for text in (SECRET, SECRET_ID):
        assert text not in details  # entrypoint, runtime_env, metadata, message of every job
    environments = _resident_worker_environments(ray_head)
    assert environments, "no PoolWorker actor found"
    assert not any(SECRET.encode() in env or SECRET_ID.encode() in env for env in environments)


def test_dashboard_blips_are_retried_by_submit_and_the_trigger(client_env, ray_head, monkeypatch, capsys):
    from verl_tasks.airflow.triggers import RayJobTrigger

    token = read_token(ray_head.token_file)
    job_id = f"vt-blips-{int(time.time())}"
    with DashboardProxy(ray_head.address) as proxy:
        monkeypatch.setenv("VERL_TASKS_RAY_ADDRESS", proxy.url)
        backend = RayJobBackend(RayTarget(proxy.url, token), retry_s=60)
        proxy.fail_next(4)  # the client's version check and the submission meet resets and 503s
        backend._submit_job(job_id, entrypoint="echo vt-blip-first && sleep 3 && echo vt-blip-last")
        assert proxy.injected == {"reset": 2, "503": 2}
        proxy.fail_next(4)
        capsys.readouterr()
        trigger = RayJobTrigger(job_id, None, poll_interval=0.3, retry_s=60, log_every_s=0.5)
        event = _drain(trigger)
    assert event["status"] == "SUCCEEDED" and proxy.injected == {"reset": 4, "503": 4}, (event, proxy.injected)
    task_log = capsys.readouterr().out  # the triggerer's log (structlog writes to stdout)
    assert task_log.count(f"polling job {job_id} failed transiently") == 4
    assert task_log.count(f"[{job_id}] vt-blip-first ") == 1  # incremental: no line is logged twice
    assert "vt-blip-last" in event["log_tail"]


def test_after_the_bound_the_task_fails_naming_the_job(client_env, ray_head, monkeypatch):
    from verl_tasks.airflow.operators import VerlPhaseOperator
    from verl_tasks.airflow.triggers import RayJobTrigger
    from verl_tasks.errors import JobFailed

    job_id = "vt-rb-4-e0-plan-a1"
    with DashboardProxy(ray_head.address) as proxy:
        proxy.down = True
        monkeypatch.setenv("VERL_TASKS_RAY_ADDRESS", proxy.url)
        started = time.monotonic()
        event = _drain(RayJobTrigger(job_id, None, poll_interval=0.2, retry_s=3))
        waited = time.monotonic() - started
        with pytest.raises(RayUnavailable, match="still failing after 2s"):
            RayJobBackend(RayTarget(proxy.url, read_token(ray_head.token_file)), retry_s=2).status(job_id)
    assert event["status"] == "UNREACHABLE" and job_id in event["error"] and "last error" in event["error"], event
    assert 3 <= waited < 30, waited
    op = VerlPhaseOperator(task_id="plan", config_path=TINY, phase="plan", epoch=0, backend="ray", ray_conn_id=None)
    with pytest.raises(JobFailed, match=f"{job_id} ended UNREACHABLE") as failed:
        op.execute_complete(_ctx(experiment="rb-4"), event)
    assert failed.value.submission_id == job_id
