"""The loop every Ray Train worker of the update runs (``train_loop_per_worker``).

Each worker loads policy version ``v`` (the whole model for ddp, only its rows for
fsdp2) in ``model.train_dtype``, computes the old and reference log-probs of its
contiguous share of the epoch's rows in micro-batches and all-gathers them, then takes
its contiguous share of every minibatch (the same seeded permutation as one process),
in micro-batches of ``resources.update.micro_batch_size`` rows. Each micro-batch's loss
is weighted by its share of the minibatch's tokens (``token-mean``) or sequences
(``seq-mean-*``) times the worker count (``update_steps.micro_batches``), so the
framework's gradient *average* (DDP's all-reduce, FSDP2's reduce-scatter) is the
one-process gradient of the whole minibatch up to float summation order. Every worker
then clips and steps. Tensors handed to collectives live on the worker's device (the
process group is ``cpu:gloo,cuda:nccl`` on GPUs, ``launch.process_group_backend``).

Outputs go straight to the unit's attempt prefix in the store: ddp: rank 0 writes the
HF folder and the optimizer state; fsdp2: the full weights gathered once and streamed
by rank 0, and every rank its own optimizer shard. Rank 0 hands the file list, the
metric sums and the step count to the driver, which commits (``phases/update.py``).
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from verl_tasks import hooks as process_hooks
from verl_tasks.config import UpdateStrategy, parse_config
from verl_tasks.models.checkpoint import (
    OPTIMIZER_INDEX,
    WEIGHTS,
    load_optimizer,
    load_policy,
    optimizer_index,
    optimizer_shard_name,
    save_optimizer,
    save_optimizer_shard,
    save_policy,
)
from verl_tasks.phases.common import PhaseContext, deterministic_kernels, policy_folder
from verl_tasks.phases.update_steps import UpdateInputs, autocast_dtype, epoch_inputs, frozen_logprobs, train_steps
from verl_tasks.store import store_for
from verl_tasks.store.conventions import METRICS, TRAINER_STATE, is_optimizer_state
from verl_tasks.store.units import UnitWriter
from verl_tasks.train import sharding
from verl_tasks.train.logprobs import ResponseLogProbs


def train_loop(job: dict[str, Any]) -> None:
    """One worker's whole update; ``job`` is what ``launch.train_on_workers`` built (plain values)."""
    import ray.train
    from ray.train.torch import get_device
    from transformers import AutoTokenizer

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    config = parse_config(job["config"])
    torch.set_num_threads(max(1, config.torch_threads // world))
    deterministic_kernels()
    ctx = PhaseContext(config, store_for(config))
    algo, temperature = config.algorithm, config.rollout.temperature
    device = get_device()
    folder = policy_folder(ctx, job["policy_version"])[0]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    inputs = epoch_inputs(job["samples"], tokenizer.pad_token_id, algo.norm_adv_by_std).to(device)

    micro = config.phase_resources("update").micro_batch_size
    model, core = build(folder, config, device, world, train=True)
    optimizer = torch.optim.AdamW(core.parameters(), lr=algo.lr, betas=algo.betas, weight_decay=algo.weight_decay)
    if job["resume_optimizer"]:
        load_optimizer(optimizer, core, folder)
    if not job["single_step"]:
        inputs.old_logp = sharded_logprobs(model, inputs, temperature, micro, rank, world)
    if algo.kl_type.value != "none":
        ref = build(policy_folder(ctx, 0)[0], config, device, world, train=False)[0]
        inputs.ref_logp = sharded_logprobs(ref, inputs, temperature, micro, rank, world)
        del ref

    def on_step(step: int) -> None:
        process_hooks.fire("update_worker_step", experiment=config.experiment, epoch=job["epoch"], rank=rank,
                           step=step)

    started = time.monotonic()
    per_step = train_steps(model, optimizer, inputs, algo, temperature, job["seed"], on_step, job["first_step"],
                           micro_batch_size=micro, rank=rank, world=world)
    per_step = sum_over_workers(per_step, device)
    trained_at = time.monotonic()
    writer = UnitWriter(ctx.store, job["unit"], job["attempt"])
    hyper = save_outputs(model, core, optimizer, tokenizer, folder, writer, rank, world)
    files = gather_files(writer, world)
    if rank == 0:
        ran = {"device": str(device), "train_s": round(trained_at - started, 3),
               "write_s": round(time.monotonic() - trained_at, 3)}
        job["results"].put({"files": files, "per_step": per_step, "optimizer": hyper, "ran": ran})


def build(folder: Path, config: Any, device: torch.device, world: int, *,
          train: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the module to call: a ``ResponseLogProbs``, wrapped; the causal LM whose parameter names the
    checkpoints use) for the strategy.

    The trained model is in ``model.train_dtype``, a frozen reference in ``model.dtype``. ddp: DDP
    around the trained model's ``ResponseLogProbs`` (autocast to ``model.dtype`` when narrower; a
    frozen reference needs no DDP); fsdp2: the ``ResponseLogProbs`` is the FSDP2 root, its mixed
    precision casts to the compute dtype (``sharding.compute_dtype``).
    """
    res = config.phase_resources("update")
    dtype = config.model.train_dtype if train else config.model.dtype
    if res.strategy == UpdateStrategy.fsdp2:
        model = sharding.sharded(folder, dtype, sharding.compute_dtype(config), device, world, res)
        return model, model.lm
    core = load_policy(folder, dtype)[0].to(device)
    if not train:
        return ResponseLogProbs(core), core
    return sharding.replicated(ResponseLogProbs(core, autocast_dtype(config.model)), device), core


def sharded_logprobs(model: torch.nn.Module, inputs: UpdateInputs, temperature: float, micro_batch_size: int | None,
                     rank: int, world: int) -> torch.Tensor:
    """Frozen log-probs ``[B, R]`` of every row: each worker computes its contiguous share, then all-gather."""
    import torch.distributed as dist

    share = frozen_logprobs(model, inputs, temperature, micro_batch_size, rank, world)
    reshard = getattr(model, "reshard", None)
    if reshard is not None:  # fsdp2 keeps the root's parameters gathered after a forward: shard them again
        reshard()
    counts = [len(chunk) for chunk in torch.tensor_split(torch.arange(len(inputs)), world)]
    padded = share.new_zeros((counts[0], share.size(1)))
    padded[: len(share)] = share
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return torch.cat([part[:count] for part, count in zip(gathered, counts, strict=True)])


def sum_over_workers(per_step: list[dict[str, float]], device: torch.device) -> list[dict[str, float]]:
    """Every worker's per-step metrics added up, in one all-reduce of a steps x metrics tensor (float64, on
    the worker's device: NCCL reduces no CPU tensor). Every worker ran the same steps with the same keys."""
    import torch.distributed as dist

    if not per_step:
        return per_step
    keys = list(per_step[0])
    sums = torch.tensor([[step[k] for k in keys] for step in per_step], dtype=torch.float64, device=device)
    dist.all_reduce(sums)
    return [dict(zip(keys, row, strict=True)) for row in sums.tolist()]


def save_outputs(model: torch.nn.Module, core: torch.nn.Module, optimizer: torch.optim.Optimizer, tokenizer: Any,
                 folder: Path, writer: UnitWriter, rank: int, world: int) -> dict[str, Any]:
    """Write this worker's share of the unit's files into the attempt; returns the optimizer hyperparameters."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    hyper: dict[str, Any] = {}
    with writer.folder() as out:  # this worker's own staging folder: ranks never see each other's files
        if not isinstance(model, FSDPModule):  # ddp: rank 0 holds everything
            if rank == 0:
                core.eval()
                save_policy(core, tokenizer, out)
                hyper = save_optimizer(optimizer, core, out)
        else:
            sharding.write_full_weights(core, out / WEIGHTS if rank == 0 else None)
            rows = save_optimizer_shard(optimizer, core, out / optimizer_shard_name(rank))
            every: list[Any] = [None] * world
            dist.all_gather_object(every, rows)
            if rank == 0:
                copy_policy_files(folder, out)
                index = optimizer_index(optimizer, {optimizer_shard_name(r): every[r] for r in range(world)})
                (out / OPTIMIZER_INDEX).write_text(json.dumps(index, sort_keys=True, indent=1))
                hyper = {"param_groups": index["param_groups"]}
    writer.store.make_durable()  # the driver writes the marker, in another process
    return hyper


def copy_policy_files(folder: Path, out: Path) -> None:
    """The HF config, generation config and tokenizer files of the version trained (weights written apart)."""
    for path in sorted(folder.iterdir()):
        skip = path.name in (WEIGHTS, TRAINER_STATE, METRICS, "model.safetensors.index.json")
        if path.is_file() and not skip and not is_optimizer_state(path.name) and not path.name.startswith("."):
            shutil.copyfile(path, out / path.name)


def gather_files(writer: UnitWriter, world: int) -> dict[str, list]:
    """Every worker's written files as ``{name: [size, sha256]}`` (the driver lists them in the marker)."""
    import torch.distributed as dist

    mine = {name: [entry.size, entry.sha256] for name, entry in writer.files.items()}
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    return {name: entry for part in every for name, entry in part.items()}
