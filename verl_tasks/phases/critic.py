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


def critic_at(ctx: PhaseContext, source: UpdateSource, work: Path) -> tuple[ValueModel, torch.optim.Optimizer]:
    """Critic version ``source.policy_version`` (the snapshot's ``critic.*`` files) and its AdamW state (fresh
    for version 0). A fork's base from a parent without a critic holds none: its critic is made here."""
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
    model.to(resolve_device(cfg.model.device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=critic_cfg.lr, betas=critic_cfg.betas,
                                  weight_decay=critic_cfg.weight_decay)
    if (work / OPTIMIZER_INDEX).is_file():
        load_optimizer(optimizer, model, work)
    return model, optimizer


def values_of(model: ValueModel, data: dict[str, torch.Tensor], size: int | None) -> torch.Tensor:
    """``[B, R]`` values of every row, without gradients, ``size`` rows per forward (None: all at once)."""
    model.eval()
    rows = torch.arange(data["input_ids"].shape[0])
    parts = [rows] if size is None else list(rows.split(size))
    with torch.no_grad():
        return torch.cat([model(**{k: v[part] for k, v in data.items() if k in VALUE_KEYS}) for part in parts])


def train_critic(model: ValueModel, optimizer: torch.optim.Optimizer, data: dict[str, torch.Tensor],
                 old_values: torch.Tensor, returns: torch.Tensor, ctx: PhaseContext, seed: int, epoch: int
                 ) -> list[dict[str, float]]:
    """The critic's optimizer steps: per minibatch of the policy's (``algorithm.minibatch_size``,
    ``algorithm.ppo_epochs``, its own seeded order), the clipped value loss of its micro-batches
    (``resources.critic.micro_batch_size``) accumulated, the gradient clipped, AdamW. Returns each step's
    metrics."""
    cfg = ctx.config
    critic_cfg, algo = cfg.critic, cfg.algorithm
    assert critic_cfg is not None
    mode, micro = critic_cfg.loss_agg_mode.value, cfg.phase_resources("critic").micro_batch_size
    # The micro-batch weights split a minibatch's loss by its tokens or sequences, as the policy's do.
    weights = UpdateInputs(data, None, returns, None)
    scale = float(cfg.rollout.max_new_tokens) if mode == "seq-mean-token-sum-norm" else None
    model.train()
    per_step: list[dict[str, float]] = []
    for rows in minibatch_rows(len(returns), algo, seed):
        optimizer.zero_grad(set_to_none=True)
        metrics: dict[str, float] = {}
        for part, loss_w, token_w in micro_batches(weights, rows, 0, 1, micro, mode):
            batch = select_rows(data, part)
            predicted = model(**{k: batch[k] for k in VALUE_KEYS})
            mask = batch["response_mask"]
            loss, clipfrac = value_loss(predicted, returns[part], old_values[part], mask,
                                        critic_cfg.cliprange_value, mode, scale)
            (loss * loss_w).backward()
            for key, value, w in (("critic/vf_loss", loss.item(), loss_w), ("critic/vf_clipfrac", clipfrac, token_w),
                                  ("critic/vpred_mean", aggregate_loss(predicted.detach(), mask).item(), token_w)):
                metrics[key] = metrics.get(key, 0.0) + value * w
        ctx.hook("critic_step", epoch=epoch, step=len(per_step) + 1)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), critic_cfg.grad_clip)
        if not torch.isfinite(norm):
            raise NonFiniteUpdate("critic", f"the critic's gradient norm at its step {len(per_step) + 1} is "
                                            f"{float(norm)}; nothing is committed. Check the scores and critic.lr")
        optimizer.step()
        per_step.append({**metrics, "critic/grad_norm": float(norm)})
    return per_step


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(returns - values) / Var(returns)`` over the response tokens: 1 when the critic predicts the
    returns exactly, 0 when it does no better than their mean."""
    keep = mask.bool()
    target, error = returns[keep], (returns - values)[keep]
    if target.numel() < 2 or float(target.var()) == 0.0:
        return 0.0
    return 1.0 - float(error.var()) / float(target.var())


def critic(ctx: PhaseContext, epoch: int) -> CommitRecord:
    """Value the epoch's samples with critic version ``v``, commit their GAE advantages and critic ``v + 1``.

    Raises:
        PhaseFailed: an input unit is missing, or the snapshot trained holds no critic.
        NonFiniteUpdate: the critic's gradients or weights went non-finite; nothing is committed.
    """
    cfg = ctx.config
    algo, critic_cfg = cfg.algorithm, cfg.critic
    assert critic_cfg is not None  # the phase exists only with a critic section

    def produce(writer: UnitWriter) -> dict[str, Any]:
        from verl_tasks.phases.update import engine_to_sleep, release_gpu_memory

        source = read_update_source(ctx, epoch, critic=False)
        engine_to_sleep(ctx, epoch, to="critic")  # a vLLM engine sharing this GPU gives its memory up first
        writer.expect(*(stored_name(name) for name in CRITIC_FILES), ADVANTAGES, ADVANTAGE_ROWS)
        begun = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            model, optimizer = critic_at(ctx, source, Path(tmp))
        device = next(model.parameters()).device
        data = {k: v.to(device) for k, v in collate(source.samples, pad_id=0).items()}  # right padding: any id
        mask = data["response_mask"]
        micro = cfg.phase_resources("critic").micro_batch_size
        old_values = values_of(model, data, micro)
        advantages, returns = estimator("gae")(AdvantageInputs(
            outcome_rewards(source.samples, mask.cpu()).to(device), mask, [s["prompt_id"] for s in source.samples],
            gamma=algo.gamma, lam=algo.lam, values=old_values))
        started = time.monotonic()
        per_step = train_critic(model, optimizer, data, old_values, returns, ctx,
                                derive_seed(cfg.seed, epoch, "critic"), epoch)
        trained = time.monotonic()
        model.eval()
        try:
            check_finite(model, optimizer)
        except NonFiniteUpdate as err:
            raise NonFiniteUpdate(writer.unit, err.reason.replace("after the update", "after the critic's update")
                                  ) from None
        with writer.folder() as out:
            hyper, written = save_critic(model, optimizer, out)
            for name in CRITIC_FILES:  # the unit's names; the streamed files' checksums carry over
                os.replace(out / name, out / stored_name(name))
                if name in written:
                    writer.note_hashed(stored_name(name), written[name].size, written[name].sha256)
            tensors = {"advantages": advantages, "returns": returns, "values": old_values}
            saved = write_tensors(out / ADVANTAGES, [(k, v.detach().float().cpu().contiguous())
                                                     for k, v in tensors.items()])
            writer.note_hashed(ADVANTAGES, saved.size, saved.sha256)
            (out / ADVANTAGE_ROWS).write_text(json.dumps({"sample_ids": [s["sample_id"] for s in source.samples],
                                                          "inputs": source.inputs}))
        steps = len(per_step)
        metrics = {key: sum(step[key] for step in per_step) / steps for key in per_step[0]}
        metrics.update({"critic/values_mean": aggregate_loss(old_values, mask).item(),
                        "critic/returns_mean": aggregate_loss(returns, mask).item(),
                        "critic/explained_variance": explained_variance(old_values, returns, mask),
                        "critic/lr": critic_cfg.lr, "critic/optimizer_steps": steps})
        writer.write_json("metrics.json", metrics)
        ran = {"device": str(device), "load_s": round(started - begun, 3), "train_s": round(trained - started, 3),
               "write_s": round(time.monotonic() - trained, 3)}
        del model, optimizer
        release_gpu_memory()
        return {"metrics": metrics, "critic_version": source.policy_version + 1, "optimizer": hyper, "ran": ran}

    return run_unit(ctx, "critic", ctx.layout.critic(epoch), epoch, produce)


__all__ = ["critic", "critic_at", "explained_variance", "train_critic", "values_of"]
