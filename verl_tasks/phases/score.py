"""Score one rollout batch with the configured reward function, in a sandboxed process."""
from __future__ import annotations

import math
from typing import Any

from verl_tasks.errors import RewardFailureRate
from verl_tasks.phases.common import PhaseContext, require, run_unit
from verl_tasks.phases.prepare import train_rows
from verl_tasks.phases.rollout import BASELINES
from verl_tasks.rewards.sandbox import scoring_sandbox
from verl_tasks.store.units import CommitRecord, UnitWriter, read_jsonl

BASELINE_SCORES = "baseline_scores.jsonl"


def score(ctx: PhaseContext, epoch: int, batch: int) -> CommitRecord:
    cfg = ctx.config.rewards
    unit = ctx.layout.score(epoch, batch)

    def produce(writer: UnitWriter) -> dict[str, Any]:
        record = require(ctx, ctx.layout.rollout(epoch, batch), "rollout")
        drawn = read_jsonl(ctx.store, record, "samples.jsonl")
        # ReMax: each prompt's greedy answer is scored with the samples, the same way (its reward is the baseline).
        baselines = read_jsonl(ctx.store, record, BASELINES) if BASELINES in record.files else []
        samples = drawn + baselines
        rows = {row["id"]: row for row in train_rows(ctx)}
        requests = [
            {
                "id": s["sample_id"],
                "data_source": rows[s["prompt_id"]]["data_source"],
                "solution_str": s["response"],
                "ground_truth": rows[s["prompt_id"]]["ground_truth"],
                "extra_info": rows[s["prompt_id"]]["extra_info"],
            }
            for s in samples
        ]
        with scoring_sandbox(cfg) as sandbox:
            result = sandbox.score(requests, cfg.default_score)
        for i, value in enumerate(result.scores):  # a score out of range is a failed sample, never trained on
            if not (math.isfinite(value) and cfg.min_score <= value <= cfg.max_score):
                result.failures[requests[i]["id"]] = (f"score {value!r} outside rewards.min_score..max_score "
                                                      f"[{cfg.min_score:g}, {cfg.max_score:g}]")
                result.scores[i] = cfg.default_score
        buffer = cfg.overlong_buffer
        if buffer.enable:  # DAPO's soft overlong punishment, added to what the function returned (in range)
            import torch

            from verl_tasks.algos import overlong_penalty

            lengths = torch.tensor([len(s["response_ids"]) for s in samples])
            penalties = overlong_penalty(lengths, ctx.config.rollout.max_new_tokens, buffer.len,
                                         buffer.penalty_factor).tolist()
            result.scores = [value + penalty if sid not in result.failures else value
                             for value, penalty, sid in zip(result.scores, penalties, (r["id"] for r in requests),
                                                            strict=True)]
        fraction = len(result.failures) / max(1, len(samples))
        if fraction > cfg.max_failure_fraction:
            examples = "; ".join(f"{k}: {v}" for k, v in list(result.failures.items())[:3])
            raise RewardFailureRate(
                unit,
                f"{len(result.failures)}/{len(samples)} samples could not be scored ({fraction:.0%} > "
                f"rewards.max_failure_fraction {cfg.max_failure_fraction:.0%}); e.g. {examples}. Fix "
                f"{cfg.function} or raise the threshold",
            )
        scored = [{"sample_id": s["sample_id"], "score": value}
                  for s, value in zip(samples, result.scores, strict=True)]
        writer.write_jsonl("scores.jsonl", scored[: len(drawn)])
        if baselines:
            writer.write_jsonl(BASELINE_SCORES, scored[len(drawn):])
        scores = result.scores[: len(drawn)]
        mean = sum(scores) / max(1, len(scores))
        return {"samples": len(drawn), "reward_mean": mean, "failed_samples": result.failures}

    return run_unit(ctx, "score", unit, epoch, produce, batch=batch)
