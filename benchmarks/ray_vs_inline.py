"""The same experiment inline and on Ray worker pools: wall time side by side, and the final weights.

    .venv/bin/python benchmarks/ray_vs_inline.py [--epochs 8] [--repeats 1] [--json out.json]

Each repeat runs ``verl-tasks run dags/experiments/tiny_arith.yaml`` once inline and once with
``--backend ray`` (which starts a local head, runs every unit on the pools and stops the head:
all of that is in its time), each into a fresh store, alternately. The warm-start cache is
shared and built before timing, so both measure the RL epochs only.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "dags" / "experiments" / "tiny_arith.yaml"


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "verl_tasks.cli", *args], cwd=ROOT, check=True,
                          capture_output=True, text=True)


def timed_run(store: str, epochs: int, backend: str) -> tuple[float, str]:
    started = time.monotonic()
    cli("run", str(CONFIG), "--store", store, "--epochs", str(epochs), "--backend", backend)
    took = time.monotonic() - started
    status = json.loads(cli("status", str(CONFIG), "--store", store, "--json").stdout)
    return took, status["latest_snapshot"]["weights_sha256"]


def run_events(store: str) -> list[dict]:
    from verl_tasks.config import load_config
    from verl_tasks.events import read_events
    from verl_tasks.layout import Layout
    from verl_tasks.store import open_store

    return read_events(open_store(store), Layout(load_config(CONFIG).experiment))


def policy_loads(events: list[dict]) -> dict[str, float]:
    """From the run's events: policy loads in all, and the most of one version in one process."""
    loads = [e for e in events if e.get("kind") == "policy_loaded"]
    per_process_version = Counter((e.get("host"), e.get("pid"), e.get("version")) for e in loads)
    return {"loads": len(loads), "processes": len({(e.get("host"), e.get("pid")) for e in loads}),
            "max_per_process_and_version": max(per_process_version.values(), default=0)}


def first_validate_s(events: list[dict]) -> float | None:
    """The first epoch's validate unit, from its ``committed`` event: the gate's cost in a fresh process."""
    return next((round(e["duration_s"], 3) for e in events
                 if e.get("kind") == "committed" and e.get("phase") == "validate"), None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"inline": [], "ray": []}
    loads: dict[str, dict[str, float]] = {}
    first_validate: dict[str, list[float]] = {"inline": [], "ray": []}
    shas: set[str] = set()
    with tempfile.TemporaryDirectory() as tmp:
        cli("run", str(CONFIG), "--store", f"file://{tmp}/warm", "--epochs", "1")  # builds the warm-start cache
        for i in range(args.repeats):
            for backend in ("inline", "ray"):
                took, sha = timed_run(f"file://{tmp}/{backend}-{i}", args.epochs, backend)
                times[backend].append(took)
                shas.add(sha)
                events = run_events(f"file://{tmp}/{backend}-{i}")
                loads[backend] = policy_loads(events)
                first_validate[backend].append(first_validate_s(events))
    result = {"epochs": args.epochs, "inline_s": round(statistics.median(times["inline"]), 1),
              "ray_s": round(statistics.median(times["ray"]), 1),
              "runs_s": {k: [round(t, 1) for t in v] for k, v in times.items()}, "same_weights": len(shas) == 1,
              "policy_loads": loads, "first_validate_s": {k: statistics.median(v) for k, v in first_validate.items()},
              "load_average": open("/proc/loadavg").read().split()[:3]}
    result["ratio"] = round(result["ray_s"] / result["inline_s"], 2)
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
