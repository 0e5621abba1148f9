"""Advantage estimators, one formula each, chosen by ``algorithm.adv_estimator`` with verl's names.

Every estimator takes the same :class:`AdvantageInputs` and returns ``(advantages, returns)``, both
``[B, T]`` (``B`` sequences, ``T`` response tokens) and zero outside the response mask, as verl's
``core_algos`` estimators of the same name compute them (checked against vectors verl itself made:
``tests/data/verl_core_algos.json``). Batch-level statistics (whitening) are over every response
token of the update's batch: the epoch's samples.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from verl_tasks.errors import ConfigError


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may read.

    ``token_rewards``: ``[B, T]`` rewards per token (an outcome reward sits on the last response token);
    ``response_mask``: ``[B, T]``; ``group_ids``: ``B`` prompt ids (samples of one prompt share one);
    ``values``: ``[B, T]`` a critic's values (``gae``); ``reward_baselines``: ``[B]`` the reward of each
    prompt's greedy answer (``remax``); ``gamma``, ``lam``: discount and GAE lambda.
    """

    token_rewards: torch.Tensor
    response_mask: torch.Tensor
    group_ids: Sequence[str]
    norm_adv_by_std: bool = True
    gamma: float = 1.0
    lam: float = 1.0
    values: torch.Tensor | None = None
    reward_baselines: torch.Tensor | None = None
    epsilon: float = 1e-6


Estimator = Callable[[AdvantageInputs], tuple[torch.Tensor, torch.Tensor]]
ESTIMATORS: dict[str, Estimator] = {}


def register(name: str) -> Callable[[Estimator], Estimator]:
    def add(fn: Estimator) -> Estimator:
        ESTIMATORS[name] = fn
        return fn

    return add


def estimator(name: str) -> Estimator:
    """The estimator registered as ``name``; ConfigError listing the valid names otherwise."""
    if name not in ESTIMATORS:
        raise ConfigError(f"unknown algorithm.adv_estimator {name!r}; valid: {', '.join(sorted(ESTIMATORS))}")
    return ESTIMATORS[name]


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / sqrt(var + 1e-8)`` with the mean and the unbiased variance over the masked elements.
    Fewer than two masked elements (a batch of empty answers) have no variance: zeros, no learning signal,
    where verl's formula would divide by zero."""
    count = mask.sum()
    if count < 2:
        return torch.zeros_like(values)
    mean = (values * mask).sum() / (count + 1e-8)
    variance = ((values - mean).square() * mask).sum() / (count + 1e-8) * (count / (count - 1))
    return (values - mean) * torch.rsqrt(variance + 1e-8)


def _groups(group_ids: Sequence[str]) -> dict[str, list[int]]:
    members: dict[str, list[int]] = defaultdict(list)
    for index, gid in enumerate(group_ids):
        members[gid].append(index)
    return members


@register("grpo")
def grpo(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al. 2024): ``(r_i - mean_g) / (std_g + eps)`` with the group's unbiased std, or
    ``r_i - mean_g`` without (Dr. GRPO, ``norm_adv_by_std: false``); a group of one: mean 0, std 1."""
    scores = inputs.token_rewards.sum(dim=-1)
    mean, std = torch.zeros_like(scores), torch.ones_like(scores)
    for indices in _groups(inputs.group_ids).values():
        if len(indices) > 1:
            mean[indices] = scores[indices].mean()
            std[indices] = scores[indices].std(unbiased=True)
    centred = scores - mean
    advantage = (centred / (std + inputs.epsilon) if inputs.norm_adv_by_std else centred).unsqueeze(-1)
    advantage = advantage * inputs.response_mask
    return advantage, advantage


@register("rloo")
def rloo(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024): each sample's score minus the mean of the others of its group,
    ``n/(n-1) (r_i - mean_g)``; a group of one keeps its score."""
    scores = inputs.token_rewards.sum(dim=-1)
    out = scores.clone()
    for indices in _groups(inputs.group_ids).values():
        n = len(indices)
        if n > 1:
            out[indices] = (scores[indices] - scores[indices].mean()) * n / (n - 1)
    advantage = out.unsqueeze(-1) * inputs.response_mask
    return advantage, advantage


@register("reinforce_plus_plus")
def reinforce_plus_plus(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted returns per response token (``gamma``; a masked position carries
    the running return past itself undiscounted and holds 0), whitened over the batch's response tokens."""
    rewards, mask = inputs.token_rewards, inputs.response_mask
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        step = rewards[:, t] + inputs.gamma * running
        returns[:, t] = step * mask[:, t]
        running = step * mask[:, t] + running * (1 - mask[:, t])
    return masked_whiten(returns, mask) * mask, returns


@register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline: ``r_i - mean_g`` (a group of one: the score), broadcast over the
    response and whitened over the batch's response tokens."""
    scores = inputs.token_rewards.sum(dim=-1)
    centred = scores.clone()
    for indices in _groups(inputs.group_ids).values():
        if len(indices) > 1:
            centred[indices] = scores[indices] - scores[indices].mean()
    mask = inputs.response_mask
    advantage = masked_whiten(centred.unsqueeze(-1) * mask, mask) * mask
    return advantage, advantage


@register("remax")
def remax(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): the reward-to-go minus the reward of the prompt's greedy answer."""
    if inputs.reward_baselines is None:
        raise ConfigError("adv_estimator remax needs the greedy answers' rewards (reward_baselines)")
    mask = inputs.response_mask
    returns = (inputs.token_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    return returns - inputs.reward_baselines.unsqueeze(-1) * mask, returns


@register("gae")
def gae(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016) from a critic's ``values``:
    ``delta_t = r_t + gamma V_{t+1} - V_t``, ``A_t = delta_t + gamma lam A_{t+1}`` over response tokens
    (masked positions carry the next value and advantage through); returns ``A + V``; the advantages
    whitened over the batch's response tokens."""
    if inputs.values is None:
        raise ConfigError("adv_estimator gae needs a critic's values")
    rewards, values, mask = inputs.token_rewards, inputs.values, inputs.response_mask
    next_value = torch.zeros_like(rewards[:, 0])
    last = torch.zeros_like(rewards[:, 0])
    reversed_advantages = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + inputs.gamma * next_value - values[:, t]
        current = delta + inputs.gamma * inputs.lam * last
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        last = current * mask[:, t] + (1 - mask[:, t]) * last
        reversed_advantages.append(last)
    advantages = torch.stack(reversed_advantages[::-1], dim=1)
    returns = advantages + values
    return masked_whiten(advantages, mask), returns


__all__ = ["AdvantageInputs", "ESTIMATORS", "estimator", "masked_whiten", "register"]
