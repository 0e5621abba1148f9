"""The data-quality gate: Great Expectations over an epoch's scored samples.

A failing suite fails the task with a summary naming expectations and batches;
no validate marker is written, so the update never sees that data.

With ``fault_tolerance.min_committed_batch_fraction`` below 1, validate is where an
epoch gives up on batches whose rollout or score failed all their retries: while
enough batches are committed, the missing ones are committed once as the epoch's
``skipped`` unit, and validate and update read the other batches only, on every rerun.
"""
from __future__ import annotations

from typing import Any

from verl_tasks.errors import BatchesMissing, ValidationFailed
from verl_tasks.events import record_event
from verl_tasks.phases.common import PhaseContext, committed, require, run_unit
from verl_tasks.quality.suites import Limits, summarize, validate_epoch
from verl_tasks.store.conventions import read_skipped, write_skipped
from verl_tasks.store.units import CommitRecord, UnitWriter, check_not_fenced, read_jsonl


def epoch_batches(ctx: PhaseContext, epoch: int) -> list[int]:
    """The batches validate and update read: all of the epoch's, less those recorded as skipped; with dynamic
    sampling, every batch ``top_up`` drew (no batch is skipped then)."""
    if ctx.config.dynamic_sampling is not None:
        from verl_tasks.phases.top_up import read_selection

        return list(read_selection(ctx, epoch)["batches"])
    skipped = set(read_skipped(ctx.store, ctx.layout, epoch))
    return [b for b in range(ctx.config.rollout.batches_per_epoch) if b not in skipped]


def settle_batches(ctx: PhaseContext, epoch: int) -> list[int]:
    """The epoch's batches to read; records the missing ones as skipped when the config allows it.

    Raises:
        BatchesMissing: batches are missing and ``min_committed_batch_fraction`` does not allow going on
            (not retried: running validate again cannot bring them back).
        AttemptFenced: this validate attempt was cancelled; it records nothing.
    """
    batches = epoch_batches(ctx, epoch)
    missing = [b for b in batches if committed(ctx, ctx.layout.score(epoch, b)) is None
               or committed(ctx, ctx.layout.rollout(epoch, b)) is None]
    if not missing:
        return batches
    total = ctx.config.rollout.batches_per_epoch
    ft = ctx.config.fault_tolerance
    if not ft.may_skip(total - len(batches) + len(missing), total):
        raise BatchesMissing(
            ctx.layout.validate(epoch),
            f"batches {missing} of epoch {epoch} are not committed (rollout or score); run or clear their tasks"
            + (f", or lower fault_tolerance.min_committed_batch_fraction ({ft.min_committed_batch_fraction}) "
               f"to go on without them" if total > 1 else ""),
        )
    skipped = sorted(set(range(total)) - set(batches) | set(missing))
    # A cancelled validate must not decide, for good, which batches the epoch lacks.
    check_not_fenced(ctx.store, ctx.layout.validate(epoch), ctx.attempt)
    skipped = write_skipped(ctx.store, ctx.layout, epoch, skipped, total, ft.min_committed_batch_fraction)
    record_event(ctx.store, ctx.layout, "batches_skipped", unit=ctx.layout.skipped(epoch), epoch=epoch,
                 batches=skipped, min_committed_batch_fraction=ft.min_committed_batch_fraction)
    return [b for b in range(total) if b not in skipped]


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
        rows = {b: scored_rows(ctx, epoch, b) for b in settle_batches(ctx, epoch)}
        if not cfg.quality.enabled:
            writer.write_json("report.json", {"success": True, "skipped": "quality.enabled is false"})
            return {"success": True, "rows": sum(len(r) for r in rows.values())}
        limits = Limits(
            rows_per_batch=cfg.rollout.prompts_per_batch * cfg.algorithm.group_size,
            rows_per_epoch=len(rows) * cfg.rollout.prompts_per_batch * cfg.algorithm.group_size,
            max_prompt_tokens=cfg.data.max_prompt_tokens,
            max_response_tokens=cfg.rollout.max_new_tokens,
            # The range bounds what the reward function returns; DAPO's overlong penalty comes after it.
            min_score=cfg.rewards.min_score - (cfg.rewards.overlong_buffer.penalty_factor
                                               if cfg.rewards.overlong_buffer.enable else 0.0),
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
