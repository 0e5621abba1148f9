"""The promotion gate: a retraining run's final snapshot is promoted only when it beats where it started.

The numbers, precisely:

* **accuracy**: ``eval_accuracy`` of the run's final evaluation
  (``<experiment>/epochs/<last>/evaluate``, policy version ``last + 1``).
* **baseline**: ``eval_accuracy`` of the snapshot the run started from (its version 0), as
  the run's own evaluation measured it (``<experiment>/base/evaluate``). For a child of a
  parent experiment (a scheduled retraining run, a fork) version 0 is a byte-copy of the
  parent's snapshot, so this is the parent's accuracy on the child's held-out prompts with
  the child's decoding: both numbers come from one evaluation. A run without a parent
  compares against its configured base model.
* the parent's own number for that snapshot (its evaluation of that version, on the
  parent's held-out set, which another seed splits differently) is reported beside them,
  never compared.

Promoted when ``accuracy - baseline > margin`` (``schedule.promote_margin``; the default
0.0 means strictly better). Nothing here imports Airflow: the ``promote`` task of
:mod:`verl_tasks.airflow.promotion` publishes the Asset event when this says so.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

from verl_tasks.layout import Layout
from verl_tasks.pinning import read_pin
from verl_tasks.store.base import ObjectStore
from verl_tasks.store.units import read_marker

log = logging.getLogger(__name__)
PROMOTION = "promotion"  # the event kind


@dataclass(frozen=True)
class Promotion:
    """One decision of the gate; ``reason`` says it in a sentence."""

    experiment: str
    version: int
    promoted: bool
    reason: str
    accuracy: float | None = None
    baseline: float | None = None
    margin: float = 0.0
    parent: dict[str, Any] | None = None
    parent_reported_accuracy: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def beats(accuracy: float, baseline: float, margin: float) -> bool:
    """Whether ``accuracy`` beats ``baseline`` by more than ``margin`` (all shares in [0, 1])."""
    return accuracy - baseline > margin


def evaluated_accuracy(store: ObjectStore, unit: str) -> float | None:
    """``eval_accuracy`` of a committed evaluate unit, or None when it is not committed."""
    record = read_marker(store, unit)
    if record is None:
        return None
    value = ((record.meta or {}).get("metrics") or {}).get("eval_accuracy")
    return None if value is None else float(value)


def parent_evaluation(store: ObjectStore, parent: dict[str, Any] | None) -> float | None:
    """The parent's own accuracy for the snapshot a child started from, when the parent evaluated it."""
    if not parent or not isinstance(parent.get("version"), int):
        return None
    layout, version = Layout(parent["experiment"]), parent["version"]
    return evaluated_accuracy(store, layout.base_evaluate if version == 0 else layout.evaluate(version - 1))


def decide(store: ObjectStore, layout: Layout, final_epoch: int, margin: float = 0.0) -> Promotion:
    """Decide whether snapshot ``final_epoch + 1`` of ``layout.experiment`` is promoted (see the module).

    Returns a decision that is not promoted, with the reason, when either evaluation is missing.
    Raises:
        StoreError: ``experiment.json`` is damaged.
    """
    version = final_epoch + 1
    pin = read_pin(store, layout) or {}
    parent = pin.get("parent")
    reported = parent_evaluation(store, parent)
    accuracy = evaluated_accuracy(store, layout.evaluate(final_epoch))
    baseline = evaluated_accuracy(store, layout.base_evaluate)

    def decision(promoted: bool, reason: str) -> Promotion:
        return Promotion(layout.experiment, version, promoted, reason, accuracy=accuracy, baseline=baseline,
                         margin=margin, parent=parent, parent_reported_accuracy=reported)

    if accuracy is None or baseline is None:
        missing = layout.evaluate(final_epoch) if accuracy is None else layout.base_evaluate
        return decision(False, f"not promoted: {missing} is not committed, so snapshot {version} "
                               f"cannot be compared with where the run started")
    start = (f"{parent['experiment']} snapshot {parent['version']}" if parent else "the configured base model")
    promoted = beats(accuracy, baseline, margin)
    verdict = "promoted" if promoted else "not promoted"
    relation = "beats" if promoted else "does not beat"
    reason = (f"{verdict}: snapshot {version} eval_accuracy {accuracy:.4f} {relation} {start} ({baseline:.4f} on "
              f"the same held-out prompts) by more than the margin {margin:g}")
    return decision(promoted, reason)
