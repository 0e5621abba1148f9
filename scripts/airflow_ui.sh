#!/usr/bin/env bash
# make airflow: `airflow standalone` with the repo's DAGs and the verl-tasks plugin, plus a local Ray head.
# UI on http://127.0.0.1:${AIRFLOW_PORT:-8080} (admin password printed by standalone); dashboard at /verl-tasks/.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
source scripts/airflow_env.sh
PY="$REPO/.venv/bin/python"
STATE="$REPO/.ray-head"
PORT="${AIRFLOW_PORT:-8080}"
export AIRFLOW__API__PORT="$PORT" AIRFLOW__API__BASE_URL="http://127.0.0.1:$PORT"
cleanup() { "$PY" -m verl_tasks.execution.local_head stop --state-dir "$STATE" || true; }
trap cleanup EXIT
"$PY" -m verl_tasks.execution.local_head start --state-dir "$STATE"
eval "$("$PY" -m verl_tasks.execution.local_head env --state-dir "$STATE")"
airflow db migrate >/dev/null
airflow pools set verl_gpu 2 "GPU-bound phases (rollout, update)" >/dev/null
airflow standalone
