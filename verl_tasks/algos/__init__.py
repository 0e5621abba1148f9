"""Pure torch functions for GRPO/PPO, numerically compatible with verl's core_algos."""
from verl_tasks.algos.core import (
    aggregate_loss,
    entropy_from_logprobs,
    grpo_outcome_advantage,
    kl_penalty,
    masked_mean,
    policy_loss_vanilla,
)
from verl_tasks.algos.schedule import lr_at, schedule_of

__all__ = [
    "aggregate_loss",
    "entropy_from_logprobs",
    "grpo_outcome_advantage",
    "kl_penalty",
    "lr_at",
    "masked_mean",
    "policy_loss_vanilla",
    "schedule_of",
]
