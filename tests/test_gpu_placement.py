"""Placement decisions for GPU clusters that need no GPU to check: which pools hold placement groups, which
settings are refused before any compute, and where a vLLM engine is built from."""
from __future__ import annotations

import pytest

from verl_tasks.errors import ConfigError
from verl_tasks.execution.pool_shape import PoolShape
from verl_tasks.models.engines import EngineOptions
from verl_tasks.models.vllm_engine import build_view_path

SHARDED = {"rollout.engine": "vllm", "rollout.tensor_parallel_size": 2, "resources.rollout.num_gpus": 2,
           "resources.evaluate.num_gpus": 2}


def test_evaluate_holds_its_sharded_engines_gpus_as_a_placement_group_like_rollout(tiny_config):
    config = tiny_config(**SHARDED)
    assert PoolShape.for_phase(config, "rollout").gpu_bundles == 2
    assert PoolShape.for_phase(config, "evaluate").gpu_bundles == 2
    assert PoolShape.for_phase(config, "update").gpu_bundles == 0


def test_a_sharded_engine_without_its_gpus_in_evaluate_is_refused_naming_the_key(tiny_config):
    with pytest.raises(ConfigError, match=r"resources\.evaluate\.num_gpus: 2"):
        tiny_config(**{**SHARDED, "resources.evaluate.num_gpus": 0})


def test_an_engine_is_built_from_the_same_path_for_the_same_architecture_options_and_worker():
    """vLLM keys its compile cache by the model's path: a rebuild of the same engine in the same worker (a
    restarted actor keeps its name) reads the same path; other options or another worker, another one."""
    options = EngineOptions(dtype="bfloat16", max_model_len=256)
    key = ('{"model_type": "llama"}', options)
    assert build_view_path(key, "vt:exp:rollout:abc:0") == build_view_path(key, "vt:exp:rollout:abc:0")
    assert build_view_path(key, "vt:exp:rollout:abc:0") != build_view_path(key, "vt:exp:rollout:abc:1")
    other = ('{"model_type": "llama"}', EngineOptions(dtype="bfloat16", max_model_len=512))
    assert build_view_path(key, "vt:exp:rollout:abc:0") != build_view_path(other, "vt:exp:rollout:abc:0")
