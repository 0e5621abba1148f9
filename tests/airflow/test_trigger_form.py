"""The trigger form may change hyperparameters only: it cannot run code, load files or redirect data."""
from __future__ import annotations

from datetime import datetime
from types import SimpleNamespace

import pytest
import yaml

from tests.airflow.conftest import DAGS
from verl_tasks.airflow import runconfig
from verl_tasks.airflow.factory import build_dag
from verl_tasks.airflow.operators import ConfigureExperimentOperator
from verl_tasks.errors import ConfigError

TINY = str(DAGS / "experiments" / "tiny_arith.yaml")

REFUSED = {
    "rewards.function": "os:system",
    "model.name_or_path": "attacker/model",
    "model.trust_remote_code": True,
    "model.source": "hf",
    "data.train": "/etc/passwd",
    "data.eval": "/home/other/eval.jsonl",
    "storage.endpoint_url": "http://attacker:9000",
    "storage.sse": "none",
    "storage.uri": "s3://other-bucket/exfil",
    "storage.aws_conn_id": "prod_admin",
    "resources.update.num_gpus": 8,
    "schedule.parent": "other-team-experiment",
    "fault_tolerance.safe_mode": False,
    "fault_tolerance.retries": 100,
    "quality.enabled": False,
    "seed": 1,
    "torch_threads": 64,
    "experiment": "someone-else",
    "rollout.engine": "vllm",
    "rollout.batches_per_epoch": 64,
}


def _ctx(**params):
    return {"params": params, "dag_run": SimpleNamespace(run_type="manual", conf={}, logical_date=None, run_after=None)}


@pytest.fixture
def configure(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_TASKS_STORE_ROOT", str(tmp_path))
    return ConfigureExperimentOperator(task_id="configure", config_path=TINY)


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_configure_refuses_each_key_outside_the_allow_list(configure, tmp_path, key):
    with pytest.raises(ConfigError, match="cannot be set from the trigger form") as err:
        configure.execute(_ctx(experiment="form-a", overrides={key: REFUSED[key]}))
    assert repr(key) in str(err.value) and "whoever deploys the DAG" in str(err.value) and TINY in str(err.value)
    assert not (tmp_path / ".store").exists()  # refused before anything is written


@pytest.mark.parametrize("nested", [
    {"rewards": {"function": "os:system"}},
    {"storage": {"endpoint_url": "http://attacker:9000", "sse": "none"}},
    {"model": {"trust_remote_code": True, "name_or_path": "attacker/model"}},
    {"algorithm": {"lr": 0.01, "extra": {"deep": 1}}},
    {"rewards": "os:system"},
    {"algorithm": "replaced"},
    {"": 1},
])
def test_configure_refuses_nested_objects_that_reach_other_sections(configure, nested):
    with pytest.raises(ConfigError, match="cannot be set from the trigger form"):
        configure.execute(_ctx(experiment="form-b", overrides=nested))


def test_allowed_hyperparameters_pass_and_reach_the_config(configure):
    overrides = {"algorithm.clip_ratio_low": 0.25, "algorithm": {"entropy_coef": 0.01, "kl_type": "k1", "kl_coef": 0.1},
                 "rollout.temperature": 0.7, "rollout.top_p": 0.9, "rollout.max_new_tokens": 5,
                 "rollout.prompts_per_batch": 8, "evaluate": {"every": 2, "max_prompts": 50}, "epochs": 2}
    cfg = runconfig.resolve(TINY, {"experiment": "form-c", "overrides": overrides, "lr": 0.002})
    assert (cfg.algorithm.clip_ratio_low, cfg.algorithm.entropy_coef, cfg.algorithm.kl_coef) == (0.25, 0.01, 0.1)
    assert cfg.algorithm.lr == 0.002 and cfg.algorithm.group_size == 8  # the YAML's other algorithm keys are kept
    assert (cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.prompts_per_batch) == (0.7, 0.9, 8)
    assert (cfg.evaluate.every, cfg.evaluate.max_prompts, cfg.epochs) == (2, 50, 2)
    assert configure.execute(_ctx(experiment="form-c", overrides=overrides, lr=0.002))["experiment"] == "form-c"


@pytest.mark.parametrize("name", ["../other", "a/b", "s3://bucket/x", ".hidden", "x" * 129])
def test_experiment_and_parent_are_names_in_the_same_store(configure, name):
    with pytest.raises(ConfigError, match="invalid experiment name"):
        configure.execute(_ctx(experiment=name))
    with pytest.raises(ConfigError, match="invalid experiment name"):
        configure.execute(_ctx(experiment="form-d", resume="snapshot", parent=name, from_snapshot=0))


def test_scheduled_name_too_long_is_one_clear_error(tmp_path):
    raw = yaml.safe_load((DAGS / "experiments" / "scheduled_retrain.yaml").read_text())
    raw["experiment"] = "r" * 112  # + "-YYYYmmddTHHMMSS" = 128: the longest that fits
    run = SimpleNamespace(run_type="scheduled", conf={}, logical_date=datetime(2026, 5, 1, 3, 0), run_after=None)
    assert len(runconfig.experiment_name(raw, {}, run)) == 128
    raw["experiment"] = "r" * 113
    with pytest.raises(ConfigError, match="at most 112 characters"):
        runconfig.experiment_name(raw, {}, run)
    path = tmp_path / "long_name.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"'<experiment>-<timestamp>' \(129 characters"):
        build_dag(path)  # the deployer sees it when the DAG is imported, not at 3 a.m.
