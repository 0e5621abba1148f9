"""Write the reference vectors ``tests/test_algos_verl.py`` checks: verl's own ``core_algos`` run on seeded
inputs (advantage estimators, policy losses with their gradients, loss aggregations, the value loss, KL
penalties), saved as JSON with the verl version that made them.

verl is not a dependency of this project; point the script at an unpacked verl wheel and the few packages
its ``core_algos`` imports (verl 0.9.1 needs tensordict, omegaconf, codetiming, pyvers, orjson, transformers)::

    pip download verl==0.9.1 --no-deps -d /tmp/verl && unzip -q /tmp/verl/verl-*.whl -d /tmp/verl/src
    pip install --target /tmp/verl/deps tensordict omegaconf codetiming pyvers orjson "transformers<5"
    python scripts/verl_reference.py --verl /tmp/verl/src --deps /tmp/verl/deps
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "tests" / "data" / "verl_core_algos.json"
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def batch(seed: int) -> dict[str, Any]:
    """Eight right-padded responses of up to six tokens in four prompt groups: two of three (one with all
    rewards equal) and two of one; one response has no tokens at all, one a masked token inside."""
    g = torch.Generator().manual_seed(seed)
    lengths = [6, 4, 1, 3, 3, 3, 5, 0]
    mask = torch.zeros(8, 6)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1.0
    mask[6, 2] = 0.0  # a tool/observation token inside a response: masked, the tokens after it are not
    group_ids = ["a", "a", "a", "b", "b", "b", "c", "d"]
    outcome = torch.tensor([1.0, 0.0, 0.5, 0.7, 0.7, 0.7, 1.0, 0.3])  # group "b": all equal
    outcome_rewards = torch.zeros(8, 6)
    for row, length in enumerate(lengths):
        if length:
            outcome_rewards[row, length - 1] = outcome[row]
    dense_rewards = torch.randn(8, 6, generator=g) * mask
    return {
        "response_mask": mask,
        "group_ids": group_ids,
        "outcome_rewards": outcome_rewards,
        "dense_rewards": dense_rewards,
        "values": torch.randn(8, 6, generator=g) * 0.5,
        "values_old": torch.randn(8, 6, generator=g) * 0.5,
        "returns": torch.randn(8, 6, generator=g),
        "reward_baselines": torch.rand(8, generator=g),
        "old_log_prob": -torch.rand(8, 6, generator=g) * 3,
        "log_prob_delta": torch.randn(8, 6, generator=g) * 0.4,  # ratios around 1, some past the clip range
        "advantages": torch.randn(8, 6, generator=g) * mask,
        "ref_log_prob": -torch.rand(8, 6, generator=g) * 3,
        "loss_mat": torch.randn(8, 6, generator=g),
    }


def actor_config(low: float, high: float, c: float, loss_scale_factor: float | None):
    """verl's own actor config, with the global-batch fields its data-parallel actor fills per step."""
    from verl.workers.config import FSDPActorConfig

    config = FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=8, rollout_n=1,
                             clip_ratio=low, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c,
                             loss_scale_factor=loss_scale_factor)
    config.global_batch_info.update(dp_size=1, batch_num_tokens=None, global_batch_size=None,
                                    loss_scale_factor=loss_scale_factor)
    return config


def run() -> dict[str, Any]:
    import numpy as np
    import verl
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import core_algos as ca

    data = batch(seed=7)
    mask, ids = data["response_mask"], np.array(data["group_ids"], dtype=object)
    cases: list[dict[str, Any]] = []

    def add(kind: str, name: str, params: dict[str, Any], outputs: dict[str, Any]) -> None:
        cases.append({"kind": kind, "name": name, "params": params,
                      "outputs": {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in outputs.items()}})

    for rewards in ("outcome_rewards", "dense_rewards"):
        r = data[rewards]
        for norm in (True, False):
            adv, ret = ca.compute_grpo_outcome_advantage(r.clone(), mask, ids, norm_adv_by_std_in_grpo=norm)
            add("estimator", "grpo", {"rewards": rewards, "norm_adv_by_std": norm}, {"advantages": adv, "returns": ret})
        adv, ret = ca.compute_rloo_outcome_advantage(r.clone(), mask, ids)
        add("estimator", "rloo", {"rewards": rewards}, {"advantages": adv, "returns": ret})
        for gamma in (1.0, 0.9):
            adv, ret = ca.compute_reinforce_plus_plus_outcome_advantage(r.clone(), mask, config=AlgoConfig(gamma=gamma))
            add("estimator", "reinforce_plus_plus", {"rewards": rewards, "gamma": gamma},
                {"advantages": adv, "returns": ret})
        adv, ret = ca.compute_reinforce_plus_plus_baseline_outcome_advantage(r.clone(), mask, ids)
        add("estimator", "reinforce_plus_plus_baseline", {"rewards": rewards}, {"advantages": adv, "returns": ret})
        adv, ret = ca.compute_remax_outcome_advantage(r.clone(), data["reward_baselines"], mask)
        add("estimator", "remax", {"rewards": rewards}, {"advantages": adv, "returns": ret})
        for gamma, lam in ((1.0, 1.0), (0.99, 0.95)):
            adv, ret = ca.compute_gae_advantage_return(r.clone(), data["values"], mask, gamma, lam)
            add("estimator", "gae", {"rewards": rewards, "gamma": gamma, "lam": lam},
                {"advantages": adv, "returns": ret})

    for mode in AGG_MODES:
        for factor in ((None, 4.0) if mode == "seq-mean-token-sum-norm" else (None,)):
            loss = ca.agg_loss(data["loss_mat"], mask, mode, loss_scale_factor=factor)
            add("agg_loss", mode, {"loss_scale_factor": factor}, {"loss": loss.item()})
            for name, fn in (("vanilla", ca.compute_policy_loss_vanilla), ("gspo", ca.compute_policy_loss_gspo)):
                for low, high in ((0.2, 0.2), (0.2, 0.28)):  # symmetric, and DAPO's clip-higher
                    log_prob = (data["old_log_prob"] + data["log_prob_delta"]).requires_grad_(True)
                    config = actor_config(low, high, 3.0, factor)
                    loss, metrics = fn(data["old_log_prob"], log_prob, data["advantages"], mask, mode, config)
                    loss.backward()
                    add("policy_loss", name, {"loss_agg_mode": mode, "loss_scale_factor": factor,
                                              "clip_ratio_low": low, "clip_ratio_high": high, "clip_ratio_c": 3.0},
                        {"loss": loss.item(), "grad": log_prob.grad, **metrics})
            vf_loss, clipfrac = ca.compute_value_loss(data["values"], data["returns"], data["values_old"], mask, 0.2,
                                                      mode, loss_scale_factor=factor)
            add("value_loss", mode, {"loss_scale_factor": factor, "cliprange_value": 0.2},
                {"loss": vf_loss.item(), "clipfrac": float(clipfrac)})

    extreme = data["ref_log_prob"].clone()
    extreme[0, 0] = extreme[0, 0] + 40.0  # past the clamp of low_var_kl
    for kl_type in ("k1", "k2", "low_var_kl"):
        add("kl_penalty", kl_type, {}, {"kl": ca.kl_penalty(data["old_log_prob"], extreme, kl_type)})

    inputs = {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in data.items()}
    inputs["ref_log_prob_extreme"] = extreme.tolist()
    return {"verl_version": getattr(verl, "__version__", "unknown"), "made_by": "scripts/verl_reference.py",
            "inputs": inputs, "cases": cases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--verl", type=Path, required=True, help="folder holding the verl package")
    parser.add_argument("--deps", type=Path, help="folder holding the packages verl's core_algos imports")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    sys.path[:0] = [str(args.verl)] + ([str(args.deps)] if args.deps else [])
    torch.set_default_dtype(torch.float32)
    result = run()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=None, separators=(",", ":")) + "\n")
    print(f"{len(result['cases'])} cases from verl {result['verl_version']} -> {args.output}")


if __name__ == "__main__":
    main()
