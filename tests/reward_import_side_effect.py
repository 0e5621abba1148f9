"""A reward module with a side effect at import: it appends a line to $VT_SIDE_EFFECT_FILE.

tests/test_reward_sandbox.py checks that parsing a config naming it does not import it.
"""
from __future__ import annotations

import os

_PATH = os.environ.get("VT_SIDE_EFFECT_FILE")
if _PATH:
    try:
        with open(_PATH, "a") as _handle:
            _handle.write(f"imported by pid {os.getpid()}\n")
    except OSError:  # inside the sandbox the test's folder does not exist
        pass


def compute_score(data_source, solution_str, ground_truth, extra_info):
    return 1.0 if solution_str == ground_truth else 0.0
