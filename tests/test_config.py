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


def test_changed_hyperparameter_under_same_name_is_refused(tmp_path):
    store = open_store(f"file://{tmp_path}")
    first = parse_config(raw())
    pin_experiment(PhaseContext(first, store))
    changed = parse_config(raw(), {"algorithm.lr": 0.5, "rollout.temperature": 0.7, "epochs": 20})
    with pytest.raises(ConfigMismatch) as err:
        pin_experiment(PhaseContext(changed, store))
    assert err.value.differing_keys == ["algorithm.lr", "rollout.temperature"]  # epochs may change
    assert "new experiment name" in str(err.value)
    renamed = parse_config(raw(), {"algorithm.lr": 0.5, "experiment": "tiny-arith-lr05"})
    pin_experiment(PhaseContext(renamed, store))
