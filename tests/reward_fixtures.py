"""Reward functions that misbehave on purpose (used by the sandbox and chaos tests)."""
from __future__ import annotations

import os
import time


def misbehaving(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "raise":
        raise ValueError("boom")
    if solution_str == "hang":
        time.sleep(60)
    if solution_str == "crash":
        os._exit(9)
    if solution_str == "string":
        return "1.0"
    if solution_str == "nan":
        return float("nan")
    return 1.0 if solution_str == ground_truth else 0.0


def memory_hog(data_source, solution_str, ground_truth, extra_info):
    blob = bytearray(2 << 30)
    return float(len(blob))


def always_raises(data_source, solution_str, ground_truth, extra_info):
    raise RuntimeError("reward service unavailable")


def flaky(data_source, solution_str, ground_truth, extra_info):
    """Raises for one sample in ten (by a stable hash of the text); otherwise exact answer."""
    if sum(map(ord, solution_str + str(extra_info))) % 10 == 0:
        raise RuntimeError("flaky")
    return 1.0 if solution_str.strip() == ground_truth else 0.0


def env_switch(data_source, solution_str, ground_truth, extra_info):
    """Exact answer, but raises for every sample while VT_TEST_REWARD_FAIL is set (fault injection)."""
    if os.environ.get("VT_TEST_REWARD_FAIL"):
        raise RuntimeError("injected reward failure")
    return 1.0 if solution_str.strip() == ground_truth else 0.0
