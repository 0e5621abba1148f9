"""One worker of a resident group (a Ray actor; :mod:`verl_tasks.train.group` forms the group): the update's,
or PPO's critic's (:meth:`UpdateWorker.critic`, which keeps nothing between units).

Each worker holds policy version ``v`` (the whole model for ddp, only its rows for fsdp2) in
``model.train_dtype``, computes the old and reference log-probs of its contiguous share of the
epoch's rows in micro-batches and all-gathers them, then takes its contiguous share of every
minibatch (the same seeded permutation as one process), in micro-batches of
``resources.update.micro_batch_size`` rows. Each micro-batch's loss is weighted by its share of
the minibatch's tokens (``token-mean``) or sequences (``seq-mean-*``) times the worker count
(``update_steps.micro_batches``), so the framework's gradient *average* (DDP's all-reduce,
FSDP2's reduce-scatter) is the one-process gradient of the whole minibatch up to float
summation order. Every worker then clips and steps. Tensors handed to collectives live on the
worker's device (``cpu:gloo,cuda:nccl`` on GPUs, ``sharding.process_group_backend``).

**Resident state.** After an update the worker keeps the model it trained, its AdamW state and
the tokenizer, keyed by the checksums of the bytes it wrote (the weights' sha256 and the
optimizer files' checksums: what the committed snapshot lists when this attempt's commit won),
with the strategy, dtypes, device and AdamW's betas and weight decay. A unit that starts from a
policy with that key trains on it and reads nothing from the store; any other key (another
version, a retried epoch, a cleared task, a fork, a commit won by another attempt with other
bytes) loads from the store. The ranks agree first (an all-reduce) that every one holds the
key, so all take the same branch. The state is forgotten before training starts and keyed
again only once this attempt's files are written: a failure half-way leaves nothing that could
pass for a committed version. The frozen KL reference stays resident the same way, keyed by the
base weights' sha256.

**LoRA** (``model.lora``, ddp only): each worker holds the frozen base with the adapter; DDP all-reduces
the adapter's gradients only, the KL reference is the same model with the adapter off, and the resident
state is keyed by the adapter's sha256. Rank 0 writes the adapter and its AdamW state; nothing is handed
over in memory (rollout workers apply the adapter, a few MB from the store, to the base they hold).

**Outputs** go straight to the unit's attempt in the store, each file hashed while it is
written: ddp, rank 0 writes the HF folder and the optimizer state; fsdp2, the full weights
gathered one parameter at a time and streamed by rank 0, and every rank its own optimizer
shard. Rank 0 also puts the new weights into Ray's object store (``handover``) for rollout
and evaluation workers elsewhere, and returns the file list, the metric sums and the step
count to the driver, which commits (``phases/update.py``).
"""
from __future__ import annotations

import json
import logging
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import ray
import torch

from verl_tasks import hooks as process_hooks
from verl_tasks.config import ExperimentConfig, parse_config
from verl_tasks.errors import PhaseFailed
from verl_tasks.models import handover
from verl_tasks.models.checkpoint import (
    OPTIMIZER_INDEX,
    WEIGHTS,
    load_optimizer,
    optimizer_index,
    optimizer_shard_name,
    save_configs,
    save_optimizer_shard,
    save_policy_and_optimizer,
)
from verl_tasks.models.safetensors_io import unique_state
from verl_tasks.phases.common import PhaseContext, derive_seed, deterministic_kernels, policy_folder, require
from verl_tasks.phases.update_inputs import PolicyState, UpdateSource
from verl_tasks.phases.update_lora import lora_policy, seeded_dropout, write_lora
from verl_tasks.phases.update_steps import (
    UpdateInputs,
    autocast_dtype,
    check_finite,
    epoch_inputs,
    frozen_logprobs,
    train_steps,
)
from verl_tasks.store import store_for
from verl_tasks.store.conventions import ADAPTER, optimizer_state_of
from verl_tasks.store.units import UnitWriter
from verl_tasks.train import sharding
from verl_tasks.train.logprobs import ResponseLogProbs

log = logging.getLogger(__name__)


@dataclass
class Resident:
    """A trained policy this worker keeps between units, and what it must equal to be used."""

    key: tuple
    model: torch.nn.Module  # what the update calls (DDP or the FSDP2 root around a ResponseLogProbs)
    core: torch.nn.Module  # the causal LM, whose parameter names the checkpoints use
    optimizer: torch.optim.Optimizer
    tokenizer: Any


class UpdateWorker:
    """Rank ``rank`` of a group of ``world``; ``group`` names the group it was formed in."""

    def __init__(self, rank: int, world: int, group: str) -> None:
        from verl_tasks.models.device import hide_unreserved_gpus
        from verl_tasks.quiet import quiet_own_process

        hide_unreserved_gpus()  # a worker that reserved no GPU trains on the CPU, never on another's GPU
        quiet_own_process()
        logging.getLogger().setLevel(logging.INFO)
        self.rank, self.world, self.group = rank, world, group
        self.policy: Resident | None = None
        self.reference: tuple[tuple, torch.nn.Module] | None = None
        self.device = self._device()

    @staticmethod
    def _device() -> torch.device:
        """``cuda:0`` when Ray gave this actor a GPU (its only visible one) and CUDA works, else the CPU."""
        return torch.device("cuda", 0) if ray.get_gpu_ids() and torch.cuda.is_available() else torch.device("cpu")

    @ray.method(concurrency_group="work")
    def rendezvous(self) -> str:
        """``host:port`` for the group's TCP store (asked of rank 0): this node's address and a free port."""
        from verl_tasks.execution.ports import free_port

        host = ray.util.get_node_ip_address()
        return f"{host}:{free_port()}"

    @ray.method(concurrency_group="work")
    def join(self, address: str, timeout_s: float) -> dict[str, Any]:
        """Join the group's process group (every rank calls this at once); returns where this rank runs."""
        import torch.distributed as dist

        backend = sharding.process_group_backend(self.device.type == "cuda")
        dist.init_process_group(backend, init_method=f"tcp://{address}", rank=self.rank, world_size=self.world,
                                timeout=timedelta(seconds=timeout_s))
        return {"rank": self.rank, "pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
                "device": str(self.device), "backend": backend}

    @ray.method(concurrency_group="control")
    def describe(self) -> dict[str, Any]:
        """The group it belongs to and what it holds (answered while a unit runs: its own thread)."""
        return {"group": self.group, "rank": self.rank, "pid": os.getpid(),
                "holds": None if self.policy is None else self.policy.key[0]}

    @ray.method(concurrency_group="work")
    def train(self, job: dict[str, Any]) -> dict[str, Any]:
        """This worker's whole update of one attempt (``group.train_on_workers`` built ``job``)."""
        config = parse_config(job["config"])
        source: UpdateSource = job["source"]
        torch.set_num_threads(max(1, config.torch_threads // self.world))
        deterministic_kernels()
        ctx = PhaseContext(config, store_for(config))
        algo, temperature = config.algorithm, config.rollout.temperature
        micro = config.phase_resources("update").micro_batch_size
        started = time.monotonic()
        lora = config.model.lora is not None
        base = base_weights_sha256(ctx) if lora else None  # what a LoRA policy's adapter applies to
        model, core, optimizer, tokenizer, how = self._policy(ctx, config, source.start, base)
        inputs = epoch_inputs(source.samples, tokenizer.pad_token_id, algo, config.rollout.max_new_tokens,
                              source.advantages)
        inputs = inputs.to(self.device)
        if not source.single_step:
            inputs.old_logp = sharded_logprobs(model, inputs, temperature, micro, self.rank, self.world)
        if source.reference is not None and lora:
            peft: Any = core
            with peft.disable_adapter():  # the base: the trained model with its adapter off
                inputs.ref_logp = sharded_logprobs(model, inputs, temperature, micro, self.rank, self.world)
        elif source.reference is not None:
            ref = self._reference(ctx, config, source.reference)
            inputs.ref_logp = sharded_logprobs(ref, inputs, temperature, micro, self.rank, self.world)

        def on_step(step: int) -> None:
            process_hooks.fire("update_worker_step", experiment=config.experiment, epoch=source.epoch,
                               rank=self.rank, step=step)

        loaded_at = time.monotonic()
        with seeded_dropout(self.device, source.update_seed + self.rank) if lora else nullcontext():
            per_step = train_steps(model, optimizer, inputs, algo, temperature, source.update_seed, on_step,
                                   source.first_step, micro_batch_size=micro, rank=self.rank, world=self.world)
        per_step = sum_over_workers(per_step, self.device)
        check_finite(core, optimizer)
        trained_at = time.monotonic()
        writer = UnitWriter(ctx.store, job["unit"], job["attempt"])
        if lora:
            assert base is not None
            hyper, handed = save_adapter_outputs(core, optimizer, tokenizer, writer, self.rank, base)
        else:
            hyper, handed = save_outputs(model, core, optimizer, tokenizer, writer, self.rank, self.world)
        files = gather_files(writer, self.world)
        policy_file = ADAPTER if lora else WEIGHTS
        self.policy = Resident(self._key(config, files[policy_file][1], optimizer_state_of(files), base), model,
                               core, optimizer, tokenizer)
        if self.rank != 0:
            return {"rank": self.rank}
        ran = {"device": str(self.device), "policy": how, "load_s": round(loaded_at - started, 3),
               "train_s": round(trained_at - loaded_at, 3), "write_s": round(time.monotonic() - trained_at, 3),
               "write_bytes": sum(size for size, _sha in files.values())}
        if lora:
            ran["trainable_parameters"] = sum(p.numel() for p in core.parameters() if p.requires_grad)
        return {"files": files, "per_step": per_step, "optimizer": hyper, "ran": ran, "handover": handed}

    @ray.method(concurrency_group="work")
    def critic(self, job: dict[str, Any]) -> dict[str, Any]:
        """This worker's share of one critic unit: the critic of the policy version trained (read from the
        store: the critic is not kept resident), its values of this worker's rows all-gathered, GAE on every
        worker alike, its share of every minibatch's value loss; rank 0 writes the unit's files."""
        import tempfile
        from pathlib import Path

        from verl_tasks.phases.critic import (
            checked_finite,
            critic_advantages,
            critic_at,
            critic_metrics,
            train_critic,
            values_of,
            write_critic_unit,
        )
        from verl_tasks.phases.update import release_gpu_memory
        from verl_tasks.phases.update_steps import collate

        config = parse_config(job["config"])
        source: UpdateSource = job["source"]
        torch.set_num_threads(max(1, config.torch_threads // self.world))
        deterministic_kernels()
        ctx = PhaseContext(config, store_for(config))
        micro = config.phase_resources("critic").micro_batch_size
        started = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            value_model, optimizer = critic_at(ctx, source, Path(tmp), self.device)
        model = sharding.replicated(value_model, self.device)
        data = {k: v.to(self.device) for k, v in collate(source.samples, pad_id=0).items()}
        old_values = all_gather_rows(values_of(model, data, micro, self.rank, self.world), len(source.samples),
                                     self.world)
        advantages, returns = critic_advantages(ctx, source, data, old_values)
        loaded_at = time.monotonic()
        per_step = train_critic(model, optimizer, data, old_values, returns, ctx,
                                derive_seed(config.seed, source.epoch, "critic"), source.epoch, self.rank, self.world)
        per_step = sum_over_workers(per_step, self.device)
        value_model.eval()
        writer = UnitWriter(ctx.store, job["unit"], job["attempt"])
        checked_finite(writer.unit, value_model, optimizer)
        trained_at = time.monotonic()
        hyper: dict[str, Any] = {}
        if self.rank == 0:
            hyper = write_critic_unit(writer, value_model, optimizer, source,
                                      {"advantages": advantages, "returns": returns, "values": old_values})
        writer.store.make_durable()
        files = gather_files(writer, self.world)
        metrics = critic_metrics(ctx, per_step, old_values, returns, data["response_mask"])
        del model, value_model, optimizer
        release_gpu_memory()  # nothing is kept: an idle critic worker holds no GPU memory
        if self.rank != 0:
            return {"rank": self.rank}
        ran = {"device": str(self.device), "workers": self.world, "load_s": round(loaded_at - started, 3),
               "train_s": round(trained_at - loaded_at, 3), "write_s": round(time.monotonic() - trained_at, 3)}
        return {"files": files, "metrics": metrics, "optimizer": hyper, "ran": ran, "steps": len(per_step)}

    def _key(self, config: ExperimentConfig, weights_sha256: str, optimizer_state: str | None,
             base_sha256: str | None) -> tuple:
        """What a resident policy must equal to be trained on: the bytes it equals, and how it is held (with
        LoRA: the adapter, its LoRA settings, and the base weights it applies to)."""
        algo, res = config.algorithm, config.phase_resources("update")
        lora = None if config.model.lora is None else config.model.lora.model_dump_json()
        return ((weights_sha256, optimizer_state), res.strategy.value, config.model.train_dtype,
                sharding.compute_dtype(config), str(self.device), tuple(algo.betas), algo.weight_decay, lora,
                base_sha256)

    def _policy(self, ctx: PhaseContext, config: ExperimentConfig, start: PolicyState, base_sha256: str | None
                ) -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer, Any, str]:
        """The policy to train: the resident one when every rank holds exactly ``start``, else from the store."""
        held, self.policy = self.policy, None  # forgotten until this attempt's files are written
        want = self._key(config, *start.key, base_sha256)
        if all_agree(held is not None and held.key == want, self.device):
            assert held is not None
            return held.model, held.core, held.optimizer, held.tokenizer, "resident"
        del held  # its memory goes before the store's copy is loaded
        if config.model.lora is not None:  # ddp: each worker holds the base and the adapter
            peft, optimizer, tokenizer, loaded_base = lora_policy(ctx, start, self.device)
            if loaded_base != base_sha256:
                raise PhaseFailed(ctx.layout.snapshot(0), "the base snapshot's commit changed while the update read "
                                                          "it; rerun the update")
            model = sharding.replicated(ResponseLogProbs(peft, autocast_dtype(config.model)), self.device)
            return model, peft, optimizer, tokenizer, "store"
        from transformers import AutoTokenizer

        algo = config.algorithm
        folder = policy_folder(ctx, start.version, start.record)[0]
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model, core = sharding.build(folder, config, self.device, self.world, train=True)
        optimizer = torch.optim.AdamW(core.parameters(), lr=algo.lr, betas=algo.betas, weight_decay=algo.weight_decay)
        if start.optimizer_state is not None:
            load_optimizer(optimizer, core, folder)
        return model, core, optimizer, tokenizer, "store"

    def _reference(self, ctx: PhaseContext, config: ExperimentConfig, base: PolicyState) -> torch.nn.Module:
        """The frozen KL reference (the base policy in ``model.dtype``), kept resident by its weights' sha256."""
        key = (base.weights_sha256, config.phase_resources("update").strategy.value, config.model.dtype,
               str(self.device))
        if not all_agree(self.reference is not None and self.reference[0] == key, self.device):
            self.reference = None
            folder = policy_folder(ctx, base.version, base.record)[0]
            self.reference = (key, sharding.build(folder, config, self.device, self.world, train=False)[0])
        assert self.reference is not None
        return self.reference[1]


def all_agree(mine: bool, device: torch.device) -> bool:
    """True only when every rank says True (an all-reduce of the minimum)."""
    import torch.distributed as dist

    flag = torch.tensor([1 if mine else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def sharded_logprobs(model: torch.nn.Module, inputs: UpdateInputs, temperature: float, micro_batch_size: int | None,
                     rank: int, world: int) -> torch.Tensor:
    """Frozen log-probs ``[B, R]`` of every row: each worker computes its contiguous share, then all-gather."""
    share = frozen_logprobs(model, inputs, temperature, micro_batch_size, rank, world)
    reshard = getattr(model, "reshard", None)
    if reshard is not None:  # fsdp2 keeps the root's parameters gathered after a forward: shard them again
        reshard()
    return all_gather_rows(share, len(inputs), world)


def all_gather_rows(share: torch.Tensor, rows: int, world: int) -> torch.Tensor:
    """``[rows, ...]`` from every worker's contiguous share of the rows (``torch.tensor_split`` order)."""
    import torch.distributed as dist

    counts = [len(chunk) for chunk in torch.tensor_split(torch.arange(rows), world)]
    padded = share.new_zeros((counts[0], *share.shape[1:]))
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
                 writer: UnitWriter, rank: int, world: int) -> tuple[dict[str, Any], Any]:
    """Write this worker's share of the unit's files into the attempt, each hashed as it is written.

    Returns the optimizer hyperparameters and, on rank 0, the new weights' handover (None elsewhere).
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    hyper: dict[str, Any] = {}
    handed = None
    with writer.folder() as out:  # this worker's own staging folder: ranks never see each other's files
        if not isinstance(model, FSDPModule):  # ddp: rank 0 holds everything
            if rank == 0:
                hyper, written = save_policy_and_optimizer(core, tokenizer, optimizer, out)
                handed = handover.put_weights(unique_state(core), written[WEIGHTS].sha256)
                for name, entry in written.items():
                    writer.note_hashed(name, entry.size, entry.sha256)
        else:
            tensors = sharding.write_full_weights(core, out / WEIGHTS if rank == 0 else None, keep=rank == 0)
            rows, shard = save_optimizer_shard(optimizer, core, out / optimizer_shard_name(rank))
            writer.note_hashed(optimizer_shard_name(rank), shard.size, shard.sha256)
            every: list[Any] = [None] * world
            dist.all_gather_object(every, rows)
            if rank == 0:
                assert tensors is not None
                weights, named = tensors
                writer.note_hashed(WEIGHTS, weights.size, weights.sha256)
                handed = handover.put_weights(named, weights.sha256)
                save_configs(core, tokenizer, out)
                index = optimizer_index(optimizer, {optimizer_shard_name(r): every[r] for r in range(world)})
                (out / OPTIMIZER_INDEX).write_text(json.dumps(index, sort_keys=True, indent=1))
                hyper = {"param_groups": index["param_groups"]}
    writer.store.make_durable()  # the driver writes the marker, in another process
    return hyper, handed


def save_adapter_outputs(core: Any, optimizer: torch.optim.Optimizer, tokenizer: Any, writer: UnitWriter, rank: int,
                         base_sha256: str) -> tuple[dict[str, Any], None]:
    """LoRA (ddp): rank 0 writes the adapter folder and the adapter's AdamW state. Nothing is handed over in
    memory: rollout workers read the adapter (a few MB) from the store and apply it to the base they hold."""
    hyper: dict[str, Any] = {}
    with writer.folder() as out:
        if rank == 0:
            hyper, written = write_lora(core, tokenizer, optimizer, out, base_sha256)
            for name, entry in written.items():
                writer.note_hashed(name, entry.size, entry.sha256)
    writer.store.make_durable()
    return hyper, None


def base_weights_sha256(ctx: PhaseContext) -> str:
    """The base snapshot's weights' sha256, which an adapter's ``base.json`` names."""
    return require(ctx, ctx.layout.snapshot(0), "plan (base snapshot)").files[WEIGHTS].sha256


def gather_files(writer: UnitWriter, world: int) -> dict[str, list]:
    """Every worker's written files as ``{name: [size, sha256]}`` (the driver lists them in the marker)."""
    import torch.distributed as dist

    mine = {name: [entry.size, entry.sha256] for name, entry in writer.files.items()}
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    return {name: entry for part in every for name, entry in part.items()}
