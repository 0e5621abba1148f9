"""verl-tasks' estimators, policy losses, aggregations, value loss and KL penalties equal verl's ``core_algos``
to 1e-6 on the vectors verl itself made (``tests/data/verl_core_algos.json``, written by
``scripts/verl_reference.py``): groups of one, a group whose rewards are all equal, a response with no tokens
and a masked token inside a response are among the inputs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from verl_tasks.algos import AdvantageInputs, aggregate_loss, estimator, kl_penalty, policy_loss, value_loss

REFERENCE = json.loads((Path(__file__).parent / "data" / "verl_core_algos.json").read_text())
INPUTS = {k: torch.tensor(v) if k != "group_ids" else v for k, v in REFERENCE["inputs"].items()}
CASES = REFERENCE["cases"]


def _close(got: torch.Tensor | float, want, what: str) -> None:
    torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float32), torch.tensor(want, dtype=torch.float32),
                               rtol=0, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _ids(kind: str) -> list[str]:
    return [f"{c['name']}-{json.dumps(c['params'], sort_keys=True)}" for c in CASES if c["kind"] == kind]


def test_the_reference_covers_every_formula_and_came_from_verl():
    assert REFERENCE["verl_version"] == "0.9.1" and REFERENCE["made_by"] == "scripts/verl_reference.py"
    names = {(c["kind"], c["name"]) for c in CASES}
    for name in ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "gae"):
        assert ("estimator", name) in names
    assert {("policy_loss", "vanilla"), ("policy_loss", "gspo")} <= names
    assert {n for k, n in names if k == "agg_loss"} == {"token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                                         "seq-mean-token-sum-norm"}
    mask, groups = INPUTS["response_mask"], INPUTS["group_ids"]
    assert groups.count("c") == 1 and groups.count("d") == 1  # groups of one
    assert mask[7].sum() == 0 and mask[6, 2] == 0 and mask[6, 3] == 1  # an empty response, a masked token inside


@pytest.mark.parametrize("case", [c for c in CASES if c["kind"] == "estimator"], ids=_ids("estimator"))
def test_estimator_equals_verl(case):
    params = case["params"]
    inputs = AdvantageInputs(
        token_rewards=INPUTS[params["rewards"]].clone(), response_mask=INPUTS["response_mask"],
        group_ids=INPUTS["group_ids"], norm_adv_by_std=params.get("norm_adv_by_std", True),
        gamma=params.get("gamma", 1.0), lam=params.get("lam", 1.0), values=INPUTS["values"],
        reward_baselines=INPUTS["reward_baselines"])
    advantages, returns = estimator(case["name"])(inputs)
    _close(advantages, case["outputs"]["advantages"], f"{case['name']} advantages")
    _close(returns, case["outputs"]["returns"], f"{case['name']} returns")


@pytest.mark.parametrize("case", [c for c in CASES if c["kind"] == "policy_loss"], ids=_ids("policy_loss"))
def test_policy_loss_and_its_gradient_equal_verl(case):
    p, want = case["params"], case["outputs"]
    log_prob = (INPUTS["old_log_prob"] + INPUTS["log_prob_delta"]).requires_grad_(True)
    loss, metrics = policy_loss(case["name"])(
        INPUTS["old_log_prob"], log_prob, INPUTS["advantages"], INPUTS["response_mask"], p["clip_ratio_low"],
        p["clip_ratio_high"], p["clip_ratio_c"], p["loss_agg_mode"], p["loss_scale_factor"])
    loss.backward()
    _close(loss.item(), want["loss"], "loss")
    _close(log_prob.grad, want["grad"], "gradient")
    for key in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        _close(metrics[key], want[key], key)


@pytest.mark.parametrize("case", [c for c in CASES if c["kind"] == "agg_loss"], ids=_ids("agg_loss"))
def test_loss_aggregation_equals_verl(case):
    got = aggregate_loss(INPUTS["loss_mat"], INPUTS["response_mask"], case["name"], case["params"]["loss_scale_factor"])
    _close(got.item(), case["outputs"]["loss"], case["name"])


@pytest.mark.parametrize("case", [c for c in CASES if c["kind"] == "value_loss"], ids=_ids("value_loss"))
def test_value_loss_equals_verl(case):
    loss, clipfrac = value_loss(INPUTS["values"], INPUTS["returns"], INPUTS["values_old"], INPUTS["response_mask"],
                                case["params"]["cliprange_value"], case["name"], case["params"]["loss_scale_factor"])
    _close(loss.item(), case["outputs"]["loss"], "value loss")
    _close(clipfrac, case["outputs"]["clipfrac"], "clip fraction")


@pytest.mark.parametrize("case", [c for c in CASES if c["kind"] == "kl_penalty"], ids=_ids("kl_penalty"))
def test_kl_penalty_equals_verl(case):
    got = kl_penalty(INPUTS["old_log_prob"], INPUTS["ref_log_prob_extreme"], case["name"])
    _close(got, case["outputs"]["kl"], case["name"])
