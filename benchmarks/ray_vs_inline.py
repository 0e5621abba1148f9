"""The same experiment inline and on Ray worker pools: wall time side by side, and the final weights.

    .venv/bin/python benchmarks/ray_vs_inline.py [--epochs 8] [--repeats 3] [--json out.json] [--output BENCHMARKS.md]

Each repeat runs ``verl-tasks run dags/experiments/tiny_arith.yaml`` once inline and once with
``--backend ray`` (which starts a local head, runs every unit on the pools and stops the head:
all of that is in its time), each into a fresh store, alternately. The warm-start cache is
shared and built before timing, so both measure the RL epochs only. The section between this
script's markers in ``--output`` is replaced.
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
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "dags" / "experiments" / "tiny_arith.yaml"
OWNER = "benchmarks/ray_vs_inline.py"


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


def markdown(result: dict, repeats: int, command: str) -> str:
    from benchmarks.run import provenance

    lines = [
        "## The tiny experiment inline and on Ray worker pools",
        "",
        provenance(command),
        "",
        f"`verl-tasks run dags/experiments/tiny_arith.yaml --epochs {result['epochs']}`, inline and with "
        "`--backend ray` (a local head without dashboard, started and stopped by the command: its start-up, "
        "the pool actors' start-up and every unit's round trip are in the time), alternately, "
        f"{repeats} runs each, each into a fresh store; the warm-start cache is built first and shared. "
        "Policy loads are the runs' `policy_loaded` events (in all, the processes that loaded, and the most "
        "loads of one version in one process); the first validate is the first epoch's validate unit "
        "(`committed` event), where the quality gate's import shows.",
        "",
        "| backend | runs (s) | median (s) | policy loads (processes; most of one version in one process) "
        "| first validate (s) |",
        "|---|---|---:|---|---:|",
    ]
    for backend in ("inline", "ray"):
        loads = result["policy_loads"][backend]
        lines.append(f"| {'inline' if backend == 'inline' else 'ray (pools)'} | "
                     f"{', '.join(f'{t:.1f}' for t in result['runs_s'][backend])} | {result[backend + '_s']:.1f} | "
                     f"{loads['loads']} ({loads['processes']}; {loads['max_per_process_and_version']}) | "
                     f"{result['first_validate_s'][backend]:.2f} |")
    lines += ["", f"Ray / inline: **{result['ratio']:.2f}x**. Final `weights_sha256` "
              + ("the same in every run." if result["same_weights"] else "NOT the same in every run.")]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md")
    args = parser.parse_args()
    from benchmarks.run import write_section

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
                print(f"run {i + 1}/{args.repeats} {backend}: {took:.1f} s", file=sys.stderr, flush=True)
    result = {"epochs": args.epochs, "inline_s": round(statistics.median(times["inline"]), 1),
              "ray_s": round(statistics.median(times["ray"]), 1),
              "runs_s": {k: [round(t, 1) for t in v] for k, v in times.items()}, "same_weights": len(shas) == 1,
              "policy_loads": loads, "first_validate_s": {k: statistics.median(v) for k, v in first_validate.items()}}
    result["ratio"] = round(result["ray_s"] / result["inline_s"], 2)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    text = markdown(result, args.repeats, " ".join([".venv/bin/python benchmarks/ray_vs_inline.py", *sys.argv[1:]]))
    print(text)
    write_section(args.output, text, OWNER)


if __name__ == "__main__":
    main()
