"""The Training page in a real browser, reached the way a person reaches it: log in to Airflow's UI,
click "Training" in the main navigation, and read the page Airflow shows in its frame.

A real ``airflow api-server`` (SQLite, SimpleAuthManager with a password file) serves the UI, the
plugin and one experiment DAG whose store holds three finished epochs. Headless Chromium (Debian's
``chromium``, installed by ``make install``) runs through Playwright's Python package; nothing is
downloaded. The screenshot is kept under the test's tmp folder; with ``VT_SAVE_SCREENSHOT=1`` it is
also copied to ``docs/img/dashboard.png`` (the README shows it), and with ``VT_SCREENSHOT_PATH=FILE`` to FILE.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import yaml

from benchmarks.dashboard_render import fabricate
from tests.airflow.api_server import REPO, airflow_cli, airflow_env, serving, write_passwords

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]
EXPERIMENT, DAG_ID, EPOCHS = "browser-demo", "vt_browser", 12

pytestmark = pytest.mark.airflow


def _layout(root: Path) -> None:
    """One experiment YAML, its DAG file, and a store with three finished epochs of it."""
    raw = yaml.safe_load((REPO / "dags" / "experiments" / "tiny_arith.yaml").read_text())
    raw.update(experiment=EXPERIMENT, epochs=EPOCHS)
    raw.setdefault("rollout", {})["batches_per_epoch"] = 4
    raw["storage"] = {"uri": f"file://{root / 'store'}"}
    (root / "experiments").mkdir()
    (root / "experiments" / f"{DAG_ID}.yaml").write_text(yaml.safe_dump(raw))
    (root / "dags").mkdir()
    (root / "dags" / f"{DAG_ID}.py").write_text(
        "from verl_tasks.airflow.factory import build_dag\n"
        f"dag = build_dag({str(root / 'experiments' / f'{DAG_ID}.yaml')!r})\n")
    fabricate(root / "store", EXPERIMENT, EPOCHS, 4)
    _failed_attempt(root / "store")


def _failed_attempt(store_root: Path) -> None:
    """Rollout batch 2 of epoch 1 failed once before it committed: its cell shows the retry."""
    from verl_tasks.events import record_event
    from verl_tasks.layout import Layout
    from verl_tasks.store.local import LocalStore

    unit = Layout(EXPERIMENT).rollout(1, 2)
    ids = {"unit": unit, "epoch": 1, "phase": "rollout", "batch": 2, "attempt": "first-try"}
    record_event(LocalStore(store_root), Layout(EXPERIMENT), "started", **ids)
    record_event(LocalStore(store_root), Layout(EXPERIMENT), "failed", error="RuntimeError: worker lost", **ids)


@pytest.fixture(scope="module")
def airflow_ui(tmp_path_factory):
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: run `make install` (it installs Debian's chromium)")
    root = tmp_path_factory.mktemp("dashboard-browser")
    _layout(root)
    password = write_passwords(root, {"admin": None})["admin"]
    env = airflow_env(root, {"admin": ("admin", None)}, AIRFLOW__CORE__DAGS_FOLDER=str(root / "dags"))
    airflow_cli(env, "db", "migrate")
    airflow_cli(env, "dags", "reserialize")
    with serving(root, env) as base:
        yield base, password, root


def test_dashboard_through_the_airflow_ui_in_chromium(airflow_ui, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    base, password, root = airflow_ui
    shot = tmp_path / "dashboard.png"
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1300})
            page.goto(f"{base}/", timeout=60_000)
            page.locator("input[name=username]").fill("admin")
            page.locator("input[name=password]").fill(password)
            page.locator("button[type=submit]").click()
            training = page.get_by_role("link", name="Training")
            expect(training).to_be_visible(timeout=60_000)  # a top-level entry of the main navigation
            training.click()
            frame = page.frame_locator("iframe")
            expect(frame.locator("h2")).to_have_text(EXPERIMENT, timeout=60_000)
            grid = frame.locator("table.grid tr")
            expect(grid).to_have_count(EPOCHS + 1)  # header + one row per epoch
            expect(frame.locator("table.grid td.committed")).not_to_have_count(0)
            retried = frame.locator(f'a.retried[title^="{EXPERIMENT}/epochs/00001/rollout/b0002: committed"]')
            expect(retried).to_have_attribute("title", re.compile(r"2 attempt\(s\), 1 failed"))
            expect(retried).to_have_text("2")  # the number of tries, drawn in the cell
            chart = frame.locator(".chart svg")
            expect(chart).to_be_visible()
            assert chart.locator("path").count() >= 6, "no curve drawn"  # one line per curve at least
            for title in ("reward (mean)", "eval accuracy", "KL", "clip fraction", "entropy", "grad norm"):
                expect(chart.get_by_text(title, exact=True)).to_be_visible()
            expect(frame.locator("table.snapshots tr")).to_have_count(EPOCHS + 1)
            page.screenshot(path=str(shot), full_page=True)
            retried.click()  # each cell links to its unit's page, inside the same frame
            expect(frame.locator("h1")).to_have_text(f"{EXPERIMENT}/epochs/00001/rollout/b0002", timeout=60_000)
            expect(frame.locator("table.events td", has_text="RuntimeError: worker lost")).to_have_count(1)
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
    targets = [Path(os.environ["VT_SCREENSHOT_PATH"])] if os.environ.get("VT_SCREENSHOT_PATH") else []
    if os.environ.get("VT_SAVE_SCREENSHOT") == "1":
        targets.append(REPO / "docs" / "img" / "dashboard.png")
    for target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, target)
