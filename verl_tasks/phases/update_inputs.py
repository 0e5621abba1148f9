"""An epoch's update inputs, read from the store once, before any compute.

The update reads many committed units: the validate marker (the gate passed), the plan (which
policy version it trains, its seed), every rollout and score batch the epoch did not skip, and
the snapshot of the policy version (its weights' and optimizer state's checksums, the global
step). ``read_update_source`` reads each once, checks the policy version was not pruned, and
returns one plain object that both the one-process update and the resident workers take; nothing
after it reads an input unit again.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from verl_tasks.errors import PhaseFailed
from verl_tasks.phases.common import PhaseContext, require
from verl_tasks.phases.rollout import baseline_id
from verl_tasks.phases.score import BASELINE_SCORES
from verl_tasks.phases.validate import epoch_batches
from verl_tasks.store.conventions import TRAINER_STATE, check_not_pruned, optimizer_state_id, weights_sha256
from verl_tasks.store.units import CommitRecord, read_bytes, read_json, read_jsonl

# The critic unit's GAE advantages, returns and old values ([B, R] each) and the sample ids of their rows.
ADVANTAGES = "advantages.safetensors"
ADVANTAGE_ROWS = "advantages.json"


@dataclass(frozen=True)
class PolicyState:
    """Which committed policy an update starts from: its snapshot's record. A resident copy of a policy is
    used only when it was made from exactly the bytes this names (``key``: the weights' sha256 and the
    optimizer state's checksums, None for a base snapshot, which has none)."""

    version: int
    record: CommitRecord

    @property
    def weights_sha256(self) -> str:
        return weights_sha256(self.record)

    @property
    def optimizer_state(self) -> str | None:
        return optimizer_state_id(self.record)

    @property
    def key(self) -> tuple[str, str | None]:
        return self.weights_sha256, self.optimizer_state


@dataclass(frozen=True)
class UpdateSource:
    """Everything the update of ``epoch`` reads.

    ``samples``: the epoch's rollout samples joined with their scores (and ``batch``), in (batch, sample)
    order, skipped batches left out; with dynamic sampling, the groups ``top_up`` kept, in its order.
    ``start``: the policy trained; ``reference``: the base policy the KL term compares with (None without KL).
    ``first_step``: the global optimizer step it starts from.
    ``single_step``: the epoch is one optimizer step over all samples, so the old log-probs are the
    step's own. ``advantages``: ``[B, R]``, the critic phase's GAE advantages (None: the update computes
    them with ``algorithm.adv_estimator``). ``inputs``: the attempt of every rollout and score unit read.
    """

    epoch: int
    update_seed: int
    samples: list[dict[str, Any]]
    start: PolicyState
    reference: PolicyState | None
    first_step: int
    single_step: bool
    advantages: torch.Tensor | None = None
    inputs: dict[str, str] = field(default_factory=dict)

    @property
    def policy_version(self) -> int:
        return self.start.version


def read_update_source(ctx: PhaseContext, epoch: int, *, critic: bool = True) -> UpdateSource:
    """Read the update's inputs (one read per input unit); ``critic`` False: not the critic's advantages (the
    critic phase reads the rest to compute them).

    Raises:
        PhaseFailed: an input unit is not committed (naming the task to run first).
        SnapshotPruned: retention removed the weights of the policy version to train.
    """
    algo = ctx.config.algorithm
    require(ctx, ctx.layout.validate(epoch), "validate")
    planned = read_json(ctx.store, require(ctx, ctx.layout.plan(epoch), "plan"), "plan.json")
    version = int(planned["policy_version"])
    samples: list[dict[str, Any]] = []
    inputs: dict[str, str] = {}
    for b in epoch_batches(ctx, epoch):
        rollout_record = require(ctx, ctx.layout.rollout(epoch, b), "rollout")
        score_record = require(ctx, ctx.layout.score(epoch, b), "score")
        inputs.update({rollout_record.unit: rollout_record.attempt, score_record.unit: score_record.attempt})
        rows = read_jsonl(ctx.store, rollout_record, "samples.jsonl")
        scores = {r["sample_id"]: r["score"] for r in read_jsonl(ctx.store, score_record, "scores.jsonl")}
        if algo.adv_estimator == "remax":  # each sample's baseline: its prompt's greedy answer's reward
            greedy = read_jsonl(ctx.store, score_record, BASELINE_SCORES)
            baselines = {r["sample_id"]: r["score"] for r in greedy}
            rows = [{**row, "baseline_score": baselines[baseline_id(epoch, b, row["prompt_id"])]} for row in rows]
        samples.extend({**row, "score": scores[row["sample_id"]], "batch": b} for row in rows)
    if ctx.config.dynamic_sampling is not None:  # the groups top_up kept, in its (draw) order
        from verl_tasks.phases.top_up import read_selection

        order = {(b, prompt): i for i, (b, prompt) in enumerate(read_selection(ctx, epoch)["groups"])}
        samples = sorted((s for s in samples if (s["batch"], s["prompt_id"]) in order),
                         key=lambda s: order[(s["batch"], s["prompt_id"])])
    check_not_pruned(ctx.store, ctx.layout, version)  # here, not in a worker: not retried
    record = require(ctx, ctx.layout.snapshot(version), "snapshot")
    first_step = read_json(ctx.store, record, TRAINER_STATE).get("step", 0) if TRAINER_STATE in record.files else 0
    reference = None
    if algo.kl_type.value != "none":
        base = record if version == 0 else require(ctx, ctx.layout.snapshot(0), "plan (base snapshot)")
        reference = PolicyState(0, base)
    return UpdateSource(epoch=epoch, update_seed=int(planned["update_seed"]), samples=samples,
                        start=PolicyState(version, record), reference=reference, first_step=int(first_step),
                        single_step=algo.ppo_epochs == 1 and algo.minibatch_size >= len(samples),
                        advantages=critic_advantages(ctx, epoch, samples, inputs) if critic and ctx.config.critic
                        else None, inputs=inputs)


def critic_advantages(ctx: PhaseContext, epoch: int, samples: list[dict[str, Any]], inputs: dict[str, str]
                      ) -> torch.Tensor:
    """The GAE advantages the critic phase of ``epoch`` committed, rows in ``samples``' order.

    Raises:
        PhaseFailed: the critic unit is not committed, or it read other rollout or score attempts than
            ``inputs`` (a batch recomputed after it committed: quarantined, or restored from elsewhere).
    """
    from safetensors.torch import load

    unit = ctx.layout.critic(epoch)
    record = require(ctx, unit, "critic")
    rows = read_json(ctx.store, record, ADVANTAGE_ROWS)
    if rows["sample_ids"] != [s["sample_id"] for s in samples] or rows.get("inputs") != inputs:
        redo = (f"verl-tasks rollback CONFIG --to-epoch {epoch - 1}, then run again" if epoch else
                "the first epoch cannot be rolled back: start it again under a new experiment name")
        raise PhaseFailed(unit, f"the critic's advantages were computed from other rollout or score units than the "
                                f"epoch's committed ones (a batch was recomputed after the critic ran); recompute "
                                f"the epoch from its plan: {redo}")
    return load(read_bytes(ctx.store, record, ADVANTAGES))["advantages"]


__all__ = ["ADVANTAGES", "ADVANTAGE_ROWS", "PolicyState", "UpdateSource", "critic_advantages", "read_update_source"]
