"""Rollout batches that fail for good, cleared the way a person clears them: in Airflow's own UI, in Chromium.

`airflow standalone` as ``make airflow`` runs it (LocalExecutor, SQLite, the verl-tasks plugin) serves two
DAGs of a small tiny-arith (1 epoch, 2 rollout batches, no retries), each its own experiment; the test's
fault plan (tests/faults) decides what fails, and when.

* One batch fails alone (held until batch 0 is committed, then failed just before its commit). The Training
  page draws it failed, and the safe-mode panel's first line names the unit and the Clear to do: that
  task instance, Downstream checked. The person clears it from the task instance's page; the run succeeds
  and the page draws the batch committed and retried (2 tries, 1 failed), with no safe-mode panel.
* Batch 1 fails while batch 0 waits to start; once released, batch 0 is refused by safe mode. The page
  draws batch 0 refused, and the first line asks for the run's Clear of its failed tasks. The person
  follows its link to the run, clears it with "Clear only failed tasks", and both batches commit.

Afterwards each store holds every unit committed once, and one lift of safe mode. Waits follow progress
(task states, store events) and print what they saw when they give up.
"""
from __future__ import annotations

import json
import os
import re
import secrets
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import faults
from tests.airflow.e2e_support import (
    SLOW_HEARTBEATS,
    Api,
    Standalone,
    free_port,
    standalone_env,
    states,
    ti_key,
    wait_for,
)

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]
ROLLOUT = "epoch_000.rollout"
EXPERIMENTS = {"vt_clear_one": "clear-one", "vt_clear_run": "clear-run"}  # DAG id -> its experiment
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
  lr: 0.0001
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

    def trigger(self, dag_id: str) -> Watch:
        run_id = f"{dag_id}_{secrets.token_hex(3)}"
        watch = Watch(self, dag_id, run_id)
        self.api.request("POST", f"/api/v2/dags/{dag_id}/dagRuns", {"dag_run_id": run_id, "logical_date": None})
        return watch


@contextmanager
def standalone_stack(root: Path) -> Iterator[Stack]:
    """`airflow standalone` with the settings ``make airflow`` uses, the inline DAGs, the test's fault hooks."""
    store = root / "store"
    dags = root / "dags"
    (dags / "experiments").mkdir(parents=True)  # the Training page lists the DAGs folder's experiments/
    for dag_id, experiment in EXPERIMENTS.items():
        config = dags / "experiments" / f"{dag_id}.yaml"
        config.write_text(EXPERIMENT_YAML.format(experiment=experiment, store=store))
        (dags / f"{dag_id}.py").write_text("from verl_tasks.airflow.factory import build_dag\n"
                                           f"dag = build_dag({str(config)!r}, backend='inline', gpu_pool='')\n")
    plan_dir = root / "fault-plan"
    plan_dir.mkdir()
    home = root / "airflow-home"
    home.mkdir()
    ports = set()
    while len(ports) < 3:
        ports.add(free_port())
    port, worker_logs, trigger_logs = sorted(ports)
    env = standalone_env(home, dags, REPO / "plugins", port, (worker_logs, trigger_logs),
                         f"sqlite:///{home}/airflow.db", **SLOW_HEARTBEATS)
    env.update(faults.harness_env(plan_dir, env))
    airflow = Standalone(home, port, env)
    airflow.start()
    try:
        api = Api(airflow.base_url)

        def diagnose() -> str:
            return f"standalone alive={airflow.alive()}; log tail:\n{airflow.log_tail()}"

        wait_for("the Airflow API", lambda: airflow.api_version(api), 120,
                 diagnose=diagnose, progress=airflow.log_size, limit_s=900)
        for dag_id in EXPERIMENTS:
            wait_for(f"DAG {dag_id} to be parsed", lambda d=dag_id: api.dag_parsed(d), 120,
                     diagnose=diagnose, progress=airflow.log_size, limit_s=600)
        yield Stack(api, airflow, f"file://{store}", plan_dir)
    finally:
        airflow.stop()


class Watch:
    """One DAG run's task states and its experiment's store: what can move while the test waits."""

    def __init__(self, stack: Stack, dag_id: str, run_id: str):
        from verl_tasks.layout import Layout
        from verl_tasks.store import open_store

        self.stack, self.dag_id, self.run_id, self.experiment = stack, dag_id, run_id, EXPERIMENTS[dag_id]
        self.store, self.layout = open_store(stack.store_uri), Layout(self.experiment)

    def task_states(self) -> dict[str, Any]:
        return states(self.stack.api.task_instances(self.dag_id, self.run_id))

    def picture(self) -> tuple:
        tis = self.stack.api.task_instances(self.dag_id, self.run_id)
        return (tuple((ti_key(t), t["state"], t["try_number"]) for t in tis),
                len(self.store.list(self.layout.events + "/")))

    def diagnose(self) -> str:
        parts = [f"load average {os.getloadavg()}"]
        try:
            parts.append(f"task states: {json.dumps(self.task_states(), indent=1)}")
        except Exception as err:  # noqa: BLE001 - the diagnosis goes on without them
            parts.append(f"(no task states: {err})")
        for path, text in self.stack.airflow.task_logs(self.dag_id, self.run_id).items():
            parts.append(f"--- {path}\n" + "\n".join(text.splitlines()[-25:]))
        parts += [self.stack.airflow.component_tail(name, 30) for name in ("scheduler", "api-server")]
        return "\n".join(parts)[-20000:]

    def until(self, what: str, probe) -> Any:
        return wait_for(what, probe, STALL_S, every=2.0, diagnose=self.diagnose, progress=self.picture)

    def tries(self) -> dict[str, int]:
        return {ti_key(t): t["try_number"] for t in self.stack.api.task_instances(self.dag_id, self.run_id)}

    def cleared(self, task: str, tries_before: int) -> None:
        """Wait until the Clear gave ``task`` a new try: the dialog closes before the run's state leaves
        ``failed``, so a run read at once may still be the failed one."""
        self.until(f"the Clear to give {task} a new try", lambda: self.tries()[task] > tries_before)

    def run_ends(self) -> str:
        def probe():
            state = self.stack.api.dag_run(self.dag_id, self.run_id)["state"]
            return state if state in ("success", "failed") else None

        return self.until(f"run {self.run_id} to end", probe)

    def committed(self, batch: int) -> bool:
        from verl_tasks.store.units import MARKER

        return self.store.exists(f"{self.layout.rollout(0, batch)}/{MARKER}")

    def check_store(self) -> None:
        """Safe mode lifted once, by a clear; every unit committed once, each with its marker."""
        from verl_tasks.events import read_events
        from verl_tasks.ops.safe_mode import read_safe_mode
        from verl_tasks.store.units import MARKER

        assert read_safe_mode(self.store, self.layout) is None
        events = read_events(self.store, self.layout)
        lifted = [e for e in events if e["kind"] == "resumed"]
        assert len(lifted) == 1 and lifted[0]["by"] == "clear", lifted
        committed = Counter(e["unit"] for e in events if e["kind"] == "committed")
        markers = {k[: -len(MARKER) - 1] for k in self.store.list(self.layout.root + "/") if k.endswith("/" + MARKER)}
        assert set(committed) == markers and set(committed.values()) == {1}, committed


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: run `make system-packages` (it installs Debian's chromium)")
    with standalone_stack(tmp_path_factory.mktemp("clear-in-browser")) as running:
        yield running


@contextmanager
def browser_page(stack: Stack, shots: Path):
    """A Chromium page on the stack's UI (all-admins: no login) and a function that opens the Training page
    of an experiment and returns its frame."""
    from playwright.sync_api import expect, sync_playwright

    shots.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.set_default_timeout(60_000)
            expect.set_options(timeout=60_000)  # a loaded machine renders a page in seconds, not milliseconds

            def training(experiment: str):
                page.goto(f"{stack.api.base}/", timeout=120_000)
                page.get_by_role("link", name="Training").click()
                frame = page.frame_locator("iframe")
                frame.get_by_role("navigation", name="experiments").get_by_role("link", name=experiment).click()
                expect(frame.locator("h2")).to_have_count(1)  # the page of that experiment alone
                expect(frame.locator("h2")).to_have_text(experiment)
                return frame

            yield page, training
        finally:
            browser.close()


def test_a_batch_failed_alone_is_cleared_from_its_task_instance_and_drawn_retried(stack, tmp_path):
    from playwright.sync_api import expect

    from verl_tasks.ops.safe_mode import read_safe_mode

    dag_id, batch = "vt_clear_one", 1
    experiment = EXPERIMENTS[dag_id]
    held = faults.hold(stack.plan_dir, experiment, 0, batch)
    watch = stack.trigger(dag_id)
    watch.until(f"rollout batch {batch} to be held", held.exists)
    watch.until("rollout batch 0 to commit", lambda: watch.committed(0))
    fired = faults.fail_at_commit(stack.plan_dir, experiment, "rollout", 0, batch)
    faults.release(stack.plan_dir, experiment, 0, batch)
    assert watch.run_ends() == "failed", watch.diagnose()
    seen = watch.task_states()
    assert seen[f"{ROLLOUT}[{batch}]"] == "failed" and seen[f"{ROLLOUT}[0]"] == "success", seen
    assert fired.exists(), "the planned fault never fired"
    unit = watch.layout.rollout(0, batch)
    halted = read_safe_mode(watch.store, watch.layout)
    assert halted is not None and halted["dag_id"] == dag_id, halted

    shots = tmp_path / "screens"
    with browser_page(stack, shots) as (page, training):
        # 1. The Training page: the batch drawn failed; the safe-mode panel's first line says what to do.
        frame = training(experiment)
        cell = frame.locator(f'table.grid a[title^="{unit}:"]')
        expect(cell).to_have_class(re.compile(r"\bfailed\b"))
        expect(cell).to_have_attribute("title", re.compile(r"failed for good: Clear its task"))
        first = frame.locator("div.safe-mode p.safe-mode-first")
        expect(first).to_contain_text(f"SAFE MODE: {unit} failed after all its retries.")
        expect(first).to_contain_text(f"To continue: Clear {ROLLOUT} (map index {batch}) in DAG {dag_id} "
                                      "with Downstream checked")
        page.screenshot(path=str(shots / "1-failed.png"), full_page=True)

        # 2. The panel's link opens the task instance in Airflow's grid; its Clear, Downstream checked.
        first.get_by_role("link", name=ROLLOUT).click()
        expect(page).to_have_url(re.compile(rf"/dags/{dag_id}/runs/{watch.run_id}/tasks/{ROLLOUT}/mapped/{batch}$"))
        page.get_by_role("button", name="Press shift+c to clear").click()  # the task instance's Clear
        dialog = page.get_by_role("dialog")
        expect(dialog).to_contain_text(f"Clear Task Instance: {ROLLOUT}")
        # Downstream is checked (Airflow's default): the affected tasks list the epoch's update, not batch 0.
        expect(dialog.get_by_role("button", name="Downstream", exact=True)).to_be_visible()
        expect(dialog.get_by_text("epoch_000.update", exact=True)).to_have_count(1)
        expect(dialog.get_by_role("row").filter(has_text=ROLLOUT)).to_have_count(1)
        page.screenshot(path=str(shots / "2-clear-dialog.png"), full_page=True)
        tries = watch.tries()[f"{ROLLOUT}[{batch}]"]
        dialog.get_by_role("button", name="Confirm", exact=True).click()
        expect(dialog).to_be_hidden()
        watch.cleared(f"{ROLLOUT}[{batch}]", tries)

        assert watch.run_ends() == "success", watch.diagnose()
        assert set(watch.task_states().values()) == {"success"}, watch.task_states()

        # 3. The Training page after the Clear: committed, retried once, safe mode gone.
        frame = training(experiment)
        cell = frame.locator(f'table.grid a[title^="{unit}:"]')
        expect(cell).to_have_class(re.compile(r"\bcommitted\b.*\bretried\b"))
        expect(cell).to_have_attribute("title", re.compile(r"committed, 2 attempt\(s\), 1 failed"))
        expect(cell).to_have_text("2")
        expect(frame.locator("table.grid a.retried")).to_have_count(1)
        expect(frame.locator("div.safe-mode")).to_have_count(0)
        page.screenshot(path=str(shots / "3-retried.png"), full_page=True)
    watch.check_store()


def test_tasks_safe_mode_refused_rerun_with_the_run_s_clear_of_failed_tasks(stack, tmp_path):
    from playwright.sync_api import expect

    from verl_tasks.ops.safe_mode import read_safe_mode

    dag_id = "vt_clear_run"
    experiment = EXPERIMENTS[dag_id]
    held = faults.hold(stack.plan_dir, experiment, 0, 0, at_start=True)
    fired = faults.fail_once(stack.plan_dir, experiment, "rollout", 0, 1)
    watch = stack.trigger(dag_id)
    watch.until("rollout batch 0 to wait before its start", held.exists)
    watch.until("safe mode", lambda: read_safe_mode(watch.store, watch.layout))
    faults.release(stack.plan_dir, experiment, 0, 0)  # batch 0 starts now: safe mode refuses it
    assert watch.run_ends() == "failed", watch.diagnose()
    seen = watch.task_states()
    assert seen[f"{ROLLOUT}[0]"] == seen[f"{ROLLOUT}[1]"] == "failed", seen
    assert fired.exists() and not watch.committed(0)
    refused, failed = watch.layout.rollout(0, 0), watch.layout.rollout(0, 1)

    shots = tmp_path / "screens"
    with browser_page(stack, shots) as (page, training):
        frame = training(experiment)
        expect(frame.locator(f'table.grid a[title^="{refused}:"]')).to_have_class("refused")
        expect(frame.locator(f'table.grid a[title^="{failed}:"]')).to_have_class("failed")
        first = frame.locator("div.safe-mode p.safe-mode-first")
        expect(first).to_contain_text(f"SAFE MODE: {failed} failed after all its retries.")
        expect(first).to_contain_text(f"To continue: Clear the failed tasks of run {watch.run_id} in DAG {dag_id} "
                                      '(the run\'s Clear, with "Clear only failed tasks"): safe mode also refused '
                                      f"{ROLLOUT} (map index 0), which never ran.")
        page.screenshot(path=str(shots / "1-refused.png"), full_page=True)

        first.get_by_role("link", name=watch.run_id).click()  # the run's page in Airflow's grid
        expect(page).to_have_url(re.compile(rf"/dags/{dag_id}/runs/{watch.run_id}$"))
        page.get_by_role("button", name="Press shift+c to clear").click()  # the run's Clear
        dialog = page.get_by_role("dialog")
        expect(dialog).to_contain_text(f"Clear Dag Run: {watch.run_id}")
        dialog.get_by_role("button", name="Clear only failed tasks", exact=True).click()
        expect(dialog.get_by_role("row").filter(has_text="configure")).to_have_count(0)  # only the failed ones
        expect(dialog.get_by_role("row").filter(has_text=ROLLOUT)).to_have_count(2)
        page.screenshot(path=str(shots / "2-clear-run.png"), full_page=True)
        tries = watch.tries()[f"{ROLLOUT}[1]"]
        dialog.get_by_role("button", name="Confirm", exact=True).click()
        expect(dialog).to_be_hidden()
        watch.cleared(f"{ROLLOUT}[1]", tries)

        assert watch.run_ends() == "success", watch.diagnose()
        assert set(watch.task_states().values()) == {"success"}, watch.task_states()

        frame = training(experiment)
        expect(frame.locator(f'table.grid a[title^="{refused}:"]')).to_have_class("committed")  # it ran once
        expect(frame.locator(f'table.grid a[title^="{failed}:"]')).to_have_class("committed retried")
        expect(frame.locator("div.safe-mode")).to_have_count(0)
        page.screenshot(path=str(shots / "3-committed.png"), full_page=True)
    watch.check_store()
