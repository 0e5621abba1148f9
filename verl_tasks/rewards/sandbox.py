"""Score samples in a separate process with a per-sample time limit and a memory limit.

A sample whose scoring raises, returns a non-number, hangs past the limit or
kills the worker gets the configured default score; its id and the reason are
returned so the phase can record them. The worker is restarted after a hang
or a crash.
"""
from __future__ import annotations

import json
import logging
import os
import resource
import select
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from verl_tasks.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class ScoreResult:
    scores: list[float]
    failures: dict[str, str] = field(default_factory=dict)  # sample id -> reason


class RewardSandbox:
    """A restartable worker process running one reward function."""

    def __init__(self, function: str, timeout_s: float, memory_limit_mb: int):
        self.function = function
        self.timeout_s = timeout_s
        self.memory_limit = memory_limit_mb << 20
        self.proc: subprocess.Popen | None = None
        self.reader: int | None = None
        self._buffer = b""
        self._eof = False

    def _limits(self) -> None:
        resource.setrlimit(resource.RLIMIT_AS, (self.memory_limit, self.memory_limit))
        os.setsid()

    def start(self) -> None:
        read_fd, write_fd = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "verl_tasks.rewards.worker", self.function, str(write_fd)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE if log.isEnabledFor(logging.DEBUG) else subprocess.DEVNULL,
            pass_fds=(write_fd,),
            preexec_fn=self._limits,
            text=True,
        )
        os.close(write_fd)
        self.reader = read_fd
        self._buffer = b""
        self._eof = False
        hello = self._read_line(max(30.0, self.timeout_s))
        if hello is None or "load_error" in hello:
            reason = hello["load_error"] if hello else "the worker did not start"
            self.close()
            raise ConfigError(f"rewards.function {self.function!r} cannot be loaded: {reason}")

    def _read_line(self, timeout: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.reader], [], [], left)
            if not ready:
                return None
            chunk = os.read(self.reader, 65536)
            if not chunk:
                self._eof = True  # the worker died
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            if self.proc.stdin:
                self.proc.stdin.close()
            if self.proc.stderr:
                self.proc.stderr.close()
            self.proc = None
        if self.reader is not None:
            os.close(self.reader)
            self.reader = None

    def __enter__(self) -> "RewardSandbox":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def score(self, samples: list[dict[str, Any]], default: float) -> ScoreResult:
        """Score samples in order. Each needs id, data_source, solution_str, ground_truth, extra_info."""
        result = ScoreResult(scores=[])
        for i, sample in enumerate(samples):
            if self.proc is None:
                self.start()
            request = {k: sample[k] for k in ("data_source", "solution_str", "ground_truth", "extra_info")}
            try:
                self.proc.stdin.write(json.dumps({"i": i, **request}) + "\n")
                self.proc.stdin.flush()
                reply = self._read_line(self.timeout_s)
            except (BrokenPipeError, OSError):
                reply, self._eof = None, True
            if reply is None:
                crashed = self._eof or self.proc.poll() is not None
                reason = "worker crashed" if crashed else f"timed out after {self.timeout_s:g}s"
                self.close()
                result.scores.append(default)
                result.failures[sample["id"]] = reason
            elif "error" in reply:
                result.scores.append(default)
                result.failures[sample["id"]] = reply["error"]
            else:
                result.scores.append(float(reply["score"]))
        return result
