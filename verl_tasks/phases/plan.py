"""Plan an epoch: which prompts go to which rollout batch, with which seeds, from which policy."""
from __future__ import annotations

import random
from typing import Any

from verl_tasks.phases.common import PhaseContext, derive_seed, run_unit
from verl_tasks.phases.prepare import prepare, train_rows
from verl_tasks.store.units import CommitRecord, UnitWriter


def extra_batches(cfg: Any, epoch: int, ids: list[str], chosen: set[str]) -> list[dict[str, Any]]:
    """The batches dynamic sampling may draw after the epoch's own (none without it)."""
    groups = cfg.dynamic_sampling
    if groups is None:
        return []
    first, size = cfg.rollout.batches_per_epoch, cfg.rollout.prompts_per_batch
    others = [pid for pid in ids if pid not in chosen]
    if len(others) < size:  # too few unused prompts for a batch: draw from all (a batch never repeats a prompt)
        others = list(ids)
    random.Random(derive_seed(cfg.seed, epoch, "plan-extra")).shuffle(others)
    needed = (groups.max_batches - first) * size
    order = (others * (needed // len(others) + 1))[:needed]
    return [{"batch": b, "prompt_ids": order[(b - first) * size : (b - first + 1) * size],
             "seed": derive_seed(cfg.seed, epoch, "rollout", b), "extra": True}
            for b in range(first, groups.max_batches)]


def plan(ctx: PhaseContext, epoch: int) -> CommitRecord:
    """Deterministic: a seeded permutation of the pinned train prompts, cut into batches.

    Epochs walk through the permutation of their "pass" over the data, so every
    prompt is used once per pass before any repeats. With DAPO's dynamic sampling
    (``algorithm.filter_groups``) the plan also lists the batches the epoch may draw
    beyond its own, up to ``max_batches``: prompts of another seeded permutation
    of the data, less the epoch's own (repeating when the data runs out, never within
    a batch), each batch with its own seed. Only ``top_up`` rolls them out, and only as many as it needs.
    """
    prepare(ctx)
    cfg = ctx.config

    def produce(writer: UnitWriter) -> dict[str, Any]:
        ids = [row["id"] for row in train_rows(ctx)]
        per_epoch = cfg.prompts_per_epoch
        epochs_per_pass = max(1, len(ids) // per_epoch)
        data_pass, offset = divmod(epoch, epochs_per_pass)
        order = list(ids)
        random.Random(derive_seed(cfg.seed, data_pass, "plan-pass")).shuffle(order)
        chosen = order[offset * per_epoch : (offset + 1) * per_epoch]
        size = cfg.rollout.prompts_per_batch
        batches = [
            {"batch": b, "prompt_ids": chosen[b * size : (b + 1) * size],
             "seed": derive_seed(cfg.seed, epoch, "rollout", b)}
            for b in range(cfg.rollout.batches_per_epoch)
        ]
        batches += extra_batches(cfg, epoch, ids, set(chosen))
        writer.write_json(
            "plan.json",
            {
                "epoch": epoch,
                "policy_version": epoch,
                "group_size": cfg.algorithm.group_size,
                "batches": batches,
                "update_seed": derive_seed(cfg.seed, epoch, "update"),
            },
        )
        return {"batches": cfg.rollout.batches_per_epoch, "extra_batches": len(batches) - cfg.rollout.batches_per_epoch,
                "prompts": len(chosen), "policy_version": epoch}

    return run_unit(ctx, "plan", ctx.layout.plan(epoch), epoch, produce)
