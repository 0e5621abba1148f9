"""One GPU for a whole epoch: rollout, update and evaluate asking for a GPU each share one pool when the
cluster has fewer GPUs than their separate pools would hold, and the vLLM engine gives the GPU to the
trainer and takes it back in order. Logical GPUs and the CPU engine here: the placement and the call
order are real; what sleeping frees on CUDA is not exercised (docs/gpu.md)."""
from __future__ import annotations

import os

import pytest

from tests.conftest import ROOT
from tests.test_pools import join_loopback_head
from verl_tasks.errors import ConfigError
from verl_tasks.execution.pool_shape import GPU_KIND, PoolShape, gpu_sharing_phases

ONE_GPU_EACH = {"resources.rollout.num_gpus": 1, "resources.update.num_gpus": 1, "resources.evaluate.num_gpus": 1}


def test_gpu_phases_share_a_pool_only_when_the_cluster_lacks_gpus_for_separate_ones(tiny_config):
    config = tiny_config(**ONE_GPU_EACH)
    assert gpu_sharing_phases(config, 1.0) == ("rollout", "update", "evaluate")
    assert gpu_sharing_phases(config, 3.0) == () and gpu_sharing_phases(config, None) == ()
    shared = {PoolShape.for_phase(config, phase, 1.0) for phase in ("rollout", "update", "evaluate")}
    assert len(shared) == 1 and next(iter(shared)).kind == GPU_KIND and next(iter(shared)).num_gpus == 1
    assert PoolShape.for_phase(config, "score", 1.0).kind == "cpu"
    assert gpu_sharing_phases(tiny_config(**ONE_GPU_EACH, **{"placement.gpu_phases": "separate"}), 1.0) == ()
    assert gpu_sharing_phases(tiny_config(**ONE_GPU_EACH, **{"placement.gpu_phases": "shared"}), 8.0) != ()
    distributed = tiny_config(**ONE_GPU_EACH, **{"resources.update.workers": 2})
    assert gpu_sharing_phases(distributed, 1.0) == ("rollout", "evaluate")  # its workers stay its own


def test_a_critic_on_a_worker_group_keeps_its_gpus_out_of_the_shared_pool(tiny_config):
    """``resources.critic.workers: 2``: the critic's pool is one driver actor holding no GPU (its two workers
    reserve theirs, like a distributed update's), it shares no pool, and the head's CPU count covers the workers."""
    from verl_tasks.execution.pool_shape import cpus_for

    ppo = {**ONE_GPU_EACH, "algorithm.adv_estimator": "gae", "critic": {"lr": 1e-4}, "resources.critic.num_gpus": 1}
    one = tiny_config(**ppo)
    assert gpu_sharing_phases(one, 1.0) == ("rollout", "critic", "update", "evaluate")
    grouped = tiny_config(**ppo, **{"resources.critic.workers": 2})
    assert gpu_sharing_phases(grouped, 1.0) == ("rollout", "update", "evaluate")
    driver = PoolShape.for_phase(grouped, "critic", 1.0)
    assert (driver.workers, driver.num_gpus, driver.kind) == (1, 0, "critic")
    # The driver takes the one-process critic's CPU; its two workers add theirs.
    assert cpus_for(grouped) == cpus_for(one) + 2 * grouped.phase_resources("critic").num_cpus


def test_fractional_gpus_that_cannot_hold_their_engines_are_refused_before_any_compute(tiny_config):
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization to 0\.45 or less"):
        tiny_config(**{"rollout.engine": "vllm", "resources.rollout.num_gpus": 0.5})
    tiny_config(**{"rollout.engine": "vllm", "resources.rollout.num_gpus": 0.5,
                   "rollout.gpu_memory_utilization": 0.4})


@pytest.fixture(scope="module")
def one_gpu_head(tmp_path_factory):
    """A local head with 1 logical GPU (4 CPUs); this process joins it as a driver."""
    import ray

    from verl_tasks.execution import local_head, pools
    from verl_tasks.execution.cli_cluster import _free_ports

    state = tmp_path_factory.mktemp("head")
    os.chmod(state, 0o700)
    port, dashboard = _free_ports()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        info = local_head.start(state, port=port, dashboard_port=dashboard, num_cpus=4, num_gpus=1, dashboard=False)
        join_loopback_head(mp, info)
        pools.ensure_connected(info.gcs_address)
        yield info
        ray.shutdown()
    local_head.stop(state, timeout_s=0)  # at once: with actors alive a SIGTERMed head outlasts the 30 s grace


@pytest.mark.slow
def test_an_epoch_on_one_gpu_runs_in_one_actor_and_the_engine_yields_to_the_trainer(one_gpu_head, tiny_config):
    from verl_tasks.events import read_events
    from verl_tasks.execution import pools
    from verl_tasks.runner import make_context, train

    ctx = make_context(tiny_config(**ONE_GPU_EACH, **{
        "epochs": 1, "rollout.engine": "vllm", "rollout.batches_per_epoch": 1, "evaluate.max_prompts": 8,
        "model.tiny.warm_start_steps": 20, "algorithm.minibatch_size": 32}))
    train(ctx, 1, run_units=pools.run_on_pools)
    events = read_events(ctx.store, ctx.layout)
    started = {e["phase"]: e["pid"] for e in events if e["kind"] == "started" and e.get("phase")}
    assert started["rollout"] == started["update"] == started["evaluate"], started  # one actor, one GPU
    assert started["score"] != started["rollout"]  # the CPU phases keep their own pool

    def first(kind: str, **match) -> int:
        return next(i for i, e in enumerate(events) if e["kind"] == kind and all(e.get(k) == v
                                                                                 for k, v in match.items()))

    built = first("engine_loaded", how="built")
    to_update = first("gpu_handoff", to="update")
    committed = first("committed", phase="update")
    to_engine = first("gpu_handoff", to="engine")
    evaluated = first("engine_loaded", version=1)
    assert built < to_update < committed < to_engine < evaluated, [e["kind"] for e in events]
    assert events[to_update]["engine"] == "cpu" and events[to_engine]["trainer_released"] is False
