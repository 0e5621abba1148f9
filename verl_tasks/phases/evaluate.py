"""Evaluate a policy version on the held-out prompts with greedy decoding.

``accuracy`` is the share of prompts whose reward is at least 1.0 (a correct
answer under the built-in scorers and verl's rule-based ones).
"""
from __future__ import annotations

import logging
from typing import Any

from verl_tasks import data as data_mod
from verl_tasks.events import record_event
from verl_tasks.models.engines import SamplingSpec, engine_options, get_engine
from verl_tasks.phases.common import PhaseContext, derive_seed, run_unit, sampling_policy
from verl_tasks.phases.prepare import eval_rows
from verl_tasks.phases.snapshot import retain_after_evaluate
from verl_tasks.rewards.sandbox import scoring_sandbox
from verl_tasks.store.units import CommitRecord, UnitWriter

CHUNK = 256
log = logging.getLogger(__name__)


def evaluate_version(ctx: PhaseContext, version: int, unit: str, epoch: int) -> CommitRecord:
    cfg = ctx.config

    def on_engine(how: str) -> None:
        record_event(ctx.store, ctx.layout, "engine_loaded", how=how, engine=cfg.rollout.engine, version=version,
                     epoch=epoch, phase="evaluate")

    def produce(writer: UnitWriter) -> dict[str, Any]:
        rows = eval_rows(ctx)[: cfg.evaluate.max_prompts]
        policy = sampling_policy(ctx, version)
        tokenizer, engine = policy.tokenizer, get_engine(cfg.rollout.engine)
        spec = SamplingSpec(n=1, temperature=1.0, top_p=1.0, max_new_tokens=cfg.rollout.max_new_tokens,
                            seed=derive_seed(cfg.seed, version, "evaluate"), greedy=True)
        texts: list[str] = []
        for start in range(0, len(rows), CHUNK):
            chunk = rows[start : start + CHUNK]
            ids = [tokenizer(data_mod.prompt_text(r["prompt"], tokenizer), add_special_tokens=False)["input_ids"]
                   for r in chunk]
            texts.extend(g.text for g in engine(policy, ids, spec, engine_options(cfg), on_engine))
        requests = [
            {"id": r["id"], "data_source": r["data_source"], "solution_str": t, "ground_truth": r["ground_truth"],
             "extra_info": r["extra_info"]}
            for r, t in zip(rows, texts, strict=True)
        ]
        with scoring_sandbox(cfg.rewards) as sandbox:
            result = sandbox.score(requests, cfg.rewards.default_score)
        accuracy = sum(s >= 1.0 for s in result.scores) / max(1, len(rows))
        metrics = {
            "eval_accuracy": accuracy,
            "eval_reward_mean": sum(result.scores) / max(1, len(rows)),
            "eval_prompts": len(rows),
            "policy_version": version,
            "eval_failed_samples": len(result.failures),
        }
        writer.write_json("metrics.json", metrics)
        writer.write_jsonl(
            "predictions.jsonl",
            [{"id": r["id"], "response": t, "score": s} for r, t, s in zip(rows, texts, result.scores, strict=True)],
        )
        return {"metrics": metrics, "device": policy.device}

    return run_unit(ctx, "evaluate", unit, epoch, produce)


def evaluate_base(ctx: PhaseContext) -> CommitRecord:
    return evaluate_version(ctx, 0, ctx.layout.base_evaluate, 0)


def evaluate(ctx: PhaseContext, epoch: int) -> CommitRecord:
    """Evaluate the policy produced by ``epoch`` (version ``epoch + 1``); the base too, once.

    With ``storage.keep_best_by`` retention runs again: this evaluation may name a new best.
    """
    base = evaluate_base(ctx)
    record = evaluate_version(ctx, epoch + 1, ctx.layout.evaluate(epoch), epoch)
    retain_after_evaluate(ctx)  # the version just evaluated (or an older best) may go now
    warn_on_regression(ctx, epoch, base, record)
    return record


def warn_on_regression(ctx: PhaseContext, epoch: int, base: CommitRecord, record: CommitRecord) -> None:
    """An ``accuracy_regression`` event when this evaluation and the previous one are both more than
    ``evaluate.regression_margin`` below the base's accuracy (status and the Training page say it too)."""
    from verl_tasks.status import accuracy_regression, marker_metrics

    earlier = [e for e in range(epoch) if ctx.config.should_evaluate(e)]
    previous = marker_metrics(ctx.store, [ctx.layout.evaluate(earlier[-1])]) if earlier else {}
    evaluated = [(e, m.get("eval_accuracy")) for e, m in zip(earlier[-1:], previous.values(), strict=True)]
    evaluated.append((epoch, record.meta.get("metrics", {}).get("eval_accuracy")))
    found = accuracy_regression(base.meta.get("metrics", {}).get("eval_accuracy"), evaluated,
                                ctx.config.evaluate.regression_margin)
    if found and found["epochs"][-1][0] == epoch:
        record_event(ctx.store, ctx.layout, "accuracy_regression", epoch=epoch, base=found["base"],
                     margin=found["margin"], epochs=found["epochs"])
        log.warning("held-out accuracy of epoch %d is more than %g below the base's for two evaluations in a row",
                    epoch, found["margin"])
