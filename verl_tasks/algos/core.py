"""One formula per function. Shapes: ``B`` sequences, ``T`` response tokens.

Matches verl ``verl/trainer/ppo/core_algos.py`` (the vanilla clipped policy loss with dual clip and
decoupled clip ranges, GSPO's sequence-level ratio, the loss aggregation modes, the clipped value loss,
KL penalties, DAPO's overlong penalty); the advantage estimators are in :mod:`.estimators`. Checked
against vectors verl itself made (``tests/data/verl_core_algos.json``, ``scripts/verl_reference.py``).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from verl_tasks.errors import ConfigError

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_TYPES = ("k1", "k2", "low_var_kl")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is 1 (any shape; both the same shape)."""
    return (values * mask).sum() / mask.sum().clamp_min(1)


def aggregate_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
                   loss_scale_factor: float | None = None) -> torch.Tensor:
    """Reduce a ``[B, T]`` loss to a scalar.

    ``token-mean``: mean over all response tokens of the batch;
    ``seq-mean-token-sum``: sum over tokens, mean over the sequences that have any;
    ``seq-mean-token-mean``: mean over tokens, then over the sequences that have any;
    ``seq-mean-token-sum-norm`` (Dr. GRPO): ``seq-mean-token-sum`` divided by ``loss_scale_factor`` (a
    constant; default: ``T``), so a token's weight does not depend on its sequence's length.
    """
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    present = (mask.sum(dim=-1) > 0).float()
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        loss = ((loss_mat * mask).sum(dim=-1) * present).sum() / present.sum().clamp_min(1)
        if mode == "seq-mean-token-sum":
            return loss
        return loss / (loss_scale_factor if loss_scale_factor is not None else mask.shape[-1])
    if mode == "seq-mean-token-mean":
        per_seq = (loss_mat * mask).sum(dim=-1) / (mask.sum(dim=-1) + 1e-8)
        return (per_seq * present).sum() / present.sum().clamp_min(1)
    raise ConfigError(f"unknown loss aggregation mode {mode!r}; valid: {LOSS_AGG_MODES}")


PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, float]]]
POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Register a policy loss under ``name`` (``algorithm.policy_loss``). Every one takes
    ``(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high, clip_ratio_c,
    loss_agg_mode, loss_scale_factor)`` and returns ``(scalar loss, metrics)``."""
    def add(fn: PolicyLoss) -> PolicyLoss:
        POLICY_LOSSES[name] = fn
        return fn

    return add


def policy_loss(name: str) -> PolicyLoss:
    if name not in POLICY_LOSSES:
        raise ConfigError(f"unknown algorithm.policy_loss {name!r}; valid: {', '.join(sorted(POLICY_LOSSES))}")
    return POLICY_LOSSES[name]


@register_policy_loss("vanilla")
def policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
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
    loss = aggregate_loss(losses, response_mask, loss_agg_mode, loss_scale_factor)
    return loss, {
        "actor/pg_clipfrac": clipfrac.item(),
        "actor/ppo_kl": ppo_kl.item(),
        "actor/pg_clipfrac_lower": lower_clipfrac.item(),
    }


@register_policy_loss("gspo")
def policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025): a sequence-level importance ratio, the geometric mean of the token ratios
    ``s_i = exp(mean_t (logp - old_logp))``, carried by each token as ``sg[s_i] * p_t / sg[p_t]`` (so its
    gradient is the token's), clipped to ``[1-eps_low, 1+eps_high]``, aggregated by ``loss_agg_mode`` (the
    paper's is ``seq-mean-token-mean``). ``clip_ratio_c`` is not used (no dual clip)."""
    log_ratio = log_prob - old_log_prob
    lengths = response_mask.sum(dim=-1).clamp(min=1)
    seq_log_ratio = (log_ratio * response_mask).sum(dim=-1) / lengths
    token_log_ratio = (log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)).clamp(max=10.0)
    ratio = torch.exp(token_log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    losses = torch.maximum(unclipped, clipped)
    loss = aggregate_loss(losses, response_mask, loss_agg_mode, loss_scale_factor)
    return loss, {
        "actor/pg_clipfrac": masked_mean(torch.gt(clipped, unclipped).float(), response_mask).item(),
        "actor/ppo_kl": masked_mean(-log_ratio, response_mask).item(),
        "actor/pg_clipfrac_lower": 0.0,
    }


def value_loss(values_pred: torch.Tensor, returns: torch.Tensor, values_old: torch.Tensor,
               response_mask: torch.Tensor, clip_range: float, loss_agg_mode: str = "token-mean",
               loss_scale_factor: float | None = None) -> tuple[torch.Tensor, float]:
    """PPO's clipped value loss: ``0.5 * agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2))``.

    Returns:
        (scalar loss, the share of tokens where the clipped term was the larger).
    """
    clipped_pred = torch.maximum(torch.minimum(values_pred, values_old + clip_range), values_old - clip_range)
    plain, clipped = (values_pred - returns).square(), (clipped_pred - returns).square()
    loss = 0.5 * aggregate_loss(torch.maximum(plain, clipped), response_mask, loss_agg_mode, loss_scale_factor)
    return loss, masked_mean(torch.gt(clipped, plain).float(), response_mask).item()


def overlong_penalty(response_lengths: torch.Tensor, max_response_length: int, buffer_length: int,
                     penalty_factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025), added to each sample's reward: 0 up to
    ``max_response_length - buffer_length`` tokens, then falling linearly to ``-penalty_factor`` at
    ``max_response_length``: ``min(-(L - (max - buffer)) / buffer * factor, 0)``."""
    expected = max_response_length - buffer_length
    return torch.clamp(-(response_lengths.float() - expected) / buffer_length * penalty_factor, max=0.0)


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
