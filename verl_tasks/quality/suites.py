"""Great Expectations suites for an epoch's scored samples.

Expectations run per batch (so a failure names its batch) and once over the
whole epoch (row count, unique sample ids). The summary is plain JSON.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


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

    return gx


def batch_suite(limits: Limits):
    gx = _gx()
    ex = gx.expectations
    suite = gx.ExpectationSuite(name="scored_batch")
    suite.add_expectation(ex.ExpectTableRowCountToEqual(value=limits.rows_per_batch))
    suite.add_expectation(ex.ExpectColumnValuesToBeUnique(column="sample_id"))
    suite.add_expectation(
        ex.ExpectColumnValueLengthsToBeBetween(column="response", min_value=1, mostly=limits.min_nonempty_fraction)
    )
    suite.add_expectation(ex.ExpectColumnValuesToBeBetween(column="prompt_tokens", min_value=1, max_value=limits.max_prompt_tokens))
    suite.add_expectation(ex.ExpectColumnValuesToBeBetween(column="response_tokens", min_value=0, max_value=limits.max_response_tokens))
    suite.add_expectation(ex.ExpectColumnValuesToNotBeNull(column="score"))
    suite.add_expectation(ex.ExpectColumnValuesToBeBetween(column="score", min_value=limits.min_score, max_value=limits.max_score))
    return suite


def epoch_suite(limits: Limits):
    gx = _gx()
    ex = gx.expectations
    suite = gx.ExpectationSuite(name="scored_epoch")
    suite.add_expectation(ex.ExpectTableRowCountToEqual(value=limits.rows_per_epoch))
    suite.add_expectation(ex.ExpectColumnValuesToBeUnique(column="sample_id"))
    return suite


def _context():
    gx = _gx()
    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = {"globally": False, "metric_calculations": False}
    return context


def _run(context, name: str, frame, suite) -> list[dict[str, Any]]:
    source = context.data_sources.add_pandas(name)
    batch = source.add_dataframe_asset("samples").add_batch_definition_whole_dataframe("all").get_batch(
        batch_parameters={"dataframe": frame}
    )
    outcome = batch.validate(suite)
    failed = []
    for res in outcome.results:
        if res.success:
            continue
        cfg = res.expectation_config
        detail = {k: res.result.get(k) for k in ("observed_value", "unexpected_count", "partial_unexpected_list")}
        failed.append(
            {"expectation": cfg.type, "column": cfg.kwargs.get("column"), **{k: v for k, v in detail.items() if v not in (None, [])}}
        )
    return failed


def validate_epoch(rows_by_batch: dict[int, list[dict[str, Any]]], limits: Limits) -> dict[str, Any]:
    """Run the suites. Returns ``{"success", "batches": {b: [failures]}, "epoch": [failures], "rows"}``."""
    import pandas as pd

    columns = ["sample_id", "response", "prompt_tokens", "response_tokens", "score"]
    report: dict[str, Any] = {"success": True, "batches": {}, "epoch": [], "rows": 0}
    frames = []
    context = _context()
    per_batch = batch_suite(limits)
    for batch, rows in sorted(rows_by_batch.items()):
        frame = pd.DataFrame(rows, columns=columns)
        frames.append(frame)
        failures = _run(context, f"batch-{batch}", frame, per_batch)
        if failures:
            report["batches"][str(batch)] = failures
    whole = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)
    report["rows"] = len(whole)
    report["epoch"] = _run(context, "epoch", whole, epoch_suite(limits))
    report["success"] = not report["batches"] and not report["epoch"]
    return report


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
