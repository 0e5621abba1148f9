"""Which device a worker computes on: ``model.device`` = ``auto`` | ``cpu`` | ``cuda``.

``auto`` takes the GPU Ray assigned to this worker when CUDA sees one, else the
CPU, and says so once per process. Ray sets ``CUDA_VISIBLE_DEVICES`` for an
actor that reserved ``num_gpus``, so "the first visible device" is the assigned one.
"""
from __future__ import annotations

import logging
import os

import torch

from verl_tasks.errors import ConfigError

log = logging.getLogger(__name__)
_SAID: set[str] = set()


def resolve_device(requested: str) -> torch.device:
    """The torch device for ``requested``. Raises ConfigError for ``cuda`` without a visible GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if requested == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", 0)
    if requested == "cuda":
        raise ConfigError(
            f"model.device is 'cuda' but this worker sees no CUDA device (CUDA_VISIBLE_DEVICES={visible!r}); "
            f"give the phase GPUs (resources.<phase>.num_gpus >= 1) on a GPU cluster, or use model.device: auto"
        )
    message = (f"model.device=auto: no CUDA device usable here (CUDA_VISIBLE_DEVICES={visible!r}, "
               f"assigned by Ray when the phase reserves GPUs); computing on the CPU")
    if message not in _SAID:
        _SAID.add(message)
        log.info(message)
    return torch.device("cpu")


__all__ = ["resolve_device"]
