"""``verl-tasks run --backend ray``: drive the units through the worker pools from this process.

Without ``--ray-address`` a local head is started for the run (its own token,
temp folder and ports, sized for the pools) and stopped afterwards; with one,
this process joins that cluster as a driver. Either way the units go to the
same pools the Airflow path uses, so inline and Ray runs compare on the same work.
"""
from __future__ import annotations

import logging
import os
import socket
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

from verl_tasks.config import ExperimentConfig
from verl_tasks.phase_registry import PHASE_NAMES

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 5  # the run's own head: nothing in it outlives the run (its actors are killed first: ~1 s)


def cpus_needed(config: ExperimentConfig) -> int:
    """Logical CPUs for every pool of the experiment to be resident at once (one pool per kind)."""
    from verl_tasks.execution.pools import pool_kind

    kinds: dict[str, float] = {}
    for phase in PHASE_NAMES:
        res = config.phase_resources(phase)
        # A distributed update is a driver actor plus its Ray Train workers, each with the update's CPUs.
        actors = res.workers + 1 if phase == "update" and res.distributed else res.workers
        kinds[pool_kind(phase)] = max(kinds.get(pool_kind(phase), 0.0), res.num_cpus * actors)
    return max(os.cpu_count() or 1, int(sum(kinds.values()) + 0.999))


def _free_ports() -> tuple[int, int]:
    """A GCS port P and dashboard port D such that P, P+1 and D..D+4 are all free (see local_head)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base > 60000:
            continue
        wanted = [base, base + 1] + [base + 10 + i for i in range(5)]
        try:
            for port in wanted:
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base, base + 10
    raise RuntimeError("no free ports for a local Ray head")


def connect(stack: ExitStack, config: ExperimentConfig, ray_address: str | None,
            console: Any = None) -> Callable[[], Callable]:
    """Start joining a cluster (or starting one); returns ``join``, which waits until this process is
    its driver and returns the unit runner for ``runner.train``.

    The caller imports its own heavy modules between the two calls while a head started here
    boots. Everything started here is stopped when ``stack`` closes.
    """
    info = None
    if ray_address is None:
        # Ray reads these when it is imported (waiting for the head imports it): loopback, token auth on.
        os.environ.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="token")
        from verl_tasks.execution import local_head

        state = Path(tempfile.mkdtemp(prefix="vt-ray-"))
        port, dashboard = _free_ports()
        info = local_head.launch(state, port=port, dashboard_port=dashboard, num_cpus=cpus_needed(config),
                                 cwd=Path.cwd(), dashboard=False)
        stack.callback(local_head.stop, state, STOP_TIMEOUT_S)
        os.environ.update(info.client_env(), **info.driver_env())
        ray_address = info.gcs_address
        if console is not None:
            console.print(f"local Ray head at {info.address} (pid {info.pid}); stopped when the run ends")

    def join() -> Callable:
        import ray

        from verl_tasks.execution import pools

        if info is not None:
            from verl_tasks.execution import local_head

            local_head.wait_for_node(info)
        _connect_when_ready(pools, ray_address)
        stack.callback(ray.shutdown)
        if info is not None:
            stack.callback(pools.release_experiment, config.experiment)  # its actors first: the head then stops at once
        return pools.run_on_pools

    return join


def _connect_when_ready(pools: Any, address: str, timeout_s: float = 90) -> None:
    """``ray.init`` as soon as the head takes drivers (a head just started may still be registering its node)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            pools.ensure_connected(address)
            return
        except ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


__all__ = ["connect", "cpus_needed"]
