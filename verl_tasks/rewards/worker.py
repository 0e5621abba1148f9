"""The sandboxed scoring process: reads JSON requests on stdin, answers on a private fd.

Run as ``python -m verl_tasks.rewards.worker FUNCTION_PATH FD LIMITS_JSON`` by
:class:`verl_tasks.rewards.sandbox.RewardSandbox`, inside the sandbox it built. Before the
reward function's module is imported, the worker sets its limits (they hold for every process
the function starts, too): the process count (``RLIMIT_NPROC``, when asked), no core files,
and CPU time. CPU time has two levels: each sample may use ``cpu_s`` seconds (a soft
``RLIMIT_CPU`` renewed per sample; ``SIGXCPU`` stops the function with a named error), and no
process may use more than ``cpu_cap_s`` in all (the hard limit, which cannot be raised again:
a runaway child dies there). The worker itself answers ``"retire": true`` and exits before it
would reach that cap, and the sandbox starts a fresh one.

Then it imports and checks the function (:func:`verl_tasks.rewards.checks.load_reward_function`)
and says hello, or says why not. The function's own prints go to stderr, so they cannot corrupt
the protocol; replies are checked by the parent anyway (the function could write to the fd).
"""
from __future__ import annotations

import errno
import json
import math
import os
import resource
import signal
import sys
from typing import TYPE_CHECKING

from verl_tasks.rewards.checks import RewardFunctionError, load_reward_function

if TYPE_CHECKING:
    from typing import Any


class CPUTimeExceeded(BaseException):
    """Raised in the reward function by SIGXCPU (a BaseException, so ``except Exception`` cannot keep it going)."""


def to_score(value) -> float:
    if isinstance(value, dict):
        value = value.get("score")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"returned {type(value).__name__}, not a number")
    if not math.isfinite(value):
        raise ValueError(f"returned {value}")
    return float(value)


def cpu_used() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Limits:
    """The worker's limits (from the parent's LIMITS_JSON) and the per-sample CPU budget."""

    def __init__(self, spec: dict[str, Any]):
        self.cpu_s = int(spec.get("cpu_s", 0))
        self.cpu_cap_s = int(spec.get("cpu_cap_s", 0))
        self.max_processes = spec.get("max_processes")  # for messages
        self.nproc = spec.get("nproc")  # RLIMIT_NPROC, when it applies (see verl_tasks.rewards.isolation)
        self.memory_mb = spec.get("memory_mb")

    def apply(self) -> None:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if self.nproc:
            resource.setrlimit(resource.RLIMIT_NPROC, (self.nproc, self.nproc))
        if self.cpu_cap_s:
            resource.setrlimit(resource.RLIMIT_CPU, (self.cpu_cap_s, self.cpu_cap_s))
            signal.signal(signal.SIGXCPU, _on_sigxcpu)

    def start_sample(self) -> None:
        if self.cpu_s:
            soft = min(math.ceil(cpu_used()) + self.cpu_s, self.cpu_cap_s)
            resource.setrlimit(resource.RLIMIT_CPU, (soft, self.cpu_cap_s))

    def end_sample(self) -> None:
        if self.cpu_s:
            resource.setrlimit(resource.RLIMIT_CPU, (self.cpu_cap_s, self.cpu_cap_s))

    def should_retire(self) -> bool:
        """Whether the next sample could not get its full CPU budget under the hard cap."""
        return bool(self.cpu_s) and cpu_used() + self.cpu_s + 1 >= self.cpu_cap_s

    def explain(self, err: BaseException) -> str:
        """The reply's error text: the exception, and which limit stopped it when one did."""
        if isinstance(err, CPUTimeExceeded):
            return f"CPU time limit exceeded: more than {self.cpu_s}s of CPU for one sample (rewards.cpu_limit_s)"
        text = f"{type(err).__name__}: {err}"
        if isinstance(err, MemoryError) and self.memory_mb:
            text += f" (rewards.memory_limit_mb={self.memory_mb})"
        elif isinstance(err, OSError) and err.errno == errno.EAGAIN and self.max_processes:
            text += f" (the sandbox allows {self.max_processes} processes and threads: rewards.max_processes)"
        return text


def _on_sigxcpu(signum, frame) -> None:
    raise CPUTimeExceeded()


def main() -> None:
    path, fd = sys.argv[1], int(sys.argv[2])
    limits = Limits(json.loads(sys.argv[3]) if len(sys.argv) > 3 else {})
    out = os.fdopen(fd, "w", buffering=1)
    sys.stdout = sys.stderr
    limits.apply()
    try:
        fn = load_reward_function(path)
    except RewardFunctionError as err:
        out.write(json.dumps({"load_error": str(err)}) + "\n")
        return
    out.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        reply: dict[str, Any] = {"i": req["i"]}
        limits.start_sample()
        try:
            reply["score"] = to_score(fn(req["data_source"], req["solution_str"], req["ground_truth"],
                                         req["extra_info"]))
        except (Exception, CPUTimeExceeded) as err:  # noqa: BLE001 - one bad sample must not stop the batch
            reply["error"] = limits.explain(err)[:300]
        finally:
            limits.end_sample()
        retire = limits.should_retire()
        if retire:
            reply["retire"] = True
        out.write(json.dumps(reply) + "\n")
        if retire:
            return


if __name__ == "__main__":
    main()
