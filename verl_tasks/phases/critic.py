"""PPO's critic phase: the epoch's values, GAE advantages and returns, and the critic's update.

Runs after the quality gate and before the policy update (``algorithm.adv_estimator: gae``), as
verl's trainer does: the critic of version ``v`` (the policy version the epoch trains) values every
response token of the epoch's samples; GAE (``algorithm.gamma``, ``algorithm.lam``) turns the outcome
scores and those values into advantages (whitened) and returns; the critic then trains on the returns
with verl's clipped value loss over the policy's minibatches and PPO epochs. One unit commits both:
``advantages.safetensors`` (what the policy update reads) and critic version ``v + 1`` (``critic.*``:
weights, AdamW state, config), which the snapshot publishes beside policy version ``v + 1``.

Critic version 0 is the base snapshot's ``critic.*`` files: a value head drawn from the experiment's
seed on ``critic.name_or_path`` or the policy's base, written when the base is (``initial_critic``), or a
fork's, copied from its parent's snapshot without the optimizer state. Everything is derived from the committed inputs
and the seed, so a retried or cleared unit writes the same bytes (on the CPU).
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from verl_tasks.algos import AdvantageInputs, aggregate_loss, estimator, value_loss
from verl_tasks.errors import NonFiniteUpdate, PhaseFailed
from verl_tasks.models.checkpoint import OPTIMIZER_INDEX, load_optimizer, load_policy
from verl_tasks.models.critic import (
    CRITIC_FILES,
    ValueModel,
    is_critic_file,
    load_critic,
    local_name,
    new_critic,
    save_critic,
    stored_name,
)
from verl_tasks.models.device import resolve_device
from verl_tasks.models.safetensors_io import write_tensors
from verl_tasks.phases.common import PhaseContext, derive_seed, policy_folder, run_unit
from verl_tasks.phases.update_inputs import ADVANTAGE_ROWS, ADVANTAGES, UpdateSource, read_update_source
from verl_tasks.phases.update_steps import (
    UpdateInputs,
    autocast_dtype,
    check_finite,
    collate,
    micro_batches,
    minibatch_rows,
    outcome_rewards,
    select_rows,
)
from verl_tasks.store.units import CommitRecord, UnitWriter, download

VALUE_KEYS = ("input_ids", "attention_mask", "positions", "response_mask")


def initial_critic(ctx: PhaseContext, base_folder: Path, out: Path) -> list[Path]:
    """Write critic version 0 into ``out`` (config and weights, no optimizer state): a value head drawn from the
    experiment's seed on ``critic.name_or_path``'s decoder, or on the base policy's in ``base_folder``. The base
    snapshot commits these files, so the critic an experiment starts from is pinned like its policy.

    Raises:
        ConfigError: the critic's vocabulary is smaller than the policy's tokenizer (it reads the policy's ids).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_tasks.errors import ConfigError

    cfg, critic_cfg = ctx.config, ctx.config.critic
    assert critic_cfg is not None
    if critic_cfg.name_or_path is not None:
        lm: Any = AutoModelForCausalLM.from_pretrained(
            critic_cfg.name_or_path, use_safetensors=True, dtype=getattr(torch, cfg.model.train_dtype))
        tokens, rows = len(AutoTokenizer.from_pretrained(base_folder)), lm.get_input_embeddings().num_embeddings
        if rows < tokens:
            raise ConfigError(f"critic.name_or_path {critic_cfg.name_or_path!r} embeds {rows} token ids, the "
                              f"policy's tokenizer has {tokens}: the critic reads the policy's token ids; name a "
                              f"model with the policy's tokenizer, or remove critic.name_or_path")
    else:
        lm = load_policy(base_folder, cfg.model.train_dtype)[0]
    save_critic(new_critic(lm, derive_seed(cfg.seed, 0, "critic_init")), None, out)
    return [out / name for name in CRITIC_FILES if (out / name).is_file()]


def critic_at(ctx: PhaseContext, source: UpdateSource, work: Path, device: torch.device | None = None
              ) -> tuple[ValueModel, torch.optim.Optimizer]:
    """Critic version ``source.policy_version`` (the snapshot's ``critic.*`` files) and its AdamW state (fresh
    for version 0), on ``device`` (default: ``model.device``). A fork's base from a parent without a critic
    holds none: its critic is made here."""
    cfg, critic_cfg = ctx.config, ctx.config.critic
    assert critic_cfg is not None  # the phase exists only with a critic section
    record, autocast = source.start.record, autocast_dtype(cfg.model)
    stored = sorted(name for name in record.files if is_critic_file(name))
    if stored:
        for name in stored:
            download(ctx.store, record, name, work / local_name(name))
    elif source.policy_version == 0:
        initial_critic(ctx, policy_folder(ctx, 0, record)[0], work)
    else:
        raise PhaseFailed(record.unit, f"snapshot {source.policy_version} holds no critic (critic.* files); it was "
                                       f"not written by a PPO run of this experiment")
    model = load_critic(work, cfg.model.train_dtype, autocast)
    model.to(device or resolve_device(cfg.model.device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=critic_cfg.lr, betas=critic_cfg.betas,
                                  weight_decay=critic_cfg.weight_decay)
    if (work / OPTIMIZER_INDEX).is_file():
        load_optimizer(optimizer, model, work)
    return model, optimizer


def values_of(model: torch.nn.Module, data: dict[str, torch.Tensor], size: int | None, rank: int = 0,
              world: int = 1) -> torch.Tensor:
    """``[share, R]`` values of worker ``rank``'s contiguous share of the rows (every row with one worker),
    without gradients, ``size`` rows per forward (None: the whole share at once). Every worker runs the same
    number of forwards (DDP syncs buffers in each): a worker without rows runs one and drops it."""
    model.eval()
    shares = torch.tensor_split(torch.arange(data["input_ids"].shape[0]), world)
    count = 1 if size is None else max(1, -(-len(shares[0]) // size))  # shares[0] is the largest
    parts = [shares[rank]] if size is None else list(shares[rank].split(size))
    parts += [shares[rank][:0]] * (count - len(parts))
    out = []
    with torch.no_grad():
        for part in parts:
            run = part if len(part) else torch.arange(1)
            out.append(model(**{k: v[run] for k, v in data.items() if k in VALUE_KEYS})[: len(part)])
    return torch.cat(out)


def train_critic(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: dict[str, torch.Tensor],
                 old_values: torch.Tensor, returns: torch.Tensor, ctx: PhaseContext, seed: int, epoch: int,
                 rank: int = 0, world: int = 1) -> list[dict[str, float]]:
    """The critic's optimizer steps: per minibatch of the policy's (``algorithm.minibatch_size``,
    ``algorithm.ppo_epochs``, its own seeded order), the clipped value loss of its micro-batches
    (``resources.critic.micro_batch_size``) accumulated, the gradient clipped, AdamW. Returns each step's
    metrics.

    On ``world`` DDP workers each takes its share of every minibatch (``micro_batches``), its losses scaled by
    ``world`` since DDP averages the gradients, which it all-reduces on the last micro-batch only; summed
    over the workers the metrics are the one-process values (``critic/grad_norm`` counts on rank 0)."""
    cfg = ctx.config
    critic_cfg, algo = cfg.critic, cfg.algorithm
    assert critic_cfg is not None
    mode, micro = critic_cfg.loss_agg_mode.value, cfg.phase_resources("critic").micro_batch_size
    # The micro-batch weights split a minibatch's loss by its tokens or sequences, as the policy's do.
    weights = UpdateInputs(data, None, returns, None)
    scale = float(cfg.rollout.max_new_tokens) if mode == "seq-mean-token-sum-norm" else None
    model.train()
    per_step: list[dict[str, float]] = []
    no_sync = getattr(model, "no_sync", None)
    for rows in minibatch_rows(len(returns), algo, seed):
        optimizer.zero_grad(set_to_none=True)
        metrics: dict[str, float] = {}
        parts = micro_batches(weights, rows, rank, world, micro, mode)
        for index, (part, loss_w, token_w) in enumerate(parts):
            batch = select_rows(data, part)
            mask = batch["response_mask"]
            with nullcontext() if index == len(parts) - 1 or no_sync is None else no_sync():
                predicted = model(**{k: batch[k] for k in VALUE_KEYS})
                loss, clipfrac = value_loss(predicted, returns[part], old_values[part], mask,
                                            critic_cfg.cliprange_value, mode, scale)
                (loss * (loss_w * world)).backward()
            for key, value, w in (("critic/vf_loss", loss.item(), loss_w), ("critic/vf_clipfrac", clipfrac, token_w),
                                  ("critic/vpred_mean", aggregate_loss(predicted.detach(), mask).item(), token_w)):
                metrics[key] = metrics.get(key, 0.0) + value * w
        ctx.hook("critic_step", epoch=epoch, step=len(per_step) + 1, rank=rank)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), critic_cfg.grad_clip)
        if not torch.isfinite(norm):
            raise NonFiniteUpdate("critic", f"the critic's gradient norm at its step {len(per_step) + 1} is "
                                            f"{float(norm)}; nothing is committed. Check the scores and critic.lr")
        optimizer.step()
        per_step.append({**metrics, "critic/grad_norm": float(norm) if rank == 0 else 0.0})
    return per_step


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(returns - values) / Var(returns)`` over the response tokens: 1 when the critic predicts the
    returns exactly, 0 when it does no better than their mean."""
    keep = mask.bool()
    target, error = returns[keep], (returns - values)[keep]
    if target.numel() < 2 or float(target.var()) == 0.0:
        return 0.0
    return 1.0 - float(error.var()) / float(target.var())


def critic_advantages(ctx: PhaseContext, source: UpdateSource, data: dict[str, torch.Tensor],
                      old_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (``algorithm.gamma``, ``algorithm.lam``) of the epoch's outcome scores under ``old_values``: the
    whitened advantages and the returns, ``[B, R]`` each."""
    algo, mask = ctx.config.algorithm, data["response_mask"]
    return estimator("gae")(AdvantageInputs(
        outcome_rewards(source.samples, mask.cpu()).to(mask.device), mask, [s["prompt_id"] for s in source.samples],
        gamma=algo.gamma, lam=algo.lam, values=old_values))


def write_critic_unit(writer: UnitWriter, model: ValueModel, optimizer: torch.optim.Optimizer, source: UpdateSource,
                      tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Write critic ``v + 1`` (its files under their ``critic.`` names) and the epoch's advantages, returns and
    values, with the sample ids they belong to, into the attempt; returns the optimizer's hyperparameters."""
    with writer.folder() as out:
        hyper, written = save_critic(model, optimizer, out)
        for name in CRITIC_FILES:  # the unit's names; the streamed files' checksums carry over
            os.replace(out / name, out / stored_name(name))
            if name in written:
                writer.note_hashed(stored_name(name), written[name].size, written[name].sha256)
        saved = write_tensors(out / ADVANTAGES, [(k, v.detach().float().cpu().contiguous())
                                                 for k, v in tensors.items()])
        writer.note_hashed(ADVANTAGES, saved.size, saved.sha256)
        (out / ADVANTAGE_ROWS).write_text(json.dumps({"sample_ids": [s["sample_id"] for s in source.samples],
                                                      "inputs": source.inputs}))
    return hyper


def critic_metrics(ctx: PhaseContext, per_step: list[dict[str, float]], old_values: torch.Tensor,
                   returns: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    """The unit's ``critic/*`` row: each training metric's mean over the optimizer steps, and the values'."""
    critic_cfg = ctx.config.critic
    assert critic_cfg is not None
    steps = len(per_step)
    metrics: dict[str, Any] = {key: sum(step[key] for step in per_step) / steps for key in per_step[0]}
    metrics.update({"critic/values_mean": aggregate_loss(old_values, mask).item(),
                    "critic/returns_mean": aggregate_loss(returns, mask).item(),
                    "critic/explained_variance": explained_variance(old_values, returns, mask),
                    "critic/lr": critic_cfg.lr, "critic/optimizer_steps": steps})
    return metrics


def checked_finite(unit: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """``check_finite`` of the critic, its error naming the critic's unit and update."""
    try:
        check_finite(model, optimizer)
    except NonFiniteUpdate as err:
        raise NonFiniteUpdate(unit, err.reason.replace("after the update", "after the critic's update")) from None


def _critic_here(ctx: PhaseContext, source: UpdateSource, writer: UnitWriter, epoch: int
                 ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The critic's unit in this process; returns (metrics, optimizer hyperparameters, where and how long)."""
    from verl_tasks.phases.update import release_gpu_memory

    cfg = ctx.config
    begun = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        model, optimizer = critic_at(ctx, source, Path(tmp))
    device = next(model.parameters()).device
    data = {k: v.to(device) for k, v in collate(source.samples, pad_id=0).items()}  # right padding: any id
    old_values = values_of(model, data, cfg.phase_resources("critic").micro_batch_size)
    advantages, returns = critic_advantages(ctx, source, data, old_values)
    started = time.monotonic()
    per_step = train_critic(model, optimizer, data, old_values, returns, ctx, derive_seed(cfg.seed, epoch, "critic"),
                            epoch)
    trained = time.monotonic()
    model.eval()
    checked_finite(writer.unit, model, optimizer)
    hyper = write_critic_unit(writer, model, optimizer, source,
                              {"advantages": advantages, "returns": returns, "values": old_values})
    metrics = critic_metrics(ctx, per_step, old_values, returns, data["response_mask"])
    ran = {"device": str(device), "load_s": round(started - begun, 3), "train_s": round(trained - started, 3),
           "write_s": round(time.monotonic() - trained, 3)}
    del model, optimizer
    release_gpu_memory()
    return metrics, hyper, ran


def critic(ctx: PhaseContext, epoch: int) -> CommitRecord:
    """Value the epoch's samples with critic version ``v``, commit their GAE advantages and critic ``v + 1``.

    Runs in this process, or with ``resources.critic.workers > 1`` on the critic's worker group
    (``verl_tasks.train``: DDP workers, each holding the whole critic).

    Raises:
        PhaseFailed: an input unit is missing, the snapshot trained holds no critic, or a worker failed.
        NonFiniteUpdate: the critic's gradients or weights went non-finite; nothing is committed.
    """
    cfg = ctx.config
    assert cfg.critic is not None  # the phase exists only with a critic section

    def produce(writer: UnitWriter) -> dict[str, Any]:
        from verl_tasks.phases.update import engine_to_sleep
        from verl_tasks.train.group import train_on_workers

        source = read_update_source(ctx, epoch, critic=False)
        writer.expect(*(stored_name(name) for name in CRITIC_FILES), ADVANTAGES, ADVANTAGE_ROWS)
        if cfg.phase_resources("critic").distributed:
            result = train_on_workers(ctx, source, writer, phase="critic")
            metrics, hyper, ran = result["metrics"], result["optimizer"], result["ran"]
            for step in range(1, result["steps"] + 1):  # the hook points this process has, as in one process
                ctx.hook("critic_step", epoch=epoch, step=step)
        else:
            engine_to_sleep(ctx, epoch, to="critic")  # a vLLM engine sharing this GPU gives its memory up first
            metrics, hyper, ran = _critic_here(ctx, source, writer, epoch)
        writer.write_json("metrics.json", metrics)
        return {"metrics": metrics, "critic_version": source.policy_version + 1, "optimizer": hyper, "ran": ran,
                "critic_workers": cfg.phase_resources("critic").workers}

    return run_unit(ctx, "critic", ctx.layout.critic(epoch), epoch, produce)


__all__ = ["checked_finite", "critic", "critic_advantages", "critic_at", "critic_metrics", "explained_variance",
           "train_critic", "values_of", "write_critic_unit"]
