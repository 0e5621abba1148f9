"""Errors across the Ray boundary: result line -> typed error; deterministic ones fail without retries."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import requests
from airflow.sdk.exceptions import AirflowFailException

from tests.airflow.conftest import DAGS
from verl_tasks.errors import (
    ConfigError,
    ConfigMismatch,
    DataError,
    IntegrityError,
    JobFailed,
    PhaseFailed,
    RewardFailureRate,
    SafeMode,
    ValidationFailed,
)
from verl_tasks.execution.outcome import error_from_result, failure_result, is_deterministic, parse_result
from verl_tasks.execution.ray_jobs import Backoff, is_transient, public_env

TINY = str(DAGS / "experiments" / "tiny_arith.yaml")
UNIT = "exp/epochs/00002/validate"


def _through_the_log(err: Exception) -> dict:
    """What the trigger reads back: the job's log with the result line last."""
    log = "\n".join(["2026-11-30 INFO running", "{not json", json.dumps(failure_result(err, UNIT)), ""])
    return parse_result(log)


@pytest.mark.parametrize("err", [
    ConfigError("rewards.function 'x:y' cannot be loaded"),
    ConfigMismatch("exp", ["algorithm.lr"], "file:///s/exp"),
    DataError("data.train has 3 prompts"),
    ValidationFailed(UNIT, "2 expectations failed"),
    RewardFailureRate("exp/epochs/00002/score/b0001", "9/16 samples could not be scored"),
    IntegrityError("exp/snapshots/00002", ["model.safetensors: sha256 differs"]),
    SafeMode("experiment 'exp' is in safe mode"),
])
def test_result_line_rebuilds_the_same_typed_error(err):
    result = _through_the_log(err)
    assert result["ok"] is False and result["unit"] == UNIT
    assert result["error"]["module"] == "verl_tasks.errors" and result["error"]["type"] == type(err).__name__
    rebuilt = error_from_result(result)
    assert type(rebuilt) is type(err) and str(rebuilt) == str(err)
    public = {k: v for k, v in vars(err).items() if not k.startswith("_")}
    assert {k: getattr(rebuilt, k) for k in public} == public


@pytest.mark.parametrize("error", [
    {"type": "RuntimeError", "module": "builtins", "message": "boom"},
    {"type": "ConfigError", "module": "os", "message": "a name from elsewhere is never imported"},
    {"type": "system", "module": "verl_tasks.errors", "message": "not a class of the registry"},
    {"type": "annotations", "module": "verl_tasks.errors", "message": "a module attribute that is no error"},
    "RuntimeError: an old-style string",
])
def test_unknown_classes_are_not_rebuilt(error):
    assert error_from_result({"ok": False, "error": error}) is None


def test_only_configuration_gate_and_safe_mode_errors_are_deterministic():
    assert all(is_deterministic(e) for e in (ConfigMismatch("e", ["k"], "u"), DataError("d"),
                                             ValidationFailed("u", "r"), SafeMode("s")))
    assert not any(is_deterministic(e) for e in (RewardFailureRate("u", "r"), PhaseFailed("u", "r"),
                                                 IntegrityError("u", ["p"]), JobFailed("j", "FAILED"), MemoryError()))


def _op(phase="validate"):
    from verl_tasks.airflow.operators import VerlPhaseOperator

    return VerlPhaseOperator(task_id=phase, config_path=TINY, phase=phase, epoch=2, backend="ray", ray_conn_id=None)


def _event(err: Exception | None, status="FAILED", **extra):
    return {"status": status, "submission_id": "vt-exp-e2-validate-a1", "log_tail": "tail line",
            "result": failure_result(err, UNIT) if err else None, **extra}


def test_deterministic_job_error_fails_the_task_without_retries():
    with pytest.raises(AirflowFailException) as failed:
        _op().execute_complete({}, _event(ConfigMismatch("exp", ["algorithm.lr"], "file:///s/exp")))
    cause = failed.value.__cause__
    assert isinstance(cause, ConfigMismatch) and cause.differing_keys == ["algorithm.lr"]
    assert UNIT in str(failed.value) and "vt-exp-e2-validate-a1" in str(failed.value)
    assert isinstance(cause.__cause__, JobFailed) and cause.__cause__.log_tail == "tail line"


def test_transient_job_error_is_raised_typed_for_airflow_to_retry():
    with pytest.raises(RewardFailureRate) as failed:
        _op().execute_complete({}, _event(RewardFailureRate(UNIT, "9/16 samples could not be scored")))
    assert failed.value.unit == UNIT and isinstance(failed.value.__cause__, JobFailed)


def test_untyped_or_unreachable_job_raises_job_failed_with_the_job_id():
    with pytest.raises(JobFailed, match="vt-exp-e2-validate-a1 ended FAILED"):
        _op().execute_complete({}, _event(MemoryError("oom")))
    with pytest.raises(JobFailed, match="UNREACHABLE .*last error: ConnectionResetError") as failed:
        _op().execute_complete({}, _event(None, status="UNREACHABLE",
                                          error="Ray dashboard failed for 120s; last error: ConnectionResetError"))
    assert failed.value.submission_id == "vt-exp-e2-validate-a1"


def test_inline_backend_fails_deterministic_errors_without_retries(tmp_path, monkeypatch):
    from verl_tasks.airflow.operators import ConfigureExperimentOperator, VerlPhaseOperator

    monkeypatch.setenv("VERL_TASKS_STORE_ROOT", str(tmp_path))

    def ctx(**params):
        run = SimpleNamespace(run_type="manual", conf={}, logical_date=None, run_after=None)
        return {"params": params, "dag_run": run}

    ConfigureExperimentOperator(task_id="configure", config_path=TINY).execute(ctx(experiment="inl", lr=0.001))
    op = VerlPhaseOperator(task_id="validate", config_path=TINY, phase="validate", epoch=0, backend="inline")
    with pytest.raises(AirflowFailException, match="inl/epochs/00000/validate: ConfigMismatch") as failed:
        op.execute(ctx(experiment="inl", lr=0.005))
    assert failed.value.__cause__.differing_keys == ["algorithm.lr"]


@pytest.mark.parametrize("err", [ConnectionResetError(104, "reset"), requests.ConnectionError("refused"),
                                 requests.ReadTimeout("slow"),
                                 RuntimeError("Request failed with status code 503: busy"),
                                 RuntimeError("Request failed with status code 500: No available agent to submit job")])
def test_dashboard_blips_are_transient(err):
    assert is_transient(err)
    try:
        raise RuntimeError("wrapped") from err
    except RuntimeError as wrapped:
        assert is_transient(wrapped)


@pytest.mark.parametrize("err", [
    RuntimeError("Request failed with status code 404: job not found"),
    RuntimeError("Request failed with status code 400: Please use a different submission_id"),
    ValueError("bad"), ConfigError("x"),
])
def test_refusals_are_not_transient(err):
    assert not is_transient(err)


def test_backoff_doubles_and_stops_at_the_budget():
    backoff = Backoff(budget_s=100.0, first_s=0.5, max_s=4.0)
    assert [backoff.next_delay() for _ in range(5)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert Backoff(budget_s=0.0).next_delay() is None
    backoff.reset()
    assert backoff.next_delay() == 0.5


def test_secrets_are_refused_in_a_job_environment():
    assert public_env({"VERL_TASKS_S3_ENDPOINT": "http://minio:9000"}) == {"VERL_TASKS_S3_ENDPOINT": "http://minio:9000"}
    for name in ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "RAY_AUTH_TOKEN", "HF_TOKEN", "DB_PASSWORD"):
        with pytest.raises(ConfigError, match=name):
            public_env({name: "x"})


def test_a_bad_trigger_form_fails_a_phase_task_without_retries(tmp_path, monkeypatch):
    from verl_tasks.airflow.operators import VerlPhaseOperator

    monkeypatch.setenv("VERL_TASKS_STORE_ROOT", str(tmp_path))
    op = VerlPhaseOperator(task_id="plan", config_path=TINY, phase="plan", epoch=0, backend="inline")
    bad = {"params": {"experiment": "../escape"},
           "dag_run": SimpleNamespace(run_type="manual", conf={}, logical_date=None, run_after=None)}
    with pytest.raises(AirflowFailException, match="task plan: ConfigError") as failed:
        op.execute(bad)
    assert isinstance(failed.value.__cause__, ConfigError)


def test_job_logs_shown_in_airflow_carry_no_config_blob():
    """The job's entrypoint line names the config by its length, not as hundreds of base64 characters."""
    from verl_tasks.execution.ray_jobs import log_tail, redact_config

    line = ("Running entrypoint for job vt-x-e0-plan-a1: python -m verl_tasks.execution.entry --config-b64 "
            + "eyJ" * 200 + " --phase plan")
    assert redact_config(line).endswith("--config-b64 <config, 600 chars> --phase plan")
    assert "eyJeyJ" not in log_tail("first\n" + line)


def test_a_deferral_past_its_timeout_stops_the_units_live_ray_job(tmp_path, monkeypatch):
    """Airflow resumes a timed-out deferral with ``__fail__`` and calls no on_kill: the operator stops the
    unit's live job itself (its driver then fences the attempt), and the task still fails as a timeout."""
    from airflow.sdk.bases.operator import TriggerFailureReason
    from airflow.sdk.exceptions import TaskDeferralError, TaskDeferralTimeout

    from verl_tasks.execution.ray_jobs import JobHandle

    monkeypatch.setenv("VERL_TASKS_STORE_ROOT", str(tmp_path))
    stopped: list[str] = []
    jobs = [JobHandle("vt-inl-e2-rollout-b1-a1", "FAILED", 1, False),
            JobHandle("vt-inl-e2-rollout-b1-a2", "RUNNING", 2, False)]
    op = _op("rollout")
    op.__dict__["ray"] = SimpleNamespace(unit_jobs=lambda spec: jobs, stop=lambda job_id: stopped.append(job_id))
    context = {"params": {"experiment": "inl"},
               "dag_run": SimpleNamespace(run_type="manual", conf={}, logical_date=None, run_after=None)}
    with pytest.raises(TaskDeferralError):  # the trigger failed (not the timeout): the retry attaches to the job
        op.resume_execution("__fail__", {"error": TriggerFailureReason.TRIGGER_FAILURE}, context)
    assert stopped == []
    with pytest.raises(TaskDeferralTimeout):
        op.resume_execution("__fail__", {"error": TriggerFailureReason.TRIGGER_TIMEOUT}, context)
    assert stopped == ["vt-inl-e2-rollout-b1-a2"]
