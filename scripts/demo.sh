#!/usr/bin/env bash
# make demo: a local Ray head, a project-local Airflow (SQLite), the tiny experiment's DAG end to end
# with every phase run on the experiment's Ray worker pools (`airflow dags test`, the task process a Ray driver), one line per
# committed unit as it goes, then the summary table. Exit 0 on success.
#   DEMO_EPOCHS=N (default 8, the YAML's epochs)   DEMO_EXPERIMENT=name (default tiny-arith)
#   DEMO_RAY_STATE=dir (default .ray-head), RAY_PORT, RAY_DASHBOARD_PORT: the head's state folder and ports
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
source scripts/airflow_env.sh
PY="$REPO/.venv/bin/python"
STATE="${DEMO_RAY_STATE:-$REPO/.ray-head}"
EXPERIMENT="${DEMO_EXPERIMENT:-tiny-arith}"
EPOCHS="${DEMO_EPOCHS:-8}"
export VERL_TASKS_BACKEND="${VERL_TASKS_BACKEND:-ray-driver}"  # "ray": one Ray job per task (deferrable)

STORE="file://$VERL_TASKS_STORE_ROOT/.store"
show_curve() {
  COLUMNS="${COLUMNS:-140}" "$REPO/.venv/bin/verl-tasks" status dags/experiments/tiny_arith.yaml --curve \
    --experiment "$EXPERIMENT" --store "$STORE" --epochs "$EPOCHS"
}
# A second `make demo`: nothing to compute; say so and show the curve (no Ray head, no Airflow run).
if "$PY" -m verl_tasks.cli status dags/experiments/tiny_arith.yaml --experiment "$EXPERIMENT" --store "$STORE" \
     --epochs "$EPOCHS" --json 2>/dev/null | "$PY" -c "import json, sys; sys.exit(0 if json.load(sys.stdin)['finished'] else 1)"; then
  echo "$EXPERIMENT is already trained ($EPOCHS epochs committed in $STORE); nothing recomputed." \
       "To train again: DEMO_EXPERIMENT=another-name make demo, or remove $VERL_TASKS_STORE_ROOT/.store"
  show_curve
  exit 0
fi

AF_PID=""
WATCH_PID=""
cleanup() {
  [ -n "$WATCH_PID" ] && kill "$WATCH_PID" 2>/dev/null
  [ -n "$AF_PID" ] && kill "$AF_PID" 2>/dev/null
  "$PY" -m verl_tasks.execution.local_head stop --state-dir "$STATE" || true
}
trap cleanup EXIT

"$PY" -m verl_tasks.execution.local_head start --state-dir "$STATE" --port "${RAY_PORT:-6399}" --dashboard-port "${RAY_DASHBOARD_PORT:-8275}"
eval "$("$PY" -m verl_tasks.execution.local_head env --state-dir "$STATE")"   # address, GCS address, token file

airflow db migrate >"$AIRFLOW_HOME/migrate.log" 2>&1 || { tail -20 "$AIRFLOW_HOME/migrate.log"; exit 1; }
airflow pools set verl_gpu 2 "GPU-bound phases (rollout, update)" >/dev/null
started=$(date +%s)
"$REPO/.venv/bin/verl-tasks" watch dags/experiments/tiny_arith.yaml --experiment "$EXPERIMENT" --store "$STORE" &
WATCH_PID=$!
airflow dags test tiny_arith -c "{\"experiment\": \"$EXPERIMENT\", \"epochs\": $EPOCHS}" >"$AIRFLOW_HOME/demo-dags-test.log" 2>&1 &
AF_PID=$!
if ! wait "$AF_PID"; then
  AF_PID=""
  grep -E "ERROR|Error|failed" "$AIRFLOW_HOME/demo-dags-test.log" | tail -20
  echo "dags test failed; full log: $AIRFLOW_HOME/demo-dags-test.log" >&2
  exit 1
fi
AF_PID=""
grep -q "state=success" "$AIRFLOW_HOME/demo-dags-test.log" || { echo "run did not succeed; see $AIRFLOW_HOME/demo-dags-test.log" >&2; exit 1; }
echo "DAG run tiny_arith succeeded in $(( $(date +%s) - started ))s (phases ran on Ray worker pools, backend $VERL_TASKS_BACKEND; log: $AIRFLOW_HOME/demo-dags-test.log)"
"$PY" benchmarks/demo_split.py --db "$AIRFLOW_HOME/airflow.db" --log "$AIRFLOW_HOME/demo-dags-test.log" || true
kill "$WATCH_PID" 2>/dev/null; WATCH_PID=""
show_curve
