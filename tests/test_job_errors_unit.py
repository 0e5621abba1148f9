"""Ray dashboard errors without Airflow: which ones ``RayJobBackend`` retries as transient."""
from __future__ import annotations

import time
from types import SimpleNamespace

from verl_tasks.execution import UnitSpec
from verl_tasks.execution.ray_jobs import RayJobBackend, RayTarget, is_transient

SUBMISSION_ID = "vt-tiny-arith-e0-rollout-b1-a1"
# What JobSubmissionClient raises when the head's call to the job agent fails: the agent's
# HTTP 400 (a duplicate id is a ValueError there) inside the head's HTTP 500 traceback.
NESTED_DUPLICATE = (
    "Request failed with status code 500: Traceback (most recent call last):\n"
    '  File "/usr/lib/python3.11/site-packages/ray/dashboard/modules/job/job_head.py", line 419, in submit_job\n'
    "    resp = await job_agent_client.submit_job_internal(submit_request)\n"
    '  File "/usr/lib/python3.11/site-packages/ray/dashboard/modules/job/job_head.py", line 150, '
    "in submit_job_internal\n"
    "    await self._raise_error(resp)\n"
    '  File "/usr/lib/python3.11/site-packages/ray/dashboard/modules/job/job_head.py", line 133, in _raise_error\n'
    '    raise RuntimeError(f"Request failed with status code {status}: {error_text}.")\n'
    "RuntimeError: Request failed with status code 400: Traceback (most recent call last):\n"
    '  File "/usr/lib/python3.11/site-packages/ray/dashboard/modules/job/job_agent.py", line 45, in submit_job\n'
    "    submission_id = await self.get_job_manager().submit_job(\n"
    '  File "/usr/lib/python3.11/site-packages/ray/dashboard/modules/job/job_manager.py", line 553, in submit_job\n'
    "    raise ValueError(\n"
    f"ValueError: Job with submission_id {SUBMISSION_ID} already exists. Please use a different submission_id.\n"
    ".\n."
)


def test_a_duplicate_submission_id_wrapped_in_a_500_is_not_transient():
    """Retried, it would end as RayUnavailable after the whole budget instead of attaching to the job."""
    err = RuntimeError(NESTED_DUPLICATE)
    assert not is_transient(err)
    try:
        raise RuntimeError("submit failed") from err
    except RuntimeError as wrapped:
        assert not is_transient(wrapped)


def test_a_plain_500_is_still_transient():
    assert is_transient(RuntimeError("Request failed with status code 500: No available agent to submit job, "
                                     "please try again later.."))


class _RacedHead:
    """A Jobs API where another retry of the unit submitted attempt 1 between our lookup and our submit."""

    def get_job_info(self, job_id):
        raise RuntimeError(f"Request failed with status code 404: Job {job_id} does not exist.")

    def submit_job(self, **kwargs):
        raise RuntimeError(NESTED_DUPLICATE)

    def get_job_status(self, job_id):
        return SimpleNamespace(value="RUNNING")


def test_submit_attaches_to_the_job_of_a_duplicate_id_at_once(tiny_config):
    backend = RayJobBackend(RayTarget("http://127.0.0.1:8265"), pool=False, retry_s=1.0)
    backend._client = _RacedHead()
    handle = backend.submit(tiny_config(), UnitSpec("tiny-arith", "rollout", 0, 1))
    assert (handle.submission_id, handle.status, handle.submitted) == (SUBMISSION_ID, "RUNNING", False)


class _FlakyStop:
    """A dashboard whose stop fails with an HTTP 503 ``failures`` times, then stops the live job."""

    def __init__(self, failures: int):
        self.failures, self.stopped = failures, []

    def stop_job(self, job_id):
        if self.failures:
            self.failures -= 1
            raise RuntimeError("Request failed with status code 503: Service Unavailable")
        self.stopped.append(job_id)
        return True


def test_a_stop_is_retried_through_a_flaky_dashboard_also_where_polls_are_not():
    """The trigger's backend retries nothing itself (retry_s=0): its on_kill's stop still must."""
    backend = RayJobBackend(RayTarget("http://127.0.0.1:8265"), pool=False, retry_s=0)
    backend._client = _FlakyStop(failures=2)
    assert backend.stop(SUBMISSION_ID) is True
    assert backend._client.stopped == [SUBMISSION_ID]


def test_an_overdue_job_that_cannot_be_stopped_is_not_joined_by_a_second_one(tiny_config, monkeypatch):
    """Past its timeout the live job is stopped before the next attempt is submitted; when the stop keeps
    failing, submit raises instead of leaving two live jobs of one unit."""
    import time

    from verl_tasks.execution import ray_jobs

    monkeypatch.setattr(ray_jobs, "STOP_RETRY_S", 0.5)
    cfg = tiny_config(**{"fault_tolerance.timeout_s": {"rollout": 1}})
    started_ms = (time.time() - 3600) * 1000

    class _HungJobHead(_FlakyStop):
        submitted: list = []

        def get_job_info(self, job_id):
            if job_id.endswith("-a1"):
                return SimpleNamespace(submission_id=job_id, status="RUNNING", start_time=started_ms)
            raise RuntimeError(f"Request failed with status code 404: Job {job_id} does not exist.")

        def submit_job(self, **kwargs):
            self.submitted.append(kwargs["submission_id"])

    backend = RayJobBackend(RayTarget("http://127.0.0.1:8265"), pool=False, retry_s=1.0)
    backend._client = _HungJobHead(failures=10_000)
    spec = UnitSpec(cfg.experiment, "rollout", 0, 1)
    try:
        backend.submit(cfg, spec)
    except ray_jobs.RayUnavailable as err:
        assert "stop" in str(err)
    else:
        raise AssertionError("submit went on although the overdue job could not be stopped")
    assert backend._client.submitted == []


class _OneLiveJob:
    """A Jobs API holding attempt 1 of the unit, RUNNING, submitted with ``store`` in its metadata."""

    def __init__(self, store):
        self.store, self.submitted = store, []

    def get_job_info(self, job_id):
        if job_id.endswith("-a1"):
            return SimpleNamespace(submission_id=job_id, status="RUNNING", start_time=time.time() * 1000,
                                   metadata={"verl_tasks_store": self.store})
        raise RuntimeError(f"Request failed with status code 404: Job {job_id} does not exist.")

    def submit_job(self, **kwargs):
        self.submitted.append(kwargs)


def test_a_live_job_of_the_same_unit_id_in_another_store_is_refused_not_joined(tiny_config, tmp_path):
    """Two deployments with one experiment name on one cluster: job ids collide, stores do not."""
    import pytest

    from verl_tasks.errors import ConfigError
    from verl_tasks.execution import store_identity

    staging = tiny_config(f"file://{tmp_path}/staging")
    production = tiny_config(f"file://{tmp_path}/production")
    spec = UnitSpec(staging.experiment, "rollout", 0, 1)
    backend = RayJobBackend(RayTarget("http://127.0.0.1:8265"), pool=False, retry_s=1.0)
    backend._client = _OneLiveJob(store_identity(staging))
    with pytest.raises(ConfigError, match="commits to another store .* give one of them another experiment name"):
        backend.submit(production, spec)
    assert backend._client.submitted == []
    attached = backend.submit(staging, spec)  # its own job: attached as before
    assert (attached.submission_id.endswith("-a1"), attached.submitted) == (True, False)
