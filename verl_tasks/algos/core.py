"""One formula per function. Shapes: ``B`` sequences, ``T`` response tokens.

Matches verl ``verl/trainer/ppo/core_algos.py`` (GRPO outcome advantage,
vanilla clipped policy loss with dual clip, loss aggregation modes, KL penalties).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from verl_tasks.errors import ConfigError

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_TYPES = ("k1", "k2", "low_var_kl")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is 1 (any shape; both the same shape)."""
    return (values * mask).sum() / mask.sum().clamp_min(1)


def grpo_outcome_advantage(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: Sequence[str],
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantage (Shao et al. 2024), broadcast over response tokens.

    Args:
        token_rewards: ``[B, T]`` rewards per token (an outcome reward sits on one token).
        response_mask: ``[B, T]`` 1 for response tokens.
        group_ids: ``B`` ids; samples of one prompt share an id.
        norm_adv_by_std: divide by the group's unbiased std (GRPO) or not (Dr.GRPO).

    Returns:
        ``[B, T]`` advantages: ``(r_i - mean_g) / (std_g + eps)`` times the mask, where
        ``r_i`` is the sequence's summed reward; a group of one has mean 0 and std 1.
    """
    scores = token_rewards.sum(dim=-1)
    members: dict[str, list[int]] = defaultdict(list)
    for index, gid in enumerate(group_ids):
        members[gid].append(index)
    mean = torch.zeros_like(scores)
    std = torch.ones_like(scores)
    for indices in members.values():
        if len(indices) == 1:
            continue
        group = scores[indices]
        mean[indices] = group.mean()
        std[indices] = group.std(unbiased=True)
    centred = scores - mean
    advantage = centred / (std + epsilon) if norm_adv_by_std else centred
    return advantage.unsqueeze(-1) * response_mask


def aggregate_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean") -> torch.Tensor:
    """Reduce a ``[B, T]`` loss to a scalar.

    ``token-mean``: mean over all response tokens of the batch;
    ``seq-mean-token-sum``: sum over tokens, mean over sequences;
    ``seq-mean-token-mean``: mean over tokens, then over sequences.
    """
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    if mode == "seq-mean-token-sum":
        return (loss_mat * mask).sum(dim=-1).mean()
    if mode == "seq-mean-token-mean":
        per_seq = (loss_mat * mask).sum(dim=-1) / mask.sum(dim=-1).clamp_min(1)
        return per_seq.mean()
    raise ConfigError(f"unknown loss aggregation mode {mode!r}; valid: {LOSS_AGG_MODES}")


def policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with dual clip (Ye et al. 2020) for negative advantages.

    ``ratio = exp(clamp(logp - old_logp, -20, 20))``;
    ``L = max(-A*ratio, -A*clamp(ratio, 1-eps_low, 1+eps_high))``; for ``A < 0`` the
    loss is further capped at ``-A*c``. All tensors ``[B, T]``.

    Returns:
        (scalar loss, metrics ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``).
    """
    log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, response_mask)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    clip1 = torch.maximum(unclipped, clipped)
    clipfrac = masked_mean(torch.gt(clipped, unclipped).float(), response_mask)
    clip2 = torch.minimum(-advantages * clip_ratio_c, clip1)
    dual_clipped = torch.gt(clip1, -advantages * clip_ratio_c).float() * (advantages < 0).float()
    lower_clipfrac = masked_mean(dual_clipped, response_mask)
    losses = torch.where(advantages < 0, clip2, clip1)
    loss = aggregate_loss(losses, response_mask, loss_agg_mode)
    return loss, {
        "actor/pg_clipfrac": clipfrac.item(),
        "actor/ppo_kl": ppo_kl.item(),
        "actor/pg_clipfrac_lower": lower_clipfrac.item(),
    }


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL estimate between the policy and a frozen reference (Schulman's k1/k2/k3).

    ``k1 = logp - ref``; ``k2 = 0.5 (logp - ref)^2``;
    ``low_var_kl`` (k3): ``kl = clamp(ref - logp, -20, 20)``, ``clamp(exp(kl) - kl - 1, -10, 10)``.
    """
    if kl_type == "k1":
        return log_prob - ref_log_prob
    if kl_type == "k2":
        return 0.5 * (log_prob - ref_log_prob).square()
    if kl_type == "low_var_kl":
        kl = (ref_log_prob - log_prob).clamp(-20, 20)
        return (torch.exp(kl) - kl - 1).clamp(-10, 10)
    raise ConfigError(f"unknown KL type {kl_type!r}; valid: {KL_TYPES}")


def entropy_from_logprobs(log_probs: torch.Tensor) -> torch.Tensor:
    """Per-position entropy ``[...]`` of categorical distributions given as ``log_softmax`` output ``[..., V]``."""
    return -(log_probs.exp() * log_probs).sum(dim=-1)
