"""How soon a stopped unit's worker process is gone on a Ray worker pool; written into BENCHMARKS.md.

    .venv/bin/python benchmarks/pool_cancel.py [--repeats 5] [--output BENCHMARKS.md]

A local Ray head (its own state folder, ports and ``RAY_TMPDIR``, token auth, 4 logical CPUs and 2
logical GPUs, as in ``tests/test_pools.py``; stopped at the end) runs with the test fault hooks
(``tests/faults``), so a rollout can be held in its middle: after loading the policy it writes its
PID and waits. Two ways of stopping that running unit take turns in each round:

* ``pools.cancel_unit``: what the dispatcher calls when a unit is cancelled or times out;
* ``VerlPhaseOperator.on_kill``: the ``ray-driver`` backend's task, ``execute`` running in a thread,
  killed as Airflow's clear, mark-failed and ``execution_timeout`` do.

The clock starts at the call. Timed: the call's return, and the moment the held worker's process is
gone (``/proc/<pid>``, polled every 5 ms). The restart of the killed actor and the next unit's start
are not timed. ``tests/test_pools.py`` checks that the process goes and the attempt never commits;
this script only measures (and stops if a stopped attempt committed).
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OWNER = "benchmarks/pool_cancel.py"
FAST = {"model.tiny.warm_start_steps": 20, "resources.rollout.idle_release_s": 4}
BATCH = 1  # the held rollout batch; a stopped attempt never commits, so every round reuses it
WAIT_S = 300


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def held_pid(held: Path, ref=None) -> int | None:
    """The PID the held rollout wrote, once it is in its middle; None if ``ref`` found its actor restarting."""
    import ray

    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if held.exists() and held.read_text().strip():
            return int(held.read_text())
        if ref is not None and ray.wait([ref], timeout=0)[0]:
            try:
                result = ray.get(ref)
            except ray.exceptions.ActorUnavailableError:  # killed by the previous round, not back yet
                return None
            raise SystemExit(f"the unit ended before it was held: {result}")
        time.sleep(0.05)
    raise SystemExit(f"the rollout was not held within {WAIT_S} s")


def gone_after(pid: int, started: float) -> float:
    """Seconds from ``started`` until process ``pid`` is gone."""
    deadline = time.monotonic() + WAIT_S
    while Path(f"/proc/{pid}").exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"worker process {pid} still there {WAIT_S} s after it was stopped")
        time.sleep(0.005)
    return time.perf_counter() - started


def start_head(stack: ExitStack, plan: Path, work: Path) -> None:
    """A loopback head with the fault hooks; this process joins it as a driver."""
    from tests.faults import harness_env

    os.environ.update(harness_env(plan))
    os.environ.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="token")  # read when ray is imported
    from verl_tasks.execution import local_head
    from verl_tasks.execution.cli_cluster import _connect_when_ready, _free_ports

    state = Path(tempfile.mkdtemp(prefix="vt-cancel-head-"))
    os.chmod(state, 0o700)
    port, dashboard = _free_ports()
    stack.callback(shutil.rmtree, state, True)
    stack.callback(shutil.rmtree, f"/tmp/vt-ray-{port}", True)
    stack.callback(local_head.stop, state)
    started = time.monotonic()
    info = local_head.start(state, port=port, dashboard_port=dashboard, num_cpus=4, num_gpus=2, cwd=work,
                            dashboard=False)
    say(f"head pid {info.pid} at {info.gcs_address} (ready in {time.monotonic() - started:.1f} s)")
    os.environ.update(info.client_env(), **info.driver_env())
    import ray

    from verl_tasks.execution import pools

    _connect_when_ready(pools, info.gcs_address)
    stack.callback(ray.shutdown)


class ByCancel:
    """``pools.cancel_unit`` of a rollout the dispatcher sent to its pool."""

    name = "`pools.cancel_unit`"

    def __init__(self, yaml: Path, plan: Path):
        from verl_tasks.config import load_config
        from verl_tasks.runner import make_context, run_phase

        self.ctx = make_context(load_config(yaml, {"experiment": "bench-cancel"}))
        run_phase(self.ctx, "plan", 0)  # in this process: pins data and the base snapshot
        self.plan = plan

    def once(self) -> tuple[float, float]:
        import ray

        from tests.faults import hold, release
        from verl_tasks.execution import UnitSpec, pools
        from verl_tasks.store.units import new_attempt_id, read_marker

        cfg = self.ctx.config
        spec = UnitSpec(cfg.experiment, "rollout", 0, BATCH)
        held = hold(self.plan, cfg.experiment, 0, BATCH)
        for _ in range(int(WAIT_S / 0.2)):  # sent again while Ray restarts the actor, as the dispatcher does
            attempt = new_attempt_id()
            ref, actor = pools.submit(cfg, spec, attempt)
            pid = held_pid(held, ref)
            if pid is not None:
                break
            time.sleep(0.2)
        else:
            raise SystemExit(f"the pool's actor was not back within {WAIT_S} s")
        started = time.perf_counter()
        pools.cancel_unit(cfg, spec, attempt, actor, "benchmarks/pool_cancel.py")
        returned = time.perf_counter() - started
        gone = gone_after(pid, started)
        try:
            ray.get(ref, timeout=120)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            pass
        release(self.plan, cfg.experiment, 0, BATCH)
        if read_marker(self.ctx.store, self.ctx.layout.rollout(0, BATCH)) is not None:
            raise SystemExit("a cancelled attempt committed")
        return returned, gone


class ByOnKill:
    """``on_kill`` of a ``ray-driver`` task whose ``execute`` runs in a thread."""

    name = "`VerlPhaseOperator.on_kill` (`ray-driver`)"
    experiment = "bench-on-kill"

    def __init__(self, yaml: Path, plan: Path):
        from verl_tasks.airflow.operators import ConfigureExperimentOperator

        self.yaml, self.plan = yaml, plan
        self.context = {"params": {"experiment": self.experiment},
                        "dag_run": SimpleNamespace(run_type="manual", conf={}, logical_date=None, run_after=None)}
        ConfigureExperimentOperator(task_id="configure", config_path=str(yaml)).execute(self.context)
        self.operator("plan").execute(self.context)

    def operator(self, phase: str, batch: int | None = None):
        from verl_tasks.airflow.operators import VerlPhaseOperator

        return VerlPhaseOperator(task_id=phase, config_path=str(self.yaml), phase=phase, epoch=0, batch=batch,
                                 backend="ray-driver", ray_conn_id=None)

    def once(self) -> tuple[float, float]:
        from tests.faults import hold, release

        held = hold(self.plan, self.experiment, 0, BATCH)
        doomed = self.operator("rollout", BATCH)
        outcome: dict = {}

        def run_task() -> None:
            try:
                outcome["result"] = doomed.execute(self.context)
            except BaseException as err:  # noqa: BLE001 - what the killed task raised
                outcome["error"] = err

        task = threading.Thread(target=run_task, daemon=True)
        task.start()
        pid = held_pid(held)
        assert pid is not None
        started = time.perf_counter()
        doomed.on_kill()
        returned = time.perf_counter() - started
        gone = gone_after(pid, started)
        task.join(timeout=120)
        release(self.plan, self.experiment, 0, BATCH)
        if "result" in outcome:
            raise SystemExit(f"a killed task returned a result: {outcome['result']}")
        return returned, gone


def markdown(runs: dict[str, list[tuple[float, float]]], repeats: int, command: str) -> str:
    lines = [
        "## Stopping a running unit on a Ray worker pool",
        "",
        f"Produced by `{command}` on {platform.machine()} with {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d', time.gmtime())}. A tiny experiment's "
        "rollout held in its middle (policy loaded) on a local Ray head, then stopped; the clock starts at the "
        f"call. The two ways take turns, {repeats} rounds, medians (max in brackets).",
        "",
        "| stopped by | call returned (s) | worker process gone (s) |",
        "|---|---:|---:|",
    ]
    for name, times in runs.items():
        returned, gone = [r for r, _ in times], [g for _, g in times]
        lines.append(f"| {name} | {statistics.median(returned):.2f} ({max(returned):.2f}) | "
                     f"{statistics.median(gone):.2f} ({max(gone):.2f}) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md")
    args = parser.parse_args()
    from benchmarks.run import write_section
    from tests.conftest import small_overrides, write_yaml

    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="vt-cancel-bench-")))
        plan = work / "plan"
        plan.mkdir()
        yaml = write_yaml(work, small_overrides(**FAST, **{"storage.uri": f"file://{work}/store"}))
        start_head(stack, plan, work)
        ways = [ByCancel(yaml, plan), ByOnKill(yaml, plan)]
        from verl_tasks.execution import pools

        for experiment in ("bench-cancel", ByOnKill.experiment):  # their actors first: the head then stops at once
            stack.callback(pools.release_experiment, experiment)
        runs: dict[str, list[tuple[float, float]]] = {way.name: [] for way in ways}
        for i in range(args.repeats):
            for way in ways if i % 2 == 0 else ways[::-1]:
                runs[way.name].append(way.once())
            say(f"round {i + 1}/{args.repeats}: " + "; ".join(f"{n} {t[-1][1]:.2f} s" for n, t in runs.items()))
    command = " ".join([".venv/bin/python benchmarks/pool_cancel.py", *sys.argv[1:]])
    text = markdown(runs, args.repeats, command)
    print(text)
    write_section(args.output, text, OWNER)


if __name__ == "__main__":
    main()
