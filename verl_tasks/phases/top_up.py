"""DAPO's dynamic sampling: leave out groups whose samples scored alike, draw batches until the epoch is full.

A group (one prompt's ``group_size`` samples) whose scores are all equal has zero GRPO advantage everywhere:
it costs update compute and teaches nothing. With ``algorithm.filter_groups.enable`` the ``top_up`` task runs
after the epoch's mapped score tasks: it counts the prompts whose scores differ, and while there are fewer
than the epoch's ``batches_per_epoch x prompts_per_batch``, it rolls out and scores the plan's next extra
batch, each as its own committed rollout and score unit (``rollout/bNNNN`` past the planned ones), up to
``max_batches`` in all; reaching it without enough is refused (not retried: the same draws come back). Then
it commits ``selection.json``: the batches drawn and, in draw order, the kept groups trained on (the first
ones that fill the epoch, as verl keeps the first trajectories). A retried or cleared ``top_up`` redoes only
the extra units that are not committed; everything is a function of the committed units and the seed.
"""
from __future__ import annotations

from typing import Any

from verl_tasks.errors import TooFewGroups
from verl_tasks.events import record_event
from verl_tasks.phases.common import PhaseContext, require, run_unit
from verl_tasks.phases.rollout import rollout
from verl_tasks.phases.score import score
from verl_tasks.store.units import CommitRecord, UnitWriter, read_json, read_jsonl

SELECTION = "selection.json"


def varied_groups(ctx: PhaseContext, epoch: int, batch: int) -> list[str]:
    """The prompt ids of ``batch`` whose samples' scores differ, in the batch's order (verl keeps a group whose
    metric has a nonzero std)."""
    samples = read_jsonl(ctx.store, require(ctx, ctx.layout.rollout(epoch, batch), "rollout"), "samples.jsonl")
    scores = {r["sample_id"]: r["score"]
              for r in read_jsonl(ctx.store, require(ctx, ctx.layout.score(epoch, batch), "score"), "scores.jsonl")}
    by_prompt: dict[str, set[float]] = {}
    for sample in samples:
        by_prompt.setdefault(sample["prompt_id"], set()).add(scores[sample["sample_id"]])
    return [prompt for prompt, values in by_prompt.items() if len(values) > 1]


def top_up(ctx: PhaseContext, epoch: int) -> CommitRecord:
    """Draw the epoch's extra batches until it holds enough prompts whose scores differ; commit the selection.

    Raises:
        PhaseFailed: a planned batch's rollout or score is not committed.
        TooFewGroups: ``max_batches`` batches were drawn and too few groups differ.
    """
    cfg = ctx.config
    groups = cfg.dynamic_sampling
    assert groups is not None and groups.max_batches is not None  # the phase exists only with it
    wanted, most = cfg.prompts_per_epoch, groups.max_batches

    def produce(writer: UnitWriter) -> dict[str, Any]:
        kept: list[list[Any]] = []
        batch = 0
        while len(kept) < wanted:
            if batch >= most:
                raise TooFewGroups(writer.unit, f"dynamic sampling drew algorithm.filter_groups.max_batches="
                                                f"{most} rollout batches and found {len(kept)} prompts whose "
                                                f"samples' scores differ; the epoch needs {wanted}. Those keys are "
                                                f"pinned: go on in a new experiment from this one's latest snapshot "
                                                f"with a higher max_batches, or with data neither too easy nor too "
                                                f"hard for the policy (verl-tasks run NEW.yaml --resume-from "
                                                f"{cfg.experiment} --experiment NEW_NAME)")
            if batch >= cfg.rollout.batches_per_epoch:  # an extra batch: its own units, once each
                rollout(ctx, epoch, batch)
                score(ctx, epoch, batch)
            kept += [[batch, prompt] for prompt in varied_groups(ctx, epoch, batch)]
            batch += 1
        drawn = batch
        selection: dict[str, list[Any]] = {"batches": list(range(drawn)), "groups": kept[:wanted]}
        writer.write_json(SELECTION, selection)
        extra = drawn - cfg.rollout.batches_per_epoch
        if extra:
            record_event(ctx.store, ctx.layout, "batches_drawn", epoch=epoch, extra_batches=extra,
                         varied_prompts=len(kept), wanted_prompts=wanted)
        return {"batches_drawn": drawn, "extra_batches": extra, "varied_prompts": len(kept),
                "kept_prompts": len(selection["groups"]),
                "varied_fraction": len(kept) / (drawn * cfg.rollout.prompts_per_batch)}

    return run_unit(ctx, "top_up", ctx.layout.top_up(epoch), epoch, produce)


def read_selection(ctx: PhaseContext, epoch: int) -> dict[str, Any]:
    """The committed ``selection.json`` of ``epoch`` (``batches``, ``groups``: ``[batch, prompt_id]`` pairs)."""
    return read_json(ctx.store, require(ctx, ctx.layout.top_up(epoch), "top_up"), SELECTION)


__all__ = ["SELECTION", "read_selection", "top_up", "varied_groups"]
