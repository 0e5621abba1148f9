"""The arithmetic of one update: the batch, minibatch order, micro-batches and their weights, the loss, the loop.

Shared by the one-process update (``phases/update.py``) and the resident group's workers
(``train/worker.py``), so both compute the same loss the same way: the one process is
rank 0 of a world of 1. The model is called through
:class:`verl_tasks.train.logprobs.ResponseLogProbs` (or DDP/FSDP2 around it), which never makes
``[B, L, V]`` logits; ``resources.update.micro_batch_size`` bounds the rows of each forward.
Shapes: ``B`` sequences, ``L`` padded sequence length, ``R`` response tokens.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from verl_tasks.algos import AdvantageInputs, aggregate_loss, estimator, kl_penalty, lr_at, policy_loss, schedule_of
from verl_tasks.config import AlgorithmConfig, ModelConfig
from verl_tasks.errors import NonFiniteUpdate
from verl_tasks.train.logprobs import ResponseLogProbs

DATA_KEYS = ("input_ids", "attention_mask", "positions", "response_ids", "response_mask")
# Metrics that are token means whatever the loss aggregation mode (see ``policy_loss_vanilla``).
TOKEN_MEAN_METRICS = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")


@dataclass
class UpdateInputs:
    """Everything the optimisation reads, fixed before the first step.

    ``data``: the collated batch (``DATA_KEYS``, ``[B, L]`` or ``[B, R]``);
    ``old_logp``, ``advantages``, ``ref_logp``: ``[B, R]`` (``ref_logp`` None without KL;
    ``old_logp`` None when the epoch is one optimizer step: the step's own detached log-probs);
    ``loss_scale``: the constant ``seq-mean-token-sum-norm`` divides by (None for the other modes).
    """

    data: dict[str, torch.Tensor]
    old_logp: torch.Tensor | None
    advantages: torch.Tensor
    ref_logp: torch.Tensor | None
    loss_scale: float | None = None

    def __len__(self) -> int:
        return self.advantages.size(0)

    def to(self, device: torch.device) -> UpdateInputs:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return UpdateInputs({k: v.to(device) for k, v in self.data.items()}, move(self.old_logp),
                            self.advantages.to(device), move(self.ref_logp), self.loss_scale)


def collate(samples: list[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids [B, L]``, ``attention_mask [B, L]``, response positions ``[B, R]``.

    Rows are padded as Python lists and become tensors in one call each (a tensor per row
    and slice assignments cost several times more: about 7 ms against 1 ms for 128 rows).
    """
    sequences = [s["prompt_ids"] + s["response_ids"] for s in samples]
    width = max(map(len, sequences))
    resp_width = max(1, max(len(s["response_ids"]) for s in samples))
    input_ids, attention, positions, response_ids, response_mask = [], [], [], [], []
    for s, ids in zip(samples, sequences, strict=True):
        n_prompt, n_resp = len(s["prompt_ids"]), len(s["response_ids"])
        input_ids.append(ids + [pad_id] * (width - len(ids)))
        attention.append([1] * len(ids) + [0] * (width - len(ids)))
        resp_pad = [0] * (resp_width - n_resp)
        positions.append(list(range(n_prompt - 1, n_prompt - 1 + n_resp)) + resp_pad)
        response_ids.append(s["response_ids"] + [pad_id] * (resp_width - n_resp))
        response_mask.append([1.0] * n_resp + [0.0] * (resp_width - n_resp))
    return {
        "input_ids": torch.tensor(input_ids, dtype=torch.long),
        "attention_mask": torch.tensor(attention, dtype=torch.long),
        "positions": torch.tensor(positions, dtype=torch.long),
        "response_ids": torch.tensor(response_ids, dtype=torch.long),
        "response_mask": torch.tensor(response_mask, dtype=torch.float32),
    }


def outcome_rewards(samples: list[dict[str, Any]], response_mask: torch.Tensor) -> torch.Tensor:
    """``[B, R]`` token rewards: each sample's score on its last response token, 0 elsewhere."""
    scores = torch.tensor([s["score"] for s in samples], dtype=torch.float32)
    token_rewards = torch.zeros_like(response_mask)
    last = (response_mask.sum(-1).long() - 1).clamp_min(0)
    token_rewards[torch.arange(len(samples)), last] = scores
    return token_rewards


def epoch_inputs(samples: list[dict[str, Any]], pad_id: int, algo: AlgorithmConfig,
                 max_new_tokens: int, advantages: torch.Tensor | None = None) -> UpdateInputs:
    """The collated batch and its advantages (``algo.adv_estimator`` over the outcome scores, each on its
    sample's last response token; ``advantages``, ``[B, R]``, when the critic phase computed them: GAE);
    log-probs not yet computed. ``seq-mean-token-sum-norm`` divides by ``algo.loss_scale_factor``, else by
    ``max_new_tokens`` (verl: the padded response length)."""
    data = collate(samples, pad_id)
    mask = data["response_mask"]
    if advantages is None:
        baselines = (torch.tensor([s["baseline_score"] for s in samples], dtype=torch.float32)
                     if algo.adv_estimator == "remax" else None)
        # A group is one prompt's samples of one batch: dynamic sampling may draw a prompt again in another.
        groups = [f"{s.get('batch')}/{s['prompt_id']}" for s in samples]
        advantages, _returns = estimator(algo.adv_estimator)(AdvantageInputs(
            outcome_rewards(samples, mask), mask, groups,
            norm_adv_by_std=algo.norm_adv_by_std, gamma=algo.gamma, lam=algo.lam, reward_baselines=baselines))
    elif advantages.shape != mask.shape:
        raise ValueError(f"advantages of shape {tuple(advantages.shape)} for a batch of {tuple(mask.shape)}")
    scale = None
    if algo.loss_agg_mode.value == "seq-mean-token-sum-norm":
        scale = float(algo.loss_scale_factor or max_new_tokens)
    return UpdateInputs(data, None, advantages, None, scale)


def autocast_dtype(model: ModelConfig) -> torch.dtype | None:
    """The autocast dtype of the trained model's forward: ``model.dtype`` when it is narrower than
    ``model.train_dtype`` (float32 master weights, bfloat16 compute), else None."""
    return getattr(torch, model.dtype) if model.dtype != model.train_dtype else None


def policy_module(lm: torch.nn.Module, model: ModelConfig) -> ResponseLogProbs:
    """The module the update calls for ``lm`` in ``model.train_dtype`` (autocast to ``model.dtype``)."""
    return ResponseLogProbs(lm, autocast_dtype(model))


def response_logprobs(
    module: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities ``[B, R]`` of the response tokens (logits divided by the sampling temperature),
    and their entropies with ``with_entropy``; ``module`` is a ``ResponseLogProbs`` (or DDP/FSDP2 around one)."""
    return module(**{key: batch[key] for key in DATA_KEYS}, temperature=temperature, with_entropy=with_entropy)


def select_rows(batch: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    return {key: value[rows] for key, value in batch.items()}


def minibatch_rows(samples: int, algo: AlgorithmConfig, seed: int) -> Iterator[torch.Tensor]:
    """Row indices of each minibatch, in step order: one seeded permutation per PPO epoch."""
    generator = torch.Generator().manual_seed(seed)  # on the CPU: the same order whatever the device
    for _ in range(algo.ppo_epochs):
        order = torch.randperm(samples, generator=generator)
        for start in range(0, samples, algo.minibatch_size):
            yield order[start : start + algo.minibatch_size]


def split_rows(rows: torch.Tensor, rank: int, world: int, size: int | None) -> list[torch.Tensor]:
    """Worker ``rank``'s parts of ``rows``: its contiguous share (one of ``world``), cut into micro-batches
    of at most ``size`` rows (None: one part).

    Every worker gets the same number of parts, since each forward and backward of fsdp2 is
    collective; a part may then be empty (fewer rows than parts).
    """
    shares = torch.tensor_split(rows, world)
    count = 1 if size is None else max(1, -(-len(shares[0]) // size))  # shares[0] is the largest
    return list(torch.tensor_split(shares[rank], count))


def micro_batches(inputs: UpdateInputs, rows: torch.Tensor, rank: int, world: int, size: int | None,
                  loss_agg_mode: str) -> list[tuple[torch.Tensor, float, float]]:
    """This worker's micro-batches of minibatch ``rows``: (rows to run, loss weight, token-mean weight).

    The weights are each part's share of the minibatch: its response tokens (``token-mean``) or its
    non-empty responses (``seq-mean-*``) for the loss, its response tokens for token-mean metrics. Summed
    over the parts and workers, weighted losses give the whole minibatch's loss, hence its
    gradient, up to float summation order. An empty part runs one row at weight 0, so every
    worker takes part in every collective.
    """
    mask = inputs.data["response_mask"]
    tokens = max(float(mask[rows].sum()), 1.0)
    sequences = max(float((mask[rows].sum(dim=-1) > 0).sum()), 1.0)  # the seq-means skip empty responses
    out = []
    for part in split_rows(rows, rank, world, size):
        if len(part) == 0:
            out.append((rows[:1], 0.0, 0.0))
            continue
        token_w = float(mask[part].sum()) / tokens
        # A mean over tokens or sequences is split by its share of them.
        loss_w = token_w if loss_agg_mode == "token-mean" else float((mask[part].sum(dim=-1) > 0).sum()) / sequences
        out.append((part, loss_w, token_w))
    return out


def minibatch_loss(
    module: torch.nn.Module, inputs: UpdateInputs, rows: torch.Tensor, algo: AlgorithmConfig, temperature: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy loss (minus entropy bonus, plus KL) of ``rows``, aggregated by ``algo.loss_agg_mode``.

    Returns:
        (scalar loss with its graph, metrics ``actor/*`` of these rows).
    """
    mb = select_rows(inputs.data, rows)
    mode, scale = algo.loss_agg_mode.value, inputs.loss_scale
    logp, entropy = response_logprobs(module, mb, temperature, with_entropy=True)
    old_logp = inputs.old_logp[rows] if inputs.old_logp is not None else logp.detach()
    pg_loss, pg_metrics = policy_loss(algo.policy_loss)(
        old_logp, logp, inputs.advantages[rows], mb["response_mask"],
        algo.clip_ratio_low, algo.clip_ratio_high, algo.clip_ratio_c, mode, scale,
    )
    assert entropy is not None  # asked for above
    entropy_loss = aggregate_loss(entropy, mb["response_mask"], mode, scale)
    loss = pg_loss - algo.entropy_coef * entropy_loss
    metrics = {**pg_metrics, "actor/pg_loss": pg_loss.item(), "actor/entropy": entropy_loss.item()}
    if inputs.ref_logp is not None:
        kl = aggregate_loss(kl_penalty(logp, inputs.ref_logp[rows], algo.kl_type.value), mb["response_mask"], mode,
                            scale)
        loss = loss + algo.kl_coef * kl
        metrics["actor/kl_loss"] = kl.item()
    metrics["actor/loss"] = loss.item()
    return loss, metrics


def accumulate_gradients(module: torch.nn.Module, inputs: UpdateInputs, rows: torch.Tensor, algo: AlgorithmConfig,
                         temperature: float, size: int | None, rank: int = 0, world: int = 1) -> dict[str, float]:
    """Forward and backward of this worker's micro-batches of minibatch ``rows``; gradients accumulate.

    Each micro-batch's loss is scaled by its weight (``micro_batches``) times ``world``, since DDP and
    FSDP2 *average* over the workers and the sum is wanted. DDP synchronises on the last backward
    only (``no_sync``); FSDP2 reduce-scatters after each, keeping only sharded gradients.

    Returns:
        the metrics weighted like the losses: summed over the workers, the minibatch's.
    """
    parts = micro_batches(inputs, rows, rank, world, size, algo.loss_agg_mode.value)
    metrics: dict[str, float] = {}
    for index, (part, loss_w, token_w) in enumerate(parts):
        last = index == len(parts) - 1
        no_sync = getattr(module, "no_sync", None)  # DDP's: all-reduce on the last micro-batch only
        with nullcontext() if last or no_sync is None else no_sync():
            loss, part_metrics = minibatch_loss(module, inputs, part, algo, temperature)
            (loss * (loss_w * world)).backward()
        accumulate(metrics, {k: v * (token_w if k in TOKEN_MEAN_METRICS else loss_w) for k, v in part_metrics.items()})
    return metrics


def frozen_logprobs(module: torch.nn.Module, inputs: UpdateInputs, temperature: float, size: int | None,
                    rank: int = 0, world: int = 1) -> torch.Tensor:
    """Log-probs ``[share, R]`` of worker ``rank``'s contiguous share of all rows, without gradients,
    ``size`` rows per forward (the whole share at once when None)."""
    parts = split_rows(torch.arange(len(inputs)), rank, world, size)
    out = []
    module.eval()
    with torch.no_grad():
        for part in parts:
            run = part if len(part) else torch.arange(1)  # a worker without rows still runs a forward (fsdp2)
            out.append(response_logprobs(module, select_rows(inputs.data, run), temperature)[0][: len(part)])
    return torch.cat(out)


def accumulate(totals: dict[str, float], metrics: dict[str, float]) -> None:
    for key, value in metrics.items():
        totals[key] = totals.get(key, 0.0) + value


def set_lr(optimizer: torch.optim.Optimizer, algo: AlgorithmConfig, step: int) -> float:
    """Set every param group's rate for global optimizer step ``step`` (``algos.lr_at``); returns it."""
    lr = lr_at(step, **schedule_of(algo))
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def train_steps(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: UpdateInputs,
    algo: AlgorithmConfig,
    temperature: float,
    seed: int,
    on_step: Callable[[int], None],
    first_step: int = 0,
    *,
    micro_batch_size: int | None = None,
    rank: int = 0,
    world: int = 1,
) -> list[dict[str, float]]:
    """This worker's part of the optimisation from global step ``first_step``: per minibatch, accumulate
    the micro-batches' gradients, call ``on_step(step)``, clip, step.

    Returns:
        Each optimizer step's metrics, in order: this worker's share; summed over the workers they are
        the one-process values. ``actor/grad_norm`` (the same on every worker) counts on rank 0.
    """
    module.train()
    per_step: list[dict[str, float]] = []
    for rows in minibatch_rows(len(inputs), algo, seed):
        optimizer.zero_grad(set_to_none=True)
        metrics = accumulate_gradients(module, inputs, rows, algo, temperature, micro_batch_size, rank, world)
        on_step(len(per_step) + 1)
        grad_norm = torch.nn.utils.clip_grad_norm_(module.parameters(), algo.grad_clip)
        norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        if not torch.isfinite(norm):  # every rank sees the same total norm: all refuse together
            raise NonFiniteUpdate("update", f"the gradient norm of optimizer step {first_step + len(per_step) + 1} "
                                            f"is {float(norm)} (loss {metrics.get('actor/loss')}); no weights are "
                                            f"committed. Check the scores (rewards.min_score/max_score), the "
                                            f"learning rate and the data")
        set_lr(optimizer, algo, first_step + len(per_step))
        optimizer.step()
        metrics["actor/grad_norm"] = float(norm) if rank == 0 else 0.0
        per_step.append(metrics)
    return per_step


def check_finite(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse to write weights or optimizer state holding NaN or infinity (this worker's shard of them).

    Raises:
        NonFiniteUpdate: naming the first tensor that is not finite.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    for name, param in model.named_parameters():
        shard: torch.Tensor = param.to_local() if hasattr(param, "to_local") else param
        if not torch.isfinite(shard).all():
            raise NonFiniteUpdate("update", f"weight {name} is not finite after the update; nothing is committed")
    for held, state in optimizer.state.items():
        for key, value in state.items():
            local = value.to_local() if hasattr(value, "to_local") else value
            if torch.is_tensor(local) and local.is_floating_point() and not torch.isfinite(local).all():
                raise NonFiniteUpdate("update", f"optimizer state {names.get(id(held), '?')}::{key} is not finite "
                                                f"after the update; nothing is committed")


def step_records(per_step: list[dict[str, float]], first_step: int, lrs: list[float]) -> list[dict[str, float]]:
    """One record per optimizer step: its global number (1-based, as ``trainer_state.json`` counts), its
    metrics and its learning rate: what ``steps.jsonl`` of the update unit holds."""
    return [{"step": first_step + i + 1, **metrics, "actor/lr": lr}
            for i, (metrics, lr) in enumerate(zip(per_step, lrs, strict=True))]
