"""The deployment, not the experiment, decides how far the reward sandbox may be widened: an experiment that
asks for a weaker isolation or larger limits than the machine's environment allows is refused before the
sandbox starts, naming the key, the bound and the variable that sets it."""
from __future__ import annotations

import pytest

from verl_tasks.config import load_config
from verl_tasks.errors import ConfigError
from verl_tasks.rewards import deployment
from verl_tasks.rewards.sandbox import RewardSandbox, preflight

from .conftest import TINY_YAML

BUILTIN = "verl_tasks.rewards.builtin:exact_answer"


@pytest.fixture(autouse=True)
def default_deployment(monkeypatch):
    for name in (deployment.ISOLATIONS_ENV, deployment.MAX_MEMORY_ENV, deployment.MAX_PROCESSES_ENV,
                 deployment.MAX_TIMEOUT_ENV):
        monkeypatch.delenv(name, raising=False)


def test_an_experiment_cannot_switch_the_sandbox_off_unless_the_deployment_allows_it(monkeypatch, tmp_path):
    config = load_config(TINY_YAML, {"rewards.isolation": "process", "storage.uri": f"file://{tmp_path}/s"})
    with pytest.raises(ConfigError, match=r"rewards.isolation 'process' is not allowed on this machine.*"
                                          r"VERL_TASKS_REWARD_ISOLATIONS"):
        preflight(config.rewards)  # what `verl-tasks run` and the DAG's configure do before any compute
    monkeypatch.setenv(deployment.ISOLATIONS_ENV, "namespaces,process")
    with RewardSandbox(BUILTIN, 5.0, 512, isolation="process") as box:
        assert box.score([{"id": "s", "data_source": "t", "solution_str": "4", "ground_truth": "4",
                           "extra_info": {}}], default=0.0).scores == [1.0]


@pytest.mark.parametrize(("key", "kwargs", "env"), [
    ("memory_limit_mb", {"memory_limit_mb": 100_000_000}, deployment.MAX_MEMORY_ENV),
    ("max_processes", {"max_processes": 100_000_000}, deployment.MAX_PROCESSES_ENV),
    ("timeout_s", {"timeout_s": 1e300}, deployment.MAX_TIMEOUT_ENV),
    ("cpu_limit_s", {"cpu_limit_s": 10_000.0}, deployment.MAX_TIMEOUT_ENV),
])
def test_limits_beyond_the_deployments_bounds_are_refused_before_the_sandbox_starts(key, kwargs, env):
    settings = {"timeout_s": 5.0, "memory_limit_mb": 512, **kwargs}
    box = RewardSandbox(BUILTIN, settings.pop("timeout_s"), settings.pop("memory_limit_mb"), **settings)
    with pytest.raises(ConfigError, match=rf"rewards\.{key} is .*above this deployment's bound.*{env}"):
        box.start()
    assert box.proc is None


def test_an_operator_raises_a_bound_in_the_environment_and_a_malformed_one_is_refused(monkeypatch):
    monkeypatch.setenv(deployment.MAX_MEMORY_ENV, "8192")
    assert deployment.bounds().max_memory_mb == 8192
    deployment.check_allowed(isolation="namespaces", memory_limit_mb=8000, max_processes=8, timeout_s=5.0,
                             cpu_limit_s=None)
    monkeypatch.setenv(deployment.MAX_MEMORY_ENV, "lots")
    with pytest.raises(ConfigError, match="VERL_TASKS_REWARD_MAX_MEMORY_MB='lots' is not a number"):
        deployment.bounds()
