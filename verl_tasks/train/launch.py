"""The driver side of the update on Ray Train: one ``TorchTrainer.fit`` per update attempt.

The process running the update unit (a pool actor on ``--backend ray``, or the inline
process) starts ``resources.update.workers`` Ray Train workers, each reserving the
phase's ``num_cpus``/``num_gpus``/``memory_mb``/custom resources, so Ray places them
on any nodes that have them. The process group is gloo on CPU and ``cpu:gloo,cuda:nccl``
when the workers hold GPUs (``process_group_backend``); nothing else differs. The workers
write the unit's files into the attempt; this side lists them in the writer, and the phase
commits as always.

Failure: ``FailureConfig(max_failures=0)``: a worker that raises or dies (Ray Train's
health check sees a dead worker within seconds) ends the fit, and the attempt fails
with ``PhaseFailed``; Airflow's (or the inline runner's) retry is a new attempt that
recomputes from the same committed inputs. Ray Train restarting workers itself would
retry inside one attempt, behind the fencing and the retry accounting, so it is off.
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import verl_tasks
from verl_tasks.config import Resources
from verl_tasks.errors import PhaseFailed
from verl_tasks.phases.common import PhaseContext
from verl_tasks.store.units import FileEntry, UnitWriter

log = logging.getLogger(__name__)

RESULT_WAIT_S = 60.0


def train_on_workers(ctx: PhaseContext, epoch: int, writer: UnitWriter, *, policy_version: int,
                     samples: list[dict[str, Any]], first_step: int, seed: int, single_step: bool,
                     resume_optimizer: bool) -> dict[str, Any]:
    """Train policy ``policy_version`` on ``samples`` with Ray Train; the workers write into ``writer``'s attempt.

    Returns:
        ``totals`` (metric sums over steps), ``steps``, ``optimizer`` (hyperparameters); the
        workers' files are added to ``writer.files``.

    Raises:
        PhaseFailed: a worker raised or died; the attempt is left uncommitted.
    """
    res = ctx.config.phase_resources("update")
    ensure_ray(res)
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from ray.train.v2.api.exceptions import TrainingFailedError
    from ray.util.queue import Queue

    from verl_tasks.train.worker import train_loop

    backend = process_group_backend(res.num_gpus > 0)
    results = Queue(actor_options={"num_cpus": 0})
    job = {"config": ctx.config.model_dump(mode="json"), "unit": writer.unit, "attempt": writer.attempt,
           "epoch": epoch, "policy_version": policy_version, "samples": samples, "first_step": first_step,
           "seed": seed, "single_step": single_step, "resume_optimizer": resume_optimizer, "results": results}
    storage = tempfile.mkdtemp(prefix="vt-train-")
    trainer = TorchTrainer(
        train_loop, train_loop_config=job,
        scaling_config=ScalingConfig(num_workers=res.workers, use_gpu=res.num_gpus > 0,
                                     resources_per_worker=worker_resources(res)),
        torch_config=TorchConfig(backend=backend),
        run_config=RunConfig(name=f"{ctx.config.experiment}-e{epoch}-update-{writer.attempt}", storage_path=storage,
                             failure_config=FailureConfig(max_failures=0)),
    )
    log.info("update of epoch %d on %d Ray Train workers (%s, %s)", epoch, res.workers, res.strategy.value, backend)
    try:
        trainer.fit()
        result = results.get(timeout=RESULT_WAIT_S)
    except TrainingFailedError as err:
        message = f"update worker failed; attempt {writer.attempt} is not committed: {err}"
        raise PhaseFailed(writer.unit, message[:4000]) from err
    finally:
        results.shutdown(force=True)
        shutil.rmtree(storage, ignore_errors=True)
    for name, (size, sha) in result["files"].items():
        writer.files[name] = FileEntry(size, sha)
    return result


def process_group_backend(use_gpu: bool) -> str:
    """The torch.distributed backend of the update's workers: ``gloo`` on CPU; on GPUs NCCL for CUDA
    tensors *and* gloo for CPU ones (``cpu:gloo,cuda:nccl``), since some collectives run on host memory
    (FSDP2 with ``cpu_offload``: the gradient norm and the full weights are computed from CPU shards).

    Ray 2.60's ``TorchConfig`` passes the string to ``init_process_group`` as is, and reads any
    ``cuda:nccl`` entry as NCCL (it then sets ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` unless set).
    """
    return "cpu:gloo,cuda:nccl" if use_gpu else "gloo"


def worker_resources(res: Resources) -> dict[str, float]:
    """What each Ray Train worker reserves: the update phase's resources."""
    wanted = {"CPU": res.num_cpus, "GPU": res.num_gpus, **res.custom}
    if res.memory_mb:
        wanted["memory"] = res.memory_mb * 1024 * 1024
    return {key: value for key, value in wanted.items() if value}


def ensure_ray(res: Resources) -> None:
    """Connect to nothing new when this process is already in a Ray cluster (a pool actor, a driver);
    otherwise (inline: tests, ``verl-tasks run``) start a private local Ray that lives as long as the process."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep a local Ray on loopback (read at import)
    import ray

    if ray.is_initialized():
        return
    from verl_tasks.execution.local_head import LOGICAL_CPUS

    # Logical CPUs are a placement count: enough for a later epoch's larger worker count too.
    cpus = max(os.cpu_count() or 1, LOGICAL_CPUS, math.ceil(res.workers * res.num_cpus))
    # The workers import the code this process runs (a checkout may shadow the installed package).
    root = str(Path(verl_tasks.__file__).resolve().parents[1])
    pythonpath = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
    log.info("no Ray cluster connected: started a local Ray (%d logical CPUs) for the update's %d workers; "
             "it stops when this process exits", cpus, res.workers)
