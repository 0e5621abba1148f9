"""The one list of phases: name, whether it is mapped over batches, its unit key, its inputs.

The runner, the DAG factory, the dashboard, the CLI, the layout and the config
all read this table instead of keeping their own phase lists. It imports
neither torch nor Airflow: the phase function is named by import path and
loaded only when a unit actually runs.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    from verl_tasks.layout import Layout


@dataclass(frozen=True)
class PhaseSpec:
    """One phase of an epoch.

    Attributes:
        name: the phase's name everywhere (task id, unit folder, events).
        batched: one unit per rollout batch (a mapped task) instead of one per epoch.
        function: ``module:function`` of the phase, ``fn(ctx, epoch[, batch]) -> CommitRecord``.
        inputs: phases whose committed units this phase reads (documentation and DAG shape).
        doc: one sentence for the DAG's task docs.
        only_with: a config attribute that must not be None for the phase to exist (``critic``,
            ``dynamic_sampling``); None: always.
    """

    name: str
    batched: bool
    function: str
    inputs: tuple[str, ...]
    doc: str
    only_with: str | None = None

    def applies(self, config: Any) -> bool:
        """Whether an experiment of ``config`` runs this phase."""
        return self.only_with is None or getattr(config, self.only_with) is not None

    def unit(self, layout: Layout, epoch: int, batch: int | None = None) -> str:
        """The storage key of this phase's unit for ``epoch`` (and ``batch`` when batched)."""
        if self.batched:
            if batch is None:
                from verl_tasks.errors import ConfigError

                raise ConfigError(f"phase {self.name} needs a batch index")
            return getattr(layout, self.name)(epoch, batch)
        if self.name == "snapshot":
            return layout.snapshot(epoch + 1)
        return getattr(layout, self.name)(epoch)

    def load(self) -> Callable[..., Any]:
        module, _, attr = self.function.partition(":")
        return getattr(importlib.import_module(module), attr)

    def run(self, ctx: Any, epoch: int, batch: int | None = None) -> Any:
        """Run (or skip, when committed) the unit: the batch goes only to batched phases."""
        fn = self.load()
        return fn(ctx, epoch, batch) if self.batched else fn(ctx, epoch)


def _spec(name: str, batched: bool, inputs: tuple[str, ...], doc: str, only_with: str | None = None) -> PhaseSpec:
    return PhaseSpec(name, batched, f"verl_tasks.phases.{name}:{name}", inputs, doc, only_with)


PHASES: dict[str, PhaseSpec] = {
    spec.name: spec
    for spec in (
        _spec("plan", False, (),
              "Writes `epochs/NNNNN/plan/plan.json`: which prompts go to which rollout batch, with which seeds. "
              "On the first epoch it also pins the data and the base snapshot."),
        _spec("rollout", True, ("plan",),
              "One task instance per batch. Writes `epochs/NNNNN/rollout/bBBBB/samples.jsonl`: a group of samples "
              "per prompt from the current policy, seeded by (seed, epoch, batch)."),
        _spec("score", True, ("rollout",),
              "One task instance per batch. Writes `epochs/NNNNN/score/bBBBB/scores.jsonl` (reward function in a "
              "sandbox)."),
        _spec("top_up", False, ("score",),
              "DAPO's dynamic sampling only (algorithm.filter_groups): leaves out prompts whose samples scored "
              "alike and draws the plan's extra rollout batches (each its own committed rollout and score unit) "
              "until the epoch is full; writes `top_up/selection.json` or fails at max_batches.",
              only_with="dynamic_sampling"),
        _spec("validate", False, ("score", "top_up"),
              "Great Expectations gate on the epoch's scored samples; writes `validate/report.json` or fails."),
        _spec("critic", False, ("validate",),
              "PPO only (a critic section): the critic's values of the epoch's samples, their GAE advantages and "
              "returns, and the critic's clipped value-loss update; writes the advantages and critic version "
              "epoch+1 (weights, optimizer state).", only_with="critic"),
        _spec("update", False, ("validate", "critic"),
              "GRPO/PPO-clipped update of the policy on the epoch's samples; writes new weights, optimizer state "
              "and metrics."),
        _spec("snapshot", False, ("update",),
              "Publishes policy version epoch+1 under `snapshots/NNNNN/`, moves `latest.json`, applies retention."),
        _spec("evaluate", False, ("snapshot",),
              "Greedy evaluation of the new policy on the held-out prompts; writes `evaluate/metrics.json`."),
    )
}
PHASE_NAMES: tuple[str, ...] = tuple(PHASES)


def phases_for(config: Any) -> dict[str, PhaseSpec]:
    """The phases an experiment of ``config`` runs, in execution order (without a critic: no ``critic``)."""
    return {name: spec for name, spec in PHASES.items() if spec.applies(config)}

BATCHED: tuple[str, ...] = tuple(name for name, spec in PHASES.items() if spec.batched)


def phase(name: str) -> PhaseSpec:
    """The spec of ``name``. Raises ConfigError listing the valid names."""
    try:
        return PHASES[name]
    except KeyError:
        from verl_tasks.errors import ConfigError

        raise ConfigError(f"unknown phase {name!r}; use one of {', '.join(PHASE_NAMES)}") from None


__all__ = ["PhaseSpec", "PHASES", "PHASE_NAMES", "BATCHED", "phase", "phases_for"]
