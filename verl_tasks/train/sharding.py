"""The model one update worker trains: replicated (DDP) or sharded per transformer block (FSDP2).

Either way the module called is a :class:`~verl_tasks.train.logprobs.ResponseLogProbs` around
the causal LM: DDP wraps it, and for FSDP2 it is the root, so the root's pre-forward hook
gathers the embeddings and the LM head that its chunked log-probs use.
FSDP2 never materialises the whole model on a worker: parameters are created on the
``meta`` device, sharded (``fully_shard`` on every transformer block, then the root),
allocated, and each worker reads only its rows of every weight from the safetensors
file. Writing the trained weights goes the other way, one parameter at a time: all
ranks gather it, rank 0 appends it to a safetensors file whose header it wrote first,
so at most one full parameter is in memory besides the shards.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from verl_tasks.config import ExperimentConfig, MixedPrecision, Resources, UpdateStrategy
from verl_tasks.errors import IntegrityError
from verl_tasks.models.checkpoint import WEIGHTS, load_policy, local_rows, params_on_meta, refuse_pickles
from verl_tasks.models.safetensors_io import TensorSpec, TensorWriter, Written
from verl_tasks.phases.update_steps import autocast_dtype
from verl_tasks.train.logprobs import ResponseLogProbs

log = logging.getLogger(__name__)


def replicated(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The model wrapped in DistributedDataParallel: gradients averaged over the workers by the framework.

    Parameters that do not train (a LoRA run's base) are left out of DDP: every worker loaded the same bytes, so
    neither the start-up broadcast from rank 0 nor the gradient all-reduce has anything to carry for them.
    """
    from torch.nn.parallel import DistributedDataParallel

    model.to(device)
    frozen = [name for name, param in model.named_parameters() if not param.requires_grad]
    if frozen:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, frozen)
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def process_group_backend(use_gpu: bool) -> str:
    """The torch.distributed backend of the update's workers: ``gloo`` on CPU; on GPUs NCCL for CUDA
    tensors *and* gloo for CPU ones (``cpu:gloo,cuda:nccl``), since some collectives run on host memory
    (FSDP2 with ``cpu_offload``: the gradient norm and the full weights are computed from CPU shards)."""
    return "cpu:gloo,cuda:nccl" if use_gpu else "gloo"


def compute_dtype(config: ExperimentConfig) -> str:
    """The dtype an fsdp2 worker computes in: ``resources.update.mixed_precision`` when set, else ``model.dtype``.

    So ``model.dtype: bfloat16`` with float32 ``model.train_dtype`` computes in bfloat16 over float32
    shards without setting ``mixed_precision``; setting it overrides the compute dtype for the update only.
    """
    chosen = config.phase_resources("update").mixed_precision
    return {MixedPrecision.bf16: "bfloat16", MixedPrecision.fp16: "float16"}.get(chosen, config.model.dtype)


def sharded(folder: Path, dtype: str, compute: str, device: torch.device, world_size: int,
            res: Resources) -> ResponseLogProbs:
    """Policy ``folder`` as the FSDP2 root ``ResponseLogProbs``: parameters (in ``dtype``), gradients and
    optimizer state sharded over the workers; forward and backward in ``compute``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    refuse_pickles(folder)
    with params_on_meta():
        lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=getattr(torch, dtype))
    model = ResponseLogProbs(lm)
    buffers = {name: buf.detach().clone() for name, buf in lm.named_buffers()}  # computed at init, not stored
    options = fsdp_options(res, init_device_mesh(device.type, (world_size,)), device, dtype, compute)
    for block in transformer_blocks(lm):
        fully_shard(block, **options)
    fully_shard(model, **options)
    model.to_empty(device="cpu" if "offload_policy" in options else device)
    with torch.no_grad():
        load_local_rows(lm, folder)
        for name, buf in lm.named_buffers():
            buf.copy_(buffers[name])
    return model


def fsdp_options(res: Resources, mesh: Any, device: torch.device, dtype: str, compute: str) -> dict[str, Any]:
    """``fully_shard`` keyword arguments: mixed precision when ``compute`` differs from the parameters'
    ``dtype`` (gradients reduced in float32), CPU offload from ``resources.update``.

    CPU offload moves shards from an accelerator to host memory; a CPU worker's shards are there
    already (and FSDP2 refuses the policy without an accelerator), so it is ignored there.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    options: dict[str, Any] = {"mesh": mesh}
    if compute != dtype:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=getattr(torch, compute), reduce_dtype=torch.float32)
    if res.cpu_offload and device.type != "cpu":
        options["offload_policy"] = CPUOffloadPolicy()
    elif res.cpu_offload:
        log.info("resources.update.cpu_offload: this worker computes on the CPU, its shards are in host memory already")
    return options


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks (HF's ``_no_split_modules``: e.g. ``LlamaDecoderLayer``), each one FSDP unit."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"{type(model).__name__} names no transformer block class (_no_split_modules); "
                         f"fsdp2 shards per block: use strategy: ddp for this model")
    return blocks


def weight_files(folder: Path) -> dict[str, Path]:
    """Which safetensors file of an HF folder holds each tensor (one file, or HF's sharded index)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {name: folder / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    with safe_open(str(folder / WEIGHTS), "pt") as f:
        return {name: folder / WEIGHTS for name in f.keys()}


def load_local_rows(model: torch.nn.Module, folder: Path) -> None:
    """Copy this worker's rows of every parameter from the folder's safetensors files (nothing else is read)."""
    files = weight_files(folder)
    handles: dict[Path, Any] = {}
    for name, param in model.named_parameters():
        if name not in files:
            raise IntegrityError(str(folder), [f"{name} is not in the policy's weights"])
        path = files[name]
        handle = handles.get(path) or handles.setdefault(path, safe_open(str(path), "pt"))
        start, stop = local_rows(param)
        local = param.to_local() if hasattr(param, "to_local") else param
        local.copy_(handle.get_slice(name)[start:stop])


def write_full_weights(model: torch.nn.Module, path: Path | None, *, keep: bool = False
                       ) -> tuple[Written, list[tuple[str, torch.Tensor]]] | None:
    """Gather the full weights one parameter at a time; the writer (``path`` given) streams them to safetensors,
    hashing as it writes.

    Every worker must call this (each parameter is an all-gather); only one passes a path, and gets the
    file's size and sha256 back, with the gathered tensors (on the CPU) when ``keep``: the weights'
    in-memory handover. Parameters as ``named_parameters`` lists them: a tied weight once, as HF saves it.
    """
    params = list(model.named_parameters())
    writer = TensorWriter(path, [TensorSpec(n, p.dtype, tuple(p.shape)) for n, p in params], {"format": "pt"}) \
        if path is not None else None
    kept: list[tuple[str, torch.Tensor]] = []
    with torch.no_grad():
        for name, param in params:
            full = param.full_tensor() if hasattr(param, "full_tensor") else param.detach()
            if writer is not None:
                host = full.cpu()
                writer.write(host)
                if keep:
                    kept.append((name, host))
            del full
    return None if writer is None else (writer.close(), kept)


def build(folder: Any, config: Any, device: torch.device, world: int, *,
          train: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the module to call: a ``ResponseLogProbs``, wrapped; the causal LM whose parameter names the
    checkpoints use) for the strategy.

    The trained model is in ``model.train_dtype``, a frozen reference in ``model.dtype``. ddp: DDP
    around the trained model's ``ResponseLogProbs`` (autocast to ``model.dtype`` when narrower; a
    frozen reference needs no DDP); fsdp2: the ``ResponseLogProbs`` is the FSDP2 root, its mixed
    precision casts to the compute dtype (``compute_dtype``).
    """
    res = config.phase_resources("update")
    dtype = config.model.train_dtype if train else config.model.dtype
    if res.strategy == UpdateStrategy.fsdp2:
        model = sharded(folder, dtype, compute_dtype(config), device, world, res)
        return model, model.lm
    core = load_policy(folder, dtype)[0].to(device)
    if not train:
        return ResponseLogProbs(core), core
    return replicated(ResponseLogProbs(core, autocast_dtype(config.model)), device), core
