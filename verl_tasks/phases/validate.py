"""The data-quality gate: Great Expectations over an epoch's scored samples.

A failing suite fails the task with a summary naming expectations and batches;
no validate marker is written, so the update never sees that data.
"""
from __future__ import annotations

from typing import Any

from verl_tasks.errors import ValidationFailed
from verl_tasks.events import record_event
from verl_tasks.phases.common import PhaseContext, require, run_unit
from verl_tasks.quality.suites import Limits, summarize, validate_epoch
from verl_tasks.store.units import CommitRecord, UnitWriter, read_jsonl


def scored_rows(ctx: PhaseContext, epoch: int, batch: int) -> list[dict[str, Any]]:
    samples = read_jsonl(ctx.store, require(ctx, ctx.layout.rollout(epoch, batch), "rollout"), "samples.jsonl")
    scores = read_jsonl(ctx.store, require(ctx, ctx.layout.score(epoch, batch), "score"), "scores.jsonl")
    by_id = {row["sample_id"]: row["score"] for row in scores}
    return [
        {
            "sample_id": s["sample_id"],
            "response": s["response"],
            "prompt_tokens": len(s["prompt_ids"]),
            "response_tokens": len(s["response_ids"]),
            "score": by_id.get(s["sample_id"]),
        }
        for s in samples
    ]


def validate(ctx: PhaseContext, epoch: int) -> CommitRecord:
    cfg = ctx.config
    unit = ctx.layout.validate(epoch)

    def produce(writer: UnitWriter) -> dict[str, Any]:
        rows = {b: scored_rows(ctx, epoch, b) for b in range(cfg.rollout.batches_per_epoch)}
        if not cfg.quality.enabled:
            writer.write_json("report.json", {"success": True, "skipped": "quality.enabled is false"})
            return {"success": True, "rows": sum(len(r) for r in rows.values())}
        limits = Limits(
            rows_per_batch=cfg.rollout.prompts_per_batch * cfg.algorithm.group_size,
            rows_per_epoch=cfg.samples_per_epoch,
            max_prompt_tokens=cfg.data.max_prompt_tokens,
            max_response_tokens=cfg.rollout.max_new_tokens,
            min_score=cfg.rewards.min_score,
            max_score=cfg.rewards.max_score,
            min_nonempty_fraction=cfg.quality.min_nonempty_response_fraction,
        )
        report = validate_epoch(rows, limits)
        if not report["success"]:
            summary = summarize(report)
            record_event(ctx.store, ctx.layout, "validation_report", unit=unit, epoch=epoch, report=report)
            raise ValidationFailed(unit, "data-quality gate failed; the update will not run on this data:\n" + summary)
        writer.write_json("report.json", report)
        return {"success": True, "rows": report["rows"]}

    return run_unit(ctx, "validate", unit, epoch, produce)
