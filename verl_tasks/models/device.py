"""Which device a worker computes on: ``model.device`` = ``auto`` | ``cpu`` | ``cuda``.

Inside a Ray worker the GPUs Ray assigned to it decide, not what CUDA happens to see.
Ray 2.60 leaves ``CUDA_VISIBLE_DEVICES`` as the node has it for an actor that reserved no
GPU (it blanks it only with ``RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1``), so on a GPU node
such an actor sees every GPU, and "the first visible one" is a GPU another actor reserved.
An actor that reserved GPUs gets ``CUDA_VISIBLE_DEVICES`` narrowed to them (unless
``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1``), so its first one is ``cuda:0``; else
it is found by its id among the visible devices. Outside Ray (the inline backend, a
driver) ``auto`` takes the first visible CUDA device, when CUDA is usable.
"""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

import torch

from verl_tasks.errors import ConfigError

log = logging.getLogger(__name__)
_SAID: set[str] = set()
CPU = torch.device("cpu")


@dataclass(frozen=True)
class DeviceFacts:
    """What decides the device, as observed in one process."""

    ray_gpu_ids: tuple[str, ...] | None  # the GPU ids Ray assigned to this worker; None: not a Ray worker
    cuda_usable: bool  # torch.cuda.is_available()
    visible: tuple[str, ...] | None  # CUDA_VISIBLE_DEVICES, split; None: unset (every device visible)

    def describe(self) -> str:
        env = "unset" if self.visible is None else repr(",".join(self.visible))
        ray_part = "" if self.ray_gpu_ids is None else f", Ray assigned GPUs {list(self.ray_gpu_ids)}"
        return f"CUDA_VISIBLE_DEVICES {env}{ray_part}"


def choose_device(requested: str, facts: DeviceFacts) -> tuple[torch.device, str]:
    """The device for ``requested`` given ``facts``, and why (for the log). Pure: no CUDA, no Ray.

    Raises:
        ConfigError: ``cuda`` where this worker may use no GPU; or Ray assigned GPUs that
            ``CUDA_VISIBLE_DEVICES`` does not list (the environment contradicts the placement).
    """
    if requested == "cpu":
        return CPU, "model.device=cpu"
    if facts.ray_gpu_ids == ():
        if requested == "cuda":
            raise ConfigError(f"model.device is 'cuda' but this Ray worker reserved no GPU ({facts.describe()}); "
                              f"give the phase GPUs (resources.<phase>.num_gpus >= 1), or use model.device: auto")
        return CPU, (f"model.device=auto: this Ray worker reserved no GPU (resources.<phase>.num_gpus is 0; "
                     f"{facts.describe()}); computing on the CPU")
    if not facts.cuda_usable:
        if requested == "cuda":
            raise ConfigError(
                f"model.device is 'cuda' but this worker sees no CUDA device ({facts.describe()}); give the phase "
                f"GPUs (resources.<phase>.num_gpus >= 1) on a GPU cluster, or use model.device: auto")
        return CPU, f"model.device=auto: no CUDA device usable here ({facts.describe()}); computing on the CPU"
    if facts.ray_gpu_ids is None:
        return torch.device("cuda", 0), f"model.device={requested}: the first visible CUDA device ({facts.describe()})"
    index = _first_assigned(facts, facts.ray_gpu_ids)
    why = f"model.device={requested}: cuda:{index}, the first GPU Ray assigned to this worker ({facts.describe()})"
    return torch.device("cuda", index), why


def _first_assigned(facts: DeviceFacts, assigned: tuple[str, ...]) -> int:
    """The CUDA index of the first assigned GPU (``assigned``: Ray's GPU ids, ``facts.ray_gpu_ids``): its
    position among the visible devices (0 when Ray narrowed them to the assigned ones), or its id when
    every device is visible."""
    if facts.visible is None:
        return min(int(gpu) for gpu in assigned)
    positions = [facts.visible.index(gpu) for gpu in assigned if gpu in facts.visible]
    if not positions:
        raise ConfigError(f"Ray assigned this worker GPUs it cannot see ({facts.describe()}); do not set "
                          f"CUDA_VISIBLE_DEVICES in the phase's runtime environment: Ray sets it")
    return min(positions)


def device_facts() -> DeviceFacts:
    """The facts in this process. Ray is asked only if already imported (a Ray worker has imported it;
    importing it here would cost the inline backend a second for nothing), and only in a worker:
    a driver holds no GPUs of its own."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ray = sys.modules.get("ray")
    ray_gpu_ids = None
    if ray is not None and ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE:
        ray_gpu_ids = tuple(str(gpu) for gpu in ray.get_gpu_ids())
    return DeviceFacts(
        ray_gpu_ids=ray_gpu_ids,
        cuda_usable=torch.cuda.is_available(),
        visible=None if visible is None else tuple(v.strip() for v in visible.split(",") if v.strip()),
    )


def hide_unreserved_gpus() -> bool:
    """In a Ray worker that reserved no GPU, make CUDA see none (``CUDA_VISIBLE_DEVICES`` empty): Ray 2.60
    leaves it as the node has it, so a library that picks "the first visible GPU" by itself (vLLM does)
    would compute on a GPU another actor reserved. Call before anything initialises CUDA. Returns whether
    the GPUs were hidden."""
    if device_facts().ray_gpu_ids == ():
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        return True
    return False


def resolve_device(requested: str) -> torch.device:
    """The torch device for ``requested``, said once per process and reason.

    Raises:
        ConfigError: see :func:`choose_device`.
    """
    if requested == "cpu":
        return CPU
    device, why = choose_device(requested, device_facts())
    if why not in _SAID:
        _SAID.add(why)
        log.info(why)
    return device


__all__ = ["DeviceFacts", "choose_device", "device_facts", "hide_unreserved_gpus", "resolve_device"]
