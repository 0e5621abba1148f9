"""How long each DAG file under dags/ takes to parse, as a DAG processor parses it; written into BENCHMARKS.md.

    .venv/bin/python benchmarks/dag_parse.py [--repeats 5] [--output BENCHMARKS.md]

Each measurement is a fresh interpreter that imports Airflow first (a DAG processor has it loaded),
then times ``runpy.run_path`` of one DAG file on its own. The files take turns within each round,
so they see the same load. Medians and maxima over ``--repeats`` rounds, with the whole process's wall
time beside them, and whether the file imported torch or ray (``tests/airflow/test_dagbag.py``
asserts it imports neither; this script only reports).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DAGS = ROOT / "dags"
OWNER = "benchmarks/dag_parse.py"

PROBE = """
import json, runpy, sys, time
import airflow.sdk
from airflow.sdk import DAG, Asset, Param, TaskGroup, BaseOperator
started = time.perf_counter()
runpy.run_path(sys.argv[1])
took = time.perf_counter() - started
print(json.dumps({"parse_s": took, "torch": "torch" in sys.modules, "ray": "ray" in sys.modules}))
"""


def dag_files() -> list[Path]:
    return sorted(p for p in DAGS.glob("*.py") if not p.name.startswith("_"))


def parse_once(path: Path) -> dict:
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    took = time.perf_counter() - started
    if out.returncode != 0:
        raise SystemExit(f"{path.name} failed to parse:\n{out.stderr[-3000:]}")
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "process_s": took}


def measure(repeats: int) -> dict[str, list[dict]]:
    files = dag_files()
    runs: dict[str, list[dict]] = {p.name: [] for p in files}
    for i in range(repeats):
        for path in files if i % 2 == 0 else files[::-1]:
            runs[path.name].append(parse_once(path))
        print(f"round {i + 1}/{repeats} done", file=sys.stderr, flush=True)
    return runs


def markdown(runs: dict[str, list[dict]], repeats: int, command: str) -> str:
    lines = [
        "## DAG file parse time",
        "",
        f"Produced by `{command}` on {platform.machine()} with {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d', time.gmtime())}. Each DAG file under "
        f"`dags/` in a fresh interpreter that has imported Airflow first (as a DAG processor has), the file's own "
        f"`runpy.run_path` timed; the files take turns, {repeats} rounds, medians.",
        "",
        "| DAG file | parse (s, median) | parse (s, max) | whole process (s, median) | imports torch | imports ray |",
        "|---|---:|---:|---:|---|---|",
    ]
    for name, results in runs.items():
        parse = [r["parse_s"] for r in results]
        process = [r["process_s"] for r in results]
        torch = "yes" if any(r["torch"] for r in results) else "no"
        ray = "yes" if any(r["ray"] for r in results) else "no"
        lines.append(f"| `{name}` | {statistics.median(parse):.3f} | {max(parse):.3f} | "
                     f"{statistics.median(process):.2f} | {torch} | {ray} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md")
    args = parser.parse_args()
    from benchmarks.run import write_section

    runs = measure(args.repeats)
    command = " ".join([".venv/bin/python benchmarks/dag_parse.py", *sys.argv[1:]])
    text = markdown(runs, args.repeats, command)
    print(text)
    write_section(args.output, text, OWNER)


if __name__ == "__main__":
    main()
