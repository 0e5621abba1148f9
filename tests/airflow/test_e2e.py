"""End to end with the real parts: `airflow standalone` (api-server, scheduler, dag-processor,
triggerer) on PostgreSQL, a project-local Ray head (token auth on), S3 through a moto server
over HTTP. The module's tests share that stack, each with its own experiment on the one DAG.

The first test, a fault cleared:

1. trigger the DAG through REST API v2 with a fault planned for rollout batch 1 of epoch 0 (the test's
   fault hooks, loaded by every process the stack starts: see tests/faults);
2. see that task instance fail and the run end failed;
3. clear exactly that map index with downstream (`clearTaskInstances`, `dry_run: false`, as the
   UI's Clear button does) and see the run succeed;
4. check storage: every unit committed exactly once, one attempt per unit, no duplicate sample ids,
   final `weights_sha256` equal to a fault-free run computed inline in a local store;
5. clear the whole successful run: it succeeds again with no new `started` event (`configure`
   finds the epoch committed and skips its tasks at once); the time per task is printed (and
   written to ``$VT_E2E_BENCH_OUT`` when set).

The second clears a rollout task while it runs (its docstring says how).

Waits follow progress: one gives up only when nothing (task state, store event, Ray job status)
moved for ``STALL_S`` seconds, and then prints what it saw (task states and logs, each Airflow
component's log tail, the last store events, the Ray jobs, the scheduler's rows in the database).

    .venv/bin/python -m pytest tests/airflow/test_e2e.py -m "airflow and slow" -s
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests import faults
from tests.airflow.e2e_support import (
    SLOW_HEARTBEATS,
    Api,
    PgDatabase,
    Standalone,
    free_port,
    pg_user,
    standalone_env,
    states,
    ti_key,
    wait_for,
)

pytestmark = [pytest.mark.airflow, pytest.mark.slow]

DAG_ID = "vt_e2e_arith"
EXPERIMENT = "e2e-arith"
CONN_ID = "vt_e2e_s3"
ROLLOUT = "epoch_000.rollout"
AWS_KEY, AWS_SECRET = "testing-key-id", "testing-secret-value"

EXPERIMENT_YAML = """\
# Small tiny-arith for the end-to-end test: 1 epoch, 2 rollout batches of 8 prompts x 4 samples.
experiment: {experiment}
seed: 7
epochs: 1
model:
  source: tiny
  tiny:
    warm_start_steps: 300
data:
  train: builtin:arith
  eval: builtin:arith
  train_size: 400
  eval_size: 40
algorithm:
  group_size: 4
  lr: 0.0001
  minibatch_size: 32
rollout:
  engine: hf
  temperature: 1.0
  max_new_tokens: 5
  batches_per_epoch: 2
  prompts_per_batch: 8
rewards:
  function: verl_tasks.rewards.builtin:exact_answer
evaluate:
  every: 1
  max_prompts: 40
fault_tolerance:
  retries: 0          # the injected failure must not be retried away
storage:
  uri: {uri}
  aws_conn_id: {conn_id}
"""

DAG_FILE = """\
from pathlib import Path

from verl_tasks.airflow.factory import build_dag

dag = build_dag(Path(__file__).parent / "experiments" / "{dag_id}.yaml")
"""

REFERENCE = """\
import json, sys
from verl_tasks.config import load_config
from verl_tasks.runner import make_context, train
cfg = load_config(sys.argv[1], {"storage.uri": "file://" + sys.argv[2]})
print(json.dumps(train(make_context(cfg), cfg.epochs)["latest_snapshot"]))
"""

TERMINAL = ("success", "failed")
STALL_S = float(os.environ.get("VT_E2E_STALL_S", "180"))  # a wait fails when nothing moved this long
POLL_S = 2.0  # the api-server is one process: the test's polling must leave it room for the workers


def _now() -> datetime:
    return datetime.now(UTC)


def _ts(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


@pytest.fixture(scope="module")
def stack(tmp_path_factory, moto_endpoint):
    """PostgreSQL database, bucket, Ray head, airflow standalone, shared by this module's tests (each runs its
    own experiment on the one DAG); all torn down by PID/name we own."""
    import boto3

    from verl_tasks.execution import local_head

    user = pg_user()
    if user is None:
        pytest.fail("no PostgreSQL with trust auth at 127.0.0.1:5432: this test needs the real database; start it "
                    "(`pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start`) and run again")
    tmp_path = tmp_path_factory.mktemp("e2e")
    with ExitStack() as stop, pytest.MonkeyPatch.context() as monkeypatch:
        db = PgDatabase.create(user)
        stop.callback(db.drop)

        bucket = f"vt-e2e-{secrets.token_hex(4)}"
        boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1", aws_access_key_id=AWS_KEY,
                     aws_secret_access_key=AWS_SECRET).create_bucket(Bucket=bucket)
        store_uri = f"s3://{bucket}/runs"

        dags = tmp_path / "dags"
        (dags / "experiments").mkdir(parents=True)
        yaml_path = dags / "experiments" / f"{DAG_ID}.yaml"
        yaml_path.write_text(EXPERIMENT_YAML.format(experiment=EXPERIMENT, uri=store_uri, conn_id=CONN_ID))
        (dags / f"{DAG_ID}.py").write_text(DAG_FILE.format(dag_id=DAG_ID))

        # The reference (no fault, local store) runs in its own process while the stack comes up and
        # works; niced, so that on a busy machine it does not starve the stack under test.
        ref_store = tmp_path / "reference"
        ref_log = open(tmp_path / "reference.log", "w")
        stop.callback(ref_log.close)
        reference = subprocess.Popen(["nice", "-n", "5", sys.executable, "-c", REFERENCE, str(yaml_path),
                                      str(ref_store)], stdout=subprocess.PIPE, stderr=ref_log, text=True,
                                     cwd=str(tmp_path))
        stop.callback(lambda: reference.poll() is None and reference.kill())

        # Ray head: its jobs reach S3 through the moto endpoint with the test credentials.
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", AWS_KEY)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", AWS_SECRET)
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        monkeypatch.setenv("VERL_TASKS_S3_ENDPOINT", moto_endpoint)
        plan_dir = tmp_path / "fault-plan"
        plan_dir.mkdir()
        for key, value in faults.harness_env(plan_dir).items():  # the head, Airflow and all they start
            monkeypatch.setenv(key, value)
        taken: set[int] = set()

        def pick(span: int = 1) -> int:  # free now, and not one another component was given
            while True:
                base = free_port(span)
                if not taken & set(range(base, base + span)):
                    taken.update(range(base, base + span))
                    return base

        ray_port, dash_port = pick(2), pick(5)
        head_state = tmp_path / "ray-head"
        # Airflow (the long pole: it migrates the database first) starts before the head; the
        # head's client settings are known from its ports and state folder.
        head_env = {"VERL_TASKS_RAY_ADDRESS": f"http://127.0.0.1:{dash_port}",
                    "RAY_AUTH_TOKEN_PATH": str(head_state.resolve() / "auth_token")}

        home = tmp_path / "airflow-home"
        (home / "plugins").mkdir(parents=True)
        port = pick()
        env = standalone_env(
            home, dags, home / "plugins", port, (pick(), pick()), db.sync_url,
            AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC=db.async_url, **SLOW_HEARTBEATS,
            **{f"AIRFLOW_CONN_{CONN_ID.upper()}": json.dumps({
                "conn_type": "aws", "login": AWS_KEY, "password": AWS_SECRET,
                "extra": {"endpoint_url": moto_endpoint, "region_name": "us-east-1"}}),
               # The failure callback pauses the DAG through this connection (safe mode).
               "AIRFLOW_CONN_VERL_AIRFLOW_API": json.dumps({"conn_type": "http", "host": "127.0.0.1", "port": port})},
            **head_env)
        started = time.monotonic()
        airflow = Standalone(home, port, env)
        airflow.start()
        stop.callback(airflow.stop)

        stop.callback(shutil.rmtree, f"/tmp/vt-ray-{ray_port}", True)
        # At once: with actors alive a SIGTERMed head outlasts the 30 s grace.
        stop.callback(local_head.stop, head_state, 0)
        head = local_head.start(head_state, port=ray_port, dashboard_port=dash_port, num_cpus=8)
        assert head.client_env() == head_env, (head.client_env(), head_env)
        api = Api(airflow.base_url)

        def diagnose() -> str:
            return f"standalone alive={airflow.alive()}; log tail:\n{airflow.log_tail()}"

        # Starting up, the log grows while anything happens (migrations, parsing).
        wait_for("the Airflow API", lambda: airflow.api_version(api), 120,
                 every=POLL_S, diagnose=diagnose, progress=airflow.log_size, limit_s=900)
        wait_for(f"DAG {DAG_ID} to be parsed", lambda: api.dag_parsed(DAG_ID), 120,
                 every=POLL_S, diagnose=diagnose, progress=airflow.log_size, limit_s=600)
        # Warm the execution API (first request initialises it) before a worker depends on it.
        for path in ("/execution/health", "/execution/health/ping"):
            try:
                api.request("GET", path, timeout=120)
            except Exception as err:  # noqa: BLE001 - only a warm-up
                print(f"warm-up {path}: {err}")
        ready_s = time.monotonic() - started
        print(f"\nairflow standalone ready and DAG parsed in {ready_s:.1f}s")
        # GPU-bound phases run in this pool; it must exist before anything is scheduled.
        api.request("POST", "/api/v2/pools", {"name": "verl_gpu", "slots": 2, "description": "e2e"})
        yield {"ready_s": ready_s, "api": api, "airflow": airflow, "head": head, "store_uri": store_uri,
               "endpoint": moto_endpoint, "reference": reference, "ref_store": ref_store, "tmp": tmp_path,
               "yaml": yaml_path, "db": db, "faults": plan_dir}


def reference_result(stack: dict) -> dict:
    """The fault-free reference run's result line, once its process (started with the stack) exits."""
    if "reference_result" in stack:
        return stack["reference_result"]

    def ref_files() -> list[tuple[str, int]]:  # the reference's progress: what it has written so far
        return sorted((str(p), p.stat().st_size) for p in stack["ref_store"].rglob("*") if p.is_file())

    wait_for("the fault-free reference run", lambda: stack["reference"].poll() is not None, STALL_S, every=POLL_S,
             progress=ref_files, diagnose=lambda: (stack["tmp"] / "reference.log").read_text()[-4000:])
    out, _ = stack["reference"].communicate(timeout=60)
    assert stack["reference"].returncode == 0, (stack["tmp"] / "reference.log").read_text()[-4000:]
    stack["reference_result"] = json.loads(out.strip().splitlines()[-1])
    return stack["reference_result"]


def _failing_logs(airflow: Standalone, run_id: str, tis: list[dict]) -> str:
    logs = airflow.task_logs(DAG_ID, run_id)
    bad = {ti_key(t) for t in tis if t["state"] in ("failed", "upstream_failed")}
    out = []
    for path, text in logs.items():
        task = path.split("/")[0].removeprefix("task_id=")
        if any(b.split("[")[0] == task for b in bad):
            out.append(f"--- {path}\n" + "\n".join(text.splitlines()[-40:]))
    return "\n".join(out)[-12000:]


class Watch:
    """What the test looks at while it waits on the stack: a picture of everything that can move
    (task states and tries, store events, Ray job statuses) and, on giving up, what it saw."""

    def __init__(self, stack: dict[str, Any], run_id: str, experiment: str = EXPERIMENT):
        from verl_tasks.execution.ray_jobs import RayJobBackend, RayTarget, read_token
        from verl_tasks.layout import Layout
        from verl_tasks.store import open_store

        self.stack, self.run_id, self.experiment = stack, run_id, experiment
        self.api: Api = stack["api"]
        self.airflow: Standalone = stack["airflow"]
        self.store = open_store(stack["store_uri"], endpoint_url=stack["endpoint"],
                                credentials={"aws_access_key_id": AWS_KEY, "aws_secret_access_key": AWS_SECRET})
        self.layout = Layout(experiment)
        self.ray = RayJobBackend(RayTarget(stack["head"].address, read_token(stack["head"].token_file)))
        self._jobs: tuple[float, tuple] = (0.0, ())

    def jobs(self) -> dict[str, str]:
        return {j.submission_id: str(getattr(j.status, "value", j.status)) for j in self.ray.client.list_jobs()
                if (j.submission_id or "").startswith(f"vt-{self.experiment}-")}

    def _recent_jobs(self) -> tuple:
        """The jobs' statuses, listed at most every 10 s (the dashboard also serves the triggers)."""
        if time.monotonic() - self._jobs[0] > 10:
            self._jobs = (time.monotonic(), tuple(sorted(self.jobs().items())))
        return self._jobs[1]

    def picture(self) -> tuple:
        tis = self.api.task_instances(DAG_ID, self.run_id)
        return (tuple((ti_key(t), t["state"], t["try_number"]) for t in tis),
                len(self.store.list(self.layout.events + "/")), self._recent_jobs())

    def diagnose(self) -> str:
        parts = [f"load average {os.getloadavg()} on {os.cpu_count()} cores"]
        try:
            tis = self.api.task_instances(DAG_ID, self.run_id)
            parts += [f"task states: {json.dumps(states(tis), indent=1)}",
                      _failing_logs(self.airflow, self.run_id, tis)]
        except Exception as err:  # noqa: BLE001 - diagnosis goes on without it
            parts.append(f"(no task states: {err})")
        parts += [self.airflow.component_tail(name, lines) for name, lines in
                  (("scheduler", 60), ("triggerer", 25), ("dag-processor", 10), ("api-server", 15))]
        parts.append(f"standalone log tail:\n{self.airflow.log_tail(30)}")
        try:
            from verl_tasks.events import read_events

            events = read_events(self.store, self.layout)[-12:]
            parts.append("last store events:\n" + "\n".join(json.dumps(e, sort_keys=True)[:300] for e in events))
            parts.append(f"ray jobs: {json.dumps(self.jobs(), indent=1)}")
        except Exception as err:  # noqa: BLE001
            parts.append(f"(no store events / ray jobs: {err})")
        db = self.stack["db"]
        parts.append("task instances in the database:\n" + db.table(
            "select task_id, map_index, state, try_number, pool, queued_dttm, start_date, queued_by_job_id, "
            f"next_method from task_instance where run_id = '{self.run_id}' order by task_id, map_index"))
        parts.append("jobs in the database:\n" + db.table(
            "select id, job_type, state, latest_heartbeat, start_date, end_date from job order by id"))
        parts.append("pools:\n" + db.table("select pool, slots from slot_pool"))
        return "\n".join(parts)

    def wait(self, what: str, probe: Callable[[], Any]) -> Any:
        """``probe`` until truthy; give up when nothing moved for ``STALL_S``."""
        return wait_for(what, probe, STALL_S, every=POLL_S, diagnose=self.diagnose, progress=self.picture)

    def wait_run(self) -> tuple[str, list[dict]]:
        """Wait until the run is terminal; return (state, task instances)."""
        def probe():
            state = self.api.dag_run(DAG_ID, self.run_id)["state"]
            return state if state in TERMINAL else None

        state = self.wait(f"run {self.run_id} to finish", probe)
        return state, self.api.task_instances(DAG_ID, self.run_id)


def test_fault_clear_and_rerun_through_the_rest_api(stack):
    api: Api = stack["api"]
    airflow: Standalone = stack["airflow"]
    t0 = time.monotonic()

    api.request("PATCH", f"/api/v2/dags/{DAG_ID}", {"is_paused": False})

    # -- 1. trigger with a fault on rollout batch 1 of epoch 0 ----------------------------------
    fired = faults.fail_once(stack["faults"], EXPERIMENT, "rollout", 0, 1)
    run_id = "e2e_fault_" + secrets.token_hex(3)
    watch = Watch(stack, run_id)
    run = api.request("POST", f"/api/v2/dags/{DAG_ID}/dagRuns",
                      {"dag_run_id": run_id, "logical_date": None, "conf": {"experiment": EXPERIMENT}})
    assert run["dag_run_id"] == run_id

    # -- 2. the faulty map index fails -------------------------------------------------------
    def failed_yet():
        tis = api.task_instances(DAG_ID, run_id)
        return tis if states(tis).get(f"{ROLLOUT}[1]") == "failed" else None

    tis = watch.wait(f"{ROLLOUT}[1] to fail", failed_yet)
    fault_s = time.monotonic() - t0
    print(f"rollout[1] failed after {time.monotonic() - t0:.0f}s: {states(tis)}")
    assert fired.exists(), "the fault hook never fired in the Ray worker"
    failed_log = "\n".join(text for path, text in airflow.task_logs(DAG_ID, run_id).items()
                           if path.startswith(f"task_id={ROLLOUT}/map_index=1/"))
    assert "injected fault" in failed_log, failed_log[-4000:]

    # -- 2b. retries exhausted -> safe mode (docs/fault-tolerance.md): the failure callback wrote
    # control/safe_mode.json and paused the DAG. The runbook: `verl-tasks resume`, unpause, Clear.
    store, layout = watch.store, watch.layout
    watch.wait("safe mode", lambda: store.exists(layout.safe_mode))
    watch.wait("the failure callback to pause the DAG",
               lambda: api.dag_parsed(DAG_ID)["is_paused"])
    resumed = subprocess.run([str(Path(sys.executable).parent / "verl-tasks"), "resume", str(stack["yaml"]),
                              "--experiment", EXPERIMENT], capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert not store.exists(layout.safe_mode)
    api.request("PATCH", f"/api/v2/dags/{DAG_ID}", {"is_paused": False})

    # unpaused, the scheduler finishes the run: downstream upstream_failed, run failed
    state, tis = watch.wait_run()
    by_key = states(tis)
    print(f"run {state} after {time.monotonic() - t0:.0f}s: {by_key}")
    why = f"{json.dumps(by_key, indent=1)}\n{_failing_logs(airflow, run_id, tis)}"
    assert state == "failed", why
    assert by_key[f"{ROLLOUT}[1]"] == "failed", why
    assert by_key[f"{ROLLOUT}[0]"] == "success", why
    assert by_key["configure"] == by_key["epoch_000.plan"] == "success", why
    assert all(by_key[k] == "upstream_failed" for k in by_key if k.startswith("epoch_000.score")), why

    # -- 3. Clear exactly that map index with its downstream, as the UI does ---------------------
    cleared_at = _now()
    recover_s = time.monotonic()
    cleared = api.clear(DAG_ID, {"task_ids": [[ROLLOUT, 1]], "dag_run_id": run_id, "include_downstream": True,
                                 "include_upstream": False, "only_failed": False, "reset_dag_runs": True})
    cleared_keys = {ti_key(t) for t in cleared["task_instances"]}
    print(f"cleared: {sorted(cleared_keys)}")
    assert f"{ROLLOUT}[1]" in cleared_keys and f"{ROLLOUT}[0]" not in cleared_keys, cleared_keys
    assert "configure" not in cleared_keys and "epoch_000.plan" not in cleared_keys, cleared_keys
    state, tis = watch.wait_run()
    recover_s = time.monotonic() - recover_s
    by_key = states(tis)
    print(f"after the clear ({time.monotonic() - t0:.0f}s): run {state}")
    assert state == "success", f"{by_key}\n{_failing_logs(airflow, run_id, tis)}"
    assert all(v == "success" for v in by_key.values()), by_key
    redone = {ti_key(t) for t in tis if _ts(t["start_date"]) and _ts(t["start_date"]) >= cleared_at}
    assert redone == cleared_keys, (redone, cleared_keys)

    # -- 4. storage --------------------------------------------------------------------------
    from verl_tasks.config import load_config
    from verl_tasks.events import read_events
    from verl_tasks.runner import status
    from verl_tasks.store.units import ATTEMPTS, MARKER, read_jsonl, read_marker

    keys = store.list(layout.root + "/")
    units = sorted(k[: -len(MARKER) - 1] for k in keys if k.endswith("/" + MARKER))
    attempts: dict[str, set[str]] = {}
    for key in keys:
        at = key.find(f"/{ATTEMPTS}/")
        if at >= 0:
            attempts.setdefault(key[:at], set()).add(key[at + len(ATTEMPTS) + 2:].split("/", 1)[0])
    cfg = load_config(stack["yaml"], {"storage.uri": stack["store_uri"]})
    expected = {layout.unit(p, 0, b) for p in ("rollout", "score") for b in range(2)}
    expected |= {layout.unit(p, 0) for p in ("plan", "validate", "update", "snapshot", "evaluate")}
    assert expected <= set(units), sorted(expected - set(units))
    for unit in units:
        record = read_marker(store, unit)
        assert attempts.get(unit) == {record.attempt}, f"{unit}: attempts {attempts.get(unit)}, marker {record.attempt}"
    assert set(attempts) <= set(units), f"attempts without a marker: {sorted(set(attempts) - set(units))}"
    events = read_events(store, layout)
    committed = Counter(e["unit"] for e in events if e["kind"] == "committed")
    assert all(n == 1 for n in committed.values()), committed
    assert set(committed) == set(units), (sorted(committed), units)
    kinds = Counter(e["kind"] for e in events)
    assert not kinds["lost_race"] and not kinds["failed"] and not kinds["quarantined"], kinds
    assert kinds["safe_mode"] == kinds["resumed"] == 1, kinds
    sample_ids: list[str] = []
    for b in range(2):
        rows = read_jsonl(store, read_marker(store, layout.rollout(0, b)), "samples.jsonl")
        assert len(rows) == 8 * 4
        sample_ids += [r["sample_id"] for r in rows]
    assert len(sample_ids) == len(set(sample_ids)) == 64, "duplicate sample ids"

    # one Ray job per unit; only the faulty unit has a second attempt
    backend = watch.ray
    jobs = watch.jobs()
    prefix = f"vt-{EXPERIMENT}-e0-rollout-b1-"
    assert jobs.pop(prefix + "a1") == "FAILED" and jobs.pop(prefix + "a2") == "SUCCEEDED"
    assert all(s == "SUCCEEDED" for s in jobs.values()), jobs
    assert all(j.endswith("-a1") for j in jobs), jobs

    # same weights as the fault-free reference
    reference = reference_result(stack)
    latest = status(cfg, store)["latest_snapshot"]
    print(f"weights_sha256: airflow+ray+s3 {latest['weights_sha256']} / reference {reference['weights_sha256']}")
    assert latest["version"] == reference["version"] == 1
    assert latest["weights_sha256"] == reference["weights_sha256"]

    # -- 5. clear the whole successful run: configure finds the epoch committed and skips it -----
    started_before = sum(e["kind"] == "started" for e in events)
    jobs_before = {j.submission_id for j in backend.client.list_jobs()}
    cleared_at = _now()
    wall = time.monotonic()
    cleared = api.clear(DAG_ID, {"dag_run_id": run_id, "only_failed": False, "reset_dag_runs": True})
    assert len(cleared["task_instances"]) == len(tis), (len(cleared["task_instances"]), len(tis))
    state, tis = watch.wait_run()
    wall = time.monotonic() - wall
    assert state == "success", states(tis)
    by_state = states(tis)
    assert by_state.pop("configure") == "success" and set(by_state.values()) == {"skipped"}, states(tis)
    assert all(_ts(t["start_date"]) >= cleared_at for t in tis), "some task was not cleared"
    after = read_events(store, layout)
    assert sum(e["kind"] == "started" for e in after) == started_before, "the rerun did work again"
    assert not [e for e in after[len(events):] if e["kind"] == "committed"]
    assert {j.submission_id for j in backend.client.list_jobs()} == jobs_before, "the rerun submitted Ray jobs"

    # A skipped instance keeps the duration of its last run in the API: only the ones that ran have one.
    rows = sorted(((ti_key(t), t["state"], float(t["duration"] or 0.0)) for t in tis),
                  key=lambda r: next(t["start_date"] for t in tis if ti_key(t) == r[0]))
    first = min(_ts(t["start_date"]) for t in tis)
    last = max(_ts(t["end_date"]) for t in tis)
    ran = [d for _, state, d in rows if state == "success"]
    table = ["| task instance | state | duration (s) |", "|---|---|---:|"] + [
        f"| `{k}` | {state} | {f'{d:.2f}' if state == 'success' else ''} |" for k, state, d in rows]
    summary = (f"{len(rows)} task instances, {len(ran)} ran ({sum(ran):.2f} s); first start -> last end "
               f"{(last - first).total_seconds():.1f} s; clear request -> run success seen {wall:.1f} s")
    print("\nrerun of the cleared successful run (configure skipped the committed epoch's tasks):")
    print("\n".join(table) + "\n" + summary)
    print(f"whole test body: {time.monotonic() - t0:.0f}s")
    bench = os.environ.get("VT_E2E_BENCH_OUT")
    if bench:
        Path(bench).write_text("\n".join([
            "## Clearing a successful DAG run: configure skips the committed epoch",
            "",
            f"Measured {time.strftime('%Y-%m-%d')} by the end-to-end test on this machine (2 shared CPU cores): "
            "`airflow standalone` 3.3 (LocalExecutor, PostgreSQL, parallelism 4, scheduler idle sleep 0.2 s, "
            "min heartbeat interval 1 s), a local Ray 2.60 head, S3 on a moto server. DAG: 1 epoch, 2 rollout "
            "batches (10 task instances). After the faulty run had been cleared and had succeeded, the whole "
            "run was cleared again (`clearTaskInstances`, all tasks, `dry_run: false`): `configure` found "
            "epoch 0 committed and skipped its 9 task instances at once (mapped ones by map index); no "
            "task started a Ray job or wrote a `started` event.",
            "",
            "```",
            "VT_E2E_BENCH_OUT=benchmarks/airflow.md .venv/bin/python -m pytest tests/airflow/test_e2e.py "
            "-m 'airflow and slow' -s",
            "```",
            "",
            *table,
            "",
            summary + ".",
            "",
            f"Same test, same run: `airflow standalone` start -> API up and DAG parsed "
            f"{stack['ready_s']:.0f} s; trigger -> faulty task failed {fault_s:.0f} s; Clear of the failed map "
            f"index -> run success {recover_s:.0f} s; whole test body {time.monotonic() - t0:.0f} s.",
            "",
        ]))


CLEARED = "e2e-clear-running"  # the experiment of the test below: the same DAG, its own units and Ray jobs
STOP_S = 5.0  # the actor's work stops within 5 s of the clear
HELD_BATCH = 1


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def test_clearing_a_running_rollout_stops_its_actor_and_the_retry_commits_once(stack):
    """Clear a *running* rollout task through the REST API (experiment ``CLEARED`` on the same stack):

    1. rollout batch 1 of epoch 0 is held in its middle by the test hook (tests/faults: the worker
       actor writes its PID to ``.held`` and waits), its task deferred on its Ray job;
    2. that task instance is cleared (``clearTaskInstances``, ``dry_run: false``, as the UI does):
       Airflow cancels the trigger, the trigger's ``on_kill`` stops the Ray job, the job's driver
       fences the attempt in the store and kills the actor;
    3. the held actor process must be gone within ``STOP_S`` (5 s) of the clear request; the
       attempt's fence record must exist; the hold is then released for the retry;
    4. the run must succeed; the unit's marker names the retry's attempt (never the killed one),
       it was committed once (one ``committed`` event), the killed attempt left no files; every
       unit committed exactly once; the final ``weights_sha256`` equals the fault-free reference
       (the experiment's name is not in any seed).
    """
    from verl_tasks.config import load_config
    from verl_tasks.events import read_events
    from verl_tasks.runner import status
    from verl_tasks.store.units import ATTEMPTS, MARKER, fence_record, read_marker

    api: Api = stack["api"]
    t0 = time.monotonic()
    api.request("PATCH", f"/api/v2/dags/{DAG_ID}", {"is_paused": False})

    # -- 1. hold rollout batch 1 in its middle ---------------------------------------------------
    held = faults.hold(stack["faults"], CLEARED, 0, HELD_BATCH)
    run_id = "e2e_clear_running_" + secrets.token_hex(3)
    watch = Watch(stack, run_id, CLEARED)
    store, layout = watch.store, watch.layout
    unit = layout.rollout(0, HELD_BATCH)
    task = f"{ROLLOUT}[{HELD_BATCH}]"
    api.request("POST", f"/api/v2/dags/{DAG_ID}/dagRuns",
                {"dag_run_id": run_id, "logical_date": None, "conf": {"experiment": CLEARED}})

    def started_attempts() -> list[dict]:
        return [e for e in read_events(store, layout) if e["kind"] == "started" and e.get("unit") == unit]

    def in_its_middle():
        """The held PID, the task's state and the attempt's `started` event, once all are there."""
        if not held.exists():
            return None
        tis = api.task_instances(DAG_ID, run_id)
        state = states(tis).get(task)
        if state not in ("deferred", "running"):
            return None
        started = started_attempts()
        return (int(held.read_text()), state, started) if started else None

    pid, state_at_clear, started = watch.wait(f"{task} to be held in its middle", in_its_middle)
    assert len(started) == 1, started
    killed = started[0]["attempt"]
    assert started[0]["pid"] == pid, (started[0], pid)  # the held process is the one running the attempt
    assert _alive(pid) and read_marker(store, unit) is None
    print(f"\n{task} held in its middle after {time.monotonic() - t0:.0f}s: actor pid {pid}, attempt {killed}, "
          f"task {state_at_clear}")

    # -- 2. clear that task instance while it runs ----------------------------------------------
    clear_sent = time.monotonic()
    cleared = api.clear(DAG_ID, {"task_ids": [[ROLLOUT, HELD_BATCH]], "dag_run_id": run_id,
                                 "include_downstream": False, "include_upstream": False, "only_failed": False,
                                 "reset_dag_runs": False})
    clear_answered = time.monotonic() - clear_sent
    assert [ti_key(t) for t in cleared["task_instances"]] == [task], cleared

    # -- 3. the actor's work stops within STOP_S; the attempt is fenced --------------------------
    def diagnose_stop() -> str:
        logs = "\n".join(f"--- {path}\n{text[-3000:]}"
                         for path, text in stack["airflow"].task_logs(DAG_ID, run_id).items()
                         if path.startswith(f"task_id={ROLLOUT}/map_index={HELD_BATCH}/"))
        return (f"actor pid {pid} alive={_alive(pid)}; fence={fence_record(store, unit, killed)}; "
                f"ray jobs={watch.jobs()}\n{stack['airflow'].component_tail('triggerer', 40)}\n{logs}")

    wait_for(f"actor process {pid} of the cleared attempt to be gone", lambda: not _alive(pid), 60, every=0.05,
             diagnose=diagnose_stop)
    stopped_s = time.monotonic() - clear_sent
    fence = wait_for("the cleared attempt's fence record", lambda: fence_record(store, unit, killed), 60,
                     every=0.1, diagnose=diagnose_stop)
    fenced_s = time.monotonic() - clear_sent
    print(f"clear answered in {clear_answered:.2f}s; actor process gone {stopped_s:.2f}s after the clear request; "
          f"fence record seen after {fenced_s:.2f}s: {fence}")
    faults.release(stack["faults"], CLEARED, 0, HELD_BATCH)  # the retry must not be held
    assert stopped_s <= STOP_S, f"the cleared attempt's actor ran {stopped_s:.2f}s after the clear\n{diagnose_stop()}"
    assert "stopped" in fence.get("reason", ""), fence
    assert read_marker(store, unit) is None, "a marker appeared although the attempt was cancelled"

    # -- 4. the retry commits once; the run succeeds with the fault-free weights -------------------
    state, tis = watch.wait_run()
    by_key = states(tis)
    print(f"run {state} {time.monotonic() - t0:.0f}s after the trigger: {by_key}")
    assert state == "success", f"{json.dumps(by_key, indent=1)}\n{_failing_logs(stack['airflow'], run_id, tis)}"
    assert all(v == "success" for v in by_key.values()), by_key
    ti = next(t for t in tis if ti_key(t) == task)
    assert ti["try_number"] >= 2, ti  # the clear made a new try
    retry_log = "\n".join(text for path, text in stack["airflow"].task_logs(DAG_ID, run_id).items()
                          if path.startswith(f"task_id={ROLLOUT}/map_index={HELD_BATCH}/attempt=2."))
    raced = "which this try attached to, was stopped" in retry_log
    print("the new try " + ("attached to the cleared try's job before its on_kill stopped it, then submitted "
                            "the next attempt" if raced else
                            "found the cleared try's job stopped and submitted the next one"))

    record = read_marker(store, unit)
    assert record is not None and record.attempt != killed, (record, killed)
    events = read_events(store, layout)
    mine = [e for e in events if e.get("unit") == unit]
    assert Counter(e["kind"] for e in mine if e["kind"] == "committed") == {"committed": 1}, mine
    assert {e["attempt"] for e in mine if e["kind"] == "started"} == {killed, record.attempt}, mine
    assert not [e for e in mine if e["kind"] == "committed" and e.get("attempt") == killed], mine
    keys = store.list(unit + "/")
    assert not [k for k in keys if f"/{ATTEMPTS}/{killed}/" in k], f"the killed attempt left files: {keys}"
    assert fence_record(store, unit, record.attempt) is None

    committed = Counter(e["unit"] for e in events if e["kind"] == "committed")
    units = sorted(k[: -len(MARKER) - 1] for k in store.list(layout.root + "/") if k.endswith("/" + MARKER))
    assert set(committed) == set(units) and all(n == 1 for n in committed.values()), committed
    jobs = watch.jobs()
    prefix = f"vt-{CLEARED}-e0-rollout-b{HELD_BATCH}-"
    assert jobs.get(prefix + "a1") == "STOPPED" and jobs.get(prefix + "a2") == "SUCCEEDED", jobs

    reference = reference_result(stack)
    cfg = load_config(stack["yaml"], {"storage.uri": stack["store_uri"], "experiment": CLEARED})
    latest = status(cfg, store)["latest_snapshot"]
    print(f"weights_sha256: cleared run {latest['weights_sha256']} / fault-free reference "
          f"{reference['weights_sha256']}")
    assert latest["version"] == reference["version"] == 1
    assert latest["weights_sha256"] == reference["weights_sha256"]
    print(f"whole test body: {time.monotonic() - t0:.0f}s; actor stopped {stopped_s:.2f}s after the clear")
