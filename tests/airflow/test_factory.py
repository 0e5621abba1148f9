"""The DAG's shape, params schema, retries and the run-config resolution (no Airflow DB needed)."""
from __future__ import annotations

from datetime import datetime, timedelta
from types import SimpleNamespace

import pytest
import yaml

from tests.airflow.conftest import DAGS
from verl_tasks.airflow import runconfig
from verl_tasks.airflow.factory import build_dag
from verl_tasks.errors import ConfigError

TINY = DAGS / "experiments" / "tiny_arith.yaml"
SCHEDULED = DAGS / "experiments" / "scheduled_retrain.yaml"


def test_tiny_dag_shape():
    dag = build_dag(TINY)
    cfg = yaml.safe_load(TINY.read_text())
    ids = set(dag.task_ids)
    assert "configure" in ids
    for epoch in range(cfg["epochs"]):
        for phase in ("plan", "rollout", "score", "validate", "update", "snapshot", "evaluate"):
            assert f"epoch_{epoch:03d}.{phase}" in ids
    rollout = dag.get_task("epoch_000.rollout")
    score = dag.get_task("epoch_000.score")
    assert type(rollout).__name__ == "MappedOperator" and type(score).__name__ == "MappedOperator"
    assert rollout.expand_input.value["batch"] == list(range(cfg["rollout"]["batches_per_epoch"]))
    assert "task.batch" in rollout.map_index_template
    assert rollout.pool == "verl_gpu" and dag.get_task("epoch_000.update").pool == "verl_gpu"
    assert dag.get_task("epoch_000.plan").upstream_task_ids == {"configure"}
    assert dag.get_task("epoch_001.plan").upstream_task_ids == {"epoch_000.snapshot"}
    assert dag.get_task("epoch_000.evaluate").upstream_task_ids == {"epoch_000.snapshot"}
    update = dag.get_task("epoch_000.update")
    ft = cfg.get("fault_tolerance", {})
    assert update.retries == ft.get("retries", 3) and update.retry_exponential_backoff
    assert update.max_retry_delay == timedelta(seconds=ft.get("max_retry_delay_s", 300))
    assert dag.doc_md and update.doc_md and "Retry" in update.doc_md
    last = dag.get_task(f"epoch_{cfg['epochs'] - 1:03d}.snapshot")
    assert [a.uri for a in last.outlets] == ["verl-tasks://tiny_arith/snapshots"]


def test_params_schema():
    dag = build_dag(TINY)
    params = dag.params
    for name in ("experiment", "resume", "from_snapshot", "parent", "epochs", "lr", "group_size", "overrides"):
        assert name in params
    schema = params.get_param("resume").schema
    assert schema["enum"] == ["latest", "fresh", "snapshot"]
    raw = yaml.safe_load(TINY.read_text())
    assert params["lr"] == raw["algorithm"]["lr"] and params["group_size"] == raw["algorithm"]["group_size"]
    assert params["experiment"] == raw["experiment"]
    from airflow.sdk.exceptions import ParamValidationError

    with pytest.raises(ParamValidationError):
        params.get_param("experiment").resolve("bad name/..")
    with pytest.raises(ParamValidationError):
        params.get_param("epochs").resolve(99)


def test_the_forms_parent_defaults_to_the_scheduled_parent_where_there_is_one():
    """What the form says is what configure does (``runconfig.default_parent``): a retraining DAG's manual
    ``resume=snapshot`` starts from its ``schedule.parent``, any other DAG's from its own experiment."""
    assert "Defaults to 'tiny-arith' (schedule.parent)" in build_dag(SCHEDULED).params.get_param("parent").description
    assert "Defaults to 'tiny-arith' (this DAG's experiment)" in build_dag(TINY).params.get_param("parent").description


def test_scheduled_dag_uses_cron_and_parent():
    dag = build_dag(SCHEDULED)
    assert type(dag.timetable).__name__ == "CronTriggerTimetable" and dag.timetable.expression == "0 3 * * *"
    assert "tiny-arith" in dag.doc_md


def test_resolve_overrides_and_scheduled_names(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_TASKS_STORE_ROOT", str(tmp_path))
    manual = SimpleNamespace(run_type="manual", logical_date=None, run_after=datetime(2026, 1, 2, 3, 4, 5))
    params = {"experiment": "x1", "lr": 0.002, "epochs": 2, "overrides": {"algorithm.clip_ratio_low": 0.1}}
    cfg = runconfig.resolve(TINY, params, manual)
    assert cfg.experiment == "x1" and cfg.algorithm.lr == 0.002 and cfg.epochs == 2
    assert cfg.algorithm.clip_ratio_low == 0.1
    assert cfg.storage.uri == f"file://{tmp_path}/.store"
    scheduled = SimpleNamespace(run_type="scheduled", logical_date=datetime(2026, 1, 2, 3, 0), run_after=None)
    assert runconfig.resolve(SCHEDULED, {}, scheduled).experiment == "scheduled-retrain-20260102T030000"
    with pytest.raises(ConfigError):
        runconfig.resolve(TINY, {"epochs": 99}, manual)
    with pytest.raises(ConfigError):
        runconfig.resolve(TINY, {"overrides": {"algorithm.nope": 1}}, manual)


def test_skippable_batches_do_not_block_score_and_validate(tmp_path):
    raw = yaml.safe_load(TINY.read_text())
    raw.setdefault("fault_tolerance", {})["min_committed_batch_fraction"] = 0.75
    path = tmp_path / "skippable.yaml"
    path.write_text(yaml.safe_dump(raw))
    dag = build_dag(path)
    assert dag.get_task("epoch_000.score").trigger_rule == "all_done"
    assert dag.get_task("epoch_000.validate").trigger_rule == "all_done"
    assert dag.get_task("epoch_000.update").trigger_rule == "all_success"
    assert build_dag(TINY).get_task("epoch_000.validate").trigger_rule == "all_success"


def test_every_epoch_has_an_evaluate_and_the_run_picks_which_ones_run(tmp_path):
    """The DAG's evaluate tasks follow no YAML schedule: a run of fewer epochs (or another
    ``evaluate.every``) still evaluates its own last epoch; configure skips the rest up front."""
    from airflow.sdk.exceptions import DownstreamTasksSkipped

    raw = yaml.safe_load(TINY.read_text())
    raw.update(epochs=4, evaluate={"every": 2}, schedule={"cron": "0 3 * * *"})
    raw["storage"]["uri"] = f"file://{tmp_path}/store"
    path = tmp_path / "every2.yaml"
    path.write_text(yaml.safe_dump(raw))
    dag = build_dag(path)
    evaluates = {f"epoch_{epoch:03d}.evaluate" for epoch in range(4)}
    assert evaluates <= set(dag.task_ids)
    assert dag.get_task("epoch_002.evaluate").upstream_task_ids == {"epoch_002.snapshot"}
    assert dag.get_task("epoch_003.plan").upstream_task_ids == {"epoch_002.snapshot"}
    assert dag.get_task("promote").upstream_task_ids == evaluates

    params = {"experiment": "every2", "epochs": 3}  # last epoch 2: not on the YAML's every-2 schedule
    cfg = runconfig.resolve(path, params)
    reasons = {epoch: dag.get_task(f"epoch_{epoch:03d}.evaluate")._skip_reason(cfg) for epoch in range(4)}
    assert reasons[1] is None and reasons[2] is None, reasons
    assert "evaluate.every=2" in reasons[0] and "trains 3 epoch(s)" in reasons[3], reasons
    every1 = runconfig.resolve(path, {**params, "overrides": {"evaluate.every": 1}})
    assert dag.get_task("epoch_000.evaluate")._skip_reason(every1) is None

    with pytest.raises(DownstreamTasksSkipped) as skipped:
        dag.get_task("configure").execute({"params": params, "dag_run": None, "ti": None})
    names = {name for name in skipped.value.tasks if isinstance(name, str)}
    assert "epoch_000.evaluate" in names and "epoch_003.plan" in names, names
    assert not names & {"epoch_001.evaluate", "epoch_002.evaluate", "epoch_000.snapshot", "epoch_002.plan"}, names


def test_a_ppo_dag_runs_the_critic_between_the_gate_and_the_update(tmp_path):
    raw = yaml.safe_load(TINY.read_text())
    raw["algorithm"]["adv_estimator"] = "gae"
    raw["critic"] = {"lr": 1e-4}
    path = tmp_path / "ppo.yaml"
    path.write_text(yaml.safe_dump(raw))
    dag = build_dag(path)
    for epoch in range(raw["epochs"]):
        group = f"epoch_{epoch:03d}"
        assert dag.get_task(f"{group}.critic").upstream_task_ids == {f"{group}.validate"}
        assert dag.get_task(f"{group}.update").upstream_task_ids == {f"{group}.validate", f"{group}.critic"}
    assert dag.get_task("epoch_000.critic").pool == "verl_gpu"
    assert not [t for t in build_dag(TINY).task_ids if t.endswith(".critic")]


def test_dynamic_sampling_tops_the_epoch_up_before_the_gate(tmp_path):
    raw = yaml.safe_load(TINY.read_text())
    raw["algorithm"]["filter_groups"] = {"enable": True, "max_batches": 3 * raw["rollout"]["batches_per_epoch"]}
    path = tmp_path / "dapo.yaml"
    path.write_text(yaml.safe_dump(raw))
    dag = build_dag(path)
    assert dag.get_task("epoch_000.top_up").upstream_task_ids == {"epoch_000.score"}
    assert dag.get_task("epoch_000.validate").upstream_task_ids == {"epoch_000.score", "epoch_000.top_up"}
    assert dag.get_task("epoch_000.top_up").pool == "verl_gpu"  # it rolls out the extra batches
    assert not [t for t in build_dag(TINY).task_ids if t.endswith(".top_up")]
