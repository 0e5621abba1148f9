"""GRPO/PPO formulas against values computed by hand (verl core_algos semantics)."""
from __future__ import annotations

import math

import pytest
import torch

from verl_tasks.algos import (
    AdvantageInputs,
    aggregate_loss,
    estimator,
    kl_penalty,
    overlong_penalty,
    policy_loss_vanilla,
)
from verl_tasks.errors import ConfigError


def test_grpo_advantage_unbiased_std_and_singleton_group():
    # group "a": scores 1, 0, 0 -> mean 1/3, unbiased std sqrt(1/3); group "b": one sample
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 0.0], [0.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    adv, _ = estimator("grpo")(AdvantageInputs(rewards, mask, ["a", "a", "a", "b"]))
    std = math.sqrt(1 / 3)
    assert adv[0, 0].item() == pytest.approx((1 - 1 / 3) / (std + 1e-6), rel=1e-6)
    assert adv[1, 1].item() == pytest.approx((0 - 1 / 3) / (std + 1e-6), rel=1e-6)
    assert adv[2, 1].item() == 0.0  # masked
    assert adv[3, 0].item() == pytest.approx(5.0 / (1 + 1e-6))  # singleton: mean 0, std 1


def test_dr_grpo_does_not_divide_by_std():
    rewards = torch.tensor([[2.0], [0.0]])
    adv, _ = estimator("grpo")(AdvantageInputs(rewards, torch.ones(2, 1), ["g", "g"], norm_adv_by_std=False))
    assert adv.squeeze().tolist() == [1.0, -1.0]


def test_clipped_loss_positive_advantage_clips_at_one_plus_eps():
    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[1.5, 1.1]]))  # ratios 1.5 and 1.1
    adv = torch.ones(1, 2)
    loss, metrics = policy_loss_vanilla(old, new, adv, torch.ones(1, 2))
    # token 1: max(-1.5, -1.2) = -1.2 ; token 2: max(-1.1, -1.1) = -1.1 ; token-mean
    assert loss.item() == pytest.approx((-1.2 - 1.1) / 2, rel=1e-5)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.5)
    assert metrics["actor/ppo_kl"] == pytest.approx(-(math.log(1.5) + math.log(1.1)) / 2, rel=1e-5)


def test_dual_clip_caps_negative_advantage_loss():
    old = torch.zeros(1, 1)
    new = torch.log(torch.tensor([[10.0]]))  # ratio 10
    adv = -torch.ones(1, 1)
    loss, metrics = policy_loss_vanilla(old, new, adv, torch.ones(1, 1), clip_ratio_c=3.0)
    # clip1 = max(10, 1.2) = 10 ; dual clip min(3, 10) = 3
    assert loss.item() == pytest.approx(3.0)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1.0)


def test_ratio_log_is_clamped():
    old = torch.zeros(1, 1)
    new = torch.full((1, 1), 100.0)
    loss, _ = policy_loss_vanilla(old, new, torch.ones(1, 1), torch.ones(1, 1), clip_ratio_high=1e9)
    assert loss.item() == pytest.approx(-math.exp(20), rel=1e-5)


def test_loss_aggregation_modes():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    with pytest.raises(ConfigError, match="valid"):
        aggregate_loss(loss, mask, "sum")


def test_kl_penalties():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.125)
    kl = -0.5
    assert kl_penalty(logp, ref, "low_var_kl").item() == pytest.approx(math.exp(kl) - kl - 1, rel=1e-6)
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([50.0]), "low_var_kl").item() == pytest.approx(10.0)
    with pytest.raises(ConfigError, match="low_var_kl"):
        kl_penalty(logp, ref, "k9")


def test_dapo_overlong_penalty_is_linear_inside_the_buffer():
    # max 10 tokens, buffer 4: no penalty up to 6 tokens, then -factor * (L - 6) / 4, reaching -factor at 10
    penalty = overlong_penalty(torch.tensor([3, 6, 7, 8, 10]), 10, 4, 0.5)
    assert penalty.tolist() == pytest.approx([0.0, 0.0, -0.125, -0.25, -0.5])


def test_seq_mean_token_sum_norm_divides_the_sequence_mean_by_a_constant():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # the last response is empty
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx((6 + 4) / 2 / 3)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm", 10.0).item() == pytest.approx((6 + 4) / 2 / 10)


def test_every_estimator_verl_names_is_accepted_at_load():
    from verl_tasks.config import AlgorithmConfig
    from verl_tasks.verl_import import ESTIMATORS

    assert sorted(ESTIMATORS) == sorted(AlgorithmConfig.model_fields["adv_estimator"].annotation.__args__)
    for name in ESTIMATORS:
        assert AlgorithmConfig(adv_estimator=name).adv_estimator == name
