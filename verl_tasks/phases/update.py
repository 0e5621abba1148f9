"""The policy update: GRPO advantages, clipped policy loss, optional KL to the base, AdamW.

Reads policy version ``epoch`` (weights and optimizer moments) and the epoch's
validated samples; writes policy version ``epoch + 1`` into its own unit. The
snapshot phase then publishes it. Nothing here depends on how many workers ran
before: optimizer state is keyed by parameter name, so ``resources.update.workers``
may change between epochs of one experiment. The loss and the loop live in
``update_steps``; the data-parallel workers in ``update_parallel``.
"""
from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import torch

from verl_tasks.algos import grpo_outcome_advantage, lr_at, schedule_of
from verl_tasks.models.checkpoint import OPTIMIZER, load_optimizer, save_optimizer, save_policy
from verl_tasks.store.conventions import TRAINER_STATE
from verl_tasks.phases.common import PhaseContext, keep_policy, load_version, policy_folder, require, run_unit
from verl_tasks.phases.update_parallel import train_parallel
from verl_tasks.phases.update_steps import UpdateInputs, response_logprobs, train_single
from verl_tasks.phases.validate import epoch_batches
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


def load_epoch_samples(ctx: PhaseContext, epoch: int) -> list[dict[str, Any]]:
    """The epoch's samples joined with their scores, in (batch, sample) order; skipped batches left out."""
    out = []
    for b in epoch_batches(ctx, epoch):
        samples = read_jsonl(ctx.store, require(ctx, ctx.layout.rollout(epoch, b), "rollout"), "samples.jsonl")
        scores = {r["sample_id"]: r["score"] for r in read_jsonl(ctx.store, require(ctx, ctx.layout.score(epoch, b), "score"), "scores.jsonl")}
        for s in samples:
            out.append({**s, "score": scores[s["sample_id"]]})
    return out




def prepare_inputs(
    samples: list[dict[str, Any]], model: torch.nn.Module, ref_model: torch.nn.Module | None, pad_id: int, temperature: float,
    norm_adv_by_std: bool, single_step: bool = False,
) -> UpdateInputs:
    """Collate, GRPO advantages from the outcome scores, and the frozen log-probs (old policy, reference).

    With ``single_step`` (one optimizer step per epoch) the old log-probs are those of the step's
    own forward pass, detached: the weights have not moved yet, so the extra pass is skipped.
    """
    data = {key: value.to(model.device) for key, value in collate(samples, pad_id).items()}
    mask = data["response_mask"]
    scores = torch.tensor([s["score"] for s in samples], dtype=torch.float32, device=mask.device)
    token_rewards = torch.zeros_like(mask)
    last = (mask.sum(-1).long() - 1).clamp_min(0)
    token_rewards[torch.arange(len(samples), device=mask.device), last] = scores
    advantages = grpo_outcome_advantage(token_rewards, mask, [s["prompt_id"] for s in samples], norm_adv_by_std)
    with torch.no_grad():
        model.eval()
        old_logp = None if single_step else response_logprobs(model, data, temperature)[0]
        ref_logp = response_logprobs(ref_model, data, temperature)[0] if ref_model is not None else None
    return UpdateInputs(data, old_logp, advantages, ref_logp)


def _train_here(
    ctx: PhaseContext, epoch: int, model: torch.nn.Module, tokenizer: Any, optimizer_path: Path | None,
    inputs: UpdateInputs, seed: int, out: Path, first_step: int,
) -> tuple[dict[str, float], int, dict[str, Any]]:
    """One process: train, then write ``out/policy/`` and ``out/optimizer.safetensors``."""
    algo = ctx.config.algorithm
    optimizer = torch.optim.AdamW(model.parameters(), lr=algo.lr, betas=algo.betas, weight_decay=algo.weight_decay)
    if optimizer_path is not None:
        load_optimizer(optimizer, model, optimizer_path)
    on_step = lambda step: ctx.hook("update_step", epoch=epoch, step=step)  # noqa: E731
    totals, steps = train_single(model, optimizer, inputs, algo, ctx.config.rollout.temperature, seed, on_step,
                                 first_step)
    model.eval()
    save_policy(model, tokenizer, out / "policy")
    return totals, steps, save_optimizer(optimizer, model, out / OPTIMIZER)


def _train_workers(
    ctx: PhaseContext, epoch: int, policy_dir: Path, optimizer_path: Path | None, inputs: UpdateInputs, seed: int,
    out: Path, first_step: int,
) -> tuple[dict[str, float], int, dict[str, Any]]:
    """Data-parallel workers (``update_parallel``); the step hook runs here once they are done."""
    result = train_parallel(
        unit=ctx.layout.update(epoch), config=ctx.config, inputs=inputs, policy_dir=policy_dir,
        optimizer_path=optimizer_path, seed=seed, out=out, first_step=first_step,
    )
    for step in range(1, result.steps + 1):
        ctx.hook("update_step", epoch=epoch, step=step)
    return result.totals, result.steps, result.optimizer


def update(ctx: PhaseContext, epoch: int) -> CommitRecord:
    """Train policy version ``epoch`` on the epoch's samples; commit version ``epoch + 1``.

    Runs in this process, or on ``resources.update.workers`` data-parallel workers.

    Raises:
        PhaseFailed: an input unit is missing, or a worker failed or timed out.
    """
    cfg = ctx.config
    algo = cfg.algorithm

    trained: dict[str, Any] = {}

    def produce(writer: UnitWriter) -> dict[str, Any]:
        require(ctx, ctx.layout.validate(epoch), "validate")
        planned = read_json(ctx.store, require(ctx, ctx.layout.plan(epoch), "plan"), "plan.json")
        samples = load_epoch_samples(ctx, epoch)
        workers = cfg.phase_resources("update").workers
        model, tokenizer, folder = load_version(ctx, planned["policy_version"], owned=workers == 1)
        record = policy_folder(ctx, planned["policy_version"])[1]
        optimizer_path = folder / OPTIMIZER if OPTIMIZER in record.files else None
        first_step = read_json(ctx.store, record, TRAINER_STATE).get("step", 0) if TRAINER_STATE in record.files else 0
        ref_model = load_version(ctx, 0)[0] if algo.kl_type.value != "none" else None
        single_step = algo.ppo_epochs == 1 and algo.minibatch_size >= len(samples)
        inputs = prepare_inputs(samples, model, ref_model, tokenizer.pad_token_id, cfg.rollout.temperature,
                                algo.norm_adv_by_std, single_step)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            if workers > 1:
                log.info("update of epoch %d on %d data-parallel workers", epoch, workers)
                totals, steps, hyper = _train_workers(ctx, epoch, folder, optimizer_path, inputs,
                                                      planned["update_seed"], out, first_step)
            else:
                totals, steps, hyper = _train_here(ctx, epoch, model, tokenizer, optimizer_path, inputs,
                                                   planned["update_seed"], out, first_step)
                trained.update(model=model, tokenizer=tokenizer, folder=folder)
            for path in sorted(p for p in (out / "policy").iterdir() if p.is_file()):
                writer.write_file(path.name, path)
            writer.write_file(OPTIMIZER, out / OPTIMIZER)
        lrs = [lr_at(step, **schedule_of(algo)) for step in range(first_step, first_step + steps)]
        metrics = {**_epoch_metrics(totals, steps, samples, inputs.data["response_mask"]), "actor/lr": lrs[-1]}
        writer.write_json("metrics.json", metrics)
        writer.write_json(TRAINER_STATE, {"step": first_step + steps, "optimizer": hyper,
                                          "lr_schedule": {**schedule_of(algo), "first_step": first_step, "lrs": lrs}})
        # Not pinned (a run may resume on another worker count); results agree within float
        # tolerance across counts and are byte-identical for one count, so the count is recorded.
        return {"metrics": metrics, "policy_version": planned["policy_version"] + 1, "update_workers": workers}

    committed_record = run_unit(ctx, "update", ctx.layout.update(epoch), epoch, produce)
    if trained:  # the trained model is policy epoch + 1: the next epoch's units need not load it
        keep_policy(ctx, committed_record, trained["model"], trained["tokenizer"], trained["folder"])
    return committed_record


def _epoch_metrics(totals: dict[str, float], steps: int, samples: list[dict[str, Any]], mask: torch.Tensor) -> dict[str, Any]:
    scores = torch.tensor([s["score"] for s in samples], dtype=torch.float32)
    metrics: dict[str, Any] = {key: value / steps for key, value in totals.items()}
    metrics.update(
        {
            "reward_mean": scores.mean().item(),
            "reward_std": scores.std(unbiased=True).item() if len(scores) > 1 else 0.0,
            "response_length_mean": mask.sum(-1).mean().item(),
            "samples": len(samples),
            "optimizer_steps": steps,
        }
    )
    return metrics
