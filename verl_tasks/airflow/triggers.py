"""Wait for a Ray job without holding a worker slot, streaming its new log lines into the task log."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from verl_tasks.execution.outcome import parse_result
from verl_tasks.execution.ray_jobs import DEFAULT_RETRY_S, TERMINAL, Backoff, is_transient, log_tail, redact_config

UNREACHABLE = "UNREACHABLE"


class RayJobTrigger(BaseTrigger):
    """Poll one Ray job until it is terminal; fire one event ``{status, submission_id, log_tail, result}``.

    ``result`` is the job's result line (see :mod:`verl_tasks.execution.outcome`), or None.
    A transient error of the dashboard (refused, reset, timeout, HTTP 5xx) is retried
    with exponential backoff; after ``retry_s`` seconds of consecutive failures the
    event is ``{status: "UNREACHABLE", error: ...}`` naming the address and the last error.

    Ray's log endpoint returns the whole log (no offset; ``tail_job_logs`` streams over a
    websocket but replays from the start on every reconnect); it is fetched every
    ``log_every_s`` seconds and once at the end, and only lines not shown yet go to the task log.

    Args:
        submission_id: the Ray job.
        ray_conn_id: the connection giving address and token (rebuilt inside the triggerer;
            the token is never part of the trigger's serialised arguments).
        poll_interval: seconds between status polls.
        retry_s: how long transient dashboard errors are retried before the task fails.
        log_every_s: seconds between log fetches while the job runs.
    """

    def __init__(self, submission_id: str, ray_conn_id: str | None = "ray_default", poll_interval: float = 0.5,
                 retry_s: float = DEFAULT_RETRY_S, log_every_s: float = 5.0):
        super().__init__()
        self.submission_id = submission_id
        self.ray_conn_id = ray_conn_id
        self.poll_interval = poll_interval
        self.retry_s = retry_s
        self.log_every_s = log_every_s

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {"submission_id": self.submission_id, "ray_conn_id": self.ray_conn_id, "poll_interval": self.poll_interval,
             "retry_s": self.retry_s, "log_every_s": self.log_every_s},
        )

    async def _backend(self):
        from verl_tasks.airflow.connections import ray_target
        from verl_tasks.execution.ray_jobs import RayJobBackend

        target = await asyncio.to_thread(ray_target, self.ray_conn_id)
        return RayJobBackend(target, retry_s=0)  # retried here, with asyncio.sleep: no thread sleeps

    def _show(self, text: str, shown: int) -> int:
        """Log the part of ``text`` after ``shown`` characters; return the new count."""
        for line in text[shown:].splitlines():
            if line.strip():
                self.log.info("[%s] %s", self.submission_id, redact_config(line)[:2000])
        return max(shown, len(text))

    async def run(self) -> AsyncIterator[TriggerEvent]:
        backend = await self._backend()
        backoff = Backoff(self.retry_s)
        shown, text, next_logs = 0, "", 0.0
        while True:
            try:
                status = await asyncio.to_thread(backend.status, self.submission_id)
                if status in TERMINAL or time.monotonic() >= next_logs:
                    text = await asyncio.to_thread(backend.logs, self.submission_id)
                    shown = self._show(text, shown)
                    next_logs = time.monotonic() + self.log_every_s
            except Exception as err:
                if not is_transient(err):
                    raise
                delay = backoff.next_delay()
                if delay is None:
                    yield TriggerEvent(self._unreachable(backend.target.address, err, text))
                    return
                self.log.warning("Ray dashboard at %s: polling job %s failed transiently (%s); retry %d in %.1fs "
                                 "(giving up after %gs)", backend.target.address, self.submission_id, err,
                                 backoff.failures, delay, self.retry_s)
                await asyncio.sleep(delay)
                continue
            backoff.reset()
            if status in TERMINAL:
                yield TriggerEvent({"status": status, "submission_id": self.submission_id, "log_tail": log_tail(text),
                                    "result": parse_result(text)})
                return
            await asyncio.sleep(self.poll_interval)

    def _unreachable(self, address: str, err: BaseException, text: str) -> dict[str, Any]:
        error = (f"Ray dashboard at {address} failed for {self.retry_s:g}s while polling job {self.submission_id}; "
                 f"last error: {type(err).__name__}: {err}")
        self.log.error("%s", error)
        return {"status": UNREACHABLE, "submission_id": self.submission_id, "log_tail": log_tail(text),
                "error": error, "result": None}

    async def on_kill(self) -> None:
        """The user marked, cleared or failed the deferred task: stop its Ray job."""
        backend = await self._backend()
        stopped = await asyncio.to_thread(backend.stop, self.submission_id)
        self.log.info("stop requested for Ray job %s (was live: %s)", self.submission_id, stopped)
