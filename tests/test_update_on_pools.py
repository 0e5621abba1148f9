"""The update on the Ray backend: its pool actor drives the resident worker group without holding what it needs."""
from __future__ import annotations

import os

import pytest

from tests.conftest import ROOT
from tests.test_pools import join_loopback_head
from verl_tasks.execution import UnitSpec
from verl_tasks.execution.pools import PoolShape
from verl_tasks.store.units import read_marker

OVERRIDES = {"rewards.function": "tests.reward_fixtures:shared_characters", "model.tiny.warm_start_steps": 20,
             "resources.update.workers": 2}


def test_a_distributed_update_pool_is_one_actor_without_gpus(tiny_config):
    config = tiny_config(**{"resources.update.workers": 4, "resources.update.num_gpus": 1,
                            "resources.update.memory_mb": 4096, "resources.update.custom": {"a100": 1}})
    shape = PoolShape.for_phase(config, "update")
    assert (shape.workers, shape.num_gpus, shape.memory_mb, shape.custom) == (1, 0, None, ())
    one = PoolShape.for_phase(tiny_config(**{"resources.update.num_gpus": 1}), "update")
    assert (one.workers, one.num_gpus) == (1, 1)  # one ddp worker computes in the pool actor itself


def test_without_pools_a_job_that_drives_a_group_reserves_no_gpu(tiny_config):
    """VERL_TASKS_POOLS=0: the unit's job entrypoint reserves the phase's resources, except the GPUs and memory
    of a distributed update's or critic's workers (they reserve their own); with pools it reserves nothing."""
    from verl_tasks.execution.ray_jobs import entrypoint_resources

    gpus = {"resources.update.num_gpus": 1, "resources.update.memory_mb": 4096, "resources.critic.num_gpus": 1,
            "algorithm.adv_estimator": "gae", "critic": {"lr": 1e-4}}
    one = tiny_config(**gpus)
    assert entrypoint_resources(one, "update", pool=False) == {
        "entrypoint_num_cpus": 1, "entrypoint_num_gpus": 1, "entrypoint_memory": 4096 * 1024 * 1024}
    assert entrypoint_resources(one, "critic", pool=False)["entrypoint_num_gpus"] == 1
    grouped = tiny_config(**gpus, **{"resources.update.workers": 2, "resources.critic.workers": 2})
    for phase in ("update", "critic"):
        assert entrypoint_resources(grouped, phase, pool=False) == {
            "entrypoint_num_cpus": 1, "entrypoint_num_gpus": 0, "entrypoint_memory": None}
        assert entrypoint_resources(grouped, phase, pool=True)["entrypoint_num_gpus"] == 0


@pytest.mark.slow
def test_the_update_pool_actor_runs_two_resident_workers_on_a_head_just_big_enough(tiny_config, tmp_path_factory):
    """3 logical CPUs: the driver actor takes one, the two workers the others; the unit commits."""
    import ray

    from verl_tasks.execution import local_head, pools
    from verl_tasks.execution.cli_cluster import _free_ports
    from verl_tasks.runner import epoch_units, make_context, run_phase

    state = tmp_path_factory.mktemp("head")
    os.chmod(state, 0o700)
    port, dashboard = _free_ports()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        info = local_head.start(state, port=port, dashboard_port=dashboard, num_cpus=3)
        try:
            join_loopback_head(mp, info)
            pools.ensure_connected(info.gcs_address)
            ctx = make_context(tiny_config(**OVERRIDES))
            for phase, batch in epoch_units(ctx, 0, ctx.config.epochs):
                if phase == "update":
                    break
                run_phase(ctx, phase, 0, batch)
            result = pools.run_unit(ctx.config, UnitSpec(ctx.config.experiment, "update", 0), None,
                                    timeout_s=600)
        finally:
            ray.shutdown()
            local_head.stop(state)
    assert result["ok"], result
    assert result["placement"]["gpu_ids"] == []
    assert any("2 workers (ddp, gloo)" in line and "formed" in line for line in result["log"]), result["log"]
    assert any("on 2 resident workers (ddp" in line for line in result["log"]), result["log"]
    meta = read_marker(ctx.store, ctx.layout.update(0)).meta
    assert (meta["update_workers"], meta["update_strategy"]) == (2, "ddp")
