#!/usr/bin/env bash
# make airflow: `airflow standalone` with the repo's DAGs and the verl-tasks plugin, plus a local Ray head.
# UI on http://127.0.0.1:${AIRFLOW_PORT:-8080}: log in as `admin` with the password standalone generates in
# $AIRFLOW_HOME/simple_auth_manager_passwords.json.generated (.airflow/ by default); Training page in the nav.
# Ctrl-C stops everything within seconds: standalone runs in its own process group, which is terminated
# (then killed) as a whole, so no scheduler, triggerer or dag-processor outlives it; then the Ray head stops
# and its session logs go.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
source scripts/airflow_env.sh
PY="$REPO/.venv/bin/python"
STATE="${VERL_TASKS_HEAD_STATE:-$REPO/.ray-head}"
PORT="${AIRFLOW_PORT:-8080}"
STOP_GRACE_S="${STOP_GRACE_S:-10}"
export AIRFLOW__API__PORT="$PORT" AIRFLOW__API__BASE_URL="http://127.0.0.1:$PORT"
GROUP=""

stop_airflow() {
  [ -n "$GROUP" ] || return 0
  kill -TERM -- "-$GROUP" 2>/dev/null || true
  for _ in $(seq 1 $((STOP_GRACE_S * 5))); do
    kill -0 -- "-$GROUP" 2>/dev/null || break
    sleep 0.2
  done
  kill -KILL -- "-$GROUP" 2>/dev/null || true
  GROUP=""
}
cleanup() {
  # Ignored, not reset: `make` forwards a SIGTERM to this script after the group got one, and a second
  # signal must not end the cleanup before the Ray head is stopped.
  trap '' INT TERM
  stop_airflow
  "$PY" -m verl_tasks.execution.local_head stop --state-dir "$STATE" || true
}
trap cleanup EXIT
# Ctrl-C (or a SIGTERM) is how this is stopped: a normal stop, so the exit status is 0 and make reports no error.
trap 'exit 0' INT TERM
"$PY" -m verl_tasks.execution.local_head start --state-dir "$STATE" \
  --port "${VERL_TASKS_HEAD_PORT:-6399}" --dashboard-port "${VERL_TASKS_HEAD_DASHBOARD_PORT:-8275}"
eval "$("$PY" -m verl_tasks.execution.local_head env --state-dir "$STATE")"
airflow db migrate >/dev/null
airflow pools set verl_gpu 2 "GPU-bound phases (rollout, update)" >/dev/null
echo "Airflow UI: http://127.0.0.1:$PORT  (user admin, password in $AIRFLOW_HOME/simple_auth_manager_passwords.json.generated)"
setsid airflow standalone &
GROUP=$!
wait "$GROUP"
