"""The loop every Ray Train worker of the update runs (``train_loop_per_worker``).

Each worker loads policy version ``v`` (the whole model for ddp, only its rows for
fsdp2), computes the old and reference log-probs of its contiguous share of the
epoch's rows and all-gathers them, then takes its contiguous share of every
minibatch (the same seeded permutation as one process). Its loss is weighted by its
share of the minibatch's tokens (``token-mean``) or sequences (``seq-mean-*``) times
the worker count, so the framework's gradient *average* (DDP's all-reduce, FSDP2's
reduce-scatter) is the one-process gradient of the whole minibatch up to float
summation order. Every worker then clips and steps.

Outputs go straight to the unit's attempt prefix in the store: ddp: rank 0 writes the
HF folder and the optimizer state; fsdp2: the full weights gathered once and streamed
by rank 0, and every rank its own optimizer shard. Rank 0 hands the file list, the
metric sums and the step count to the driver, which commits (``phases/update.py``).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from verl_tasks import hooks as process_hooks
from verl_tasks.config import AlgorithmConfig, UpdateStrategy, parse_config
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
from verl_tasks.phases.update_steps import (
    UpdateInputs,
    accumulate,
    epoch_inputs,
    minibatch_loss,
    minibatch_rows,
    response_logprobs,
    select_rows,
    set_lr,
)
from verl_tasks.store import store_for
from verl_tasks.store.conventions import METRICS, TRAINER_STATE, is_optimizer_state
from verl_tasks.store.units import UnitWriter
from verl_tasks.train import sharding


# Metrics that are token means whatever the loss aggregation mode (see ``policy_loss_vanilla``).
TOKEN_MEAN_METRICS = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")


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

    model, core = build(folder, config, device, world, train=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=algo.lr, betas=algo.betas, weight_decay=algo.weight_decay)
    if job["resume_optimizer"]:
        load_optimizer(optimizer, core, folder)
    if not job["single_step"]:
        inputs.old_logp = sharded_logprobs(model, inputs, temperature, rank, world)
    if algo.kl_type.value != "none":
        ref = build(policy_folder(ctx, 0)[0], config, device, world, train=False)[0]
        inputs.ref_logp = sharded_logprobs(ref, inputs, temperature, rank, world)
        del ref

    def on_step(step: int) -> None:
        process_hooks.fire("update_worker_step", experiment=config.experiment, epoch=job["epoch"], rank=rank,
                           step=step)

    totals, steps = train_steps(model, optimizer, inputs, algo, temperature, job["seed"], job["first_step"], on_step)
    writer = UnitWriter(ctx.store, job["unit"], job["attempt"])
    hyper = save_outputs(model, core, optimizer, tokenizer, folder, writer, rank, world)
    files = gather_files(writer, world)
    if rank == 0:
        job["results"].put({"files": files, "totals": totals, "steps": steps, "optimizer": hyper})


def build(folder: Path, config: Any, device: torch.device, world: int, *,
          train: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the module to call, the module whose parameter names the checkpoints use) for the strategy.

    ddp: DDP around the full model (a frozen reference model needs no wrapper); fsdp2: one
    sharded module, both roles.
    """
    res = config.phase_resources("update")
    if res.strategy == UpdateStrategy.fsdp2:
        model = sharding.sharded(folder, config.model.dtype, device, world, res)
        return model, model
    core = load_policy(folder, config.model.dtype)[0].to(device)
    return (sharding.replicated(core, device) if train else core), core


def sharded_logprobs(model: torch.nn.Module, inputs: UpdateInputs, temperature: float, rank: int,
                     world: int) -> torch.Tensor:
    """Frozen log-probs ``[B, R]`` of every row: each worker computes its contiguous share, then all-gather.

    A worker without rows (fewer rows than workers) still runs one forward, since fsdp2's
    forward is collective; its result is dropped.
    """
    import torch.distributed as dist

    chunks = torch.tensor_split(torch.arange(len(inputs)), world)
    rows = chunks[rank] if len(chunks[rank]) else chunks[0][:1]
    with torch.no_grad():
        model.eval()
        logp = response_logprobs(model, select_rows(inputs.data, rows), temperature)[0]
    if hasattr(model, "reshard"):  # fsdp2 keeps the root's parameters gathered after a forward: shard them again
        model.reshard()
    padded = logp.new_zeros((len(chunks[0]), logp.size(1)))
    padded[: len(chunks[rank])] = logp[: len(chunks[rank])]
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return torch.cat([part[: len(chunk)] for part, chunk in zip(gathered, chunks)])


def shard_rows(
    inputs: UpdateInputs, rows: torch.Tensor, rank: int, world: int, loss_agg_mode: str
) -> tuple[torch.Tensor, float, float]:
    """This worker's rows of a minibatch and its weights (loss weight, token-mean weight).

    The rows are split into ``world`` contiguous parts. A worker left without rows (a
    minibatch shorter than the worker count) runs one row with weight 0, so every worker
    takes part in every collective of the step.
    """
    shard = torch.tensor_split(rows, world)[rank]
    if len(shard) == 0:
        return rows[:1], 0.0, 0.0
    mask = inputs.data["response_mask"]
    token_w = float(mask[shard].sum()) / max(float(mask[rows].sum()), 1.0)
    loss_w = token_w if loss_agg_mode == "token-mean" else len(shard) / len(rows)
    return shard, loss_w, token_w


def train_steps(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: UpdateInputs, algo: AlgorithmConfig,
    temperature: float, seed: int, first_step: int, on_step: Any,
) -> tuple[dict[str, float], int]:
    """This worker's part of the optimisation from global step ``first_step``. Returns (global metric sums, steps)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model.train()
    totals: dict[str, float] = {}
    steps = 0
    for rows in minibatch_rows(len(inputs), algo, seed):
        shard, loss_w, token_w = shard_rows(inputs, rows, rank, world, algo.loss_agg_mode.value)
        loss, metrics = minibatch_loss(model, inputs, shard, algo, temperature)
        on_step(steps + 1)
        optimizer.zero_grad(set_to_none=True)
        (loss * (loss_w * world)).backward()  # the framework averages over workers: the sum is wanted
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), algo.grad_clip)
        set_lr(optimizer, algo, first_step + steps)
        optimizer.step()
        metrics["actor/loss"] = loss.item()
        weighted = {k: v * (token_w if k in TOKEN_MEAN_METRICS else loss_w) for k, v in metrics.items()}
        norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        weighted["actor/grad_norm"] = float(norm) if rank == 0 else 0.0  # the same on every worker
        accumulate(totals, weighted)
        steps += 1
    keys = list(totals)
    sums = torch.tensor([totals[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(sums)
    return dict(zip(keys, sums.tolist())), steps


def save_outputs(model: torch.nn.Module, core: torch.nn.Module, optimizer: torch.optim.Optimizer, tokenizer: Any,
                 folder: Path, writer: UnitWriter, rank: int, world: int) -> dict[str, Any]:
    """Write this worker's share of the unit's files into the attempt; returns the optimizer hyperparameters."""
    import torch.distributed as dist

    hyper: dict[str, Any] = {}
    with writer.folder() as out:  # this worker's own staging folder: ranks never see each other's files
        if model is not core:  # ddp: rank 0 holds everything
            if rank == 0:
                core.eval()
                save_policy(core, tokenizer, out)
                hyper = save_optimizer(optimizer, core, out)
        else:
            sharding.write_full_weights(model, out / WEIGHTS if rank == 0 else None)
            rows = save_optimizer_shard(optimizer, model, out / optimizer_shard_name(rank))
            every = [None] * world
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
