"""Worker pools on a real Ray head with logical GPUs (``ray start --num-gpus 2`` on this CPU machine).

The head and its workers load the test fault hooks (tests/faults), so a rollout can be held
in its middle: that proves two units run at the same time and lets a test cancel one.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.faults import harness_env, hold, release
from verl_tasks.execution import UnitSpec
from verl_tasks.layout import Layout
from verl_tasks.store.units import read_marker

pytestmark = pytest.mark.slow
FAST = {"model.tiny.warm_start_steps": 20, "resources.rollout.idle_release_s": 4}
GPU_ROLLOUT = {"resources.rollout.num_gpus": 1, "resources.rollout.workers": 2}


def wait_until(what: str, probe, timeout_s: float = 240, every: float = 0.2):
    """Poll ``probe`` until truthy; on giving up say what was waited for and what was seen last."""
    deadline, seen = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        seen = probe()
        if seen:
            return seen
        time.sleep(every)
    raise AssertionError(f"gave up waiting for {what} after {timeout_s}s; last seen: {seen!r}")


def join_loopback_head(mp: pytest.MonkeyPatch, info) -> None:
    """Let this (already Ray-importing) test process join a loopback head with token auth.

    Ray reads both settings when it is imported; the CLI sets them before that, a pytest
    process that collected other Ray tests first has to refresh them (Ray's own test helper).
    """
    import ray._private.ray_constants as constants
    from ray._private.authentication_test_utils import reset_auth_token_state

    mp.setenv("RAY_AUTH_MODE", "token")
    mp.setenv("RAY_AUTH_TOKEN_PATH", info.token_file)
    mp.setenv("RAY_TMPDIR", info.tmpdir)
    mp.setattr(constants, "ENABLE_RAY_CLUSTER", False)
    reset_auth_token_state()


@pytest.fixture(scope="module")
def gpu_head(tmp_path_factory):
    """A local head with 4 logical CPUs and 2 logical GPUs; this process joins it as a driver."""
    import ray

    from verl_tasks.execution import local_head, pools
    from verl_tasks.execution.cli_cluster import _free_ports

    plan = tmp_path_factory.mktemp("plan")
    state = tmp_path_factory.mktemp("head")
    os.chmod(state, 0o700)
    port, dashboard = _free_ports()
    with pytest.MonkeyPatch.context() as mp:
        for key, value in harness_env(plan).items():
            mp.setenv(key, value)
        info = local_head.start(state, port=port, dashboard_port=dashboard, num_cpus=4, num_gpus=2)
        join_loopback_head(mp, info)
        pools.ensure_connected(info.gcs_address)
        yield {"info": info, "plan": plan}
        ray.shutdown()
    local_head.stop(state, timeout_s=0)  # at once: with actors alive a SIGTERMed head outlasts the 30 s grace


def _planned(tiny_config, store_uri: str, **extra):
    from verl_tasks.runner import make_context, run_phase

    ctx = make_context(tiny_config(store_uri, **{**FAST, **extra}))
    run_phase(ctx, "plan", 0)  # in this process: pins data and the base snapshot
    return ctx


def test_two_rollout_batches_run_at_once_on_their_own_gpus(gpu_head, tiny_config, tmp_path):
    import ray

    from verl_tasks.execution import pools

    plan = gpu_head["plan"]
    ctx = _planned(tiny_config, f"file://{tmp_path}/store", **GPU_ROLLOUT)
    name = ctx.config.experiment
    held = [hold(plan, name, 0, b) for b in (0, 1)]
    refs = [pools.submit(ctx.config, UnitSpec(name, "rollout", 0, b), None)[0] for b in (0, 1)]
    try:
        wait_until("both rollouts to be in their middle at the same time", lambda: all(p.exists() for p in held))
    finally:
        for b in (0, 1):
            release(plan, name, 0, b)
    results = ray.get(refs, timeout=240)
    assert all(r["ok"] for r in results), results
    gpus = [r["placement"]["gpu_ids"] for r in results]
    assert sorted(g for ids in gpus for g in ids) == ["0", "1"], gpus  # one logical GPU each, different ones
    assert len({r["placement"]["pid"] for r in results}) == 2
    log = "\n".join(line for r in results for line in r["log"])
    assert "model.device=auto: no CUDA device usable here" in log and "computing on the CPU" in log
    # Each worker froze its warm heap (torch, the policy) after its unit: its full GCs skip it.
    assert all(r["frozen_objects"] > 10_000 for r in results), [r["frozen_objects"] for r in results]


def test_a_unit_asking_for_both_gpus_waits_until_they_are_free(gpu_head, tiny_config, tmp_path):
    import ray

    from verl_tasks.execution import pools

    plan = gpu_head["plan"]
    first = _planned(tiny_config, f"file://{tmp_path}/a", **GPU_ROLLOUT)
    name = first.config.experiment
    held = [hold(plan, name, 0, b) for b in (0, 1)]
    rollouts = [pools.submit(first.config, UnitSpec(name, "rollout", 0, b), None)[0] for b in (0, 1)]
    try:
        wait_until("both rollouts to hold a GPU", lambda: all(p.exists() for p in held))
        second = tiny_config(f"file://{tmp_path}/b", **{**FAST, "experiment": "two-gpus", "resources.plan.num_gpus": 2,
                                                        "resources.plan.idle_release_s": 4})  # the GPUs back soon
        wide, _ = pools.submit(second, UnitSpec("two-gpus", "plan", 0), None)
        ready, _ = ray.wait([wide], timeout=3)
        assert not ready, "a unit asking for 2 GPUs started while both were held"
    finally:
        for b in (0, 1):
            release(plan, name, 0, b)
    assert all(r["ok"] for r in ray.get(rollouts, timeout=240))
    result = ray.get(wide, timeout=240)  # placed once the idle rollout workers exit (idle_release_s=4)
    assert result["ok"], result
    assert sorted(result["placement"]["gpu_ids"]) == ["0", "1"]
    assert result["started_at"] >= max(r["finished_at"] for r in ray.get(rollouts))


def test_a_cancelled_unit_stops_and_never_commits(gpu_head, tiny_config, tmp_path):
    """How soon the worker process is gone after the cancel is measured by ``benchmarks/pool_cancel.py``."""
    import ray

    from verl_tasks.execution import pools
    from verl_tasks.store.units import new_attempt_id

    plan = gpu_head["plan"]
    ctx = _planned(tiny_config, f"file://{tmp_path}/store")
    name = ctx.config.experiment
    spec = UnitSpec(name, "rollout", 0, 1)
    held = hold(plan, name, 0, 1)
    doomed = new_attempt_id()
    ref, actor = pools.submit(ctx.config, spec, doomed)
    pid = int(wait_until("the rollout to be in its middle", lambda: held.exists() and held.read_text()))
    pools.cancel_unit(ctx.config, spec, doomed, actor, "cleared in the UI")
    wait_until("the cancelled worker process to be gone", lambda: not Path(f"/proc/{pid}").exists(), timeout_s=120)
    with pytest.raises((ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)):
        ray.get(ref, timeout=60)
    release(plan, name, 0, 1)
    unit = Layout(name).rollout(0, 1)
    assert read_marker(ctx.store, unit) is None
    retried = pools.run_unit(ctx.config, spec, new_attempt_id(), timeout_s=240)
    assert retried["ok"], retried
    record = read_marker(ctx.store, unit)
    assert record.attempt != doomed
    from verl_tasks.errors import AttemptFenced
    from verl_tasks.store.units import UnitWriter

    late = UnitWriter(ctx.store, unit, doomed)  # the killed attempt, had it lived on, cannot commit
    with pytest.raises(AttemptFenced):
        late.commit({})
    assert read_marker(ctx.store, unit).attempt == record.attempt


def test_a_worker_killed_mid_batch_gets_its_units_again_without_spending_a_try(gpu_head, tiny_config, tmp_path):
    """A rollout worker SIGKILLed mid-batch while the next batch waits in its queue: Ray restarts the actor and
    refuses calls until it is back. With no retries to spend, ``run_on_pools`` sends both units again once the
    actor answers, and each batch commits once."""
    import signal
    import threading

    from verl_tasks.execution import pools

    plan = gpu_head["plan"]
    ctx = _planned(tiny_config, f"file://{tmp_path}/store", **{"fault_tolerance.retries": 0})
    name = ctx.config.experiment
    held = hold(plan, name, 0, 0)
    killed: list[int] = []

    def kill_the_holder() -> None:
        try:
            pid = int(wait_until("rollout batch 0 to be in its middle", lambda: held.exists() and held.read_text()))
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        finally:
            release(plan, name, 0, 0)  # never left held: the run below would wait for it for ever

    killer = threading.Thread(target=kill_the_holder, daemon=True)
    killer.start()
    committed = list(pools.run_on_pools(ctx, "rollout", 0, [0, 1]))
    killer.join(timeout=60)
    assert killed, "the held worker was never killed"
    assert sorted(committed) == [0, 1]
    for batch in (0, 1):
        assert read_marker(ctx.store, Layout(name).rollout(0, batch)) is not None


def test_cancelling_a_unit_queued_behind_another_leaves_that_one_running(gpu_head, tiny_config, tmp_path):
    """One actor, two batches: batch 1 waits in the actor's queue while batch 0 runs. Clearing batch 1
    fences it and leaves batch 0 alone (same process, commits); batch 1 never starts its work."""
    import ray

    from verl_tasks.events import read_events
    from verl_tasks.execution import pools
    from verl_tasks.store.units import fence_record, new_attempt_id

    plan = gpu_head["plan"]
    ctx = _planned(tiny_config, f"file://{tmp_path}/store", **{"resources.rollout.workers": 1})
    name = ctx.config.experiment
    held = hold(plan, name, 0, 0)
    running_ref, actor = pools.submit(ctx.config, UnitSpec(name, "rollout", 0, 0), new_attempt_id())
    queued_spec, queued = UnitSpec(name, "rollout", 0, 1), new_attempt_id()
    try:
        pid = int(wait_until("batch 0 to be in its middle", lambda: held.exists() and held.read_text()))
        queued_ref, behind = pools.submit(ctx.config, queued_spec, queued)
        assert behind._actor_id == actor._actor_id, "batch 1 went to another actor: nothing is queued"
        pools.cancel_unit(ctx.config, queued_spec, queued, behind, "cleared in the UI", queued_ref)
    finally:
        release(plan, name, 0, 0)
    result = ray.get(running_ref, timeout=240)
    assert result["ok"] and result["placement"]["pid"] == pid, result
    assert read_marker(ctx.store, Layout(name).rollout(0, 0)) is not None
    try:  # Ray dropped it from the queue, or it reached the actor and refused to start
        refused = ray.get(queued_ref, timeout=240)
        assert not refused["ok"] and refused["error"]["type"] == "AttemptFenced", refused
    except ray.exceptions.TaskCancelledError:
        pass
    unit = Layout(name).rollout(0, 1)
    assert read_marker(ctx.store, unit) is None and fence_record(ctx.store, unit, queued) is not None
    started = [e for e in read_events(ctx.store, ctx.layout) if e["kind"] == "started" and e.get("attempt") == queued]
    assert started == [], started


def test_backend_ray_gives_the_inline_weights(tmp_path):
    """``verl-tasks run --backend ray`` (own local head, started and stopped) = the inline run, byte for byte."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT, small_overrides, write_yaml

    yaml_path = write_yaml(tmp_path, small_overrides(epochs=1, **{"evaluate.max_prompts": 8}))
    shas = {}
    for backend in ("inline", "ray"):
        store = f"file://{tmp_path}/{backend}"
        subprocess.run([sys.executable, "-m", "verl_tasks.cli", "run", str(yaml_path), "--store", store,
                        "--backend", backend], cwd=ROOT, check=True, capture_output=True, text=True, timeout=900)
        out = subprocess.run([sys.executable, "-m", "verl_tasks.cli", "status", str(yaml_path), "--store", store,
                              "--json"], cwd=ROOT, check=True, capture_output=True, text=True)
        shas[backend] = json.loads(out.stdout)["latest_snapshot"]["weights_sha256"]
    assert shas["ray"] == shas["inline"]


def test_a_ray_job_past_its_timeout_is_cancelled_and_the_retry_is_a_new_attempt(gpu_head, tiny_config, tmp_path):
    """The unit's timeout is enforced where it runs (the job's driver), not only by Airflow."""
    from verl_tasks.execution.outcome import parse_result
    from verl_tasks.execution.ray_jobs import RayJobBackend, RayTarget, read_token

    plan, info = gpu_head["plan"], gpu_head["info"]
    ctx = _planned(tiny_config, f"file://{tmp_path}/store", **{"fault_tolerance.timeout_s": {"rollout": 20}})
    name = ctx.config.experiment
    spec = UnitSpec(name, "rollout", 0, 0)
    held = hold(plan, name, 0, 0)
    backend = RayJobBackend(RayTarget(info.address, read_token(info.token_file)))
    first = backend.submit(ctx.config, spec)

    def in_its_middle():
        if held.exists():
            return held.read_text()
        status = backend.status(first.submission_id)
        if status in ("PENDING", "RUNNING"):
            return None
        return f"job {status}: {backend.logs(first.submission_id)[-3000:]}"

    seen = wait_until("the rollout to be in its middle", in_its_middle)
    assert seen.isdigit(), seen
    pid = int(seen)
    assert backend.wait(first.submission_id, timeout_s=180) == "FAILED"
    result = parse_result(backend.logs(first.submission_id))
    assert result["error"]["type"] == "UnitTimeout", result
    wait_until("the hung worker process to be gone", lambda: not Path(f"/proc/{pid}").exists(), timeout_s=30)
    release(plan, name, 0, 0)
    second = backend.submit(ctx.config, spec)
    assert (second.attempt, second.submitted) == (2, True)
    assert backend.wait(second.submission_id, timeout_s=240) == "SUCCEEDED", backend.logs(second.submission_id)[-3000:]
    fenced = [k for k in ctx.store.list(Layout(name).rollout(0, 0)) if "/.fenced/" in k]
    assert len(fenced) == 1 and read_marker(ctx.store, Layout(name).rollout(0, 0)).attempt not in fenced[0]


def _driver_experiment(gpu_head, tmp_path, monkeypatch, name: str):
    """A configured experiment whose tasks use the ray-driver backend: (store URI, task context, operator factory)."""
    from types import SimpleNamespace

    from tests.conftest import small_overrides, write_yaml
    from verl_tasks.airflow.operators import ConfigureExperimentOperator, VerlPhaseOperator

    monkeypatch.setenv("VERL_TASKS_RAY_GCS_ADDRESS", gpu_head["info"].gcs_address)
    store_uri = f"file://{tmp_path}/store"
    yaml_path = write_yaml(tmp_path, small_overrides(**FAST, **{"storage.uri": store_uri}))
    ctx = {"params": {"experiment": name},
           "dag_run": SimpleNamespace(run_type="manual", conf={}, logical_date=None, run_after=None)}

    def operator(phase: str, batch: int | None = None) -> VerlPhaseOperator:
        return VerlPhaseOperator(task_id=phase, config_path=str(yaml_path), phase=phase, epoch=0, batch=batch,
                                 backend="ray-driver", ray_conn_id=None)

    ConfigureExperimentOperator(task_id="configure", config_path=str(yaml_path)).execute(ctx)
    return store_uri, ctx, operator


def test_operator_as_a_ray_driver_runs_its_unit_and_on_kill_stops_it(gpu_head, tmp_path, monkeypatch, capsys):
    """``backend="ray-driver"``: the Airflow task process runs the unit on its pool itself, logs where the
    time went, and ``on_kill`` (what Airflow's clear, mark-failed and timeout call) fences the attempt and
    stops the actor's work; the next try commits as a new attempt. How soon the worker process is gone after
    ``on_kill`` is measured by ``benchmarks/pool_cancel.py``."""
    import json
    import threading

    from verl_tasks.store import open_store
    from verl_tasks.store.units import fence_record

    plan, name = gpu_head["plan"], "driver-op"
    store_uri, ctx, operator = _driver_experiment(gpu_head, tmp_path, monkeypatch, name)
    capsys.readouterr()
    planned = operator("plan").execute(ctx)
    assert planned["unit"] == f"{name}/epochs/00000/plan"
    timings = [json.JSONDecoder().raw_decode(line.split("verl-tasks timing ", 1)[1])[0]
               for line in capsys.readouterr().out.splitlines() if "verl-tasks timing " in line]
    assert [t["unit"] for t in timings] == [planned["unit"]], timings
    assert timings[0]["compute_s"] > 0 and timings[0]["backend"] == "ray-driver", timings
    assert operator("plan").execute(ctx)["attempt"] == planned["attempt"]  # committed: returns from the marker

    held = hold(plan, name, 0, 1)
    doomed = operator("rollout", 1)
    outcome: dict = {}

    def run_task() -> None:
        try:
            outcome["result"] = doomed.execute(ctx)
        except BaseException as err:  # noqa: BLE001 - what the killed task raised
            outcome["error"] = err

    task = threading.Thread(target=run_task, daemon=True)
    task.start()
    pid = int(wait_until("the rollout to be in its middle", lambda: held.exists() and held.read_text()))
    doomed.on_kill()
    wait_until("the killed unit's worker process to be gone", lambda: not Path(f"/proc/{pid}").exists(),
               timeout_s=120)
    task.join(timeout=120)
    assert not task.is_alive() and "error" in outcome and "result" not in outcome, outcome
    release(plan, name, 0, 1)
    store = open_store(store_uri)
    unit = Layout(name).rollout(0, 1)
    attempt = doomed._running.attempt
    assert fence_record(store, unit, attempt) is not None, "the killed attempt was not fenced"
    assert read_marker(store, unit) is None
    retried = operator("rollout", 1).execute(ctx)
    assert retried["attempt"] != attempt and read_marker(store, unit).attempt == retried["attempt"]


def test_a_sharded_engine_worker_holds_its_gpus_as_one_placement_group(gpu_head, tiny_config, tmp_path):
    """``rollout.tensor_parallel_size: 2``: each rollout worker reserves 2 GPUs on one node as a placement group
    (vLLM's shard workers are placed in it), and an idle worker gives them back."""
    import ray
    from ray.util.placement_group import get_placement_group, placement_group_table
    from ray.util.state import list_actors

    from verl_tasks.execution import pools

    try:
        wait_until("both logical GPUs to be free", lambda: ray.available_resources().get("GPU", 0) == 2)
    except AssertionError as err:  # say who holds them
        live = [(a.name, a.state, a.pid) for a in list_actors(filters=[("state", "!=", "DEAD")])]
        raise AssertionError(f"{err}; available {ray.available_resources()}; live actors {live}") from None
    cfg = tiny_config(f"file://{tmp_path}/store", **{"rollout.engine": "vllm", "rollout.tensor_parallel_size": 2,
                                                      "resources.rollout.num_gpus": 2, "resources.evaluate.num_gpus": 2,
                                                      "resources.rollout.idle_release_s": 3})
    shape = pools.PoolShape.for_phase(cfg, "rollout")
    [actor] = pools.pool_actors(shape)
    state = ray.get(actor.state.remote(), timeout=240)
    assert state["gpu_ids"] == []  # the actor holds nothing itself: the group does
    table = placement_group_table(get_placement_group(f"{shape.actor_name(0)}:pg"))
    assert table["strategy"] == "STRICT_PACK" and table["state"] == "CREATED", table
    assert list(table["bundles"].values()) == [{"GPU": 1.0, "CPU": 0.5}] * 2, table
    assert ray.available_resources().get("GPU", 0) == 0
    wait_until("the idle worker to give both GPUs back", lambda: ray.available_resources().get("GPU", 0) == 2,
               timeout_s=120)
    with pytest.raises(ValueError):
        get_placement_group(f"{shape.actor_name(0)}:pg")


def test_airflows_execution_timeout_stops_a_ray_driver_unit(gpu_head, tmp_path, monkeypatch):
    """Airflow enforces ``execution_timeout`` with SIGALRM around ``execute``: the wait on the pool is
    interrupted, the attempt fenced and the actor's work stopped; the next try commits."""
    from airflow.sdk.exceptions import AirflowTaskTimeout
    from airflow.sdk.execution_time.timeout import timeout

    from verl_tasks.store import open_store
    from verl_tasks.store.units import fence_record

    plan, name = gpu_head["plan"], "driver-timeout"
    store_uri, ctx, operator = _driver_experiment(gpu_head, tmp_path, monkeypatch, name)
    operator("plan").execute(ctx)
    held = hold(plan, name, 0, 0)
    doomed = operator("rollout", 0)
    started = time.monotonic()
    with pytest.raises(AirflowTaskTimeout):
        with timeout(20):  # what the task runner wraps execute in
            doomed.execute(ctx)
    waited = time.monotonic() - started
    pid = int(held.read_text())
    wait_until("the timed-out unit's worker process to be gone", lambda: not Path(f"/proc/{pid}").exists(),
               timeout_s=5)
    assert waited < 60, f"execute returned {waited:.1f}s after a 20 s timeout"
    release(plan, name, 0, 0)
    store = open_store(store_uri)
    unit = Layout(name).rollout(0, 0)
    assert fence_record(store, unit, doomed._running.attempt) is not None
    assert read_marker(store, unit) is None
    retried = operator("rollout", 0).execute(ctx)
    assert read_marker(store, unit).attempt == retried["attempt"] != doomed._running.attempt


def test_a_unit_cancelled_before_it_reached_an_actor_is_fenced_all_the_same(tiny_config, tmp_path):
    """Airflow may kill the task between the attempt id and the call reaching a worker: with no actor
    to kill, the fence alone must stop the unit that may be on its way."""
    from verl_tasks.execution import driver
    from verl_tasks.store import open_store
    from verl_tasks.store.units import fence_record, new_attempt_id

    config = tiny_config(f"file://{tmp_path}/store")
    running = driver.Running(config, UnitSpec(config.experiment, "rollout", 0, 1), new_attempt_id())
    driver.cancel(running, "the Airflow task was killed (clear, mark failed or timeout)")
    unit = Layout(config.experiment).rollout(0, 1)
    assert running.cancelled and fence_record(open_store(config.storage.uri), unit, running.attempt) is not None


def test_a_ray_driver_cancel_fences_through_the_tasks_own_store(tiny_config, tmp_path, monkeypatch):
    """The Airflow task reaches the store with its connection's credentials, which the environment of
    its process need not hold: the fence goes through the task's store, never one built anew."""
    from verl_tasks import store as store_module
    from verl_tasks.execution import driver
    from verl_tasks.store import open_store
    from verl_tasks.store.units import fence_record

    config = tiny_config(f"file://{tmp_path}/store")
    tasks_store = open_store(config.storage.uri)

    def no_credentials(*args, **kwargs):
        raise PermissionError("no S3 credentials in this process's environment")

    monkeypatch.setattr(store_module, "store_for", no_credentials)
    running = driver.start(config, UnitSpec(config.experiment, "rollout", 0, 1), tasks_store)
    driver.cancel(running, "marked failed in the UI")
    unit = Layout(config.experiment).rollout(0, 1)
    assert fence_record(tasks_store, unit, running.attempt) is not None


def test_two_stores_of_one_experiment_name_get_their_own_pool_actors(tiny_config, tmp_path):
    """Staging and production running one experiment name on one cluster: one deployment's units must
    not queue behind (or be cancelled with) the other's on a shared actor."""
    from verl_tasks.execution.pool_shape import PoolShape

    staging = PoolShape.for_phase(tiny_config(f"file://{tmp_path}/staging"), "rollout")
    production = PoolShape.for_phase(tiny_config(f"file://{tmp_path}/production"), "rollout")
    again = PoolShape.for_phase(tiny_config(f"file://{tmp_path}/staging/"), "rollout")  # the same store
    assert staging.actor_name(0) != production.actor_name(0)
    assert staging.actor_name(0) == again.actor_name(0)
