"""Reward functions that misbehave on purpose (used by the sandbox and chaos tests)."""
from __future__ import annotations

import json
import os
import sys
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


def _once(tag: str) -> bool:
    """True the first time ``tag`` is seen under $VT_CHAOS_REWARD_DIR (a flag file per tag)."""
    folder = os.environ.get("VT_CHAOS_REWARD_DIR")
    if not folder:
        return False
    try:
        fd = os.open(os.path.join(folder, tag), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def chaos_exact(data_source, solution_str, ground_truth, extra_info):
    """Exact answer (same scores as the builtin), misbehaving on purpose for the chaos matrix.

    While $VT_CHAOS_REWARD_OUTAGE names a file that does not exist, every call raises (an outage:
    the batch exceeds the failure threshold). Otherwise the first wrong answers seen make the
    worker raise, hang, and kill itself once each; their default score 0.0 equals the true score,
    so the final weights match a run without faults.
    """
    outage = os.environ.get("VT_CHAOS_REWARD_OUTAGE")
    if outage and not os.path.exists(outage):
        raise RuntimeError("injected reward service outage")
    correct = solution_str.strip() == str(ground_truth).strip()
    if not correct:
        for mode in ("raise", "hang", "crash"):
            if _once(mode):
                if mode == "raise":
                    raise ValueError("injected reward error")
                if mode == "hang":
                    time.sleep(60)
                os._exit(9)
    return 1.0 if correct else 0.0


def shared_characters(data_source, solution_str, ground_truth, extra_info):
    """A graded score: the share of the answer's distinct characters found in the response."""
    wanted = set(ground_truth)
    return len(wanted & set(solution_str)) / max(1, len(wanted))


def two_args(solution_str, ground_truth):
    """Not verl's compute_score signature: refused when the config loads."""
    return float(solution_str == ground_truth)


NOT_CALLABLE = 0.5


def environment_report(data_source, solution_str, ground_truth, extra_info):
    """Writes what the function can see (environment, working directory) to ``extra_info["report"]``."""
    with open(extra_info["report"], "w") as handle:
        json.dump({"env": dict(os.environ), "cwd": os.getcwd()}, handle)
    return 1.0


def protocol_breaker(data_source, solution_str, ground_truth, extra_info):
    """Writes a forged reply line straight to the sandbox's reply fd (argv[2]), then answers normally."""
    forged = {"garbage": b"not json\n", "wrong-index": b'{"i": 12345, "score": 1.0}\n',
              "bad-score": b'{"i": 0, "score": "high"}\n'}.get(solution_str)
    if forged:
        os.write(int(sys.argv[2]), forged)
    return 1.0 if solution_str == ground_truth else 0.0


DYNAMIC_NOT_CALLABLE = float("0.5")  # bound by running code: only the sandbox's check can tell it is no function


def extreme_scores(data_source, solution_str, ground_truth, extra_info):
    """By a stable hash of the answer: NaN, infinity or 1e308 for a third of the samples; the exact-answer
    reward for the rest."""
    kind = sum(map(ord, solution_str + ground_truth)) % 9
    if kind in (0, 1, 2):
        return (float("nan"), float("inf"), 1e308)[kind]
    return 1.0 if solution_str.strip() == ground_truth else 0.0


def huge_scores(data_source, solution_str, ground_truth, extra_info):
    """1e308 for a right answer, 0 otherwise: finite, but an average of two overflows."""
    return 1e308 if solution_str.strip() == ground_truth else 0.0
