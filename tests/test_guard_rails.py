"""Guard rails on training: a trimmed experiment must set its learning rate, and held-out accuracy that stays
below the base's is said in status, on the Training page's data and as an event."""
from __future__ import annotations

import pytest
import yaml

from verl_tasks.config import load_config
from verl_tasks.errors import ConfigError
from verl_tasks.events import read_events
from verl_tasks.runner import make_context, status, train
from verl_tasks.status import accuracy_regression

from .conftest import TINY_YAML, small_overrides, write_yaml


def test_an_experiment_without_a_learning_rate_is_refused_naming_the_key(tmp_path):
    raw = yaml.safe_load(TINY_YAML.read_text())
    del raw["algorithm"]["lr"]
    (tmp_path / "trimmed.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"algorithm\.lr is not set.*set algorithm\.lr"):
        load_config(tmp_path / "trimmed.yaml")


def test_a_regression_is_two_evaluations_in_a_row_below_the_base_by_the_margin():
    assert accuracy_regression(0.5, [(0, 0.40), (1, 0.42)], 0.05)["epochs"] == [(0, 0.40), (1, 0.42)]
    assert accuracy_regression(0.5, [(0, 0.40), (1, 0.47), (2, 0.30)], 0.05) is None  # not in a row
    assert accuracy_regression(0.5, [(0, 0.46), (1, 0.44)], 0.05) is None  # within the margin
    assert accuracy_regression(0.5, [(0, 0.40), (1, None), (2, 0.30)], 0.05)["epochs"] == [(0, 0.40), (2, 0.30)]
    assert accuracy_regression(None, [(0, 0.1), (1, 0.1)], 0.05) is None  # no base evaluation yet


def test_a_rate_that_unlearns_the_task_is_warned_about_in_status_and_the_event_log(tmp_path):
    # the gate would stop the collapsing policy before its second evaluation; the warning is under test here
    overrides = {**small_overrides(), "epochs": 2, "algorithm.lr": 0.05, "model.tiny.warm_start_steps": 600,
                 "quality.min_nonempty_response_fraction": 0.0,
                 "storage.uri": f"file://{tmp_path}/store"}
    ctx = make_context(load_config(write_yaml(tmp_path, overrides)))
    result = train(ctx, 2)
    accuracies = [row["metrics"]["eval_accuracy"] for row in result["epochs"]]
    base = result["base"]["metrics"]["eval_accuracy"]
    assert all(a < base - 0.05 for a in accuracies), (base, accuracies)  # the rate is far too high
    warning = [w for w in status(ctx.config, ctx.store)["warnings"] if "two evaluations in a row" in w]
    assert len(warning) == 1 and "algorithm.lr (0.05)" in warning[0], warning
    events = [e for e in read_events(ctx.store, ctx.layout) if e["kind"] == "accuracy_regression"]
    assert [e["epoch"] for e in events] == [1], events
