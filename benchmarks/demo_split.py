"""Where an Airflow task's time goes: Airflow scheduling, the task's store calls, Ray submission,
queueing, the unit's compute and the way back, per task of one DAG run.

    python benchmarks/demo_split.py --db .airflow/airflow.db --log .airflow/demo-dags-test.log [--markdown]

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
import sqlite3
import statistics
from datetime import datetime
from pathlib import Path

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", type=Path, required=True, help="Airflow's SQLite metadata DB")
    parser.add_argument("--log", type=Path, required=True, help="the `airflow dags test` output")
    parser.add_argument("--dag-id", default="tiny_arith")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    rows = split(task_instances(args.db, args.dag_id), timing_lines(args.log))
    if not rows:
        raise SystemExit(f"no `{MARK.strip()}` lines in {args.log} matched a task instance")
    print(render(medians(rows), args.markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
