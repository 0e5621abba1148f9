"""Chaos matrix, cluster faults (rows 1, 9, 10) on the real stack: Airflow 3.3 run as
separate components (api-server, scheduler, dag-processor, triggerer; LocalExecutor, PostgreSQL),
a project-local Ray head (token auth on), S3 on a moto server. One stack per module.

1. a rollout unit's worker process (the ``PoolWorker`` actor of its rollout pool running it) is SIGKILLed in
   the middle of its batch: the Ray job fails, Airflow retries it, Ray restarts the actor;
9. the Ray head is stopped (SIGTERM to its process group) and started again on the same ports with
   the same token while a rollout is running: the actor and the job history go with the head; the
   task fails, its retries run the unit again on the new head, the epoch finishes;
10. the scheduler's process group is SIGKILLed while a rollout is running (deferred) and started
    again: the run completes.

"Mid-batch" is made reliable with the test-only hold hook (``tests/faults``: every process the
stack starts loads it through ``sitecustomize``): the seeded batch waits after loading the policy
and before generating, and tells its PID. Each test then checks: the run succeeds; every unit is committed
exactly once (its only attempt folder is the one its marker names; no ``lost_race``); no sample
id is lost or duplicated; the final ``weights_sha256`` equals the fault-free reference.

    .venv/bin/python -m pytest tests/chaos/test_cluster_faults.py -m chaos -s
"""
from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import faults
from tests.airflow.e2e_support import (
    Api,
    PgDatabase,
    _group_alive,
    free_port,
    pg_user,
    standalone_env,
    states,
    ti_key,
    wait_for,
)

from . import util

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.airflow]

DAG_ID = "vt_chaos_cluster"
CONN_ID = "vt_chaos_s3"
AWS_KEY, AWS_SECRET = "testing-key-id", "testing-secret-value"
ROLLOUT = "epoch_000.rollout"
BATCHES = 2
VENV_BIN = Path(sys.executable).parent
STALL_S = float(os.environ.get("VT_E2E_STALL_S", "180"))  # a wait fails when nothing moved this long

EXPERIMENT_YAML = """\
experiment: chaos-cluster
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
  every: 0
  max_prompts: 8
fault_tolerance:
  retries: 4              # automatic retries recover (a head restart can cost two tries)
  retry_delay_s: 1
  max_retry_delay_s: 8
  max_failed_batch_fraction: 1.0
storage:
  uri: {uri}
  aws_conn_id: {conn_id}
resources:
  rollout: {{workers: 2}}  # one pool worker per batch: killing batch b's worker leaves the other batch alone
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


@dataclass
class Component:
    """One Airflow component as a process group we own (started, SIGKILLed, restarted by PID)."""

    name: str
    home: Path
    env: dict[str, str]
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.home / f"{self.name}.log", "ab") as out:
            self.proc = subprocess.Popen([str(VENV_BIN / "airflow"), self.name], env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True, cwd=str(self.home))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL, wait_s: float = 15) -> None:
        if self.proc is None:
            return
        pgid = self.proc.pid
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and (self.proc.poll() is None or _group_alive(pgid)):
            time.sleep(0.2)
        if _group_alive(pgid):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def tail(self, lines: int = 25) -> str:
        try:
            text = (self.home / f"{self.name}.log").read_text(errors="replace")
        except OSError:
            return ""
        return f"--- {self.name} (alive={self.alive()})\n" + "\n".join(text.splitlines()[-lines:])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, moto_endpoint):
    import boto3

    from verl_tasks.execution import local_head

    user = pg_user()
    if user is None:
        pytest.skip("no PostgreSQL with trust auth at 127.0.0.1:5432")
    tmp = tmp_path_factory.mktemp("chaos-cluster")
    with ExitStack() as stop, pytest.MonkeyPatch.context() as mp:
        db = PgDatabase.create(user)
        stop.callback(db.drop)
        bucket = f"vt-chaos-{secrets.token_hex(4)}"
        boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1", aws_access_key_id=AWS_KEY,
                     aws_secret_access_key=AWS_SECRET).create_bucket(Bucket=bucket)
        store_uri = f"s3://{bucket}/runs"

        dags = tmp / "dags"
        (dags / "experiments").mkdir(parents=True)
        yaml_path = dags / "experiments" / f"{DAG_ID}.yaml"
        yaml_path.write_text(EXPERIMENT_YAML.format(uri=store_uri, conn_id=CONN_ID))
        (dags / f"{DAG_ID}.py").write_text(DAG_FILE.format(dag_id=DAG_ID))

        ref_log = open(tmp / "reference.log", "w")
        stop.callback(ref_log.close)
        reference = subprocess.Popen([sys.executable, "-c", REFERENCE, str(yaml_path), str(tmp / "reference")],
                                     stdout=subprocess.PIPE, stderr=ref_log, text=True, cwd=str(tmp))
        stop.callback(lambda: reference.poll() is None and reference.kill())

        hold_dir = tmp / "hold"
        hold_dir.mkdir()
        # The head's workers (the pool actors) inherit this environment, the fault hooks with it.
        mp.setenv("AWS_ACCESS_KEY_ID", AWS_KEY)
        mp.setenv("AWS_SECRET_ACCESS_KEY", AWS_SECRET)
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("VERL_TASKS_S3_ENDPOINT", moto_endpoint)
        for key, value in faults.harness_env(hold_dir).items():
            mp.setenv(key, value)
        taken: set[int] = set()

        def pick(span: int = 1) -> int:
            while True:
                base = free_port(span)
                if not taken & set(range(base, base + span)):
                    taken.update(range(base, base + span))
                    return base

        ray_port, dash_port = pick(2), pick(5)
        head_state = tmp / "ray-head"
        head_env = {"VERL_TASKS_RAY_ADDRESS": f"http://127.0.0.1:{dash_port}",
                    "RAY_AUTH_TOKEN_PATH": str(head_state.resolve() / "auth_token")}
        home = tmp / "airflow-home"
        (home / "plugins").mkdir(parents=True)
        port = pick()
        env = standalone_env(
            home, dags, home / "plugins", port, (pick(), pick()), db.sync_url,
            AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC=db.async_url,
            # A restarted scheduler resets the orphans of its killed predecessor soon (default: every 300 s).
            AIRFLOW__SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL="10",
            AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT="60",
            **{f"AIRFLOW_CONN_{CONN_ID.upper()}": json.dumps({
                "conn_type": "aws", "login": AWS_KEY, "password": AWS_SECRET,
                "extra": {"endpoint_url": moto_endpoint, "region_name": "us-east-1"}}),
               "AIRFLOW_CONN_VERL_AIRFLOW_API": json.dumps({"conn_type": "http", "host": "127.0.0.1", "port": port})},
            **head_env)
        started = time.monotonic()
        migrate = subprocess.Popen([str(VENV_BIN / "airflow"), "db", "migrate"], env=env, cwd=str(home),
                                   stdout=open(home / "migrate.log", "wb"), stderr=subprocess.STDOUT,
                                   start_new_session=True)
        stop.callback(lambda: migrate.poll() is None and os.killpg(migrate.pid, signal.SIGKILL))
        stop.callback(shutil.rmtree, f"/tmp/vt-ray-{ray_port}", True)
        # At once: with actors alive a SIGTERMed head outlasts the 30 s grace.
        stop.callback(local_head.stop, head_state, 0)
        head = local_head.start(head_state, port=ray_port, dashboard_port=dash_port, num_cpus=8)
        assert head.client_env() == head_env
        assert migrate.wait(timeout=300) == 0, (home / "migrate.log").read_text()[-3000:]
        parts = {name: Component(name, home, env) for name in ("api-server", "scheduler", "dag-processor", "triggerer")}
        for part in parts.values():
            part.start()
            stop.callback(part.kill)  # SIGKILL: the tests are done; a graceful stop costs up to 15 s a component
        api = Api(f"http://127.0.0.1:{port}")

        def diagnose() -> str:
            return "\n".join(p.tail() for p in parts.values())

        def logs_size() -> int:  # starting up, the components' logs grow while anything happens
            return sum(p.stat().st_size for p in home.glob("*.log"))

        wait_for("the Airflow API", lambda: api.request("GET", "/api/v2/version"), 120, every=2.0,
                 diagnose=diagnose, progress=logs_size, limit_s=900)
        wait_for(f"DAG {DAG_ID} to be parsed", lambda: api.dag_parsed(DAG_ID), 120, every=2.0,
                 diagnose=diagnose, progress=logs_size, limit_s=600)
        for path in ("/execution/health", "/execution/health/ping"):
            try:
                api.request("GET", path, timeout=120)
            except Exception as err:  # noqa: BLE001 - only a warm-up
                print(f"warm-up {path}: {err}")
        api.request("POST", "/api/v2/pools", {"name": "verl_gpu", "slots": 2, "description": "chaos"})
        print(f"\nchaos cluster ready in {time.monotonic() - started:.0f}s")

        out, _ = reference.communicate(timeout=600)
        assert reference.returncode == 0, (tmp / "reference.log").read_text()[-4000:]
        ref = json.loads(out.strip().splitlines()[-1])
        yield {"api": api, "parts": parts, "head_state": head_state, "ports": (ray_port, dash_port),
               "store_uri": store_uri, "endpoint": moto_endpoint, "hold": hold_dir, "yaml": yaml_path,
               "reference": ref, "diagnose": diagnose, "home": home}


# -- helpers -----------------------------------------------------------------------------------
def _store(cluster):
    from verl_tasks.store import open_store

    return open_store(cluster["store_uri"], endpoint_url=cluster["endpoint"],
                      credentials={"aws_access_key_id": AWS_KEY, "aws_secret_access_key": AWS_SECRET})


def _diagnose(cluster, run_id: str) -> str:
    api: Api = cluster["api"]
    try:
        tis = json.dumps(states(api.task_instances(DAG_ID, run_id)), indent=1)
    except Exception as err:  # noqa: BLE001
        tis = f"(no task states: {err})"
    logs = []
    root = cluster["home"] / "logs" / f"dag_id={DAG_ID}" / f"run_id={run_id}"
    for path in sorted(root.rglob("*.log")) if root.exists() else []:
        logs.append(f"--- {path.relative_to(root)}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:]))
    return f"task states: {tis}\n" + "\n".join(logs)[-8000:] + "\n" + cluster["diagnose"]()


def _picture(cluster, run_id: str) -> tuple:
    """What can move in a run: task states and tries, the experiment's store events, its Ray jobs."""
    from verl_tasks.layout import Layout

    experiment = run_id.removeprefix("chaos_")
    tis = cluster["api"].task_instances(DAG_ID, run_id)
    events = len(_store(cluster).list(Layout(experiment).events + "/"))
    jobs = tuple(sorted(_ray_jobs(cluster, experiment).items()))
    return tuple((ti_key(t), t["state"], t["try_number"]) for t in tis), events, jobs


def _wait(cluster, run_id: str, what: str, probe, every: float = 1.0):
    """``probe`` until truthy; give up only when nothing in the run moved for ``STALL_S``."""
    return wait_for(what, probe, STALL_S, every=every, diagnose=lambda: _diagnose(cluster, run_id),
                    progress=lambda: _picture(cluster, run_id))


def _trigger(cluster, experiment: str) -> str:
    api: Api = cluster["api"]
    api.request("PATCH", f"/api/v2/dags/{DAG_ID}", {"is_paused": False})
    run_id = f"chaos_{experiment}"
    api.request("POST", f"/api/v2/dags/{DAG_ID}/dagRuns",
                {"dag_run_id": run_id, "logical_date": None, "conf": {"experiment": experiment}})
    return run_id


def _ti_state(cluster, run_id: str, key: str) -> str | None:
    return states(cluster["api"].task_instances(DAG_ID, run_id)).get(key)


def _hold(cluster, experiment: str, batch: int) -> Path:
    """Plan the hold of rollout ``batch`` of epoch 0; returns the file that will name the held PID."""
    return faults.hold(cluster["hold"], experiment, 0, batch)


def _wait_held(cluster, run_id: str, held: Path) -> int:
    _wait(cluster, run_id, f"{held.stem} to reach the middle of its batch", held.exists, every=0.5)
    time.sleep(0.2)
    return int(held.read_text())


def _release(cluster, experiment: str, batch: int) -> None:
    faults.release(cluster["hold"], experiment, 0, batch)


def _wait_success(cluster, run_id: str) -> None:
    api: Api = cluster["api"]

    def terminal():
        state = api.dag_run(DAG_ID, run_id)["state"]
        return state if state in ("success", "failed") else None

    state = _wait(cluster, run_id, f"run {run_id} to finish", terminal, every=2.0)
    assert state == "success", f"run {run_id} {state}\n{_diagnose(cluster, run_id)}"


def _check_storage(cluster, experiment: str) -> Counter:
    """Exactly-once, sample ids, weights; returns how many times each unit was started."""
    from verl_tasks.events import read_events
    from verl_tasks.layout import Layout
    from verl_tasks.store.units import ATTEMPTS, MARKER, read_jsonl, read_marker

    store, layout = _store(cluster), Layout(experiment)
    keys = store.list(layout.root + "/")
    units = sorted(k[: -len(MARKER) - 1] for k in keys if k.endswith("/" + MARKER))
    attempts: dict[str, set[str]] = {}
    for key in keys:
        at = key.find(f"/{ATTEMPTS}/")
        if at >= 0:
            attempts.setdefault(key[:at], set()).add(key[at + len(ATTEMPTS) + 2:].split("/", 1)[0])
    expected = {layout.unit(p, 0, b) for p in ("rollout", "score") for b in range(BATCHES)}
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
    assert not kinds["lost_race"] and not kinds["quarantined"] and not kinds["safe_mode"], kinds
    ids: list[str] = []
    for b in range(BATCHES):
        rollout = read_marker(store, layout.rollout(0, b))
        rows = read_jsonl(store, rollout, "samples.jsonl")
        assert len(rows) == 8 * 4
        ids += [r["sample_id"] for r in rows]
        scored = {r["sample_id"] for r in read_jsonl(store, read_marker(store, layout.score(0, b)), "scores.jsonl")}
        assert scored == {r["sample_id"] for r in rows}, f"scores of batch {b} do not match its samples"
    assert len(ids) == len(set(ids)) == BATCHES * 8 * 4, "lost or duplicate sample ids"
    latest = json.loads(store.get(layout.latest))
    ref = cluster["reference"]
    print(f"weights_sha256 {latest['weights_sha256']} / reference {ref['weights_sha256']}")
    assert latest["version"] == ref["version"] == 1
    assert latest["weights_sha256"] == ref["weights_sha256"]
    return Counter(e["unit"] for e in events if e["kind"] == "started")


def _redone(started: Counter) -> list[str]:
    return sorted(u for u, n in started.items() if n > 1)


def _jobs_client(cluster):
    from verl_tasks.execution.local_head import read_info
    from verl_tasks.execution.ray_jobs import RayJobBackend, RayTarget, read_token

    info = read_info(cluster["head_state"])
    return RayJobBackend(RayTarget(info.address, read_token(info.token_file))).client


def _ray_jobs(cluster, experiment: str) -> dict[str, str]:
    return {j.submission_id: str(getattr(j.status, "value", j.status)) for j in _jobs_client(cluster).list_jobs()
            if (j.submission_id or "").startswith(f"vt-{experiment}-")}


def _job_log(cluster, job_id: str) -> str:
    return _jobs_client(cluster).get_job_logs(job_id)


def _rng(fault: str) -> random.Random:
    return random.Random(f"{util.SEED}/{fault}")


# -- the tests ---------------------------------------------------------------------------------
def test_rollout_worker_sigkilled_mid_batch(cluster):
    rng = _rng("rollout_worker_sigkill")
    batch = rng.randrange(BATCHES)
    experiment = f"chaos-kill-{secrets.token_hex(2)}"
    held = _hold(cluster, experiment, batch)
    t0 = time.monotonic()
    run_id = _trigger(cluster, experiment)
    try:
        pid = _wait_held(cluster, run_id, held)
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        assert "ray" in cmdline.lower(), f"pid {pid} is not a Ray worker: {cmdline}"
        print(f"\nbatch {batch} held in pid {pid} ({cmdline[:80]}); SIGKILL")
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
    finally:
        _release(cluster, experiment, batch)
    _wait(cluster, run_id, f"{ROLLOUT}[{batch}] to succeed again",
          lambda: _ti_state(cluster, run_id, f"{ROLLOUT}[{batch}]") == "success")
    recovery_s = time.monotonic() - killed_at
    _wait_success(cluster, run_id)
    print(f"run succeeded {time.monotonic() - t0:.0f}s after the trigger; unit recovered in {recovery_s:.1f}s")

    started = _check_storage(cluster, experiment)
    redone = _redone(started)
    from verl_tasks.layout import Layout

    assert redone == [Layout(experiment).rollout(0, batch)], started
    jobs = _ray_jobs(cluster, experiment)
    prefix = f"vt-{experiment}-e0-rollout-b{batch}-"
    # Ray restarts the actor (max_restarts=-1). Either it fails the killed call (the job fails, Airflow's
    # retry is job a2) or it reports the actor as restarting, and the job sends the same attempt to the
    # restarted actor (pools.run_unit): the unit is redone inside job a1.
    if prefix + "a2" in jobs:
        assert jobs.pop(prefix + "a1") == "FAILED" and jobs.pop(prefix + "a2") == "SUCCEEDED", jobs
        recovery = "automatic Airflow retry (job a2) on the restarted pool actor"
    else:
        assert jobs.pop(prefix + "a1") == "SUCCEEDED", jobs
        assert "sending it again" in _job_log(cluster, prefix + "a1")
        recovery = "the job sent its attempt again to the restarted pool actor (no Airflow retry)"
    assert all(s == "SUCCEEDED" and j.endswith("-a1") for j, s in jobs.items()), jobs
    util.record("rollout_worker_sigkill", recovery_s=round(recovery_s, 1), redone_units=len(redone),
                recovery=recovery, redone=redone)


def test_ray_head_restarted_during_epoch(cluster):
    from verl_tasks.execution import local_head

    rng = _rng("ray_head_restart")
    batch = rng.randrange(BATCHES)
    experiment = f"chaos-head-{secrets.token_hex(2)}"
    held = _hold(cluster, experiment, batch)
    t0 = time.monotonic()
    run_id = _trigger(cluster, experiment)
    ray_port, dash_port = cluster["ports"]
    try:
        _wait_held(cluster, run_id, held)
        print(f"\nbatch {batch} held; restarting the Ray head")
        stopped_at = time.monotonic()
        assert local_head.stop(cluster["head_state"]), "the head was not running"
    finally:
        _release(cluster, experiment, batch)
    time.sleep(rng.uniform(1, 4))  # the cluster stays down a (seeded) moment
    local_head.start(cluster["head_state"], port=ray_port, dashboard_port=dash_port, num_cpus=8)
    head_down_s = time.monotonic() - stopped_at
    print(f"head back after {head_down_s:.1f}s")
    _wait(cluster, run_id, f"{ROLLOUT}[{batch}] to succeed again",
          lambda: _ti_state(cluster, run_id, f"{ROLLOUT}[{batch}]") == "success")
    recovery_s = time.monotonic() - stopped_at
    _wait_success(cluster, run_id)
    print(f"run succeeded {time.monotonic() - t0:.0f}s after the trigger; "
          f"unit recovered {recovery_s:.1f}s after the stop")

    started = _check_storage(cluster, experiment)
    redone = _redone(started)
    from verl_tasks.layout import Layout

    # The held unit was killed with the head and redone, or its worker outlived the stopped raylet
    # long enough to finish it (the store is not on the cluster) and the retry found its marker.
    held_unit = Layout(experiment).rollout(0, batch)
    assert started[held_unit] in (1, 2), started
    # only units in flight at the restart can have been redone: rollouts of this epoch
    assert all("/rollout/" in u for u in redone), redone
    tries = {ti_key(t): t["try_number"] for t in cluster["api"].task_instances(DAG_ID, run_id)}
    assert tries[f"{ROLLOUT}[{batch}]"] >= 2, tries
    util.record("ray_head_restart", recovery_s=round(recovery_s, 1), redone_units=len(redone),
                head_down_s=round(head_down_s, 1),
                recovery="automatic Airflow retries resubmit to the restarted head; the pool actors are recreated"
                         + ("" if held_unit in redone else " (the held unit had committed before its worker died)"),
                redone=redone)


def test_scheduler_restarted_during_run(cluster):
    rng = _rng("scheduler_restart")
    batch = rng.randrange(BATCHES)
    experiment = f"chaos-sched-{secrets.token_hex(2)}"
    scheduler: Component = cluster["parts"]["scheduler"]
    held = _hold(cluster, experiment, batch)
    t0 = time.monotonic()
    run_id = _trigger(cluster, experiment)
    try:
        _wait_held(cluster, run_id, held)
        # Kill while no task holds a worker slot (the held rollout is deferred in the triggerer).
        _wait(cluster, run_id, "no running task instance", lambda: not {"running", "queued"} & set(
            states(cluster["api"].task_instances(DAG_ID, run_id)).values()), every=0.3)
        print(f"\nbatch {batch} held; SIGKILL the scheduler's process group ({scheduler.proc.pid})")
        killed_at = time.monotonic()
        scheduler.kill(signal.SIGKILL)
    finally:
        _release(cluster, experiment, batch)  # the job finishes while no scheduler runs
    time.sleep(rng.uniform(3, 8))
    scheduler.start()
    restarted_at = time.monotonic()
    _wait(cluster, run_id, f"{ROLLOUT}[{batch}] to succeed",
          lambda: _ti_state(cluster, run_id, f"{ROLLOUT}[{batch}]") == "success")
    recovery_s = time.monotonic() - killed_at
    _wait_success(cluster, run_id)
    print(f"run succeeded {time.monotonic() - t0:.0f}s after the trigger; held unit done {recovery_s:.1f}s after "
          f"the kill ({time.monotonic() - restarted_at:.1f}s after the restart to run success)")

    started = _check_storage(cluster, experiment)
    redone = _redone(started)
    assert not redone, started
    util.record("scheduler_restart", recovery_s=round(recovery_s, 1), redone_units=len(redone),
                scheduler_down_s=round(restarted_at - killed_at, 1),
                recovery="restart the scheduler; deferred tasks and Ray jobs carry on, the run completes")
