"""The policy update: GRPO advantages, clipped policy loss, optional KL to the base, AdamW.

Reads policy version ``epoch`` (weights and optimizer moments) and the epoch's
validated samples; writes policy version ``epoch + 1`` into its own unit. The
snapshot phase then publishes it. Nothing here depends on how many workers ran
before: optimizer state is keyed by parameter name.
"""
from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import torch

from verl_tasks.algos import aggregate_loss, entropy_from_logits, grpo_outcome_advantage, kl_penalty, policy_loss_vanilla
from verl_tasks.models.checkpoint import OPTIMIZER, load_optimizer, save_optimizer, save_policy
from verl_tasks.phases.common import PhaseContext, load_version, policy_folder, require, run_unit
from verl_tasks.store.units import CommitRecord, UnitWriter, read_json, read_jsonl

log = logging.getLogger(__name__)


def collate(samples: list[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids [B, L]``, ``attention_mask [B, L]``, response positions ``[B, R]``."""
    lengths = [len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples]
    width = max(lengths)
    resp_width = max(1, max(len(s["response_ids"]) for s in samples))
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(samples), width), dtype=torch.long)
    positions = torch.zeros((len(samples), resp_width), dtype=torch.long)
    response_mask = torch.zeros((len(samples), resp_width))
    response_ids = torch.full((len(samples), resp_width), pad_id, dtype=torch.long)
    for i, s in enumerate(samples):
        ids = s["prompt_ids"] + s["response_ids"]
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        n_prompt, n_resp = len(s["prompt_ids"]), len(s["response_ids"])
        if n_resp:
            positions[i, :n_resp] = torch.arange(n_prompt - 1, n_prompt - 1 + n_resp)
            response_mask[i, :n_resp] = 1
            response_ids[i, :n_resp] = torch.tensor(s["response_ids"])
    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "positions": positions,
        "response_ids": response_ids,
        "response_mask": response_mask,
    }


def response_logprobs(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities ``[B, R]`` of the response tokens (logits divided by the sampling temperature)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    index = batch["positions"].unsqueeze(-1).expand(-1, -1, logits.size(-1))
    picked = torch.gather(logits, 1, index).float() / temperature
    logp = torch.log_softmax(picked, dim=-1).gather(-1, batch["response_ids"].unsqueeze(-1)).squeeze(-1)
    entropy = entropy_from_logits(picked) if with_entropy else None
    return logp, entropy


def _select(batch: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    return {key: value[rows] for key, value in batch.items()}


def load_epoch_samples(ctx: PhaseContext, epoch: int) -> list[dict[str, Any]]:
    """The epoch's samples joined with their scores, in (batch, sample) order."""
    out = []
    for b in range(ctx.config.rollout.batches_per_epoch):
        samples = read_jsonl(ctx.store, require(ctx, ctx.layout.rollout(epoch, b), "rollout"), "samples.jsonl")
        scores = {r["sample_id"]: r["score"] for r in read_jsonl(ctx.store, require(ctx, ctx.layout.score(epoch, b), "score"), "scores.jsonl")}
        for s in samples:
            out.append({**s, "score": scores[s["sample_id"]]})
    return out


def update(ctx: PhaseContext, epoch: int, batch: int | None = None) -> CommitRecord:
    del batch
    cfg = ctx.config
    algo = cfg.algorithm

    def produce(writer: UnitWriter) -> dict[str, Any]:
        require(ctx, ctx.layout.validate(epoch), "validate")
        planned = read_json(ctx.store, require(ctx, ctx.layout.plan(epoch), "plan"), "plan.json")
        samples = load_epoch_samples(ctx, epoch)
        model, tokenizer, _ = load_version(ctx, planned["policy_version"])
        optimizer = torch.optim.AdamW(model.parameters(), lr=algo.lr, betas=algo.betas, weight_decay=algo.weight_decay)
        folder, record = policy_folder(ctx, planned["policy_version"])
        if OPTIMIZER in record.files:
            load_optimizer(optimizer, model, folder / OPTIMIZER)
        ref_model = None
        if algo.kl_type.value != "none":
            ref_model, _, _ = load_version(ctx, 0)

        data = collate(samples, tokenizer.pad_token_id)
        mask = data["response_mask"]
        scores = torch.tensor([s["score"] for s in samples], dtype=torch.float32)
        token_rewards = torch.zeros_like(mask)
        last = (mask.sum(-1).long() - 1).clamp_min(0)
        token_rewards[torch.arange(len(samples)), last] = scores
        advantages = grpo_outcome_advantage(token_rewards, mask, [s["prompt_id"] for s in samples], algo.norm_adv_by_std)
        temperature = cfg.rollout.temperature
        with torch.no_grad():
            model.eval()
            old_logp, _ = response_logprobs(model, data, temperature)
            ref_logp = response_logprobs(ref_model, data, temperature)[0] if ref_model is not None else None

        model.train()
        generator = torch.Generator().manual_seed(planned["update_seed"])
        totals: dict[str, float] = {}
        steps = 0
        for _ in range(algo.ppo_epochs):
            order = torch.randperm(len(samples), generator=generator)
            for start in range(0, len(samples), algo.minibatch_size):
                rows = order[start : start + algo.minibatch_size]
                mb = _select(data, rows)
                logp, entropy = response_logprobs(model, mb, temperature, with_entropy=True)
                pg_loss, pg_metrics = policy_loss_vanilla(
                    old_logp[rows], logp, advantages[rows], mb["response_mask"],
                    algo.clip_ratio_low, algo.clip_ratio_high, algo.clip_ratio_c, algo.loss_agg_mode.value,
                )
                entropy_loss = aggregate_loss(entropy, mb["response_mask"], algo.loss_agg_mode.value)
                loss = pg_loss - algo.entropy_coef * entropy_loss
                step_metrics = {**pg_metrics, "actor/pg_loss": pg_loss.item(), "actor/entropy": entropy_loss.item()}
                if ref_logp is not None:
                    kl = aggregate_loss(kl_penalty(logp, ref_logp[rows], algo.kl_type.value), mb["response_mask"], algo.loss_agg_mode.value)
                    loss = loss + algo.kl_coef * kl
                    step_metrics["actor/kl_loss"] = kl.item()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), algo.grad_clip)
                optimizer.step()
                step_metrics["actor/loss"] = loss.item()
                step_metrics["actor/grad_norm"] = float(grad_norm)
                for key, value in step_metrics.items():
                    totals[key] = totals.get(key, 0.0) + value
                steps += 1
                ctx.hook("update_step", epoch=epoch, step=steps)

        metrics = {key: value / steps for key, value in totals.items()}
        metrics.update(
            {
                "reward_mean": scores.mean().item(),
                "reward_std": scores.std(unbiased=True).item() if len(scores) > 1 else 0.0,
                "response_length_mean": mask.sum(-1).mean().item(),
                "samples": len(samples),
                "optimizer_steps": steps,
            }
        )
        model.eval()
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            for path in save_policy(model, tokenizer, out / "policy"):
                writer.write_file(path.name, path)
            hyper = save_optimizer(optimizer, model, out / OPTIMIZER)
            writer.write_file(OPTIMIZER, out / OPTIMIZER)
        writer.write_json("metrics.json", metrics)
        prior_steps = read_json(ctx.store, record, "trainer_state.json").get("step", 0) if "trainer_state.json" in record.files else 0
        writer.write_json("trainer_state.json", {"step": prior_steps + steps, "optimizer": hyper})
        return {"metrics": metrics, "policy_version": planned["policy_version"] + 1}

    return run_unit(ctx, "update", ctx.layout.update(epoch), epoch, produce)
