"""A soak: the tiny experiment for many epochs on Ray worker pools with faults injected every few epochs; the
resident workers' memory, open files and threads per epoch, and the final weights against a fault-free run.

    .venv/bin/python benchmarks/soak.py [--epochs 200] [--fault-every 7] [--seed 1] [--output BENCHMARKS.md]

The faulty run trains on the pools of a local Ray head (4 logical CPUs), driven from this process the way
Airflow's ``ray-driver`` backend drives them (``pools.run_on_pools``), with the test fault hooks
(``tests/faults``) on the head's workers. Every ``--fault-every`` epochs (seeded) one fault, in turn:
a rollout worker SIGKILLed in the middle of a batch (only before ``WARM_EPOCH``, so the growth is measured
over processes that live from there to the end), a unit failing once, a store write failing once. The
fault-free reference trains the same config inline (pools and inline give the same bytes). After each
epoch the resident pool workers (the shared ``cpu`` pool and the ``gate``) are measured: RSS, open file
descriptors, threads. Reported: the final weights' sha256 of both runs, each fault and its epoch, the
measures at ``WARM_EPOCH`` and at the end and their growth, and epoch times.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "dags" / "experiments" / "tiny_arith.yaml"
OWNER = "benchmarks/soak.py"
WARM_EPOCH = 20  # growth is measured from here to the end
SMALL = {"data.train_size": 400, "data.eval_size": 40, "rollout.batches_per_epoch": 2, "rollout.prompts_per_batch": 8,
         "algorithm.group_size": 4, "algorithm.minibatch_size": 32, "evaluate.every": 10, "evaluate.max_prompts": 40,
         "model.tiny.warm_start_steps": 300, "fault_tolerance.retry_delay_s": 0.5}
KINDS = ("kill a rollout worker mid-batch", "a unit fails once", "a store write fails once")


def config(store: Path, experiment: str, epochs: int):
    from verl_tasks.config import load_config

    return load_config(CONFIG, {**SMALL, "experiment": experiment, "epochs": epochs, "storage.uri": f"file://{store}"})


def plan_faults(epochs: int, every: int, seed: int) -> dict[int, str]:
    """Epoch -> the fault injected in it: one every ``every`` epochs (jittered, seeded), kinds in turn; kills
    only before ``WARM_EPOCH``."""
    rng = random.Random(seed)
    faults: dict[int, str] = {}
    epoch, turn = max(1, every // 2), 0
    while epoch < epochs:
        kind = KINDS[turn % len(KINDS)]
        if kind == KINDS[0] and epoch >= WARM_EPOCH:
            kind = KINDS[1 + turn % 2]
        faults[epoch] = kind
        turn += 1
        epoch += max(1, every + rng.randint(-1, 1))
    return faults


def resident(experiment: str) -> dict[str, dict[str, float]]:
    """RSS (MiB), open file descriptors and threads of each live resident pool worker of ``experiment``."""
    import psutil
    import ray

    from verl_tasks.execution.pool_shape import NAMESPACE, PREFIX

    out = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"] if isinstance(entry, dict) else entry
        kind = name.split(":")[2] if name.startswith(f"{PREFIX}{experiment}:") else None
        if kind not in ("cpu", "gate"):
            continue
        try:
            pid = ray.get(ray.get_actor(name, namespace=NAMESPACE).state.remote(), timeout=30)["pid"]
            proc = psutil.Process(pid)
            out[kind] = {"pid": pid, "rss_mib": proc.memory_info().rss / 2**20, "fds": proc.num_fds(),
                         "threads": proc.num_threads()}
        except Exception:  # noqa: BLE001 - restarting: measured next epoch
            continue
    return out


def killer(plan: Path, experiment: str, epoch: int, batch: int, killed: list[int]) -> threading.Thread:
    """Hold rollout ``batch`` of ``epoch`` in its middle, SIGKILL the worker holding it, then let go."""
    import signal

    from tests import faults

    held = faults.hold(plan, experiment, epoch, batch)

    def run() -> None:
        deadline = time.monotonic() + 600
        while not held.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if held.exists():
            pid = int(held.read_text())
            killed.append(pid)
            os.kill(pid, signal.SIGKILL)
        faults.release(plan, experiment, epoch, batch)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def soak(epochs: int, every: int, seed: int, work: Path) -> dict[str, Any]:
    """Run the faulty soak and its reference; returns what the report shows."""
    from tests import faults
    from verl_tasks.execution import local_head
    from verl_tasks.execution.cli_cluster import _connect_when_ready, _free_ports
    from verl_tasks.runner import make_context, train

    name = "soak"
    reference = make_context(config(work / "reference", name, epochs))
    started = time.monotonic()
    want = train(reference, epochs)["latest_snapshot"]["weights_sha256"]
    reference_s = time.monotonic() - started
    plan = work / "plan"
    plan.mkdir()
    os.environ.update(faults.harness_env(plan))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ["PYTHONPATH"]) if p)
    state = work / "head"
    state.mkdir(mode=0o700)
    port, dashboard = _free_ports()
    info = local_head.start(state, port=port, dashboard_port=dashboard, num_cpus=4, dashboard=False)
    os.environ.update(info.client_env(), **info.driver_env())  # read by Ray when it is imported, just below
    already = "ray" in sys.modules
    import ray

    if already:  # a process that imported Ray before (a test session): refresh what Ray read at its import
        import ray._private.ray_constants as constants
        from ray._private.authentication_test_utils import reset_auth_token_state

        constants.ENABLE_RAY_CLUSTER = False
        reset_auth_token_state()

    from verl_tasks.execution import pools

    planned = plan_faults(epochs, every, seed)
    injected: list[dict[str, Any]] = []
    per_epoch: list[dict[str, Any]] = []
    killed: list[int] = []
    try:
        _connect_when_ready(pools, info.gcs_address)
        ctx = make_context(config(work / "soak", name, epochs))
        rng = random.Random(seed)
        threads: list[threading.Thread] = []
        epoch_started = [time.monotonic()]

        def arm(epoch: int) -> None:
            kind = planned.get(epoch)
            if kind is None:
                return
            batch = rng.randrange(ctx.config.rollout.batches_per_epoch)
            if kind == KINDS[0]:
                threads.append(killer(plan, name, epoch, batch, killed))
            elif kind == KINDS[1]:
                faults.fail_once(plan, name, rng.choice(["rollout", "score"]), epoch, batch)
            else:
                faults.store_fails_once(plan, name, rng.choice(["update", "snapshot", "validate"]), epoch)
            injected.append({"epoch": epoch, "fault": kind})

        arm(0)

        def after_unit(phase: str, epoch: int, batch: int | None) -> None:
            last = "evaluate" if ctx.config.should_evaluate(epoch, epochs) else "snapshot"
            if phase != last:
                return
            per_epoch.append({"epoch": epoch, "s": round(time.monotonic() - epoch_started[0], 2),
                              "workers": resident(name)})
            epoch_started[0] = time.monotonic()
            arm(epoch + 1)

        got = train(ctx, epochs, after_unit, pools.run_on_pools)["latest_snapshot"]["weights_sha256"]
        for thread in threads:
            thread.join(timeout=60)
        pools.release_experiment(name)
    finally:
        ray.shutdown()
        local_head.stop(state)
    fired = {p.name for p in plan.iterdir() if p.suffix in (".failed", ".killed")}
    return {"epochs": epochs, "reference_sha": want, "soak_sha": got, "same_weights": want == got,
            "reference_s": round(reference_s, 1), "faults": injected, "fired": sorted(fired), "killed": killed,
            "per_epoch": per_epoch}


def growth(result: dict[str, Any], kind: str = "cpu") -> dict[str, dict[str, float]]:
    """Each measure of the ``kind`` worker at ``WARM_EPOCH`` (or the first epoch measured after it) and at the
    end, and the end's ratio to it."""
    rows = [r for r in result["per_epoch"] if kind in r["workers"]]
    start = next((r for r in rows if r["epoch"] >= min(WARM_EPOCH, result["epochs"] // 3)), rows[0])
    end = rows[-1]
    return {key: {"at": start["workers"][kind][key], "end": end["workers"][kind][key],
                  "ratio": end["workers"][kind][key] / max(1e-9, start["workers"][kind][key])}
            for key in ("rss_mib", "fds", "threads")} | {"from_epoch": start["epoch"], "to_epoch": end["epoch"]}


def markdown(result: dict[str, Any], command: str) -> str:
    from benchmarks.run import provenance

    grown = growth(result)
    times = [r["s"] for r in result["per_epoch"]]
    sampled = [r for r in result["per_epoch"] if r["epoch"] in {0, 10, WARM_EPOCH} or r["epoch"] % 25 == 0
               or r["epoch"] == result["epochs"] - 1]
    lines = [
        "## A soak: the tiny experiment for many epochs on Ray pools, with faults",
        "",
        provenance(command),
        "",
        f"{result['epochs']} epochs of a small tiny-arith config (2 batches of 8 prompts x 4 samples) on the pools of "
        "a local Ray head, driven as Airflow's ray-driver backend drives them, with a fault every few epochs "
        f"({len(result['faults'])} in all: "
        + ", ".join(f"{sum(f['fault'] == k for f in result['faults'])} x {k}" for k in KINDS)
        + f"). Final weights: soak `{result['soak_sha'][:16]}`, fault-free inline run `{result['reference_sha'][:16]}` "
        f"({'the same' if result['same_weights'] else 'DIFFERENT'}). Epoch time median "
        f"{statistics.median(times):.2f} s (faulty epochs included).",
        "",
        f"The resident `cpu` pool worker from epoch {grown['from_epoch']} to epoch {grown['to_epoch']}: RSS "
        f"{grown['rss_mib']['at']:.0f} -> {grown['rss_mib']['end']:.0f} MiB ({grown['rss_mib']['ratio']:.3f}x), open "
        f"files {grown['fds']['at']:.0f} -> {grown['fds']['end']:.0f} ({grown['fds']['ratio']:.3f}x), threads "
        f"{grown['threads']['at']:.0f} -> {grown['threads']['end']:.0f} ({grown['threads']['ratio']:.3f}x).",
        "",
        "| epoch | epoch s | cpu worker RSS MiB | open files | threads | gate worker RSS MiB |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sampled:
        cpu, gate = r["workers"].get("cpu", {}), r["workers"].get("gate", {})
        lines.append(f"| {r['epoch']} | {r['s']:.2f} | {cpu.get('rss_mib', float('nan')):.0f} | {cpu.get('fds', '')} "
                     f"| {cpu.get('threads', '')} | {gate.get('rss_mib', float('nan')):.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--fault-every", type=int, default=7)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md")
    args = parser.parse_args()
    import logging

    from benchmarks.run import write_section

    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="vt-soak-") as tmp:
        result = soak(args.epochs, args.fault_every, args.seed, Path(tmp))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    text = markdown(result, " ".join([".venv/bin/python benchmarks/soak.py", *sys.argv[1:]]))
    print(text)
    write_section(args.output, text, OWNER)


if __name__ == "__main__":
    main()
