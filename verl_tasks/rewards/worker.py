"""The sandboxed scoring process: reads JSON requests on stdin, answers on a private fd.

Run as ``python -m verl_tasks.rewards.worker FUNCTION_PATH FD`` by
:class:`verl_tasks.rewards.sandbox.RewardSandbox`, which gives it an environment
without secrets and a temporary working directory. The reward function's own
prints go to stderr, so they cannot corrupt the protocol; replies are checked by
the parent anyway (the function could write to the fd).
"""
from __future__ import annotations

import importlib
import json
import math
import os
import sys


def load_function(path: str):
    module_name, _, attr = path.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr)


def to_score(value) -> float:
    if isinstance(value, dict):
        value = value.get("score")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"returned {type(value).__name__}, not a number")
    if not math.isfinite(value):
        raise ValueError(f"returned {value}")
    return float(value)


def main() -> None:
    path, fd = sys.argv[1], int(sys.argv[2])
    out = os.fdopen(fd, "w", buffering=1)
    sys.stdout = sys.stderr
    try:
        fn = load_function(path)
    except Exception as err:  # noqa: BLE001 - reported to the parent as a load failure
        out.write(json.dumps({"load_error": f"{type(err).__name__}: {err}"}) + "\n")
        return
    out.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        try:
            score = to_score(fn(req["data_source"], req["solution_str"], req["ground_truth"], req["extra_info"]))
            out.write(json.dumps({"i": req["i"], "score": score}) + "\n")
        except Exception as err:  # noqa: BLE001 - one bad sample must not stop the batch
            out.write(json.dumps({"i": req["i"], "error": f"{type(err).__name__}: {err}"[:300]}) + "\n")


if __name__ == "__main__":
    main()
