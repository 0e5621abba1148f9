"""Score samples in a separate process with a per-sample time limit and a memory limit.

A sample whose scoring raises, returns a non-number, hangs past the limit or
kills the worker gets the configured default score; its id and the reason are
returned so the phase can record them. The worker is restarted after a hang
or a crash.

The reward function is user code: the worker runs without secrets in its
environment (:func:`verl_tasks.secrets.scrubbed_env`: no ``AWS_*``, Ray or Hugging
Face tokens, passwords), in a fresh temporary working directory, and every reply is
checked (well-formed JSON, the request's sample index, a finite number); anything
else gets the default score and a restarted worker.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import resource
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any, cast

from verl_tasks.errors import ConfigError
from verl_tasks.secrets import scrubbed_env

log = logging.getLogger(__name__)
MALFORMED = object()  # a reply line that is not JSON
BAD_REPLY = "malformed reply"
REQUEST_KEYS = ("data_source", "solution_str", "ground_truth", "extra_info")
# Unanswered request bytes in the worker's stdin pipe at most (Linux pipes hold 64 KiB).
WINDOW_BYTES = 32 << 10


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
        self.proc: subprocess.Popen[str] | None = None
        self.reader: int | None = None
        self._buffer = b""
        self._eof = False
        self.workdir: str | None = None
        self.started_env: dict[str, str] | None = None

    def _limits(self) -> None:
        resource.setrlimit(resource.RLIMIT_AS, (self.memory_limit, self.memory_limit))
        os.setsid()

    @staticmethod
    def _environment() -> dict[str, str]:
        """The parent's environment without secrets; the parent's folder stays importable (as with ``-m``)."""
        env = scrubbed_env(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH")) if p)
        return env

    def start(self) -> subprocess.Popen[str]:
        """Start the worker process and wait for its hello. Returns the process (also ``self.proc``)."""
        read_fd, write_fd = os.pipe()
        self.workdir = tempfile.mkdtemp(prefix="vt-reward-")
        self.started_env = self._environment()
        self.proc = proc = subprocess.Popen(
            [sys.executable, "-m", "verl_tasks.rewards.worker", self.function, str(write_fd)],
            cwd=self.workdir,
            env=self.started_env,
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
        if not isinstance(hello, dict) or not hello.get("ready"):
            reason = hello.get("load_error") if isinstance(hello, dict) else None
            self.close()
            raise ConfigError(f"rewards.function {self.function!r} cannot be loaded: "
                              f"{reason or 'the worker did not start'}")
        return proc

    def _read_line(self, timeout: float) -> Any:
        """The next reply (any JSON value; ``MALFORMED`` when not JSON), or None on timeout or a dead worker."""
        reader = self.reader
        if reader is None:  # closed: no worker to read from
            return None
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([reader], [], [], left)
            if not ready:
                return None
            chunk = os.read(reader, 65536)
            if not chunk:
                self._eof = True  # the worker died
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            return json.loads(line)
        except ValueError:
            return MALFORMED

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
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def __enter__(self) -> RewardSandbox:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def score(self, samples: list[dict[str, Any]], default: float) -> ScoreResult:
        """Score samples in order. Each needs id, data_source, solution_str, ground_truth, extra_info.

        Requests go to the worker a window at a time (at most ``WINDOW_BYTES`` unanswered, so a
        write never blocks on a full pipe); the worker answers them one after another, so sample
        ``k`` still has ``timeout_s`` from the moment sample ``k - 1`` was answered. After a hang,
        a crash or a reply out of step, the worker is replaced and the rest are sent again.
        """
        result = ScoreResult(scores=[])
        lines = [json.dumps({"i": i, **{k: s[k] for k in REQUEST_KEYS}}) + "\n" for i, s in enumerate(samples)]
        i = 0
        while i < len(samples):
            proc = self.proc if self.proc is not None else self.start()
            stdin = cast(IO[str], proc.stdin)  # never None: the worker is started with stdin=PIPE
            end, size = i, 0
            while end < len(lines) and (end == i or size + len(lines[end]) <= WINDOW_BYTES):
                size += len(lines[end])
                end += 1
            try:
                stdin.write("".join(lines[i:end]))
                stdin.flush()
            except (BrokenPipeError, OSError):
                self._eof = True
                end = i + 1  # the worker is gone: sample i gets the default, the rest a new worker
            for k in range(i, end):
                reply = None if self._eof else self._read_line(self.timeout_s)
                i = k + 1
                if reply is None:
                    crashed = self._eof or proc.poll() is not None
                    self.close()
                    result.scores.append(default)
                    result.failures[samples[k]["id"]] = ("worker crashed" if crashed
                                                         else f"timed out after {self.timeout_s:g}s")
                    break
                score, reason = check_reply(reply, k)
                result.scores.append(default if score is None else score)
                if reason is not None:
                    result.failures[samples[k]["id"]] = reason
                    if reason.startswith(BAD_REPLY):
                        self.close()  # the protocol is out of step: start a clean worker, send the rest again
                        break
        return result


def check_reply(reply: Any, index: int) -> tuple[float | None, str | None]:
    """``(score, None)`` for a good reply; ``(None, reason)`` for the function's error or a bad reply."""
    if not isinstance(reply, dict) or reply.get("i") != index or isinstance(reply.get("i"), bool):
        got = "a line that is not JSON" if reply is MALFORMED else str(reply)[:100]
        return None, f"{BAD_REPLY}: expected a JSON object for sample {index}, got {got}"
    if isinstance(reply.get("error"), str):
        return None, reply["error"][:300]
    score = reply.get("score")
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
        return None, f"{BAD_REPLY}: score {str(score)[:100]} is not a finite number"
    return float(score), None


_WARM: dict[tuple[str, float, int], RewardSandbox] = {}
_WARM_LOCKS: dict[tuple[str, float, int], threading.Lock] = {}
_GUARD = threading.Lock()


@contextlib.contextmanager
def warm_sandbox(function: str, timeout_s: float, memory_limit_mb: int) -> Iterator[RewardSandbox]:
    """The process's worker for this reward function, kept between batches (one user at a time).

    Starting a worker costs a Python start-up and the function's imports; a warm one is
    reused by the next batch. Isolation and limits are the same; a worker that crashed,
    hung or broke the protocol is replaced (``score`` restarts it), one whose batch was
    interrupted is closed, and every worker is closed when the process exits.
    """
    key = (function, timeout_s, memory_limit_mb)
    with _GUARD:
        lock = _WARM_LOCKS.setdefault(key, threading.Lock())
    with lock:
        sandbox = _WARM.get(key)
        if sandbox is not None and sandbox.started_env != RewardSandbox._environment():
            sandbox.close()  # the worker would see a stale environment or working folder
            sandbox = None
        if sandbox is None:
            sandbox = _WARM[key] = RewardSandbox(function, timeout_s, memory_limit_mb)
        try:
            yield sandbox
        except BaseException:
            # Interrupted mid-batch (a unit's deadline, Ctrl-C): replies may still be on their way,
            # and the next batch would read them as its own.
            _WARM.pop(key, None)
            sandbox.close()
            raise


@atexit.register
def _close_warm() -> None:
    for sandbox in _WARM.values():
        sandbox.close()

