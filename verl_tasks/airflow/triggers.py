"""Wait for a Ray job without holding a worker slot, streaming its new log lines into the task log."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from airflow.triggers.base import BaseTrigger, TriggerEvent

from verl_tasks.execution.ray_jobs import TERMINAL, log_tail


class RayJobTrigger(BaseTrigger):
    """Poll one Ray job until it is terminal; fire one event ``{status, submission_id, log_tail}``.

    Args:
        submission_id: the Ray job.
        ray_conn_id: the connection giving address and token (rebuilt inside the triggerer;
            the token is never part of the trigger's serialised arguments).
        poll_interval: seconds between status polls.
    """

    def __init__(self, submission_id: str, ray_conn_id: str | None = "ray_default", poll_interval: float = 0.5):
        super().__init__()
        self.submission_id = submission_id
        self.ray_conn_id = ray_conn_id
        self.poll_interval = poll_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {"submission_id": self.submission_id, "ray_conn_id": self.ray_conn_id, "poll_interval": self.poll_interval},
        )

    async def _backend(self):
        from verl_tasks.airflow.connections import ray_target
        from verl_tasks.execution.ray_jobs import RayJobBackend

        target = await asyncio.to_thread(ray_target, self.ray_conn_id)
        return RayJobBackend(target)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        backend = await self._backend()
        shown = 0
        while True:
            status = await asyncio.to_thread(backend.status, self.submission_id)
            text = await asyncio.to_thread(backend.logs, self.submission_id)
            if len(text) > shown:
                for line in text[shown:].splitlines():
                    if line.strip():
                        self.log.info("[%s] %s", self.submission_id, line[:2000])
                shown = len(text)
            if status in TERMINAL:
                yield TriggerEvent({"status": status, "submission_id": self.submission_id, "log_tail": log_tail(text)})
                return
            await asyncio.sleep(self.poll_interval)

    async def on_kill(self) -> None:
        """The user marked, cleared or failed the deferred task: stop its Ray job."""
        backend = await self._backend()
        stopped = await asyncio.to_thread(backend.stop, self.submission_id)
        self.log.info("stop requested for Ray job %s (was live: %s)", self.submission_id, stopped)
