"""`verl-tasks status` and `verl-tasks metrics` on stores of many committed epochs; written into BENCHMARKS.md.

    .venv/bin/python benchmarks/status_cpu.py [--epochs 10 200] [--batches 4] [--repeats 5] [--output BENCHMARKS.md]

For each ``--epochs`` a store is fabricated (``tests/test_metrics.py::fabricate``: every unit committed
with a real marker and a ``committed`` event, tiny files, no training). Then the installed console
script runs ``status`` and ``metrics`` on it, and, for scale, ``status`` in an interpreter that has
imported torch first (``import verl_tasks.runner``, what a torch-importing ``status`` would pay).
The commands take turns within each round, so they see the same load. Per command: the median wall
time and the median CPU time (user + system of the child, the figure that depends least on the load).
``tests/test_metrics.py`` checks what the commands print and that neither imports torch; this script
only measures.
"""
from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CLI = Path(sys.executable).parent / "verl-tasks"
OWNER = "benchmarks/status_cpu.py"
WITH_TORCH = "import sys, verl_tasks.runner; from verl_tasks.cli import main; sys.argv[0] = 'verl-tasks'; main()"


def fabricated(folder: Path, epochs: int, batches: int) -> Path:
    """A YAML naming a store with ``epochs`` committed epochs of ``batches`` batches."""
    from tests.conftest import write_yaml
    from tests.test_metrics import fabricate
    from verl_tasks.config import load_config

    folder.mkdir(parents=True)
    path = write_yaml(folder, {"epochs": epochs, "rollout.batches_per_epoch": batches,
                               "storage.uri": f"file://{folder}/store"})
    fabricate(load_config(path), epochs)
    return path


def commands(yaml: Path) -> dict[str, list[str]]:
    return {
        "verl-tasks status": [str(CLI), "status", str(yaml)],
        "verl-tasks metrics": [str(CLI), "metrics", str(yaml)],
        "status, torch imported first": [sys.executable, "-c", WITH_TORCH, "status", str(yaml)],
    }


def run_once(argv: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600, cwd=ROOT)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure(yaml: Path, repeats: int) -> dict[str, dict[str, float]]:
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in commands(yaml)}
    order = list(commands(yaml).items())
    for i in range(repeats):
        for name, argv in order if i % 2 == 0 else order[::-1]:
            runs[name].append(run_once(argv))
    return {name: {"wall_s": statistics.median(w for w, _ in times), "cpu_s": statistics.median(c for _, c in times)}
            for name, times in runs.items()}


def markdown(rows: list[tuple[int, int, int, dict]], repeats: int, command: str) -> str:
    lines = [
        "## `verl-tasks status` and `verl-tasks metrics` on many committed epochs",
        "",
        f"Produced by `{command}` on {platform.machine()} with {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d', time.gmtime())}. Fabricated stores "
        "(every unit committed with a real marker and a `committed` event, tiny files); the installed console "
        f"script, imports included; the commands take turns, {repeats} rounds, medians. CPU is user + system "
        "time of the command's process, the figure that depends least on the machine's load. The last row of "
        "each store is the same `status` in an interpreter that imported torch first, for scale.",
        "",
        "| store | command | wall (s) | CPU (s) |",
        "|---|---|---:|---:|",
    ]
    for epochs, batches, units, results in rows:
        store = f"{epochs} epochs x {batches} batches ({units:,} committed units)"
        for name, r in results.items():
            lines.append(f"| {store} | {name} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, nargs="+", default=[10, 200])
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md")
    args = parser.parse_args()
    from benchmarks.run import write_section

    rows = []
    with tempfile.TemporaryDirectory(prefix="vt-status-bench-") as tmp:
        for epochs in args.epochs:
            yaml = fabricated(Path(tmp) / f"e{epochs}", epochs, args.batches)
            store = Path(tmp) / f"e{epochs}" / "store"
            units = sum(1 for _ in store.rglob("_SUCCESS"))
            print(f"{epochs} epochs fabricated ({units} units); measuring", file=sys.stderr, flush=True)
            rows.append((epochs, args.batches, units, measure(yaml, args.repeats)))
    command = " ".join([".venv/bin/python benchmarks/status_cpu.py", *sys.argv[1:]])
    text = markdown(rows, args.repeats, command)
    print(text)
    write_section(args.output, text, OWNER)


if __name__ == "__main__":
    main()
