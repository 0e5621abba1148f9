"""What a committed unit costs to skip: `airflow dags test` of the tiny DAG twice on the same store.

    .venv/bin/python benchmarks/skip_cost.py [--epochs 2] [--backend ray-driver|inline] [--output BENCHMARKS.md]

The first run trains ``--epochs`` epochs (conf ``{"epochs": N}``); the second finds every unit
committed, so each task returns from its marker. Both run in a fresh Airflow home (SQLite) with the
same store, and, for ``ray-driver``, one local head started for the benchmark. A third command runs a
DAG of as many no-op tasks as the rerun executed, for the floor of ``airflow dags test`` itself.
Writes the times, the ratio rerun / first run, and the per-task costs into the section between this
script's markers in ``--output``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BIN = Path(sys.executable).parent
OWNER = "benchmarks/skip_cost.py"
NOOP_DAG = '''
from airflow.sdk import DAG
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.providers.standard.operators.python import PythonOperator

with DAG("noop_chain", schedule=None, catchup=False):
    previous = None
    for i in range({n}):
        task = PythonOperator(task_id=f"t{{i:03d}}", python_callable=lambda: None)
        if previous is not None:
            previous >> task
        previous = task
'''


def airflow_env(home: Path, dags: Path) -> dict[str, str]:
    return {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
            "AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": "60", "VERL_TASKS_STORE_ROOT": str(home),
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


def dags_test(env: dict[str, str], dag_id: str, conf: dict) -> tuple[float, int]:
    """Seconds for one `airflow dags test` and the number of task instances that ran (not skipped)."""
    started = time.monotonic()
    out = subprocess.run([str(BIN / "airflow"), "dags", "test", dag_id, "-c", json.dumps(conf)], env=env,
                         capture_output=True, text=True)
    took = time.monotonic() - started
    text = out.stdout + out.stderr
    if out.returncode != 0 or "state=success" not in text:
        raise SystemExit(f"`airflow dags test {dag_id}` failed:\n{text[-4000:]}")
    ran = len(set(re.findall(r"new_state=success rows_affected=1 ti_id=(\S+)", text)))
    return took, ran


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--backend", default="ray-driver", choices=("ray-driver", "inline", "ray"))
    parser.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md")
    args = parser.parse_args()
    from benchmarks.run import provenance, write_section

    work = Path(tempfile.mkdtemp(prefix="vt-skip-"))
    home, noop_dags = work / "airflow", work / "noop-dags"
    home.mkdir()
    noop_dags.mkdir()
    env = {**airflow_env(home, ROOT / "dags"), "VERL_TASKS_BACKEND": args.backend}
    head_state = work / "ray-head"
    if args.backend != "inline":
        from verl_tasks.execution import local_head
        from verl_tasks.execution.cli_cluster import _free_ports

        port, dashboard = _free_ports()
        info = local_head.start(head_state, port=port, dashboard_port=dashboard, cwd=ROOT)
        env.update(info.client_env(), **info.driver_env())
    try:
        subprocess.run([str(BIN / "airflow"), "db", "migrate"], env=env, check=True, capture_output=True)
        conf = {"experiment": "skip-bench", "epochs": args.epochs}
        first, ran_first = dags_test(env, "tiny_arith", conf)
        rerun, ran_rerun = dags_test(env, "tiny_arith", conf)
        (noop_dags / "noop_chain.py").write_text(NOOP_DAG.format(n=max(1, ran_rerun)))
        noop, ran_noop = dags_test(airflow_env(home, noop_dags), "noop_chain", {})
    finally:
        if args.backend != "inline":
            local_head.stop(head_state)
    command = " ".join([".venv/bin/python benchmarks/skip_cost.py", *sys.argv[1:]])
    head = "" if args.backend == "inline" else " on a local Ray head started for the benchmark"
    lines = [
        "## Rerunning a finished DAG run: `airflow dags test` twice on one store",
        "",
        provenance(command),
        "",
        f"The `tiny_arith` DAG run with conf `{{\"epochs\": {args.epochs}}}` by `airflow dags test` in a fresh "
        f"Airflow home (SQLite), backend `{args.backend}`{head}; then the same command again on the same store, "
        "where every unit is committed, so `configure` skips the epochs' tasks; then, for the floor of "
        "`airflow dags test` itself, a DAG of as many no-op `PythonOperator` tasks as the rerun ran.",
        "",
        "| run | wall (s) | tasks that ran | s per task |",
        "|---|---:|---:|---:|",
    ]
    for name, took, ran in (("first run (trains)", first, ran_first), ("rerun, all committed", rerun, ran_rerun),
                            ("no-op DAG, same task count", noop, ran_noop)):
        lines.append(f"| {name} | {took:.1f} | {ran} | {took / max(1, ran):.2f} |")
    lines += ["", f"Rerun / first run: **{rerun / first:.1%}**; rerun / no-op floor: {rerun / noop:.2f}x."]
    text = "\n".join(lines) + "\n"
    print(text)
    write_section(args.output, text, OWNER)


if __name__ == "__main__":
    main()
