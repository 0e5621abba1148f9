"""New weights from the update's rank 0 to rollout and evaluation workers through Ray's object store.

Why Ray's object store and not a collective between rank 0 and the engines: it needs no process
group spanning trainers and engines (which a pool actor restarted by Ray, or an engine on a node
that joined later, would have to re-form), Ray moves the object to whichever node asks for it,
and it costs nothing when nobody asks. A collective (NCCL broadcast into vLLM's workers) is
faster on a GPU cluster but binds the groups' lifetimes together, which the unit-by-unit
fault model here must not.

After an update, rank 0 puts the weights it has just written into the object store, one copy on
its node, as the raw bytes of each tensor with the sha256 of the file they were written into.
Once the driver's commit is won, it registers that object under the committed weights' sha256
with the experiment's handover registry: a named actor that keeps the latest version only (the
object lives while rank 0 does). A reader that needs a policy asks it first (:func:`fetch`) and
falls back to the store whenever the registry, the object or its owner is gone, or the checksum
it was written under is not the one the committed record lists. The store stays the truth.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch

from verl_tasks.store.units import CommitRecord

log = logging.getLogger(__name__)

KIND = "handover"
LOOKUP_S = 5.0
# Publishing may start the registry actor, whose worker process takes seconds to start on a busy node.
PUBLISH_S = 60.0
FETCH_S = 120.0


def _connected_ray() -> Any:
    """Ray, when this process already imported it and is connected (never imported here: a process
    without Ray, the GPU check's, has nothing handed over)."""
    ray = sys.modules.get("ray")
    return ray if ray is not None and ray.is_initialized() else None


def put_weights(named: list[tuple[str, torch.Tensor]], weights_sha256: str) -> list[Any] | None:
    """Put the tensors into Ray's object store (a list holding the ObjectRef, so passing it on does not
    fetch it); None where this process is not connected to Ray."""
    ray = _connected_ray()
    if ray is None:
        return None
    tensors = [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape),
                t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()) for name, t in named]
    return [ray.put({"weights_sha256": weights_sha256, "tensors": tensors})]


def registry_name(experiment: str, store: str) -> str:
    import hashlib

    from verl_tasks.execution.pool_shape import PREFIX

    return f"{PREFIX}{experiment}:{KIND}:{hashlib.sha256(store.encode()).hexdigest()[:8]}"


def _registry(config: Any, create: bool) -> Any:
    import ray

    from verl_tasks.execution import store_identity
    from verl_tasks.execution.pool_shape import NAMESPACE

    name = registry_name(config.experiment, store_identity(config))
    if not create:
        return ray.get_actor(name, namespace=NAMESPACE)
    return ray.remote(WeightsRegistry).options(name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                            num_cpus=0, max_restarts=0).remote()


def publish_weights(ctx: Any, record: CommitRecord, handle: list[Any]) -> bool:
    """Register ``handle`` as the weights of committed update ``record`` (its ``model.safetensors``' sha256
    must be the one the object was written under). Returns whether it was registered."""
    import ray

    from verl_tasks.store.conventions import WEIGHTS

    sha = record.files[WEIGHTS].sha256
    try:
        return bool(ray.get(_registry(ctx.config, create=True).publish.remote(sha, handle), timeout=PUBLISH_S))
    except (ray.exceptions.RayError, ValueError) as err:
        log.warning("the new weights were not handed over in memory (%s); readers load them from the store", err)
        return False


def fetch(config: Any, record: CommitRecord) -> dict[str, torch.Tensor] | None:
    """The weights of committed snapshot or update ``record`` from Ray's object store, or None (not there,
    its owner gone, another checksum, no Ray): then the caller reads the store.

    The tensors are read-only views of the object store's shared memory on this node; copy before changing.
    """
    from verl_tasks.store.conventions import WEIGHTS

    ray = _connected_ray()
    if ray is None or WEIGHTS not in record.files:  # no Ray, or a LoRA adapter (not handed over)
        return None
    sha = record.files[WEIGHTS].sha256
    try:
        handle = ray.get(_registry(config, create=False).lookup.remote(sha), timeout=LOOKUP_S)
        if handle is None:
            return None
        payload = ray.get(handle[0], timeout=FETCH_S)
    except (ray.exceptions.RayError, ValueError) as err:  # no registry, the owner died, a timeout
        log.info("weights %s are not in Ray's object store (%s); reading the store", sha[:12], type(err).__name__)
        return None
    if payload.get("weights_sha256") != sha:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the shared memory is read-only; callers copy
        return {name: torch.from_numpy(raw).view(getattr(torch, dtype)).reshape(shape)
                for name, dtype, shape, raw in payload["tensors"]}


# Handed-over weights written as local folders for vLLM (which loads files), per node; the newest kept, and
# any made in the last HANDOVER_MIN_AGE_S (another experiment's engine on this node may be loading it).
HANDOVER_KEEP = 2
HANDOVER_MIN_AGE_S = 900


def _handover_root() -> Path:
    from verl_tasks.local_cache import CACHE_DIR

    return CACHE_DIR / "handover"


def local_folder(record: CommitRecord) -> Path | None:
    """The folder an earlier :func:`materialize` made for ``record``'s weights on this node, if any."""
    from verl_tasks.store.conventions import WEIGHTS

    if WEIGHTS not in record.files:  # a LoRA adapter: never handed over (its merged folder is cached)
        return None
    folder = _handover_root() / record.files[WEIGHTS].sha256
    if not (folder / WEIGHTS).is_file():
        return None
    try:
        os.utime(folder)  # in use again: the newest for pruning
    except FileNotFoundError:  # pruned in between
        return None
    return folder


def materialize(tensors: dict[str, torch.Tensor], record: CommitRecord, configs: Path) -> Path | None:
    """A local policy folder for an engine that loads files: copies of ``configs``' inference files and the
    weights written from ``tensors``, hashed as they are written. None when that hash is not the one
    ``record`` lists (nothing is kept; the caller reads the store)."""
    from verl_tasks.models.safetensors_io import write_tensors
    from verl_tasks.models.vllm_engine import is_inference_file
    from verl_tasks.store.conventions import WEIGHTS

    sha = record.files[WEIGHTS].sha256
    root = _handover_root()
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        written = write_tensors(work / WEIGHTS, list(tensors.items()), {"format": "pt"})
        if written.sha256 != sha:
            log.warning("handed-over weights hash to %s, the committed snapshot lists %s; reading the store",
                        written.sha256[:12], sha[:12])
            return None
        for path in configs.iterdir():
            if path.is_file() and path.name != WEIGHTS and is_inference_file(path.name):
                shutil.copyfile(path, work / path.name)  # small; the configs' own folder may be pruned
        folder = root / sha
        try:
            work.rename(folder)
        except OSError:  # another process of this node made it first
            pass
    finally:
        shutil.rmtree(work, ignore_errors=True)
    made = {}
    for path in root.iterdir():
        try:  # another process of this node may be pruning too
            if path.is_dir() and not path.name.startswith("."):
                made[path] = path.stat().st_mtime
        except FileNotFoundError:
            continue
    for stale in sorted(made, key=made.__getitem__, reverse=True)[HANDOVER_KEEP:]:
        if time.time() - made[stale] > HANDOVER_MIN_AGE_S:
            doomed = root / f".pruned-{stale.name}-{uuid.uuid4().hex[:8]}"
            try:  # renamed first: no reader ever finds a half-deleted folder under its checksum
                stale.rename(doomed)
            except OSError:
                continue
            shutil.rmtree(doomed, ignore_errors=True)
    return local_folder(record)


class WeightsRegistry:
    """The latest handed-over weights of one experiment and store: sha256 -> [ObjectRef]."""

    def __init__(self) -> None:
        self.latest: tuple[str, list[Any]] | None = None

    def publish(self, weights_sha256: str, handle: list[Any]) -> bool:
        self.latest = (weights_sha256, handle)  # the previous version's object is released
        return True

    def lookup(self, weights_sha256: str) -> list[Any] | None:
        return self.latest[1] if self.latest and self.latest[0] == weights_sha256 else None


__all__ = ["fetch", "local_folder", "materialize", "publish_weights", "put_weights", "registry_name"]
