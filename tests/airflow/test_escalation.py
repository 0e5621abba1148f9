"""Tiered response: retried faults are recorded; too many failed batches or exhausted retries halt the experiment."""
from __future__ import annotations

import pytest
import yaml

from verl_tasks.airflow import callbacks
from verl_tasks.airflow.operators import VerlPhaseOperator
from verl_tasks.errors import SafeMode
from verl_tasks.events import read_events
from verl_tasks.layout import Layout
from verl_tasks.ops.safe_mode import leave_safe_mode, read_safe_mode
from verl_tasks.store import open_store

from ..conftest import TINY_YAML


class _TI:
    def __init__(self, task_id: str, map_index: int, try_number: int):
        self.task_id, self.map_index, self.try_number, self.dag_id = task_id, map_index, try_number, "tiny_arith"


def _context(tmp_path, phase: str, batch: int | None, error: Exception) -> dict:
    config = tmp_path / "exp.yaml"
    if not config.exists():
        raw = yaml.safe_load(TINY_YAML.read_text())
        raw["storage"] = {"uri": f"file://{tmp_path}/store"}
        config.write_text(yaml.safe_dump(raw))
    task = VerlPhaseOperator(task_id=phase, config_path=str(config), phase=phase, epoch=0, batch=batch, backend="inline")
    dag_run = type("DagRun", (), {"conf": {}, "run_type": "manual", "run_id": "manual__1"})()
    return {"task": task, "ti": _TI(phase, -1 if batch is None else batch, 1), "exception": error,
            "dag_run": dag_run, "params": {}}


def test_exhausted_retries_enter_safe_mode_and_block_every_unit(tmp_path, monkeypatch):
    monkeypatch.delenv("VERL_TASKS_AIRFLOW_API_CONN", raising=False)
    context = _context(tmp_path, "update", None, MemoryError("CUDA out of memory (injected)"))
    cfg, _ = context["task"].resolve(context)
    assert str(tmp_path) in cfg.storage.uri
    store = open_store(cfg.storage.uri)
    callbacks.on_failure(context)
    record = read_safe_mode(store, Layout(cfg.experiment))
    assert record is not None
    assert "failed after all its retries" in record["summary"]
    assert "verl-tasks resume" in record["what_to_do"]
    assert record["failed_units"][0]["error"].startswith("MemoryError")

    from verl_tasks.runner import make_context, run_phase

    with pytest.raises(SafeMode, match="verl-tasks resume"):
        run_phase(make_context(cfg), "plan", 0)
    assert leave_safe_mode(store, Layout(cfg.experiment))
    assert read_safe_mode(store, Layout(cfg.experiment)) is None


def test_failed_batch_share_above_limit_escalates(tmp_path):
    # tiny_arith: 4 batches per epoch, max_failed_batch_fraction 0.5 -> the third failed batch halts
    for batch in (0, 1):
        context = _context(tmp_path, "rollout", batch, RuntimeError("node lost"))
        callbacks.on_retry(context)
    cfg, _ = context["task"].resolve(context)
    store = open_store(cfg.storage.uri)
    layout = Layout(cfg.experiment)
    assert read_safe_mode(store, layout) is None
    assert len([e for e in read_events(store, layout) if e["kind"] == callbacks.TASK_FAILED]) == 2
    callbacks.on_retry(_context(tmp_path, "score", 2, RuntimeError("node lost")))
    halted = read_safe_mode(store, layout)
    assert halted is not None and "75% of epoch 0's batches failed" in halted["summary"]
