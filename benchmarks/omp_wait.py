"""Several torch processes on one node's cores: OpenMP threads that spin against threads that sleep.

    .venv/bin/python benchmarks/omp_wait.py [--processes 3] [--steps 300] [--rounds 2] [--output BENCHMARKS.md]

Starts ``--processes`` processes at once, each training the tiny experiment's warm start for ``--steps``
steps on its configured torch threads (``torch_threads``: 2), with ``OMP_WAIT_POLICY`` unset (OpenMP's
default: a thread spins for a while after each parallel region) and with ``PASSIVE`` (what verl-tasks' own
processes and the local Ray head set, ``verl_tasks/quiet.py``), alternating, ``--rounds`` times each; then one
process alone each way. Reports the wall time of the group, the median process's training time and the CPU
seconds the group used. The section between this script's markers in ``--output`` is replaced.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OWNER = "benchmarks/omp_wait.py"


def child(steps: int) -> None:
    """One warm start in this process; prints one JSON line."""
    import torch

    from verl_tasks.config import load_config
    from verl_tasks.models.tiny import build_tokenizer, warm_start

    with tempfile.TemporaryDirectory() as store:
        config = load_config(ROOT / "dags" / "experiments" / "tiny_arith.yaml",
                             {"storage.uri": f"file://{store}", "model.tiny.warm_start_steps": steps})
    torch.set_num_threads(config.torch_threads)
    started = time.perf_counter()
    warm_start(config.model.tiny, config.seed, build_tokenizer())
    print(json.dumps({"train_s": time.perf_counter() - started, "threads": config.torch_threads}))


def group(processes: int, steps: int, policy: str | None) -> dict:
    """``processes`` children at once under ``policy``: wall time, their training times, CPU seconds used."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, "--child", "--steps", str(steps)], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    outs = [p.communicate()[0] for p in procs]
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if any(p.returncode for p in procs):
        raise SystemExit(f"a child failed: {[p.returncode for p in procs]}")
    runs = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "train_s": [r["train_s"] for r in runs], "cpu_s": cpu, "threads": runs[0]["threads"]}


def markdown(results: dict, processes: int, steps: int, rounds: int, command: str) -> str:
    from benchmarks.run import provenance

    lines = [
        "## Torch processes sharing a node's cores: OpenMP threads spinning or sleeping",
        "",
        provenance(command),
        "",
        f"Each process trains the tiny experiment's warm start ({steps} steps, "
        f"{results[(processes, None)][0]['threads']} torch threads, `dags/experiments/tiny_arith.yaml`). "
        f"{processes} processes start at once, or one alone; `OMP_WAIT_POLICY` unset (OpenMP's default: a thread "
        "spins after each parallel region) or `PASSIVE` (what verl-tasks' own processes and the local Ray head "
        f"set, `verl_tasks/quiet.py`), alternating, {rounds} rounds each; medians over the rounds. CPU: user and "
        "system seconds of all the processes together.",
        "",
        "| processes | OMP_WAIT_POLICY | wall of the group (s) | one process's training (s, median) | CPU (s) |",
        "|---:|---|---:|---:|---:|",
    ]
    for count in (processes, 1):
        for policy in (None, "PASSIVE"):
            runs = results[(count, policy)]
            lines.append(f"| {count} | {policy or 'unset'} | {statistics.median(r['wall_s'] for r in runs):.1f} | "
                         f"{statistics.median(t for r in runs for t in r['train_s']):.1f} | "
                         f"{statistics.median(r['cpu_s'] for r in runs):.1f} |")
    spin, sleep = (statistics.median(r["wall_s"] for r in results[(processes, p)]) for p in (None, "PASSIVE"))
    lines += ["", f"With {processes} processes the group finishes {spin / sleep:.1f}x sooner when the threads sleep."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.steps)
        return
    from benchmarks.run import write_section

    results: dict = {}
    for _ in range(args.rounds):
        for count in (args.processes, 1):
            for policy in (None, "PASSIVE"):
                results.setdefault((count, policy), []).append(group(count, args.steps, policy))
    command = "python benchmarks/omp_wait.py" + "".join(
        f" --{name} {value}" for name, value, default in (("processes", args.processes, 3), ("steps", args.steps, 300),
                                                          ("rounds", args.rounds, 2)) if value != default)
    text = markdown(results, args.processes, args.steps, args.rounds, command)
    write_section(args.output, text, OWNER)
    print(text)


if __name__ == "__main__":
    main()
