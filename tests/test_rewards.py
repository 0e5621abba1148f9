"""Built-in scorers and the sandbox: exceptions, hangs, crashes and non-numbers get the default."""
from __future__ import annotations

import pytest

from verl_tasks.errors import ConfigError
from verl_tasks.rewards.builtin import exact_answer, extract_gsm8k_answer, gsm8k
from verl_tasks.rewards.sandbox import RewardSandbox

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
