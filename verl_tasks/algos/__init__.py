"""Pure torch functions for GRPO/PPO and the estimators verl users run, numerically compatible with verl's
core_algos: the losses, aggregations and penalties in ``core``, the advantage estimators in ``estimators``."""
from verl_tasks.algos.core import (
    POLICY_LOSSES,
    aggregate_loss,
    entropy_from_logprobs,
    kl_penalty,
    masked_mean,
    overlong_penalty,
    policy_loss,
    policy_loss_gspo,
    policy_loss_vanilla,
    value_loss,
)
from verl_tasks.algos.estimators import ESTIMATORS, AdvantageInputs, estimator
from verl_tasks.algos.schedule import lr_at, schedule_of

__all__ = [
    "ESTIMATORS",
    "POLICY_LOSSES",
    "AdvantageInputs",
    "aggregate_loss",
    "entropy_from_logprobs",
    "estimator",
    "kl_penalty",
    "lr_at",
    "masked_mean",
    "overlong_penalty",
    "policy_loss",
    "policy_loss_gspo",
    "policy_loss_vanilla",
    "schedule_of",
    "value_loss",
]
