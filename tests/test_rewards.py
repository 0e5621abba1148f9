"""Built-in scorers and the sandbox: exceptions, hangs, crashes and non-numbers get the default."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_tasks.errors import ConfigError
from verl_tasks.rewards.builtin import exact_answer, extract_gsm8k_answer, gsm8k
from verl_tasks.rewards.sandbox import RewardSandbox, check_reply

BAD = "tests.reward_fixtures"


def test_gsm8k_rule_matches_verl():
    assert extract_gsm8k_answer("so the total is #### $1,234") is None  # '$' is not in the pattern
    assert extract_gsm8k_answer("so the total is #### 1,234") == "1234"
    assert gsm8k("gsm8k", "work... #### 72", "72") == 1.0
    assert gsm8k("gsm8k", "work... #### 71", "72") == 0.0
    assert gsm8k("gsm8k", "#### 72" + " " * 400, "72") == 0.0  # only the last 300 characters count
    assert exact_answer("arith", " 47 ", "47") == 1.0


def _requests(*texts):
    return [
        {"id": f"s{i}", "data_source": "t", "solution_str": t, "ground_truth": "1", "extra_info": {}}
        for i, t in enumerate(texts)
    ]


def test_sandbox_defaults_for_raise_hang_crash_and_non_number():
    with RewardSandbox(f"{BAD}:misbehaving", timeout_s=1.0, memory_limit_mb=1024) as box:
        result = box.score(_requests("1", "raise", "hang", "crash", "string", "nan", "1"), default=-1.0)
    assert result.scores == [1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 1.0]
    assert set(result.failures) == {"s1", "s2", "s3", "s4", "s5"}
    assert "ValueError" in result.failures["s1"]
    assert "timed out" in result.failures["s2"]
    assert "crashed" in result.failures["s3"]
    assert "not a number" in result.failures["s4"]


def test_sandbox_memory_limit_stops_a_hog():
    with RewardSandbox(f"{BAD}:memory_hog", timeout_s=10.0, memory_limit_mb=300) as box:
        result = box.score(_requests("x"), default=0.0)
    assert result.scores == [0.0]
    assert "MemoryError" in result.failures["s0"] or "crashed" in result.failures["s0"]


def test_unloadable_reward_function_is_a_config_error():
    with pytest.raises(ConfigError, match="cannot be loaded"):
        RewardSandbox("no_such_module_xyz:fn", 1.0, 512).start()


def test_reward_function_sees_no_secrets_and_runs_in_a_temporary_folder(tmp_path, monkeypatch,
                                                                     allow_process_isolation):
    """With ``rewards.isolation: process`` (the function can write its report into the test's folder;
    the namespaced default is probed in tests/test_reward_sandbox.py, where no such folder exists)."""
    secret = "vt-reward-secret-5e1d"
    names = {"AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "RAY_AUTH_TOKEN", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN",
             "AIRFLOW_CONN_S3", "MY_SERVICE_PASSWORD", "OPENAI_API_KEY", "DB_SECRET"}
    for name in names:
        monkeypatch.setenv(name, secret)
    monkeypatch.setenv("VT_TEST_PLAIN_SETTING", "visible")
    report = tmp_path / "report.json"
    sample = _requests("1")[0] | {"extra_info": {"report": str(report)}}
    with RewardSandbox(f"{BAD}:environment_report", timeout_s=10.0, memory_limit_mb=1024, isolation="process") as box:
        workdir = box.workdir
        assert box.score([sample], default=-1.0).scores == [1.0]
    seen = json.loads(report.read_text())
    assert secret not in json.dumps(seen["env"])
    assert not names & set(seen["env"]) and not [k for k in seen["env"] if k.startswith(("AWS_", "RAY_"))]
    assert seen["env"]["VT_TEST_PLAIN_SETTING"] == "visible"  # ordinary settings still reach the function
    assert Path(seen["cwd"]).resolve() == Path(workdir).resolve() != Path.cwd().resolve()
    assert Path(seen["cwd"]).name.startswith("vt-reward-") and not Path(workdir).exists()  # removed on close


def test_malformed_replies_get_the_default_score():
    texts = ("bad-score", "1", "garbage", "1", "wrong-index", "1")
    with RewardSandbox(f"{BAD}:protocol_breaker", timeout_s=5.0, memory_limit_mb=1024) as box:
        result = box.score(_requests(*texts), default=-1.0)
    assert result.scores == [-1.0, 1.0, -1.0, 1.0, -1.0, 1.0]
    assert set(result.failures) == {"s0", "s2", "s4"}
    assert "not a finite number" in result.failures["s0"]
    assert "not JSON" in result.failures["s2"]
    assert "for sample 4" in result.failures["s4"]


@pytest.mark.parametrize("reply", [[1], {"i": 3, "score": 1.0}, {"i": True, "score": 1.0}, {"i": 1, "score": True},
                                   {"i": 1, "score": float("inf")}, {"i": 1}])
def test_check_reply_refuses_what_is_not_a_score_for_this_sample(reply):
    score, reason = check_reply(reply, 1)
    assert score is None and reason.startswith("malformed reply")


def test_warm_worker_survives_between_batches_and_a_crashed_or_hung_one_is_replaced():
    from verl_tasks.rewards.sandbox import warm_sandbox

    def batch(*texts):
        with warm_sandbox(f"{BAD}:misbehaving", 1.0, 1024) as box:
            result = box.score(_requests(*texts), default=-1.0)
            return result, box.proc.pid if box.proc else None

    first, pid = batch("1", "0", "1")
    again, same = batch("1", "1")
    assert (first.scores, again.scores) == ([1.0, 0.0, 1.0], [1.0, 1.0])
    assert same == pid, "the worker was not kept between batches"
    crashed, after_crash = batch("1", "crash", "1", "1")
    assert crashed.scores == [1.0, -1.0, 1.0, 1.0] and crashed.failures == {"s1": "worker crashed"}
    assert after_crash not in (None, pid), "the crashed worker was not replaced"
    hung, after_hang = batch("hang", "1")
    assert hung.scores == [-1.0, 1.0] and "timed out" in hung.failures["s0"]
    assert after_hang not in (None, after_crash), "the hung worker was not replaced"
    ok, kept = batch("1")
    assert ok.scores == [1.0] and kept == after_hang


def test_a_batch_larger_than_the_request_window_is_scored_in_order(monkeypatch):
    from verl_tasks.rewards import sandbox

    monkeypatch.setattr(sandbox, "WINDOW_BYTES", 400)  # a few requests per window
    texts = [str(i % 3) for i in range(40)] + ["raise"] + [str(i % 3) for i in range(20)]
    with RewardSandbox(f"{BAD}:misbehaving", timeout_s=5.0, memory_limit_mb=1024) as box:
        result = box.score(_requests(*texts), default=-1.0)
    expected = [1.0 if t == "1" else (-1.0 if t == "raise" else 0.0) for t in texts]
    assert result.scores == expected and set(result.failures) == {"s40"}
