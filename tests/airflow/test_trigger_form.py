"""The trigger form may change hyperparameters only, each up to its bound: it cannot run code, load files, redirect
data or ask for unbounded work."""
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
    "access.fork_from": ["gsm8k"],
    "access.write_to": ["gsm8k"],
    "access.adopt": ["gsm8k-private"],
    "trigger.bounds.rollout.max_new_tokens": 10**9,
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


# --- bounds: every key the form may set has an upper bound, checked before any compute ---------------------

REFUSED_BOUNDS = [  # (params, the key named, its value, its bound in tiny_arith.yaml)
    ({"group_size": 10**6}, "params.group_size (algorithm.group_size)", 10**6, "32 (4 x the DAG's 8)"),
    ({"prompts_per_batch": 10**6}, "params.prompts_per_batch (rollout.prompts_per_batch)", 10**6,
     "128 (4 x the DAG's 32)"),
    ({"overrides": {"algorithm.ppo_epochs": 10**9}}, "algorithm.ppo_epochs", 10**9, "4 (4 x the DAG's 1)"),
    ({"overrides": {"rollout.max_new_tokens": 10**9}}, "rollout.max_new_tokens", 10**9, "20 (4 x the DAG's 5)"),
    ({"overrides": {"evaluate": {"max_prompts": 10**9}}}, "evaluate.max_prompts", 10**9, "800 (4 x the DAG's 200)"),
    ({"overrides": {"algorithm.group_size": 10**6}}, "algorithm.group_size", 10**6, "32 (4 x the DAG's 8)"),
]


@pytest.mark.parametrize("params,key,value,bound", REFUSED_BOUNDS, ids=[r[1] for r in REFUSED_BOUNDS])
def test_configure_refuses_a_value_over_its_bound(configure, tmp_path, params, key, value, bound):
    with pytest.raises(ConfigError) as err:
        configure.execute(_ctx(experiment="bounded", **params))
    message = str(err.value)
    assert f"{key}={value} exceeds its bound {bound}" in message, message
    dotted = key.split("(")[-1].rstrip(")")
    assert f"The DAG's author sets these bounds in {TINY}: trigger.bounds, e.g. trigger: {{bounds: {{{dotted}: N}}}}" \
        in message, message
    assert not (tmp_path / ".store").exists()  # refused before anything is written


def test_configure_refuses_a_minibatch_that_multiplies_the_optimizer_steps(configure, tmp_path):
    """A smaller minibatch means more optimizer steps over the same samples: at most 4x fewer samples each."""
    from verl_tasks.config import load_config

    own = load_config(TINY).algorithm.minibatch_size
    with pytest.raises(ConfigError) as err:
        configure.execute(_ctx(experiment="tiny-steps", overrides={"algorithm.minibatch_size": 1}))
    message = str(err.value)
    assert (f"algorithm.minibatch_size=1 is below its bound {own / 4:g} (the DAG's {own} / 4: a smaller value "
            "multiplies the work of the run)") in message, message
    assert f"A smaller algorithm.minibatch_size is set in {TINY} by whoever deploys the DAG." in message
    assert not (tmp_path / ".store").exists()  # refused before anything is written
    assert configure.execute(_ctx(experiment="tiny-steps", overrides={"algorithm.minibatch_size": own // 4}))


def test_the_epoch_cap_applies_when_the_yaml_does_not_set_epochs(tmp_path, monkeypatch):
    """Without `epochs` in the YAML the DAG has the default's 8 epochs, and a run may ask for no more."""
    monkeypatch.setenv("VERL_TASKS_STORE_ROOT", str(tmp_path))
    raw = yaml.safe_load((DAGS / "experiments" / "tiny_arith.yaml").read_text())
    del raw["epochs"]
    path = tmp_path / "no_epochs.yaml"
    path.write_text(yaml.safe_dump(raw))
    dag = build_dag(path)
    assert len([t for t in dag.task_ids if t.endswith(".snapshot")]) == 8
    assert dag.params.get_param("epochs").schema["maximum"] == 8
    op = dag.get_task("configure")
    for params in ({"overrides": {"epochs": 10**9}}, {"epochs": 10**9}, {"epochs": 9}):
        with pytest.raises(ConfigError, match=r"epochs=\d+ exceeds its bound 8 \(the 8 epochs this DAG was built "
                                              r"with\)\. The DAG's epochs are set in .*no_epochs.yaml"):
            op.execute(_ctx(experiment="no-epochs", **params))
    assert not (tmp_path / ".store").exists()
    assert runconfig.resolve(path, {"experiment": "no-epochs", "epochs": 8}).epochs == 8


def test_the_dags_author_sets_a_bound_in_the_yaml(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_TASKS_STORE_ROOT", str(tmp_path))
    raw = yaml.safe_load((DAGS / "experiments" / "tiny_arith.yaml").read_text())
    raw["trigger"] = {"bounds": {"rollout": {"max_new_tokens": 64}, "algorithm.group_size": 10}}
    path = tmp_path / "bounded.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert runconfig.resolve(path, {"overrides": {"rollout.max_new_tokens": 64}}).rollout.max_new_tokens == 64
    with pytest.raises(ConfigError, match=r"rollout.max_new_tokens=65 exceeds its bound 64 \(trigger.bounds in the "
                                          r"YAML\)"):
        runconfig.resolve(path, {"overrides": {"rollout.max_new_tokens": 65}})
    with pytest.raises(ConfigError, match=r"params.group_size \(algorithm.group_size\)=11 exceeds its bound 10"):
        runconfig.resolve(path, {"group_size": 11})
    assert build_dag(path).params.get_param("group_size").schema["maximum"] == 10  # the form's own limit
    raw["trigger"] = {"bounds": {"rollout.max_new_tokens": 4}}  # below the YAML's 5: the DAG does not import
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="trigger.bounds.rollout.max_new_tokens is 4, below the DAG's own"):
        build_dag(path)
    raw["trigger"] = {"bounds": {"rollout.engine": 4}}
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="'rollout.engine', which is not a numeric key of the trigger form"):
        build_dag(path)


def test_every_key_the_form_may_set_declares_a_bound():
    """A key added to a section the allow-list opens (algorithm.*, evaluate.*) must get a bound beside it."""
    from pydantic import BaseModel

    from verl_tasks.config import TRIGGER_BOUNDS, ExperimentConfig

    def keys(model: type[BaseModel], prefix: str = "") -> list[str]:
        out = []
        for name, field in model.model_fields.items():
            kind = field.annotation
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                out += keys(kind, f"{prefix}{name}.")
            else:
                out.append(prefix + name)
        return out

    settable = {key for key in keys(ExperimentConfig) if runconfig.trigger_overridable(key)}
    assert settable == set(TRIGGER_BOUNDS), settable ^ set(TRIGGER_BOUNDS)


def test_the_forms_numbers_carry_their_bounds():
    params = build_dag(TINY).params
    maxima = {name: params.get_param(name).schema["maximum"]
              for name in ("epochs", "group_size", "prompts_per_batch", "lr", "temperature")}
    assert maxima == {"epochs": 8, "group_size": 32, "prompts_per_batch": 128, "lr": pytest.approx(0.01),
                      "temperature": 2.0}
    from airflow.sdk.exceptions import ParamValidationError

    with pytest.raises(ParamValidationError):
        params.get_param("group_size").resolve(10**6)
