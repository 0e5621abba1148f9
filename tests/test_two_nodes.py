"""Beyond one machine, simulated on this one: a head and a second raylet that joins it (``ray start
--address``, as every worker node of a real cluster does), each offering one rollout slot and one
trainer slot (custom resources). The experiment asks each rollout worker and each of the update's
two DDP workers (the resident group) for one slot, so Ray has to spread them over both nodes; the run must
then end with the weights the same experiment gets on the head alone.

Where things ran is read from what the run leaves behind: the rollout pool's workers say their node,
the units' ``started`` events name the worker process, and the update's workers record
their node through the test hooks (``tests/faults``).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.faults import harness_env, record_update_nodes
from tests.test_pools import join_loopback_head, wait_until

SLOTS = {"rollout_slot": 1, "train_slot": 1}  # what each node offers
RUN = {"epochs": 1, "data.train_size": 64, "data.eval_size": 8, "model.tiny.warm_start_steps": 20,
       "evaluate.max_prompts": 8,
       "rewards.function": "tests.reward_fixtures:shared_characters",
       "resources.rollout.workers": 2, "resources.rollout.idle_release_s": 600, "resources.update.workers": 2}
SPREAD = {"resources.rollout.custom": {"rollout_slot": 1}, "resources.update.custom": {"train_slot": 1}}
RUN_TIMEOUT_S = 300


# What ``ray start --address=... --block`` does for a worker node, minus its rewrite of a loopback
# address to the machine's routable one (the head's GCS listens on loopback only): one raylet joining
# the head until a signal ends this process (its reaper then ends the node's processes).
NODE = """
import json, signal, sys
from ray._private.node import Node
from ray._private.parameter import RayParams
Node(RayParams(**json.loads(sys.argv[1])), head=False, shutdown_at_exit=True, spawn_reaper=True)
signal.pause()
"""


@contextmanager
def second_node(info, log_file: Path) -> Iterator[subprocess.Popen]:
    """A raylet on this machine joining the head with the same slots and 2 CPUs, in its own session
    (killed as a whole on exit). It shares the head's temp folder and token; its fixed ports are its own."""
    from verl_tasks.execution.cli_cluster import _free_ports

    _, agent = _free_ports()
    params = {"gcs_address": info.gcs_address, "node_ip_address": "127.0.0.1", "num_cpus": 2, "num_gpus": 0,
              "resources": SLOTS, "include_log_monitor": False, "dashboard_agent_listen_port": agent + 1,
              "metrics_agent_port": agent + 2, "metrics_export_port": agent + 3, "runtime_env_agent_port": agent + 4}
    env = {**os.environ, **info.client_env(), **info.driver_env(), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    with open(log_file, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-c", NODE, json.dumps(params)], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the node drains (its workers are gone by then), then stops
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        try:  # what is left of its session (raylet, agents, workers): only that group
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _alive_nodes() -> list[dict[str, Any]]:
    import ray

    return [node for node in ray.nodes() if node["Alive"]]


def _train_on_pools(ctx, what: str) -> dict[str, Any]:
    """``runner.train`` on the pools, waited on while it runs; on giving up, say which units it committed
    and what the cluster had left (an actor Ray cannot place waits forever)."""
    import ray

    from verl_tasks.events import read_events
    from verl_tasks.execution import pools
    from verl_tasks.runner import train

    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["status"] = train(ctx, ctx.config.epochs, run_units=pools.run_on_pools)
        except BaseException as err:  # noqa: BLE001 - raised in the test's thread below
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(RUN_TIMEOUT_S)
    if thread.is_alive():
        events = [(e["kind"], e.get("unit"), e.get("pid")) for e in read_events(ctx.store, ctx.layout)]
        raise AssertionError(f"gave up waiting for {what} after {RUN_TIMEOUT_S}s; its last events: {events[-12:]}; "
                             f"free on the cluster: {ray.available_resources()}")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["status"]


def test_the_pools_and_a_ddp_update_span_two_nodes_and_give_the_one_node_weights(tiny_config, tmp_path):
    import ray

    from verl_tasks.events import read_events
    from verl_tasks.execution import local_head, pools
    from verl_tasks.execution.cli_cluster import _free_ports
    from verl_tasks.execution.pool_shape import PoolShape
    from verl_tasks.runner import make_context
    from verl_tasks.store.units import read_marker

    plan = tmp_path / "plan"
    plan.mkdir()
    state = local_head.private_dir(tmp_path / "ray-head")
    port, dashboard = _free_ports()
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    with pytest.MonkeyPatch.context() as mp, ExitStack() as stack:
        for key, value in harness_env(plan, {"PYTHONPATH": pythonpath}).items():
            mp.setenv(key, value)  # both nodes' workers import the tests' reward function and hooks
        info = local_head.start(state, port=port, dashboard_port=dashboard, num_cpus=8, resources=SLOTS,
                                dashboard=False)
        stack.callback(local_head.stop, state, 0)
        join_loopback_head(mp, info)
        pools.ensure_connected(info.gcs_address)
        stack.callback(ray.shutdown)

        alone = make_context(tiny_config(f"file://{tmp_path}/one-node", **RUN))
        name = alone.config.experiment
        stack.callback(pools.release_experiment, name)
        one_node = _train_on_pools(alone, "the run on the head alone")
        assert len(_alive_nodes()) == 1
        pools.release_experiment(name)  # its workers' CPUs back; the second run has its own store, hence workers

        node = stack.enter_context(second_node(info, tmp_path / "second-node.log"))

        def joined() -> list[dict[str, Any]] | None:
            if node.poll() is not None:
                raise AssertionError(f"the second node exited ({node.returncode}): "
                                     f"{(tmp_path / 'second-node.log').read_text()[-3000:]}")
            nodes = _alive_nodes()
            return nodes if len(nodes) == 2 else None

        nodes = wait_until("the second node to join the head", joined, timeout_s=120)
        head = next(n["NodeID"] for n in nodes if "node:__internal_head__" in n["Resources"])
        other = next(n["NodeID"] for n in nodes if n["NodeID"] != head)
        update_rank = record_update_nodes(plan, name, 0)
        spread = make_context(tiny_config(f"file://{tmp_path}/two-nodes", **RUN, **SPREAD))
        two_nodes = _train_on_pools(spread, "the run spread over two nodes")

        rollout_workers = ray.get([actor.state.remote() for actor in
                                   pools.pool_actors(PoolShape.for_phase(spread.config, "rollout"))], timeout=60)
        rollouts = [e for e in read_events(spread.store, spread.layout)
                    if e["kind"] == "started" and e["phase"] == "rollout"]
        ranks = [json.loads(update_rank(rank).read_text()) for rank in (0, 1)]
        update_meta = read_marker(spread.store, spread.layout.update(0)).meta

    seen = f"rollout workers {rollout_workers}; rollout units {rollouts}; update ranks {ranks}; head {head}"
    assert sorted(w["node"] for w in rollout_workers) == sorted([head, other]), seen
    assert rollouts and {e["pid"] for e in rollouts} <= {w["pid"] for w in rollout_workers}, seen
    assert sorted(r["node"] for r in ranks) == sorted([head, other]), seen
    assert (update_meta["update_workers"], update_meta["update_strategy"]) == (2, "ddp")
    assert two_nodes["latest_snapshot"]["weights_sha256"] == one_node["latest_snapshot"]["weights_sha256"]
