"""Tiered response: retried faults are recorded; too many failed batches or exhausted retries halt the
experiment; a person resumes it with `verl-tasks resume` or a Clear, and every printed hint runs as printed."""
from __future__ import annotations

import shlex

import pytest
import yaml
from airflow.sdk.exceptions import AirflowFailException
from typer.testing import CliRunner

from verl_tasks.airflow import callbacks
from verl_tasks.airflow.operators import ConfigureExperimentOperator, VerlPhaseOperator
from verl_tasks.cli import app
from verl_tasks.errors import SafeMode
from verl_tasks.events import read_events
from verl_tasks.layout import Layout
from verl_tasks.ops.safe_mode import (
    failed_batches,
    first_try_after_clear,
    generation,
    leave_safe_mode,
    note_dag_pause,
    read_safe_mode,
)
from verl_tasks.store import open_store
from verl_tasks.store.units import UnitWriter

from ..conftest import TINY_YAML

RETRIES = 3  # the tiny DAG's fault_tolerance.retries


class _TI:
    """The attributes of Airflow's RuntimeTaskInstance the callbacks and the operators read."""

    def __init__(self, task_id: str, map_index: int, try_number: int, max_tries: int = RETRIES):
        self.task_id, self.map_index, self.try_number, self.max_tries = task_id, map_index, try_number, max_tries
        self.dag_id, self.run_id = "tiny_arith", "manual__1"


def _config(tmp_path):
    config = tmp_path / "exp.yaml"
    if not config.exists():
        raw = yaml.safe_load(TINY_YAML.read_text())
        raw["storage"] = {"uri": f"file://{tmp_path}/store"}
        config.write_text(yaml.safe_dump(raw))
    return config


def _context(tmp_path, phase: str, batch: int | None, error: Exception | None = None, *, try_number: int = 1,
             max_tries: int = RETRIES, epoch: int = 0) -> dict:
    task = VerlPhaseOperator(task_id=phase, config_path=str(_config(tmp_path)), phase=phase, epoch=epoch, batch=batch,
                             backend="inline", retries=RETRIES)
    dag_run = type("DagRun", (), {"conf": {}, "run_type": "manual", "run_id": "manual__1"})()
    ti = _TI(phase, -1 if batch is None else batch, try_number, max_tries)
    return {"task": task, "ti": ti, "exception": error, "dag_run": dag_run, "params": {}}


def _store_layout(context):
    cfg, _ = context["task"].resolve(context)
    return cfg, open_store(cfg.storage.uri), Layout(cfg.experiment)


def _failed_batches_halt(tmp_path, batches=(0, 1, 2)) -> None:
    for batch in batches:
        callbacks.on_retry(_context(tmp_path, "rollout", batch, RuntimeError("node lost")))


def test_exhausted_retries_enter_safe_mode_and_block_every_unit(tmp_path, monkeypatch):
    monkeypatch.delenv("VERL_TASKS_AIRFLOW_API_CONN", raising=False)
    context = _context(tmp_path, "update", None, MemoryError("CUDA out of memory (injected)"), try_number=4)
    cfg, store, layout = _store_layout(context)
    assert str(tmp_path) in cfg.storage.uri
    callbacks.on_failure(context)
    record = read_safe_mode(store, layout)
    assert record is not None
    assert "failed after all its retries" in record["summary"]
    assert record["failed_units"][0]["error"].startswith("MemoryError")
    assert record["dag_id"] == "tiny_arith" and record["dag_paused"] is False

    from verl_tasks.runner import make_context, run_phase

    with pytest.raises(SafeMode) as refused:
        run_phase(make_context(cfg), "plan", 0)
    assert record["commands"]["resume"] in str(refused.value)  # the refusal prints the runnable command
    assert leave_safe_mode(store, layout)
    assert read_safe_mode(store, layout) is None


def test_failed_batch_share_above_limit_escalates(tmp_path):
    # tiny_arith: 4 batches per epoch, max_failed_batch_fraction 0.5 -> the third failed batch halts
    _failed_batches_halt(tmp_path, (0, 1))
    cfg, store, layout = _store_layout(_context(tmp_path, "rollout", 0))
    assert read_safe_mode(store, layout) is None
    assert len([e for e in read_events(store, layout) if e["kind"] == callbacks.TASK_FAILED]) == 2
    callbacks.on_retry(_context(tmp_path, "score", 2, RuntimeError("node lost")))
    halted = read_safe_mode(store, layout)
    assert halted is not None and "75% of epoch 0's batches failed" in halted["summary"]


def test_resume_starts_a_fresh_count_of_failed_batches(tmp_path):
    _failed_batches_halt(tmp_path)
    cfg, store, layout = _store_layout(_context(tmp_path, "rollout", 0))
    assert read_safe_mode(store, layout) is not None
    result = CliRunner().invoke(app, ["resume", str(_config(tmp_path)), "--store", cfg.storage.uri])
    assert result.exit_code == 0, result.output
    callbacks.on_retry(_context(tmp_path, "rollout", 3, RuntimeError("one more blip")))
    assert read_safe_mode(store, layout) is None  # 1 of 4 batches since the resume, not 4 of 4
    _failed_batches_halt(tmp_path, (0, 1))
    assert read_safe_mode(store, layout) is not None  # 3 of 4 since the resume: halts again


def _events_unwritable(store, layout) -> None:
    """The event log is lost and no event can be written: a file stands where its folder would be."""
    store.delete_prefix(layout.events + "/")
    events = store.root / layout.events
    if events.is_dir():
        events.rmdir()
    events.parent.mkdir(parents=True, exist_ok=True)
    events.write_text("not a folder")


def test_a_lost_event_log_still_escalates_at_the_right_count(tmp_path):
    cfg, store, layout = _store_layout(_context(tmp_path, "rollout", 0))
    _failed_batches_halt(tmp_path, (0,))
    store.delete_prefix(layout.events + "/")  # events deleted after they were written
    _events_unwritable(store, layout)  # and the next ones never written
    _failed_batches_halt(tmp_path, (1,))
    assert not (store.root / layout.events).is_dir()  # no event of any failure is left to read
    assert read_safe_mode(store, layout) is None  # 2 of 4: at the limit, not above it
    assert failed_batches(store, layout, 0) == {0, 1}
    _failed_batches_halt(tmp_path, (2,))
    halted = read_safe_mode(store, layout)
    assert halted is not None and "75% of epoch 0's batches failed" in halted["summary"]


def test_the_same_try_reported_twice_counts_once(tmp_path):
    cfg, store, layout = _store_layout(_context(tmp_path, "rollout", 0))
    for _ in range(2):
        callbacks.on_retry(_context(tmp_path, "rollout", 0, RuntimeError("node lost"), try_number=1))
    assert len(store.list(layout.failures(0, 0) + "/")) == 1
    callbacks.on_retry(_context(tmp_path, "rollout", 0, RuntimeError("node lost"), try_number=2))
    callbacks.on_retry(_context(tmp_path, "score", 0, RuntimeError("node lost"), try_number=1))
    assert len(store.list(layout.failures(0, 0) + "/")) == 3  # three tries, one batch
    callbacks.on_retry(_context(tmp_path, "rollout", 1, RuntimeError("node lost")))
    callbacks.on_retry(_context(tmp_path, "rollout", 1, RuntimeError("node lost")))
    assert failed_batches(store, layout, 0) == {0, 1}
    assert read_safe_mode(store, layout) is None


def test_failures_of_another_epoch_do_not_count(tmp_path):
    cfg, store, layout = _store_layout(_context(tmp_path, "rollout", 0))
    _failed_batches_halt(tmp_path, (0, 1))
    callbacks.on_retry(_context(tmp_path, "rollout", 2, RuntimeError("node lost"), epoch=1))
    callbacks.on_retry(_context(tmp_path, "rollout", 3, RuntimeError("node lost"), epoch=1))
    assert read_safe_mode(store, layout) is None  # 2 of 4 in each epoch, never 4 of 4
    assert failed_batches(store, layout, 0) == {0, 1} and failed_batches(store, layout, 1) == {2, 3}
    callbacks.on_retry(_context(tmp_path, "rollout", 0, RuntimeError("node lost"), epoch=1))
    halted = read_safe_mode(store, layout)
    assert halted is not None and "75% of epoch 1's batches failed" in halted["summary"]


def test_leaving_safe_mode_starts_a_fresh_count_without_the_event_log(tmp_path):
    cfg, store, layout = _store_layout(_context(tmp_path, "rollout", 0))
    _events_unwritable(store, layout)
    _failed_batches_halt(tmp_path)
    assert read_safe_mode(store, layout) is not None and generation(store, layout) == 0
    assert leave_safe_mode(store, layout, by="clear") is not None
    assert generation(store, layout) == 1 and failed_batches(store, layout, 0) == set()
    assert leave_safe_mode(store, layout) is None and generation(store, layout) == 1  # not halted: no new count
    _failed_batches_halt(tmp_path, (0, 1))
    assert read_safe_mode(store, layout) is None  # 2 of 4 since the clear, not 3 + 2
    _failed_batches_halt(tmp_path, (3,))
    assert read_safe_mode(store, layout) is not None


def test_tasks_of_one_clear_lifting_safe_mode_at_once_record_one_lift(tmp_path):
    """A run's Clear starts its failed tasks together: each finds the halt and lifts it; one resumed event."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from verl_tasks.events import read_events

    cfg, store, layout = _store_layout(_context(tmp_path, "rollout", 0))
    _failed_batches_halt(tmp_path)
    assert read_safe_mode(store, layout) is not None
    lifts, all_read, seen = 4, threading.Barrier(4, timeout=60), threading.local()

    class EveryoneReadsFirst:  # each lift has read the halt before any of them goes on
        def __getattr__(self, name):
            return getattr(store, name)

        def get(self, key):
            body = store.get(key)
            if key == layout.safe_mode and not getattr(seen, "done", False):
                seen.done = True
                all_read.wait()
            return body

    with ThreadPoolExecutor(lifts) as pool:
        lifted = list(pool.map(lambda n: leave_safe_mode(EveryoneReadsFirst(), layout, by="clear", task=n),
                               range(lifts)))
    assert all(r is not None for r in lifted), lifted  # each removed it, or saw it removed
    assert read_safe_mode(store, layout) is None
    assert len([e for e in read_events(store, layout) if e["kind"] == "resumed"]) == 1
    _failed_batches_halt(tmp_path, (0, 1, 2))  # a later halt is a new one: its lift is recorded too
    assert read_safe_mode(store, layout) is not None and leave_safe_mode(store, layout, by="clear") is not None


@pytest.mark.parametrize("try_number,max_tries,retries,cleared", [
    (1, 3, 3, False),   # first try of a new run
    (2, 3, 3, False),   # automatic retries
    (4, 3, 3, False),
    (5, 7, 3, True),    # failed on try 4, cleared: max_tries = 4 + 3, next try 5
    (6, 7, 3, False),   # the automatic retry after that cleared try
    (3, 5, 3, True),    # cleared while up for retry after try 2
    (1, 0, 0, False),   # configure (retries=0), first run
    (2, 1, 0, True),    # configure cleared
    (3, 2, 0, True),    # configure cleared twice
    (1, 3, 3, False),   # a never-run task cleared with its run (try_number 0 + retries) runs try 1
])
def test_first_try_after_clear_follows_airflows_max_tries(try_number, max_tries, retries, cleared):
    assert first_try_after_clear(try_number, max_tries, retries) is cleared


def test_automatic_retry_keeps_safe_mode_and_a_clear_lifts_it(tmp_path):
    _failed_batches_halt(tmp_path)
    cfg, store, layout = _store_layout(_context(tmp_path, "rollout", 0))
    writer = UnitWriter(store, layout.rollout(0, 1))  # a unit that is already committed
    writer.write_json("samples.jsonl", {"x": 1})
    writer.commit({"samples": 1})

    retry = _context(tmp_path, "rollout", 1, try_number=2)
    assert not callbacks.lift_safe_mode_if_cleared(retry, cfg, store)
    assert read_safe_mode(store, layout) is not None
    plan = _context(tmp_path, "plan", None, try_number=2)
    with pytest.raises(AirflowFailException) as refused:  # safe mode is deterministic: no retries
        plan["task"].execute(plan)
    assert isinstance(refused.value.__cause__, SafeMode)
    before = read_safe_mode(store, layout)
    callbacks.on_failure({**plan, "exception": refused.value})
    assert read_safe_mode(store, layout) == before  # a refused unit does not overwrite why it was halted

    cleared = _context(tmp_path, "rollout", 1, try_number=5, max_tries=7)
    out = cleared["task"].execute(cleared)
    assert out["unit"] == layout.rollout(0, 1) and read_safe_mode(store, layout) is None
    lifted = [e for e in read_events(store, layout) if e["kind"] == "resumed"]
    assert len(lifted) == 1 and lifted[0]["by"] == "clear" and lifted[0]["try_number"] == 5
    assert lifted[0]["note"] == "safe mode lifted by a clear of rollout[1] in manual__1"
    assert lifted[0]["user"] is None  # no Airflow API connection here to read the audit log


def test_configure_refuses_in_safe_mode_unless_cleared(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_TASKS_STORE_ROOT", str(tmp_path))
    _failed_batches_halt(tmp_path)
    cfg, store, layout = _store_layout(_context(tmp_path, "rollout", 0))
    op = ConfigureExperimentOperator(task_id="configure", config_path=str(_config(tmp_path)), retries=0)
    base = {"params": {}, "dag_run": type("DagRun", (), {"conf": {}, "run_type": "manual"})()}
    with pytest.raises(SafeMode, match="verl-tasks resume"):
        op.execute({**base, "task": op, "ti": _TI("configure", -1, 1, 0)})  # a new trigger is no confirmation
    assert op.execute({**base, "task": op, "ti": _TI("configure", -1, 2, 1)})["experiment"] == cfg.experiment
    assert read_safe_mode(store, layout) is None


def test_every_printed_hint_runs_as_printed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path.parent)  # another working directory than the one the store is relative to
    context = _context(tmp_path, "update", None, RuntimeError("OOM"), try_number=4)
    callbacks.on_failure(context)
    cfg, store, layout = _store_layout(context)
    record = read_safe_mode(store, layout)
    for verb in ("status", "verify", "resume"):  # in the runbook's order; resume last
        command = record["commands"][verb]
        assert f"`{command}`" in record["what_to_do"]
        words = shlex.split(command)
        assert words[0] == "verl-tasks"
        result = CliRunner().invoke(app, words[1:])
        if verb == "verify":  # parsed and reached the experiment, which has no snapshot in this test
            assert "no committed snapshot under" in result.output, result.output
            continue
        assert result.exit_code == 0, (command, result.output)
    assert read_safe_mode(store, layout) is None and "Clear the failed task(s) of DAG tiny_arith" in result.output
    assert "unpause" not in record["what_to_do"].replace(str(tmp_path), "")  # nothing paused it
    assert "unpause" not in result.output.replace(str(tmp_path), "")


def test_unpause_advice_only_when_the_dag_was_paused(tmp_path):
    callbacks.on_failure(_context(tmp_path, "update", None, RuntimeError("OOM"), try_number=4))
    cfg, store, layout = _store_layout(_context(tmp_path, "update", None))
    assert "airflow dags unpause" not in read_safe_mode(store, layout)["what_to_do"]
    paused = note_dag_pause(store, layout, True, "DAG tiny_arith paused")
    assert "`airflow dags unpause tiny_arith`" in paused["what_to_do"]
    result = CliRunner().invoke(app, shlex.split(paused["commands"]["resume"])[1:])
    assert "unpause the DAG (`airflow dags unpause tiny_arith`)" in result.output


def test_rollback_prints_a_run_command_for_this_experiment(tmp_path, monkeypatch):
    context = _context(tmp_path, "plan", None)
    cfg, store, layout = _store_layout(context)
    for epoch in (0, 1):
        writer = UnitWriter(store, layout.plan(epoch))
        writer.write_json("plan.json", {"epoch": epoch})
        writer.commit({})
        writer = UnitWriter(store, layout.snapshot(epoch + 1))
        writer.write_bytes("model.safetensors", f"weights-{epoch + 1}".encode())
        writer.commit({"version": epoch + 1})
    monkeypatch.chdir(tmp_path.parent)
    result = CliRunner().invoke(app, ["rollback", str(_config(tmp_path)), "--store", cfg.storage.uri,
                                      "--to-epoch", "0", "--yes"])
    assert result.exit_code == 0, result.output
    printed = " ".join(result.output.split()).split("`")[1]
    assert shlex.split(printed) == ["verl-tasks", "run", str(_config(tmp_path)), "--experiment", cfg.experiment,
                                    "--store", cfg.storage.uri]


def test_a_skippable_batch_failing_for_good_does_not_halt(tmp_path):
    # tiny_arith has 4 batches: with min_committed_batch_fraction 0.75 one may fail for good, not two
    raw = yaml.safe_load(TINY_YAML.read_text())
    raw["storage"] = {"uri": f"file://{tmp_path}/store"}
    raw.setdefault("fault_tolerance", {})["min_committed_batch_fraction"] = 0.75
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(raw))
    callbacks.on_failure(_context(tmp_path, "score", 2, RuntimeError("reward server down"), try_number=4))
    cfg, store, layout = _store_layout(_context(tmp_path, "score", 2))
    assert read_safe_mode(store, layout) is None
    callbacks.on_failure(_context(tmp_path, "score", 2, RuntimeError("reward server down"), try_number=4))
    assert read_safe_mode(store, layout) is None, "the same batch failing again is still one batch"
    callbacks.on_failure(_context(tmp_path, "rollout", 1, RuntimeError("node lost"), try_number=4))
    halted = read_safe_mode(store, layout)
    assert halted is not None and "rollout/b0001 failed after all its retries" in halted["summary"]
