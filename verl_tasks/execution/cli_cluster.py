"""``verl-tasks run --backend ray``: drive the units through the worker pools from this process.

Without ``--ray-address`` a local head is started for the run (its own token,
temp folder and ports, CPUs sized for the pools, the machine's GPUs; ``CUDA_VISIBLE_DEVICES``
narrows them) and stopped afterwards; with one,
this process joins that cluster as a driver. Either way the units go to the
same pools the Airflow path uses, so inline and Ray runs compare on the same work.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from verl_tasks.config import ExperimentConfig

log = logging.getLogger(__name__)
# The run's own head holds nothing once the run's actors are gone and its driver left: its whole session
# is killed at once (a graceful stop spends ~1 s letting each process tidy files that are deleted next).
STOP_TIMEOUT_S = 0


def cpus_needed(config: ExperimentConfig) -> int:
    """Logical CPUs for every pool of the experiment to be resident at once, and no fewer than the machine has."""
    from verl_tasks.execution.pool_shape import cpus_for

    return max(os.cpu_count() or 1, int(cpus_for(config) + 0.999))


def check_gpus(config: ExperimentConfig, offered: float) -> None:
    """Refuse an experiment one of whose workers needs more GPUs than the run's own head offers: Ray would
    leave that worker pending and the run would wait for it forever.

    Raises:
        ConfigError: naming each such phase and what the head offers.
    """
    from verl_tasks.errors import ConfigError
    from verl_tasks.phase_registry import phases_for

    needs = {phase: config.phase_resources(phase).num_gpus for phase in phases_for(config)}
    short = {phase: gpus for phase, gpus in needs.items() if gpus > offered}
    if short:
        wanted = ", ".join(f"resources.{phase}.num_gpus: {gpus:g}" for phase, gpus in short.items())
        raise ConfigError(f"{wanted}, but the local Ray head offers {offered:g} GPUs (those Ray found on this "
                          f"machine, within CUDA_VISIBLE_DEVICES); lower them (0: the CPU), or pass --ray-address "
                          f"of a cluster that has the GPUs")


def _free_ports() -> tuple[int, int]:
    """A GCS port P and dashboard port D such that P, P+1 and D..D+4 are all free (see local_head), drawn
    where no other process's connection takes them before the head binds them (``ports``)."""
    from verl_tasks.execution.ports import free_ports

    base = free_ports([0, 1, 10, 11, 12, 13, 14])
    return base, base + 10


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
        stack.callback(_discard, state, Path(info.tmpdir))  # after the stop (an ExitStack unwinds in reverse)
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

            check_gpus(config, local_head.wait_for_node(info).get("GPU", 0))
        _connect_when_ready(pools, ray_address)
        stack.callback(ray.shutdown)
        if info is not None:
            stack.callback(pools.release_experiment, config.experiment)  # its actors first: the head then stops at once
        return pools.run_on_pools

    return join


def _discard(*folders: Path) -> None:
    """The stopped head's state folder (its token) and Ray's session files: nothing is left in /tmp per run."""
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


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


__all__ = ["check_gpus", "connect", "cpus_needed"]
