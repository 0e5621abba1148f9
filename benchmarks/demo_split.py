"""Where an Airflow task's time goes: Airflow scheduling, the task's store calls, Ray submission,
queueing, the unit's compute and the way back, per task of one DAG run.

    python benchmarks/demo_split.py --db .airflow/airflow.db --log .airflow/demo-dags-test.log [--markdown]
    .venv/bin/python benchmarks/demo_split.py [--epochs 8] [--output BENCHMARKS.md]

With ``--db`` and ``--log`` (what ``scripts/demo.sh`` runs at its end) it prints the split of that
run. Without them it measures ``make demo``: it runs ``bash scripts/demo.sh`` (what ``make demo``
runs after its install step) in a fresh temporary Airflow home, store and Ray head state folder,
on free ports, after building the warm-start cache (untimed), and writes the demo's wall time, its
DAG run, the split and the held-out accuracy into the section between this script's markers in
``--output``.

Reads the task instances of the latest run of the DAG from Airflow's SQLite metadata DB and
the ``verl-tasks timing {...}`` line each unit's task logs (see ``VerlPhaseOperator``). Built for
``airflow dags test`` (what ``make demo`` runs), where tasks run one after another, so a task's
*scheduling* time is the gap between the previous task's end and its start. *Airflow task* is the
rest of the task's own duration outside the parts the operator measured (process and context
set-up, XCom, state updates). *Outside compute* = everything but the unit's compute.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OWNER = "benchmarks/demo_split.py"
CONFIG = ROOT / "dags" / "experiments" / "tiny_arith.yaml"
PARTS = ("scheduling_s", "airflow_task_s", "store_s", "connect_s", "submit_s", "queue_s", "compute_s", "return_s")
MARK = "verl-tasks timing "


def task_instances(db: Path, dag_id: str) -> list[dict]:
    """The latest run's task instances that ran, in start order."""
    with sqlite3.connect(db) as conn:
        run_id = conn.execute("SELECT run_id FROM dag_run WHERE dag_id=? ORDER BY id DESC LIMIT 1",
                              (dag_id,)).fetchone()
        if run_id is None:
            raise SystemExit(f"no run of {dag_id} in {db}")
        rows = conn.execute("SELECT task_id, map_index, start_date, end_date, state FROM task_instance "
                            "WHERE dag_id=? AND run_id=? AND start_date IS NOT NULL AND end_date IS NOT NULL",
                            (dag_id, run_id[0])).fetchall()
    tis = [{"task_id": t, "map_index": m, "start": _when(s), "end": _when(e), "state": st} for t, m, s, e, st in rows]
    return sorted(tis, key=lambda ti: ti["start"])


def _when(value: str) -> float:
    return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()


def timing_lines(log: Path) -> dict[tuple[str, int], dict]:
    """The last timing line of each (task_id, map_index) in the log."""
    found: dict[tuple[str, int], dict] = {}
    for line in log.read_text(errors="replace").splitlines():
        at = line.find(MARK)
        if at < 0:
            continue
        body = line[at + len(MARK):]
        try:
            timing = json.JSONDecoder().raw_decode(body)[0]
        except ValueError:
            continue
        found[(timing["task_id"], int(timing.get("map_index", -1)))] = timing
    return found


def split(tis: list[dict], timings: dict[tuple[str, int], dict]) -> list[dict]:
    """One row per task instance that ran a unit."""
    rows, previous_end = [], None
    for ti in tis:
        timing = timings.get((ti["task_id"], ti["map_index"]))
        scheduling = 0.0 if previous_end is None else max(0.0, ti["start"] - previous_end)
        previous_end = ti["end"]
        if timing is None:
            continue
        duration = ti["end"] - ti["start"]
        measured = sum(timing.get(k, 0.0) for k in PARTS[2:])
        row = {"task": ti["task_id"] + (f"[{ti['map_index']}]" if ti["map_index"] >= 0 else ""),
               "phase": ti["task_id"].rsplit(".", 1)[-1], "task_s": duration, "scheduling_s": scheduling,
               "airflow_task_s": max(0.0, duration - measured), **{k: timing.get(k, 0.0) for k in PARTS[2:]}}
        row["outside_compute_s"] = row["scheduling_s"] + row["task_s"] - row["compute_s"]
        rows.append(row)
    return rows


def medians(rows: list[dict]) -> dict[str, dict[str, float]]:
    by_phase: dict[str, list[dict]] = {}
    for row in rows:
        by_phase.setdefault(row["phase"], []).append(row)
    by_phase["all tasks"] = rows
    keys = (*PARTS, "outside_compute_s")
    return {phase: {"n": len(group), **{k: statistics.median(r[k] for r in group) for k in keys}}
            for phase, group in by_phase.items()}


def render(table: dict[str, dict[str, float]], markdown: bool) -> str:
    cols = ("n", *PARTS, "outside_compute_s")
    names = ("tasks", "Airflow scheduling", "Airflow task", "store I/O", "Ray connect", "Ray submission",
             "queueing", "compute", "return", "outside compute")
    if markdown:
        lines = ["| phase | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        for phase, row in table.items():
            lines.append(f"| {phase} | {int(row['n'])} | " + " | ".join(f"{row[c]:.3f}" for c in cols[1:]) + " |")
        return "\n".join(lines)
    lines = ["median seconds per task: " + ", ".join(names[1:])]
    for phase, row in table.items():
        lines.append(f"  {phase:<10} n={int(row['n']):<3} " + " ".join(f"{row[c]:6.3f}" for c in cols[1:]))
    return "\n".join(lines)


def measure_demo(epochs: int) -> dict:
    """``bash scripts/demo.sh`` in fresh temporary state, timed; its split and the trained experiment's status."""
    sys.path.insert(0, str(ROOT))
    from verl_tasks.execution.cli_cluster import _free_ports

    work = Path(tempfile.mkdtemp(prefix="vt-demo-bench-"))
    try:
        cli = [sys.executable, "-m", "verl_tasks.cli"]
        subprocess.run([*cli, "run", str(CONFIG), "--store", f"file://{work}/warm", "--epochs", "1"], cwd=ROOT,
                       check=True, capture_output=True)  # builds the warm-start cache, untimed
        port, dashboard = _free_ports()
        env = {key: value for key, value in os.environ.items() if not key.startswith("AIRFLOW")}
        env.update(AIRFLOW_HOME=str(work / "airflow"), VERL_TASKS_STORE_ROOT=str(work),
                   DEMO_RAY_STATE=str(work / "ray-head"), RAY_PORT=str(port), RAY_DASHBOARD_PORT=str(dashboard),
                   DEMO_EPOCHS=str(epochs))
        started = time.monotonic()
        done = subprocess.run(["bash", "scripts/demo.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.monotonic() - started
        if done.returncode != 0:
            raise SystemExit(f"scripts/demo.sh failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        dag_run = re.search(r"DAG run tiny_arith succeeded in (\d+)s", done.stdout)
        home = work / "airflow"
        rows = split(task_instances(home / "airflow.db", "tiny_arith"), timing_lines(home / "demo-dags-test.log"))
        status = json.loads(subprocess.run(
            [*cli, "status", str(CONFIG), "--store", f"file://{work}/.store", "--epochs", str(epochs), "--json"],
            cwd=ROOT, check=True, capture_output=True, text=True).stdout)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    accuracy = [e["metrics"].get("eval_accuracy") for e in status["epochs"]]
    return {"wall_s": wall, "dag_run_s": int(dag_run.group(1)) if dag_run else None, "rows": rows,
            "base_accuracy": status["base"]["metrics"]["eval_accuracy"], "final_accuracy": accuracy[-1],
            "backend": os.environ.get("VERL_TASKS_BACKEND", "ray-driver")}


def demo_markdown(result: dict, epochs: int, command: str) -> str:
    sys.path.insert(0, str(ROOT))
    from benchmarks.run import provenance

    table = medians(result["rows"])
    overall = table["all tasks"]
    dag_run = f"{result['dag_run_s']} s" if result["dag_run_s"] is not None else "not printed"
    lines = [
        "## `make demo`: the Airflow DAG on Ray worker pools",
        "",
        provenance(command),
        "",
        f"`bash scripts/demo.sh` (what `make demo` runs after its install step) with `DEMO_EPOCHS={epochs}`, in a "
        "fresh Airflow home (SQLite), store and Ray head state folder, on free ports; the warm-start cache is "
        f"built before (untimed). Backend `{result['backend']}`: every task's unit runs on the experiment's Ray "
        "worker pools, the task process a Ray driver; `airflow dags test` runs the tasks one at a time.",
        "",
        "| measurement | value |",
        "|---|---:|",
        f"| `scripts/demo.sh` wall (head start, DB migration, DAG run, status table) | {result['wall_s']:.1f} s |",
        f"| DAG run, {epochs} epochs (`airflow dags test`, {int(overall['n'])} unit tasks + configure) | {dag_run} |",
        f"| median task outside the unit's compute | {overall['outside_compute_s']:.3f} s |",
        f"| held-out accuracy, base -> after {epochs} epochs | {result['base_accuracy']:.1%} -> "
        f"{result['final_accuracy']:.1%} |",
        "",
        "Where a task's time went (median seconds per task): *Airflow scheduling* is the gap after the previous "
        "task ended, *Airflow task* the part of the task instance's duration outside what the operator "
        "measured, the rest from each unit's `verl-tasks timing` line (Ray connect is paid once per `dags test` "
        "process).",
        "",
        render(table, markdown=True),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", type=Path, help="Airflow's SQLite metadata DB (with --log: print that run's split)")
    parser.add_argument("--log", type=Path, help="the `airflow dags test` output")
    parser.add_argument("--dag-id", default="tiny_arith")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--epochs", type=int, default=8, help="without --db/--log: the demo's DEMO_EPOCHS")
    parser.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md",
                        help="without --db/--log: the file whose section this script rewrites")
    args = parser.parse_args(argv)
    if args.db is None and args.log is None:
        result = measure_demo(args.epochs)
        command = " ".join([".venv/bin/python benchmarks/demo_split.py", *(sys.argv[1:] if argv is None else argv)])
        text = demo_markdown(result, args.epochs, command)
        print(text)
        from benchmarks.run import write_section

        write_section(args.output, text, OWNER)
        return 0
    if args.db is None or args.log is None:
        parser.error("--db and --log go together")
    rows = split(task_instances(args.db, args.dag_id), timing_lines(args.log))
    if not rows:
        raise SystemExit(f"no `{MARK.strip()}` lines in {args.log} matched a task instance")
    print(render(medians(rows), args.markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
