"""Bad configuration fails at load, naming the key and the fix; config drift is refused."""
from __future__ import annotations

import pytest
import yaml

from verl_tasks.config import load_config, parse_config
from verl_tasks.errors import ConfigError, ConfigMismatch
from verl_tasks.phases.common import PhaseContext
from verl_tasks.phases.prepare import pin_experiment
from verl_tasks.store import open_store

from .conftest import TINY_YAML


def raw():
    return yaml.safe_load(TINY_YAML.read_text())


def test_the_shipped_tiny_config_loads():
    cfg = load_config(TINY_YAML)
    assert cfg.experiment == "tiny-arith" and cfg.epochs >= 8


@pytest.mark.parametrize(
    "patch, message",
    [
        ({"algorithm": {"learning_rate": 0.1}}, "algorithm.learning_rate: unknown key"),
        ({"algorithm": {"lr": -1}}, "algorithm.lr: Input should be greater than 0"),
        ({"algorithm": {"group_size": "eight"}}, "algorithm.group_size"),
        ({"algorithm": {"group_size": 1}}, "group_size >= 2"),
        ({"algorithm": {"minibatch_size": 100000}}, "minibatch_size (100000) is larger"),
        ({"rollout": {"engine": "sglang"}}, "rollout.engine"),
        ({"storage": {"uri": "/abs/path"}}, "must start with file:// or s3://"),
        ({"experiment": "../escape"}, "invalid experiment name"),
        ({"rewards": {"function": "not_an_import_path"}}, "package.module:function"),
        ({"fault_tolerance": {"timeout_s": {"rolout": 10}}}, "unknown phase 'rolout'"),
        ({"tracking": {"mlflow": "https://bob:s3cret@mlflow.example:5000"}}, "MLFLOW_TRACKING_PASSWORD"),
    ],
)
def test_bad_values_name_the_key(patch, message):
    data = raw()
    for section, value in patch.items():
        if isinstance(value, dict):
            data.setdefault(section, {}).update(value)
        else:
            data[section] = value
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert message in str(err.value)


def test_yaml_that_is_not_a_mapping(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(path)


def _commit_rollout(store, experiment: str) -> None:
    """A committed rollout unit: past this point the experiment's config is final."""
    from verl_tasks.layout import Layout
    from verl_tasks.store.units import UnitWriter

    writer = UnitWriter(store, Layout(experiment).rollout(0, 0))
    writer.write_jsonl("samples.jsonl", [{"id": "x"}])
    writer.commit({})


def test_changed_hyperparameter_under_same_name_is_refused(tmp_path):
    store = open_store(f"file://{tmp_path}")
    first = parse_config(raw())
    pin_experiment(PhaseContext(first, store))
    _commit_rollout(store, first.experiment)
    changed = parse_config(raw(), {"algorithm.lr": 0.5, "rollout.temperature": 0.7, "epochs": 20})
    with pytest.raises(ConfigMismatch) as err:
        pin_experiment(PhaseContext(changed, store))
    assert err.value.differing_keys == ["algorithm.lr", "rollout.temperature"]  # epochs may change
    assert "new experiment name" in str(err.value)
    assert f"deleting everything under {store.url(first.experiment)}" in str(err.value)
    renamed = parse_config(raw(), {"algorithm.lr": 0.5, "experiment": "tiny-arith-lr05"})
    pin_experiment(PhaseContext(renamed, store))


def test_torch_threads_is_pinned():
    """It changes CPU float summation order, hence the bytes of every unit (ADR 0002)."""
    from verl_tasks.config import differing_keys

    a, b = parse_config(raw()), parse_config(raw(), {"torch_threads": 1})
    assert a.config_hash() != b.config_hash()
    assert differing_keys(a.hashed_view(), b.hashed_view()) == ["torch_threads"]


@pytest.mark.parametrize(
    "function, message",
    [
        ("verl_tasks.rewards.builtn:exact_answer", "module 'verl_tasks.rewards.builtn' cannot be imported"),
        ("verl_tasks.rewards.builtin:exact_answr", "has no attribute 'exact_answr'"),
        ("tests.reward_fixtures:two_args",
         "cannot be called as fn(data_source, solution_str, ground_truth, extra_info)"),
        ("tests.reward_fixtures:NOT_CALLABLE", "not a function"),
    ],
)
def test_reward_function_is_checked_when_the_config_loads(function, message):
    with pytest.raises(ConfigError) as err:
        parse_config(raw(), {"rewards.function": function})
    assert message in str(err.value)


def test_yaml_date_as_experiment_name_says_to_quote_it(tmp_path):
    path = tmp_path / "dated.yaml"
    path.write_text(TINY_YAML.read_text().replace("experiment: tiny-arith", "experiment: 2026-11-30"))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert 'YAML read 2026-11-30 as a date, not text; quote it: experiment: "2026-11-30"' in str(err.value)


def test_a_sharded_engine_must_be_vllm_and_get_as_many_gpus_as_shards(tiny_config):
    from verl_tasks.errors import ConfigError

    with pytest.raises(ConfigError, match="needs rollout.engine: vllm"):
        tiny_config(**{"rollout.tensor_parallel_size": 2, "resources.rollout.num_gpus": 2})
    with pytest.raises(ConfigError, match="set resources.rollout.num_gpus: 2"):
        tiny_config(**{"rollout.engine": "vllm", "rollout.tensor_parallel_size": 2})
    with pytest.raises(ConfigError, match="set resources.evaluate.num_gpus: 2"):  # evaluate builds the same engine
        tiny_config(**{"rollout.engine": "vllm", "rollout.tensor_parallel_size": 2, "resources.rollout.num_gpus": 2})
    cfg = tiny_config(**{"rollout.engine": "vllm", "rollout.tensor_parallel_size": 2, "resources.rollout.num_gpus": 2,
                         "resources.evaluate.num_gpus": 2})
    assert cfg.rollout.tensor_parallel_size == 2
    assert "tensor_parallel_size" not in tiny_config().hashed_view()["rollout"]  # pins made before it stay valid


def test_a_dumped_config_parses_again_and_only_the_update_has_a_strategy(tiny_config):
    """Pools send ``model_dump`` to their actors: every phase's resources then carry the defaults."""
    from verl_tasks.config import parse_config
    from verl_tasks.errors import ConfigError

    cfg = tiny_config(**{"resources.rollout.num_gpus": 1, "resources.update.strategy": "fsdp2",
                         "resources.update.workers": 2})
    again = parse_config(cfg.model_dump(mode="json"))
    assert again.phase_resources("rollout").num_gpus == 1 and again.phase_resources("update").workers == 2
    with pytest.raises(ConfigError, match="strategy, cpu_offload and mixed_precision are the update's"):
        tiny_config(**{"resources.rollout.strategy": "fsdp2"})


def test_every_shipped_experiment_loads():
    """The YAMLs under dags/experiments are what people copy: each one parses and validates as shipped."""
    from verl_tasks.config import load_config

    from .conftest import ROOT

    shipped = sorted((ROOT / "dags" / "experiments").glob("*.yaml"))
    assert {p.name for p in shipped} >= {"tiny_arith.yaml", "smollm2_arith.yaml", "smollm2_arith_vllm.yaml"}
    engines = {p.name: load_config(p).rollout.engine for p in shipped}
    assert engines["smollm2_arith_vllm.yaml"] == "vllm"


def test_names_are_matched_whole_so_a_final_newline_is_refused():
    from verl_tasks.config import check_name
    from verl_tasks.errors import ConfigError

    with pytest.raises(ConfigError, match="invalid experiment name 'victim\\\\n'"):
        check_name("victim\n")
    assert check_name("victim") == "victim"


@pytest.mark.parametrize(("overrides", "message"), [
    ({"algorithm.betas": [-3.0, 0.999]}, r"algorithm.betas \[-3.0, 0.999\]: each must be a number in \[0, 1\)"),
    ({"algorithm.betas": [float("nan"), float("nan")]}, r"each must be a number in \[0, 1\)"),
    ({"algorithm.min_lr_ratio": 1.0}, r"algorithm.min_lr_ratio"),
    ({"algorithm.lr_schedule": "linear", "algorithm.total_steps": 1, "algorithm.warmup_steps": 2},
     r"algorithm.warmup_steps \(2\) exceeds algorithm.total_steps \(1\)"),
    ({"storage.uri": "file://../../.."}, r"storage.uri 'file://../../..' climbs out of a folder"),
])
def test_values_that_cannot_train_well_are_refused_with_the_key(tiny_config, overrides, message):
    from verl_tasks.errors import ConfigError

    uri = overrides.pop("storage.uri", None)
    with pytest.raises(ConfigError, match=message):
        tiny_config(uri, **overrides)


def test_an_unknown_conf_key_is_refused_with_its_likely_spelling(tmp_path):
    from verl_tasks.airflow.runconfig import resolve
    from verl_tasks.errors import ConfigError

    from .conftest import TINY_YAML

    with pytest.raises(ConfigError, match=r"unknown key\(s\) 'experimnet' \(did you mean 'experiment'\?\)"):
        resolve(TINY_YAML, {"experimnet": "mine"})
    with pytest.raises(ConfigError, match=r"invalid experiment name 'victim\\n'"):
        resolve(TINY_YAML, {"experiment": "victim\n"})


@pytest.mark.parametrize("name, pinned", [("tiny_arith", "162c363e05e5f910"), ("smollm2_arith", "71c73b9022c14798")])
def test_the_shipped_experiments_keep_the_config_hash_their_runs_are_pinned_with(name, pinned):
    """A key added to a hashed section must leave existing configs' hashes alone (ADDED_AT_DEFAULT, or out of the
    hash): a changed hash refuses to resume every experiment pinned before it, as runs of these YAMLs are."""
    from .conftest import ROOT

    assert load_config(ROOT / "dags" / "experiments" / f"{name}.yaml").config_hash()[:16] == pinned
