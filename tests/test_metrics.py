"""Prometheus metrics and the torch-free status: values match the store, after faults too."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT, write_yaml
from verl_tasks.config import ExperimentConfig
from verl_tasks.events import record_event
from verl_tasks.layout import Layout
from verl_tasks.status import epoch_units
from verl_tasks.store import store_for
from verl_tasks.store.conventions import WEIGHTS, write_latest
from verl_tasks.store.units import UnitWriter

FAST = {"model.tiny.warm_start_steps": 20, "epochs": 1}
CLI = Path(sys.executable).parent / "verl-tasks"


def fabricate(cfg: ExperimentConfig, epochs: int) -> None:
    """Commit every unit of ``epochs`` epochs (tiny files, real markers and committed events), no training."""
    store, layout = store_for(cfg), Layout(cfg.experiment)
    snapshot = None
    for epoch in range(epochs):
        for phase, units in epoch_units(cfg, layout, epoch).items():
            if phase == "evaluate" and not cfg.should_evaluate(epoch):
                continue
            for unit in units:
                writer = UnitWriter(store, unit)
                writer.write_bytes(WEIGHTS if phase in ("update", "snapshot") else "data.json", b"{}")
                meta = {"update": {"metrics": {"reward_mean": 0.5, "samples": 64, "response_length_mean": 4.0}},
                        "evaluate": {"metrics": {"eval_accuracy": 0.75}}}.get(phase, {})
                record, _ = writer.commit(meta)
                record_event(store, layout, "committed", phase=phase, unit=unit, epoch=epoch, duration_s=1.5,
                             commit_s=0.003)
                snapshot = record if phase == "snapshot" else snapshot
    write_latest(store, layout, epochs, snapshot)


def parse(text: str) -> dict[str, dict[tuple, float]]:
    """Sample name -> {sorted label items (experiment left out): value}, via prometheus_client's parser."""
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "experiment"))
            out.setdefault(sample.name, {})[labels] = sample.value
    return out


def metrics_of(cfg: ExperimentConfig) -> dict[str, dict[tuple, float]]:
    from verl_tasks.metrics import render_metrics

    return parse(render_metrics([(cfg, store_for(cfg))]))


def test_metrics_follow_the_store_through_a_failed_batch_and_a_fallback(tiny_config, fault_hooks):
    from verl_tasks.phases.fallback import check_resume_point
    from verl_tasks.runner import make_context, run_phase, train
    from verl_tasks.store.units import read_marker

    cfg = tiny_config(**FAST)
    ctx = make_context(cfg)
    run_phase(ctx, "plan", 0)
    run_phase(ctx, "rollout", 0, 0)

    def broken(**info):
        raise OSError("disk full")

    fault_hooks["before_commit"] = broken
    with pytest.raises(OSError, match="disk full"):
        run_phase(ctx, "rollout", 0, 1)  # a `failed` event, no marker
    m = metrics_of(cfg)
    units = m["verl_tasks_units"]
    assert units[(("phase", "rollout"), ("state", "committed"))] == 1
    assert units[(("phase", "rollout"), ("state", "failed"))] == 1
    assert units[(("phase", "plan"), ("state", "committed"))] == 1
    assert units[(("phase", "score"), ("state", "pending"))] == 2
    total = sum(units.values())  # plan, 2 rollouts, 2 scores, validate, update, snapshot, evaluate (last epoch)
    assert total == 9 and m["verl_tasks_pending_ratio"][()] == pytest.approx(7 / 9)
    assert m["verl_tasks_retries_total"][(("event", "failed"), ("phase", "rollout"))] == 1
    assert m["verl_tasks_retries_total"][(("event", "task_failed"), ("phase", "rollout"))] == 0
    assert m["verl_tasks_unit_duration_seconds_count"][(("phase", "rollout"),)] == 1
    assert m["verl_tasks_store_commit_seconds_count"][(("phase", "plan"),)] == 1
    assert 0 <= m["verl_tasks_state_log_lag_seconds"][()] < 120
    assert m["verl_tasks_current_epoch"][()] == 0 and m["verl_tasks_safe_mode"][()] == 0
    # A try safe mode refused (Airflow's failure callback records it so): neither a retry nor a failed unit.
    from verl_tasks.events import record_event

    record_event(ctx.store, Layout(cfg.experiment), "task_failed", epoch=0, phase="score", batch=0, final=True,
                 refused="safe_mode", unit=Layout(cfg.experiment).score(0, 0), error="AirflowFailException: ...")
    m = metrics_of(cfg)
    assert m["verl_tasks_retries_total"][(("event", "task_failed"), ("phase", "score"))] == 0
    assert m["verl_tasks_units"][(("phase", "score"), ("state", "failed"))] == 0

    fault_hooks.clear()
    train(ctx, 1)  # the retry commits the batch; the epoch finishes
    m = metrics_of(cfg)
    layout = Layout(cfg.experiment)
    update = read_marker(ctx.store, layout.update(0)).meta["metrics"]
    evaluate = read_marker(ctx.store, layout.evaluate(0)).meta["metrics"]
    assert m["verl_tasks_pending_ratio"][()] == 0 and m["verl_tasks_snapshot_version"][()] == 1
    assert m["verl_tasks_retries_total"][(("event", "failed"), ("phase", "rollout"))] == 1  # history stays
    assert m["verl_tasks_reward_mean"][()] == pytest.approx(update["reward_mean"])
    for gauge, key in (("approx_kl", "actor/ppo_kl"), ("entropy", "actor/entropy"), ("grad_norm", "actor/grad_norm"),
                       ("clip_fraction", "actor/pg_clipfrac"), ("learning_rate", "actor/lr"),
                       ("response_length_mean", "response_length_mean"), ("policy_loss", "actor/loss")):
        assert m[f"verl_tasks_{gauge}"][()] == pytest.approx(update[key]), gauge
    assert m["verl_tasks_eval_accuracy"][()] == pytest.approx(evaluate["eval_accuracy"])
    assert m["verl_tasks_samples_per_second"][()] > 0 and m["verl_tasks_tokens_per_second"][()] > 0
    assert m["verl_tasks_fallbacks_total"][(("phase", "snapshot"),)] == 0

    snapshot = read_marker(ctx.store, layout.snapshot(1))
    weights = ctx.store.root / snapshot.key(WEIGHTS)
    weights.write_bytes(weights.read_bytes()[:-8] + b"corrupt!")  # same size, other bytes
    assert check_resume_point(ctx)["version"] == 1
    m = metrics_of(cfg)
    assert m["verl_tasks_fallbacks_total"][(("phase", "snapshot"),)] == 1
    assert m["verl_tasks_quarantined_units_total"][(("phase", "snapshot"),)] == 1
    assert m["verl_tasks_snapshot_version"][()] == 0  # back to the base policy
    assert m["verl_tasks_units"][(("phase", "snapshot"), ("state", "pending"))] == 1
    # The snapshot's weights are a hard link to the update's (written once): both were damaged, both wait.
    assert m["verl_tasks_quarantined_units_total"][(("phase", "update"),)] == 1
    assert m["verl_tasks_units"][(("phase", "update"), ("state", "pending"))] == 1
    assert m["verl_tasks_pending_ratio"][()] == pytest.approx(2 / 9)


TORCH_PROBE = """
import sys
from verl_tasks.cli import app
app(sys.argv[1:], standalone_mode=False)
sys.stderr.write("TORCH_LOADED=%s\\n" % ("torch" in sys.modules))
"""


@pytest.fixture
def many_epochs(tmp_path):
    """A YAML and a store holding 10 committed epochs of 4 batches (markers and events, no training)."""
    path = write_yaml(tmp_path, {"epochs": 10, "rollout.batches_per_epoch": 4, "storage.uri": f"file://{tmp_path}/store"})
    from verl_tasks.config import load_config

    fabricate(load_config(path), 10)
    return path


@pytest.mark.parametrize("command", [["status"], ["status", "--json"], ["metrics"]])
def test_status_and_metrics_never_import_torch(many_epochs, command):
    run = subprocess.run([sys.executable, "-c", TORCH_PROBE, *command, str(many_epochs)], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert "TORCH_LOADED=False" in run.stderr
    assert ("verl_tasks_pending_ratio" if command == ["metrics"] else "tiny-arith") in run.stdout


def test_status_module_and_operator_skip_path_never_import_torch(tmp_path):
    """``import verl_tasks.status``, and an Airflow phase task whose unit is committed (it returns the marker)."""
    probe = """
import sys
root, yaml = sys.argv[1:]
from types import SimpleNamespace
import verl_tasks.status, verl_tasks.metrics
assert "torch" not in sys.modules, "verl_tasks.status/metrics imported torch"
from verl_tasks.airflow.operators import VerlPhaseOperator
from verl_tasks.layout import Layout
from verl_tasks.store import open_store
from verl_tasks.store.units import UnitWriter
writer = UnitWriter(open_store(f"file://{root}/.store"), Layout("exp-m").rollout(0, 1))
writer.write_json("samples.jsonl", {"x": 1})
writer.commit({"samples": 3})
op = VerlPhaseOperator(task_id="rollout", config_path=yaml, phase="rollout", epoch=0, batch=1, backend="inline")
run = SimpleNamespace(run_type="manual", conf={}, logical_date=None, run_after=None)
out = op.execute({"params": {"experiment": "exp-m"}, "dag_run": run})
assert out["unit"] == "exp-m/epochs/00000/rollout/b0001", out
print("TORCH_LOADED=%s" % ("torch" in sys.modules))
"""
    yaml = ROOT / "dags" / "experiments" / "tiny_arith.yaml"
    env = {**os.environ, "VERL_TASKS_STORE_ROOT": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", probe, str(tmp_path), str(yaml)], capture_output=True, text=True,
                         timeout=180, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "TORCH_LOADED=False" in run.stdout


def test_the_status_console_script_shows_every_committed_epoch(many_epochs):
    """The installed console script end to end: one row per epoch, every phase committed, the latest snapshot.

    How long it takes (CPU and wall, against ``metrics``) is measured by ``benchmarks/status_cpu.py``.
    """
    env = {**os.environ, "COLUMNS": "200"}  # wide enough that rich does not shorten "committed"
    run = subprocess.run([str(CLI), "status", str(many_epochs)], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    rows = [line.strip("│ ").split("│") for line in run.stdout.splitlines() if line.startswith("│")]
    assert [int(cells[0]) for cells in rows] == list(range(10)), run.stdout
    assert all([c.strip() for c in cells[1:8]] == ["committed"] * 7 for cells in rows), run.stdout
    assert "latest snapshot: version 10 (after epoch 9), sha256 " in run.stdout, run.stdout


def test_metrics_out_file_is_replaced_whole(many_epochs, tmp_path):
    target = tmp_path / "textfile" / "verl.prom"
    target.parent.mkdir()
    target.write_text("old\n")
    run = subprocess.run([str(CLI), "metrics", str(many_epochs), "--out", str(target)], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    m = parse(target.read_text())
    assert m["verl_tasks_snapshot_version"][()] == 10 and m["verl_tasks_current_epoch"][()] == 9
    assert m["verl_tasks_events_total"][(("kind", "committed"),)] == 10 * 13  # evaluate after every epoch (every: 1)
    assert m["verl_tasks_unit_duration_seconds_bucket"][(("le", "2.5"), ("phase", "rollout"))] == 40
    assert sorted(p.name for p in target.parent.iterdir()) == ["verl.prom"]  # no temporary file left
    bad = subprocess.run([str(CLI), "metrics", str(many_epochs), "--experiment", "Bad Name"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "error:" in bad.stderr and "Traceback" not in bad.stderr


def metric_names_in(expression: str) -> set[str]:
    import re

    return set(re.findall(r"\bverl_tasks_[a-z_]+", expression))


def test_alert_rules_and_dashboard_use_only_exposed_metrics(many_epochs):
    from verl_tasks.config import load_config
    from verl_tasks.metrics import render_metrics

    cfg = load_config(many_epochs)
    exposed = {f.name for f in text_string_to_metric_families(render_metrics([(cfg, store_for(cfg))]))}
    samples = exposed | {f"{n}_{s}" for n in exposed for s in ("total", "bucket", "sum", "count")}
    rules = yaml.safe_load((ROOT / "docs" / "alerts.yml").read_text())
    exprs = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    alerts = {rule["alert"] for group in rules["groups"] for rule in group["rules"]}
    assert {"VerlTasksNoProgress", "VerlTasksSafeMode", "VerlTasksFallback"} <= alerts
    dashboard = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    targets = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert dashboard["title"] and targets
    used = set().union(*(metric_names_in(e) for e in exprs + targets))
    assert used and used <= samples, sorted(used - samples)


def test_batches_the_epoch_went_on_without_are_skipped_not_pending(tmp_path):
    from verl_tasks.config import load_config
    from verl_tasks.store.conventions import write_skipped

    cfg = load_config(write_yaml(tmp_path, {"epochs": 1, "rollout.batches_per_epoch": 4,
                                            "storage.uri": f"file://{tmp_path}/store"}))
    store, layout = store_for(cfg), Layout(cfg.experiment)
    for unit in [layout.plan(0)] + [layout.unit(p, 0, b) for p in ("rollout", "score") for b in (0, 2, 3)]:
        writer = UnitWriter(store, unit)
        writer.write_bytes("data.json", b"{}")
        writer.commit({})
    write_skipped(store, layout, 0, [1], 4, 0.75)
    m = metrics_of(cfg)
    units = m["verl_tasks_units"]
    for phase in ("rollout", "score"):
        assert units[(("phase", phase), ("state", "committed"))] == 3
        assert units[(("phase", phase), ("state", "skipped"))] == 1
        assert units[(("phase", phase), ("state", "pending"))] == 0
    assert units[(("phase", "validate"), ("state", "pending"))] == 1
    assert m["verl_tasks_pending_ratio"][()] == pytest.approx(4 / 13)  # validate, update, snapshot, evaluate


def test_status_and_metrics_read_an_s3_store_like_a_local_one(tmp_path, moto_endpoint, s3_bucket):
    from verl_tasks.config import load_config
    from verl_tasks.status import status

    shown = {}
    for name, uri in (("local", f"file://{tmp_path}/store"), ("s3", f"s3://{s3_bucket}/prefix")):
        cfg = load_config(write_yaml(tmp_path, {"epochs": 3, "rollout.batches_per_epoch": 2, "storage.uri": uri,
                                                "storage.endpoint_url": moto_endpoint if name == "s3" else None}))
        fabricate(cfg, 2)
        m = metrics_of(cfg)
        shown[name] = ({k: v for k, v in m.items() if "second" not in k and "lag" not in k},
                       [row["phases"] for row in status(cfg, store_for(cfg))["epochs"]])
    assert shown["s3"] == shown["local"]
    metrics, phases = shown["s3"]
    assert metrics["verl_tasks_current_epoch"][()] == 2 and metrics["verl_tasks_pending_ratio"][()] == 1
    assert len(phases) == 2 and all(state == "committed" for row in phases for state in row.values())
