"""Run phases inline, in order, resuming from whatever is committed.

This is the execution path of the CLI and the tests. Airflow runs the same
phase functions, one task per unit, through an execution backend. ``status``
lives in the torch-free :mod:`verl_tasks.status` and is re-exported here.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from verl_tasks.config import ExperimentConfig
from verl_tasks.execution.deadline import unit_deadline
from verl_tasks.execution.heap import freeze_after_imports
from verl_tasks.execution.outcome import LEAVE_OUT, RAISE, after_failure, next_step_text
from verl_tasks.phase_registry import phase as phase_spec
from verl_tasks.phase_registry import phases_for
from verl_tasks.phases import PhaseContext
from verl_tasks.status import epoch_done, status
from verl_tasks.store import store_for
from verl_tasks.store.conventions import read_skipped
from verl_tasks.store.units import CommitRecord

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int | None], None]


def make_context(config: ExperimentConfig, credentials: dict[str, str] | None = None) -> PhaseContext:
    return PhaseContext(config, store_for(config, credentials))


def run_phase(ctx: PhaseContext, phase: str, epoch: int, batch: int | None = None) -> CommitRecord:
    return phase_spec(phase).run(ctx, epoch, batch)


def epoch_phases(ctx: PhaseContext, epoch: int, total_epochs: int) -> list[tuple[str, list[int | None]]]:
    """Each phase of one epoch in execution order, with its units' batch indices ([None] if not batched)."""
    batches: list[int | None] = list(range(ctx.config.rollout.batches_per_epoch))
    return [(name, batches if spec.batched else [None]) for name, spec in phases_for(ctx.config).items()
            if name != "evaluate" or ctx.config.should_evaluate(epoch, total_epochs)]


def epoch_units(ctx: PhaseContext, epoch: int, total_epochs: int) -> list[tuple[str, int | None]]:
    """The (phase, batch) units of one epoch in execution order."""
    return [(phase, batch) for phase, batches in epoch_phases(ctx, epoch, total_epochs) for batch in batches]


UnitRunner = Callable[[PhaseContext, str, int, list], Iterable]


def run_in_process(ctx: PhaseContext, phase: str, epoch: int, batches: list[int | None]) -> Iterator[int | None]:
    """The inline unit runner: one unit after another in this process; yields each batch when committed.

    A unit that raises follows :func:`verl_tasks.execution.outcome.after_failure`, the policy
    the Ray pools follow too: a transient error is tried again (``retry_delay_s`` apart) until
    ``1 + fault_tolerance.retries`` tries are spent; then a batched unit is left out when
    ``min_committed_batch_fraction`` < 1 (the epoch's validate decides), else the error stops the run.
    A unit past ``fault_tolerance.timeout_s`` of its phase raises ``UnitTimeout`` (``unit_deadline``).
    """
    batched = phase_spec(phase).batched
    ft = ctx.config.fault_tolerance
    for batch in batches:
        for tries in itertools.count(1):
            try:
                with unit_deadline(ctx.layout.unit(phase, epoch, batch), phase, ft.timeout_s.get(phase)):
                    run_phase(ctx, phase, epoch, batch)
            except Exception as err:  # noqa: BLE001 - the shared policy decides what a failure means
                step = after_failure(ft, batched, err, tries)
                where = f"{phase} of epoch {epoch}" + (f" batch {batch}" if batch is not None else "")
                tried = "" if step == RAISE and tries == 1 else f" (try {tries} of {1 + ft.retries})"
                log.warning("%s failed%s: %s: %s; %s", where, tried, type(err).__name__, err,
                            next_step_text(step, err, ft))
                if step == RAISE:
                    raise
                if step == LEAVE_OUT:
                    break
                time.sleep(ft.retry_delay_s)
            else:
                freeze_after_imports()  # this process runs the units to come: keep its warm heap out of full GCs
                yield batch
                break


def train(ctx: PhaseContext, epochs: int, progress: Progress | None = None,
          run_units: UnitRunner = run_in_process) -> dict[str, Any]:
    """Run epochs ``0..epochs-1``; committed units are skipped. Returns the status.

    Before any work, the newest committed snapshot is verified; a corrupt one is
    quarantined and training resumes from the previous valid one (``phases.fallback``).
    ``run_units`` runs one phase's units (in this process, or on Ray worker pools).
    """
    if not all(epoch_done(ctx.config, ctx.store, ctx.layout, e, epochs) for e in range(epochs)):
        from verl_tasks.phases.fallback import check_resume_point

        check_resume_point(ctx)
    for epoch in range(epochs):
        if epoch_done(ctx.config, ctx.store, ctx.layout, epoch, epochs):
            if progress:
                progress("epoch-skipped", epoch, None)
            continue
        # The batches the epoch went on without, and (below) those whose units failed for good.
        left_out: set[int | None] = set(read_skipped(ctx.store, ctx.layout, epoch))
        for phase, batches in epoch_phases(ctx, epoch, epochs):
            if phase_spec(phase).batched:
                batches = [b for b in batches if b not in left_out]
            done = []
            for batch in run_units(ctx, phase, epoch, batches):
                done.append(batch)
                if progress:
                    progress(phase, epoch, batch)
            left_out |= set(batches) - set(done)
    return status(ctx.config, ctx.store)


__all__ = ["make_context", "run_phase", "train", "status", "store_for"]
