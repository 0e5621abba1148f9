"""The policy update: GRPO advantages, clipped policy loss, optional KL to the base, AdamW.

Reads policy version ``epoch`` (weights and optimizer moments) and the epoch's
validated samples; writes policy version ``epoch + 1`` into its own unit. The
snapshot phase then publishes it. Nothing here depends on how many workers ran
before, or how they held the model: optimizer state is keyed by parameter name and
indexed by rows, so ``resources.update.workers`` and ``resources.update.strategy``
may change between epochs of one experiment. The loss and the loop live in
``update_steps``; one ddp worker runs here, anything else on the resident worker group (``verl_tasks.train``).
The trained weights and AdamW state are in ``model.train_dtype``, the forward computes in
``model.dtype``, ``resources.update.micro_batch_size`` rows at a time.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from verl_tasks.algos import lr_at, schedule_of
from verl_tasks.config import Resources, UpdateStrategy
from verl_tasks.errors import NonFiniteUpdate
from verl_tasks.events import record_event
from verl_tasks.models.checkpoint import (
    OPTIMIZER,
    OPTIMIZER_INDEX,
    WEIGHTS,
    load_optimizer,
    optimizer_shard_name,
    save_policy_and_optimizer,
)
from verl_tasks.models.handover import publish_weights
from verl_tasks.models.policy_cache import WarmOptimizer
from verl_tasks.phases.common import PhaseContext, committed, keep_policy, load_version, run_unit, take_version
from verl_tasks.phases.update_inputs import UpdateSource, read_update_source
from verl_tasks.phases.update_steps import (
    UpdateInputs,
    check_finite,
    epoch_inputs,
    frozen_logprobs,
    policy_module,
    step_records,
    train_steps,
)
from verl_tasks.store.conventions import STEPS_FILE, TRAINER_STATE
from verl_tasks.store.units import CommitRecord, UnitWriter
from verl_tasks.train.group import train_on_workers
from verl_tasks.train.logprobs import ResponseLogProbs


def fill_frozen_logprobs(
    inputs: UpdateInputs, policy: torch.nn.Module, ref: torch.nn.Module | None, temperature: float,
    single_step: bool, micro_batch_size: int | None,
) -> UpdateInputs:
    """Fill in the old policy's and the reference's log-probs (one process; the workers shard this).

    With ``single_step`` (one optimizer step per epoch) the old log-probs are those of the step's
    own forward pass, detached: the weights have not moved yet, so the extra pass is skipped.
    """
    if not single_step:
        inputs.old_logp = frozen_logprobs(policy, inputs, temperature, micro_batch_size)
    if ref is not None:
        inputs.ref_logp = frozen_logprobs(ref, inputs, temperature, micro_batch_size)
    return inputs


def resumed_optimizer(model: torch.nn.Module, algo, folder: Path, state_id: str | None,
                      warm: WarmOptimizer | None) -> torch.optim.Optimizer:
    """AdamW over ``model`` holding the snapshot's optimizer state (``state_id``; None: a fresh one).

    The warm optimizer kept beside the model serves when it holds exactly that state (the same
    checksums) over this model's parameters with the configured hyperparameters; otherwise the
    state is read from ``folder``. Either way the moments are the same bytes. (On a GPU a kept AdamW
    holds its ``step`` count on the CPU and a loaded one on the parameter's device; AdamW, not
    capturable, reads it as a number either way. Byte equality is tested on the CPU only.)
    """
    params = list(model.parameters())
    if warm is not None and state_id is not None and warm.state_id == state_id:
        groups = warm.optimizer.param_groups
        held = [p for group in groups for p in group["params"]]
        if (len(held) == len(params) and all(a is b for a, b in zip(held, params, strict=True))
                and all(tuple(g["betas"]) == tuple(algo.betas) and g["weight_decay"] == algo.weight_decay
                        for g in groups)):
            return warm.optimizer
    optimizer = torch.optim.AdamW(params, lr=algo.lr, betas=algo.betas, weight_decay=algo.weight_decay)
    if state_id is not None:
        load_optimizer(optimizer, model, folder)
    return optimizer


def _train_here(ctx: PhaseContext, source: UpdateSource, out: Path, writer: UnitWriter
                ) -> tuple[list[dict[str, float]], dict[str, Any], dict[str, Any], dict[str, Any]]:
    """One process, no torch.distributed (one ddp worker): train, write ``out/`` (HF folder + optimizer state).

    Returns (metric sums per step, optimizer hyperparameters, where and how long it trained and wrote,
    the trained model and optimizer to keep warm).
    """
    cfg, algo = ctx.config, ctx.config.algorithm
    version = source.policy_version
    begun = time.monotonic()
    # The base is read again after this update (the KL reference, its evaluation): train a copy of it,
    # unless those readers load it in another dtype (model.dtype) than the one trained (model.train_dtype).
    base_again = (version == 0 and (source.reference is not None or committed(ctx, ctx.layout.base_evaluate) is None)
                  and cfg.model.dtype == cfg.model.train_dtype)
    model, tokenizer, folder, warm = take_version(ctx, version, keep=base_again, record=source.start.record)
    policy = policy_module(model, cfg.model)
    ref = None
    if source.reference is not None:  # frozen, in model.dtype
        ref = ResponseLogProbs(load_version(ctx, 0, record=source.reference.record)[0])
    micro = cfg.phase_resources("update").micro_batch_size
    device = next(model.parameters()).device
    inputs = epoch_inputs(source.samples, tokenizer.pad_token_id, algo, cfg.rollout.max_new_tokens,
                          source.advantages).to(device)
    inputs = fill_frozen_logprobs(inputs, policy, ref, cfg.rollout.temperature, source.single_step, micro)
    optimizer = resumed_optimizer(model, algo, folder, source.start.optimizer_state, warm)
    on_step = lambda step: ctx.hook("update_step", epoch=source.epoch, step=step)  # noqa: E731
    started = time.monotonic()
    per_step = train_steps(policy, optimizer, inputs, algo, cfg.rollout.temperature, source.update_seed,
                           on_step, source.first_step, micro_batch_size=micro)
    trained_at = time.monotonic()
    model.eval()
    check_finite(model, optimizer)
    hyper, written = save_policy_and_optimizer(model, tokenizer, optimizer, out)
    for name, entry in written.items():
        writer.note_hashed(name, entry.size, entry.sha256)
    ran: dict[str, Any] = {"device": str(device), "load_s": round(started - begun, 3),
                           "train_s": round(trained_at - started, 3),
                           "write_s": round(time.monotonic() - trained_at, 3),
                           "write_bytes": sum(entry.size for entry in written.values())}
    return per_step, hyper, ran, {"model": model, "tokenizer": tokenizer, "folder": folder, "optimizer": optimizer}


def _train_lora_here(ctx: PhaseContext, source: UpdateSource, out: Path, writer: UnitWriter
                     ) -> tuple[list[dict[str, float]], dict[str, Any], dict[str, Any]]:
    """``model.lora`` in this process: train the adapter of policy version ``source.policy_version`` on the
    base snapshot's weights (frozen); write the adapter and its AdamW state only. The KL reference is the same
    model with the adapter off: no second copy of the base. Returns (metric sums per step, hyperparameters,
    where and how long it trained and wrote)."""
    from verl_tasks.models.device import resolve_device
    from verl_tasks.phases.update_lora import lora_policy, seeded_dropout, write_lora

    cfg, algo = ctx.config, ctx.config.algorithm
    begun = time.monotonic()
    model, optimizer, tokenizer, base_sha256 = lora_policy(ctx, source.start, resolve_device(cfg.model.device))
    policy = policy_module(model, cfg.model)
    micro = cfg.phase_resources("update").micro_batch_size
    device = next(model.parameters()).device
    inputs = epoch_inputs(source.samples, tokenizer.pad_token_id, algo, cfg.rollout.max_new_tokens,
                          source.advantages).to(device)
    inputs = fill_frozen_logprobs(inputs, policy, None, cfg.rollout.temperature, source.single_step, micro)
    if source.reference is not None:
        with model.disable_adapter():
            inputs.ref_logp = frozen_logprobs(policy, inputs, cfg.rollout.temperature, micro)
    on_step = lambda step: ctx.hook("update_step", epoch=source.epoch, step=step)  # noqa: E731
    started = time.monotonic()
    with seeded_dropout(device, source.update_seed):
        per_step = train_steps(policy, optimizer, inputs, algo, cfg.rollout.temperature, source.update_seed,
                               on_step, source.first_step, micro_batch_size=micro)
    trained_at = time.monotonic()
    model.eval()
    check_finite(model, optimizer)
    hyper, written = write_lora(model, tokenizer, optimizer, out, base_sha256)
    for name, entry in written.items():
        writer.note_hashed(name, entry.size, entry.sha256)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ran: dict[str, Any] = {"device": str(device), "load_s": round(started - begun, 3),
                           "train_s": round(trained_at - started, 3),
                           "write_s": round(time.monotonic() - trained_at, 3),
                           "write_bytes": sum(entry.size for entry in written.values()),
                           "trainable_parameters": trainable}
    return per_step, hyper, ran


def update(ctx: PhaseContext, epoch: int) -> CommitRecord:
    """Train policy version ``epoch`` on the epoch's samples; commit version ``epoch + 1``.

    Runs in this process (one ddp worker), or on the resident group of ``resources.update.workers``
    workers (``verl_tasks.train``).

    Raises:
        PhaseFailed: an input unit is missing, or a worker failed or timed out.
    """
    cfg = ctx.config
    algo = cfg.algorithm

    trained: dict[str, Any] = {}

    def produce(writer: UnitWriter) -> dict[str, Any]:
        source = read_update_source(ctx, epoch)
        res = cfg.phase_resources("update")
        writer.expect(*_update_files(res, lora=cfg.model.lora is not None))
        if cfg.model.lora is not None and not res.distributed:
            engine_to_sleep(ctx, epoch)
            with writer.folder() as out:
                try:
                    per_step, hyper, ran = _train_lora_here(ctx, source, out, writer)
                except NonFiniteUpdate as err:
                    raise NonFiniteUpdate(writer.unit, err.reason) from None
                finally:
                    release_gpu_memory()
        elif res.distributed:
            result = train_on_workers(ctx, source, writer)
            per_step, hyper, ran = result["per_step"], result["optimizer"], result["ran"]
            for step in range(1, len(per_step) + 1):
                ctx.hook("update_step", epoch=epoch, step=step)
            trained.update(handover=result.get("handover"), attempt=writer.attempt)
        else:
            trained["engine_held"] = engine_to_sleep(ctx, epoch)
            with writer.folder() as out:  # written in place: the weights are written once per epoch
                try:
                    per_step, hyper, ran, kept = _train_here(ctx, source, out, writer)
                except NonFiniteUpdate as err:
                    raise NonFiniteUpdate(writer.unit, err.reason) from None
            trained.update(kept, attempt=writer.attempt)
        first_step, steps = source.first_step, len(per_step)
        lrs = [lr_at(step, **schedule_of(algo)) for step in range(first_step, first_step + steps)]
        metrics = {**_epoch_metrics(per_step, source.samples), "actor/lr": lrs[-1]}
        writer.write_json("metrics.json", metrics)
        # Committed with the unit: a retried or cleared update replaces them, never adds a second copy.
        writer.write_jsonl(STEPS_FILE, step_records(per_step, first_step, lrs))
        writer.write_json(TRAINER_STATE, {"step": first_step + steps, "optimizer": hyper,
                                          "lr_schedule": {**schedule_of(algo), "first_step": first_step, "lrs": lrs}})
        # Not pinned (a run may resume on another worker count or strategy); results agree within float
        # tolerance across them (LoRA with dropout: not across counts, each worker draws its own masks) and
        # are byte-identical for one count and strategy, so both are recorded.
        # ``ran``: the device (rank 0's) and the seconds spent training and writing weights and optimizer state.
        return {"metrics": metrics, "policy_version": source.policy_version + 1, "update_workers": res.workers,
                "update_strategy": res.strategy.value, "ran": ran}

    committed_record = run_unit(ctx, "update", ctx.layout.update(epoch), epoch, produce)
    # The trained model is policy epoch + 1: the next epoch's units need not load it. Not when another
    # attempt's commit won the race: the record's checksums are of its bytes, not necessarily this model's.
    if trained.get("engine_held") and "model" in trained and trainer_to_release(ctx, epoch, trained):
        return committed_record
    if trained.get("attempt") == committed_record.attempt:
        if "model" in trained:
            keep_policy(ctx, committed_record, trained["model"], trained["tokenizer"], trained["folder"],
                        trained["optimizer"])
        elif trained.get("handover") is not None:
            publish_weights(ctx, committed_record, trained["handover"])
    return committed_record


def engine_to_sleep(ctx: PhaseContext, epoch: int, to: str = "update") -> bool:
    """Before the update (or the critic, ``to``) trains in a process that holds a vLLM engine (inline, or a
    pool whose actor runs rollout, update and evaluate on one GPU): the engine gives its GPU memory up
    (``vllm_engine.sleep``). Returns whether an engine was held."""
    from verl_tasks.models import vllm_engine

    done = vllm_engine.sleep()
    if done == "none":
        return False
    record_event(ctx.store, ctx.layout, "gpu_handoff", epoch=epoch, to=to, engine=done)
    return True


def release_gpu_memory() -> None:
    """After a trainer that is not kept warm (the critic, a LoRA update) dropped its model: its GPU memory goes
    back before an engine of this process wakes; nothing to do on the CPU."""
    if torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()


def trainer_to_release(ctx: PhaseContext, epoch: int, trained: dict[str, Any]) -> bool:
    """After the update in a process whose vLLM engine sleeps: a trainer on a GPU gives its memory back before
    the engine wakes (its model and optimizer, taken out of ``trained``, are not kept warm; the next update
    reads them from the store). Returns whether it released them (on the CPU there is nothing to give
    back: they stay warm)."""
    import gc

    on_gpu = next(trained["model"].parameters()).device.type == "cuda"
    if on_gpu:
        del trained["model"], trained["optimizer"]
        gc.collect()
        torch.cuda.empty_cache()
    record_event(ctx.store, ctx.layout, "gpu_handoff", epoch=epoch, to="engine", trainer_released=on_gpu)
    return on_gpu


def _update_files(res: Resources, lora: bool = False) -> list[str]:
    """The weights and optimizer files every update writes: one lost from a staging folder before it was
    listed (a worker's shard) would otherwise leave a manifest without it, so commit checks each is listed.
    With LoRA: the adapter, its config and its optimizer state."""
    if lora:
        from verl_tasks.store.conventions import ADAPTER, ADAPTER_CONFIG

        return [ADAPTER, ADAPTER_CONFIG, OPTIMIZER_INDEX, OPTIMIZER]
    if res.strategy == UpdateStrategy.fsdp2:
        return [WEIGHTS, OPTIMIZER_INDEX, *(optimizer_shard_name(rank) for rank in range(res.workers))]
    return [WEIGHTS, OPTIMIZER_INDEX, OPTIMIZER]


def _epoch_metrics(per_step: list[dict[str, float]], samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The epoch's row: each training metric's mean over its optimizer steps, and the samples' statistics."""
    scores = torch.tensor([s["score"] for s in samples], dtype=torch.float32)
    response_lengths = torch.tensor([float(len(s["response_ids"])) for s in samples])
    steps = len(per_step)
    metrics: dict[str, Any] = {key: sum(step[key] for step in per_step) / steps for key in per_step[0]}
    metrics.update(
        {
            "reward_mean": scores.mean().item(),
            "reward_std": scores.std(unbiased=True).item() if len(scores) > 1 else 0.0,
            "response_length_mean": response_lengths.mean().item(),
            "samples": len(samples),
            "optimizer_steps": steps,
        }
    )
    return metrics
