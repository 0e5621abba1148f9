"""A rollout batch that fails for good, cleared the way a person clears it: in Airflow's own UI, in Chromium.

`airflow standalone` as ``make airflow`` runs it (LocalExecutor, SQLite, the verl-tasks plugin) serves a
DAG of a small tiny-arith (1 epoch, 2 rollout batches, no retries). The test's fault plan (tests/faults)
holds rollout batch 1 until batch 0 is committed, then makes it fail just before its commit: it fails for
good, alone. The person then:

1. opens the Training page and sees that batch's cell drawn failed, and the safe-mode panel whose first
   line names the unit and the Clear to do;
2. opens that task instance in Airflow's grid, presses Clear, checks Downstream and confirms;
3. sees the run succeed with nothing else done, and on the Training page the cell drawn committed and
   retried (2 tries, 1 failed), and no safe-mode panel.

The store then holds each unit committed once. Waits follow progress (task states, store events) and print
what they saw when they give up.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import faults
from tests.airflow.e2e_support import Api, Standalone, free_port, states, ti_key, wait_for

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]
DAG_ID, EXPERIMENT, ROLLOUT, BATCH = "vt_clear_ui", "clear-ui", "epoch_000.rollout", 1
STALL_S = float(os.environ.get("VT_E2E_STALL_S", "180"))  # a wait fails when nothing moved this long

pytestmark = [pytest.mark.airflow, pytest.mark.slow]

EXPERIMENT_YAML = """\
experiment: {experiment}
seed: 7
epochs: 1
model:
  source: tiny
  tiny:
    warm_start_steps: 100
data:
  train: builtin:arith
  eval: builtin:arith
  train_size: 200
  eval_size: 20
algorithm:
  group_size: 4
  minibatch_size: 32
rollout:
  engine: hf
  max_new_tokens: 5
  batches_per_epoch: 2
  prompts_per_batch: 8
evaluate:
  max_prompts: 20
fault_tolerance:
  retries: 0          # the planned failure is the task's only try: it fails for good
storage:
  uri: file://{store}
"""


@dataclass
class Stack:
    api: Api
    airflow: Standalone
    store_uri: str
    plan_dir: Path

    def watch(self, run_id: str):
        return Watch(self, run_id)


@contextmanager
def standalone_stack(root: Path) -> Iterator[Stack]:
    """`airflow standalone` with the settings ``make airflow`` uses, one inline DAG, the test's fault hooks."""
    store = root / "store"
    dags = root / "dags"
    (dags / "experiments").mkdir(parents=True)  # the Training page lists the DAGs folder's experiments/
    config = dags / "experiments" / f"{DAG_ID}.yaml"
    config.write_text(EXPERIMENT_YAML.format(experiment=EXPERIMENT, store=store))
    (dags / f"{DAG_ID}.py").write_text("from verl_tasks.airflow.factory import build_dag\n"
                                       f"dag = build_dag({str(config)!r}, backend='inline', gpu_pool='')\n")
    plan_dir = root / "fault-plan"
    plan_dir.mkdir()
    home = root / "airflow-home"
    home.mkdir()
    ports = set()
    while len(ports) < 3:
        ports.add(free_port())
    port, worker_logs, trigger_logs = sorted(ports)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "VERL_TASKS_", "RAY_"))}
    env.update(faults.harness_env(plan_dir, env))
    env.update({
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__PARALLELISM": "4",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        "AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": "60",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
        "AIRFLOW__API__SECRET_KEY": secrets.token_hex(16),
        "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
        "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "0.2",
        "AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL": "1",
        "AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT": "90",
        "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_THRESHOLD": "120",
        "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": "120",
        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(worker_logs),
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(trigger_logs),
        "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "300",
    })
    airflow = Standalone(home, port, env)
    airflow.start()
    try:
        api = Api(airflow.base_url)

        def diagnose() -> str:
            return f"standalone alive={airflow.alive()}; log tail:\n{airflow.log_tail()}"

        wait_for("the Airflow API", lambda: airflow.alive() and api.request("GET", "/api/v2/version"), 120,
                 diagnose=diagnose, progress=airflow.log_size, limit_s=900)
        wait_for(f"DAG {DAG_ID} to be parsed", lambda: api.request("GET", f"/api/v2/dags/{DAG_ID}"), 120,
                 diagnose=diagnose, progress=airflow.log_size, limit_s=600)
        yield Stack(api, airflow, f"file://{store}", plan_dir)
    finally:
        airflow.stop()


class Watch:
    """The run's task states and the store's events: what can move while the test waits."""

    def __init__(self, stack: Stack, run_id: str):
        from verl_tasks.layout import Layout
        from verl_tasks.store import open_store

        self.stack, self.run_id = stack, run_id
        self.store, self.layout = open_store(stack.store_uri), Layout(EXPERIMENT)

    def task_states(self) -> dict[str, Any]:
        return states(self.stack.api.task_instances(DAG_ID, self.run_id))

    def picture(self) -> tuple:
        tis = self.stack.api.task_instances(DAG_ID, self.run_id)
        return (tuple((ti_key(t), t["state"], t["try_number"]) for t in tis),
                len(self.store.list(self.layout.events + "/")))

    def diagnose(self) -> str:
        parts = [f"load average {os.getloadavg()}"]
        try:
            parts.append(f"task states: {json.dumps(self.task_states(), indent=1)}")
        except Exception as err:  # noqa: BLE001 - the diagnosis goes on without them
            parts.append(f"(no task states: {err})")
        for path, text in self.stack.airflow.task_logs(DAG_ID, self.run_id).items():
            parts.append(f"--- {path}\n" + "\n".join(text.splitlines()[-25:]))
        parts += [self.stack.airflow.component_tail(name, 30) for name in ("scheduler", "api-server")]
        return "\n".join(parts)[-20000:]

    def until(self, what: str, probe) -> Any:
        return wait_for(what, probe, STALL_S, every=2.0, diagnose=self.diagnose, progress=self.picture)

    def run_ends(self) -> str:
        def probe():
            state = self.stack.api.dag_run(DAG_ID, self.run_id)["state"]
            return state if state in ("success", "failed") else None

        return self.until(f"run {self.run_id} to end", probe)


@pytest.fixture
def stack(tmp_path) -> Iterator[Stack]:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: run `make system-packages` (it installs Debian's chromium)")
    with standalone_stack(tmp_path) as running:
        yield running


def test_a_failed_batch_cleared_in_the_airflow_ui_reruns_and_the_training_page_shows_it(stack, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    from verl_tasks.events import read_events
    from verl_tasks.ops.safe_mode import read_safe_mode
    from verl_tasks.store.units import MARKER

    api = stack.api
    held = faults.hold(stack.plan_dir, EXPERIMENT, 0, BATCH)
    run_id = "clear_ui_" + secrets.token_hex(3)
    watch = stack.watch(run_id)
    api.request("POST", f"/api/v2/dags/{DAG_ID}/dagRuns", {"dag_run_id": run_id, "logical_date": None})
    watch.until(f"rollout batch {BATCH} to be held", held.exists)
    watch.until("rollout batch 0 to commit", lambda: watch.store.exists(f"{watch.layout.rollout(0, 0)}/{MARKER}"))
    fired = faults.fail_at_commit(stack.plan_dir, EXPERIMENT, "rollout", 0, BATCH)
    faults.release(stack.plan_dir, EXPERIMENT, 0, BATCH)
    assert watch.run_ends() == "failed", watch.diagnose()
    seen = watch.task_states()
    assert seen[f"{ROLLOUT}[{BATCH}]"] == "failed" and seen[f"{ROLLOUT}[0]"] == "success", seen
    assert fired.exists(), "the planned fault never fired"
    unit = watch.layout.rollout(0, BATCH)
    halted = read_safe_mode(watch.store, watch.layout)
    assert halted is not None and halted["dag_id"] == DAG_ID, halted

    shots = tmp_path / "screens"
    shots.mkdir()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.set_default_timeout(60_000)
            expect.set_options(timeout=60_000)  # a loaded machine renders a page in seconds, not milliseconds

            def training_page():
                page.goto(f"{api.base}/", timeout=120_000)
                page.get_by_role("link", name="Training").click()
                frame = page.frame_locator("iframe")
                expect(frame.locator("h2")).to_have_text(EXPERIMENT)
                return frame

            # 1. The Training page: the batch drawn failed; the safe-mode panel's first line says what to do.
            frame = training_page()
            cell = frame.locator(f'table.grid a[title^="{unit}:"]')
            expect(cell).to_have_class(re.compile(r"\bfailed\b"))
            expect(cell).to_have_attribute("title", re.compile(r"failed for good: Clear its task"))
            first = frame.locator("div.safe-mode p.safe-mode-first")
            expect(first).to_contain_text(f"SAFE MODE: {unit} failed after all its retries.")
            expect(first).to_contain_text(f"To continue: Clear {ROLLOUT} (map index {BATCH}) in DAG {DAG_ID} "
                                          "with Downstream checked")
            page.screenshot(path=str(shots / "1-failed.png"), full_page=True)

            # 2. Airflow's own Clear of that map index, Downstream checked.
            page.goto(f"{api.base}/dags/{DAG_ID}/runs/{run_id}/tasks/{ROLLOUT}/mapped/{BATCH}", timeout=120_000)
            page.get_by_role("button", name="Press shift+c to clear").click()  # the task instance's Clear
            dialog = page.get_by_role("dialog")
            expect(dialog).to_contain_text(f"Clear Task Instance: {ROLLOUT}")
            # Downstream is checked (Airflow's default): the affected tasks list the epoch's update, not batch 0.
            expect(dialog.get_by_role("button", name="Downstream", exact=True)).to_be_visible()
            expect(dialog.get_by_text("epoch_000.update", exact=True)).to_have_count(1)
            expect(dialog.get_by_role("row").filter(has_text=ROLLOUT)).to_have_count(1)
            page.screenshot(path=str(shots / "2-clear-dialog.png"), full_page=True)
            dialog.get_by_role("button", name="Confirm", exact=True).click()
            expect(dialog).to_be_hidden()

            assert watch.run_ends() == "success", watch.diagnose()
            seen = watch.task_states()
            assert set(seen.values()) == {"success"}, seen

            # 3. The Training page after the Clear: committed, retried once, safe mode gone.
            frame = training_page()
            cell = frame.locator(f'table.grid a[title^="{unit}:"]')
            expect(cell).to_have_class(re.compile(r"\bcommitted\b.*\bretried\b"))
            expect(cell).to_have_attribute("title", re.compile(r"committed, 2 attempt\(s\), 1 failed"))
            expect(cell).to_have_text("2")
            expect(frame.locator("table.grid a.retried")).to_have_count(1)
            expect(frame.locator("div.safe-mode")).to_have_count(0)
            page.screenshot(path=str(shots / "3-retried.png"), full_page=True)
        finally:
            browser.close()

    assert read_safe_mode(watch.store, watch.layout) is None
    events = read_events(watch.store, watch.layout)
    lifted = [e for e in events if e["kind"] == "resumed"]
    assert len(lifted) == 1 and lifted[0]["by"] == "clear", lifted
    committed = Counter(e["unit"] for e in events if e["kind"] == "committed")
    markers = {k[: -len(MARKER) - 1] for k in watch.store.list(watch.layout.root + "/") if k.endswith("/" + MARKER)}
    assert set(committed) == markers and set(committed.values()) == {1}, committed
