"""The Great Expectations gate over an epoch's scored samples, in one validation pass.

The epoch's samples form one frame with a ``batch`` column; per-batch
properties (row count, share of non-empty responses) are columns repeated on
each of the batch's rows, so one suite covers both the epoch and each batch, and a failure
still names its batches (from GE's unexpected row indices). The GE context,
data source and suite are built once per process and reused: building them
costs seconds (mostly importing GE), a validation ~15 ms. The summary is plain JSON.

An epoch that passes (the usual case) is validated once with GE's
``BOOLEAN_ONLY`` result format, which skips the unexpected-row bookkeeping (about
half of GE's time per call); only a failing epoch is validated again with
``COMPLETE`` results, to name the failing batches and values.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

COLUMNS = ["batch", "sample_id", "response", "prompt_tokens", "response_tokens", "score"]
_LOCK = threading.Lock()
_CACHE: dict[Any, Any] = {}


@dataclass(frozen=True)
class Limits:
    rows_per_batch: int
    rows_per_epoch: int
    max_prompt_tokens: int
    max_response_tokens: int
    min_score: float
    max_score: float
    min_nonempty_fraction: float


def _gx():
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")
    import great_expectations as gx
    from threadpoolctl import threadpool_limits

    # numpy's BLAS (GE computes with it) at one thread in a process that trains with torch's own pool:
    # both runtimes' spinning threads on 2 busy cores made a tiny-model torch step 0.03 s -> 0.9-1.9 s.
    threadpool_limits(limits=1, user_api="blas")

    # GE logs "Created temporary directory ... ephemeral docs site" at INFO for every context, from a
    # logger whose own level GE sets on import (so the parent's level alone does not silence it).
    for name in ("great_expectations", "great_expectations.data_context.types.base"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return gx


def scored_suite(limits: Limits):
    """Every expectation of the gate, over the epoch frame (with derived per-batch columns)."""
    gx = _gx()
    ex = gx.expectations
    suite = gx.ExpectationSuite(name="scored_epoch")
    for expectation in (
        ex.ExpectTableRowCountToEqual(value=limits.rows_per_epoch),
        ex.ExpectColumnValuesToBeBetween(column="batch_rows", min_value=limits.rows_per_batch,
                                         max_value=limits.rows_per_batch),
        ex.ExpectColumnValuesToBeUnique(column="sample_id"),
        ex.ExpectColumnValuesToBeBetween(column="batch_nonempty_fraction", min_value=limits.min_nonempty_fraction),
        ex.ExpectColumnValuesToBeBetween(column="prompt_tokens", min_value=1, max_value=limits.max_prompt_tokens),
        ex.ExpectColumnValuesToBeBetween(column="response_tokens", min_value=0, max_value=limits.max_response_tokens),
        ex.ExpectColumnValuesToNotBeNull(column="score"),
        ex.ExpectColumnValuesToBeBetween(column="score", min_value=limits.min_score, max_value=limits.max_score),
    ):
        suite.add_expectation(expectation)
    return suite


def _batch_definition():
    """The process's ephemeral context and whole-dataframe batch definition (built once)."""
    if "definition" not in _CACHE:
        gx = _gx()
        context = gx.get_context(mode="ephemeral")
        context.variables.progress_bars = {"globally": False, "metric_calculations": False}
        asset = context.data_sources.add_pandas("verl_tasks").add_dataframe_asset("scored_samples")
        _CACHE["definition"] = asset.add_batch_definition_whole_dataframe("epoch")
    return _CACHE["definition"]


def warm_up() -> None:
    """Import Great Expectations and build the process's context now (seconds), e.g. when a pool worker
    that will validate starts, so its first ``validate_epoch`` finds them ready. (Not in a background
    thread: imports hold the GIL, and one beside torch's imports made both slower.)"""
    _gx()
    with _LOCK:
        _batch_definition()


def _suite(limits: Limits):
    key = ("suite", limits)
    if key not in _CACHE:
        _CACHE[key] = scored_suite(limits)
    return _CACHE[key]


def epoch_frame(rows_by_batch: dict[int, list[dict[str, Any]]]):
    """One frame for the epoch, with ``batch_rows`` and ``batch_nonempty_fraction`` per row.

    Built column by column (a frame from a list of row dicts, then a group-by, costs several times more).
    """
    import pandas as pd

    columns: dict[str, list[Any]] = {name: [] for name in (*COLUMNS, "batch_rows", "batch_nonempty_fraction")}
    for batch, rows in sorted(rows_by_batch.items()):
        nonempty = sum(1 for row in rows if row.get("response")) / len(rows) if rows else 0.0
        columns["batch"] += [batch] * len(rows)
        for name in COLUMNS[1:]:
            columns[name] += [row.get(name) for row in rows]
        columns["batch_rows"] += [len(rows)] * len(rows)
        columns["batch_nonempty_fraction"] += [nonempty] * len(rows)
    return pd.DataFrame(columns)


def validate_epoch(rows_by_batch: dict[int, list[dict[str, Any]]], limits: Limits) -> dict[str, Any]:
    """Run the gate. Returns ``{"success", "batches": {b: [failures]}, "epoch": [failures], "rows"}``.

    A failed row-level expectation is reported under each batch its unexpected rows
    come from; a table-level one (the epoch's row count) under ``epoch``.
    """
    frame = epoch_frame(rows_by_batch)
    report: dict[str, Any] = {"success": True, "batches": {}, "epoch": [], "rows": len(frame)}
    if _run(frame, limits, "BOOLEAN_ONLY").success:
        return report
    outcome = _run(frame, limits, "COMPLETE")  # where it failed: batches, counts, values
    for res in outcome.results:
        if res.success:
            continue
        cfg = res.expectation_config
        result = res.result or {}
        failure = {"expectation": cfg.type, "column": cfg.kwargs.get("column")}
        failure.update({k: result[k] for k in ("observed_value", "unexpected_count") if result.get(k) is not None})
        indices = result.get("unexpected_index_list")
        if not indices:
            report["epoch"].append(failure)
            continue
        for batch, group in frame.loc[list(indices)].groupby("batch"):
            values = group[cfg.kwargs["column"]].tolist()[:20]
            report["batches"].setdefault(str(batch), []).append(
                {**failure, "unexpected_count": len(group), "partial_unexpected_list": values}
            )
    report["success"] = not report["batches"] and not report["epoch"]
    return report


def _run(frame, limits: Limits, result_format: str):
    """One GE validation pass of the suite over ``frame``."""
    with _LOCK:  # GE's context is not thread-safe; a worker may run units concurrently
        definition = _batch_definition()  # imports GE whole first: a submodule imported alone
        from great_expectations.validator.v1_validator import Validator  # beside it can deadlock

        # The validator gets the batch from the definition itself; ``get_batch(...).validate``
        # would build the same batch twice (once for the Batch, again inside its validator).
        validator = Validator(definition, result_format={"result_format": result_format},
                              batch_parameters={"dataframe": frame})
        with _pass_shortcuts(limits, result_format):
            return validator.validate_expectation_suite(_suite(limits))


@contextlib.contextmanager
def _swapped(owner: type, name: str, replacement: Callable[[Any], Any]) -> Iterator[None]:
    """``owner.name`` replaced for one pass (under ``_LOCK``) by ``replacement(original)``; GE's own
    attribute is back when the pass ends, however it ends. An attribute this GE version lacks: untouched."""
    original = owner.__dict__.get(name)
    if original is None:
        yield
        return
    setattr(owner, name, replacement(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


# GE 1.x rebuilds ``Expectation.configuration`` (a pydantic ``.dict()``, a regex on the class name
# and a new ExpectationConfiguration) about 20 times per expectation and pass: 40% of the pass.
# Nothing changes an expectation object while a pass runs (GE builds its own from the suite's
# configurations), so during one pass each object's is computed once.
def _memoized_configuration(plain: Any) -> Any:
    if not isinstance(plain, property):
        return plain  # another GE version: its own attribute
    memo: dict[int, tuple[Any, Any]] = {}

    def configuration(self):
        entry = memo.get(id(self))
        if entry is None or entry[0] is not self:  # the pair keeps the object alive: ids stay unique
            entry = memo[id(self)] = (self, plain.fget(self))
        return entry[1]

    return property(configuration, doc=plain.__doc__)


# GE builds each expectation's metric dependency graph anew in every pass (about half of a pass).
# The graph depends on the suite, the batch id (one whole-dataframe asset: always the same) and the
# result format, never on the rows, so a pass with the same three reuses the first one's graphs and
# only the metric values are computed again.
_BUILD_GRAPHS = "_generate_metric_dependency_subgraphs_for_each_expectation_configuration"


def _graphs_kept_for(key: Any) -> Callable[[Any], Any]:
    def wrap(build: Any) -> Any:
        def kept(self, expectation_configurations, processed_configurations, catch_exceptions,
                 runtime_configuration=None):
            slot = ("graphs", key, len(expectation_configurations), self.active_batch_id)
            if slot not in _CACHE:
                graphs, results, processed = build(self, expectation_configurations, processed_configurations,
                                                   catch_exceptions, runtime_configuration)
                if results:  # an expectation failed to build its graph: report it, keep nothing
                    return graphs, results, processed
                _CACHE[slot] = (graphs, list(processed))
            graphs, processed = _CACHE[slot]
            # GE removes rejected configurations from this list: each pass gets its own.
            return list(graphs), [], list(processed)

        return kept

    return wrap


@contextlib.contextmanager
def _pass_shortcuts(limits: Limits, result_format: str) -> Iterator[None]:
    """This module's two shortcuts through GE's internals, each for one pass only."""
    from great_expectations.validator.validator import Validator as PassValidator

    expectation = _gx().expectations.Expectation
    with _swapped(expectation, "configuration", _memoized_configuration), \
            _swapped(PassValidator, _BUILD_GRAPHS, _graphs_kept_for((limits, result_format))):
        yield


def summarize(report: dict[str, Any]) -> str:
    """One readable line per failed expectation, naming the batch."""
    lines = []
    for batch, failures in report["batches"].items():
        for f in failures:
            extra = ", ".join(f"{k}={v}" for k, v in f.items() if k not in ("expectation", "column"))
            lines.append(f"batch {batch}: {f['expectation']}({f.get('column') or ''}) failed: {extra}")
    for f in report["epoch"]:
        extra = ", ".join(f"{k}={v}" for k, v in f.items() if k not in ("expectation", "column"))
        lines.append(f"epoch: {f['expectation']}({f.get('column') or ''}) failed: {extra}")
    return "\n".join(lines)
