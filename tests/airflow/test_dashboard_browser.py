"""The Training page in a real browser, reached the way a person reaches it: log in to Airflow's UI,
click "Training" in the main navigation, and read the page Airflow shows in its frame.

A real ``airflow api-server`` (SQLite, SimpleAuthManager with a password file) serves the UI, the
plugin and one experiment DAG. Its store holds a real run: the shipped tiny experiment
(``dags/experiments/tiny_arith.yaml``), trained for a few epochs by the product's own runner
(``verl_tasks.runner.train``) once per module, one rollout batch of which fails once, at its
``before_commit`` hook point, and is retried by the runner. Headless Chromium (Debian's
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

from tests.airflow.api_server import REPO, airflow_cli, airflow_env, serving, write_passwords

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]
EXPERIMENT, DAG_ID, EPOCHS = "browser-demo", "vt_browser", 6
CHILD = "browser-demo-child"  # started from the experiment's last snapshot, trained one epoch
FAILS_ONCE = (1, 2)  # (epoch, batch) of the rollout unit whose first try fails
FAULT = "worker lost (a fault the test injects before the commit)"

pytestmark = pytest.mark.airflow


def _layout(root: Path) -> Path:
    """One experiment YAML (the shipped tiny experiment, EPOCHS epochs) and its DAG file; returns the YAML."""
    raw = yaml.safe_load((REPO / "dags" / "experiments" / "tiny_arith.yaml").read_text())
    raw.update(experiment=EXPERIMENT, epochs=EPOCHS)
    raw["storage"] = {"uri": f"file://{root / 'store'}"}
    raw["fault_tolerance"] = {"retry_delay_s": 1}  # the retry of the failed try comes a second later
    config = root / "experiments" / f"{DAG_ID}.yaml"
    config.parent.mkdir()
    config.write_text(yaml.safe_dump(raw))
    (root / "dags").mkdir()
    (root / "dags" / f"{DAG_ID}.py").write_text(
        "from verl_tasks.airflow.factory import build_dag\n"
        f"dag = build_dag({str(config)!r})\n")
    return config


def _train(config: Path) -> dict:
    """Train the experiment for real with the product's runner; rollout batch FAILS_ONCE fails its first try
    just before its commit (the runner records it, then retries the unit). Returns the final status."""
    from verl_tasks import hooks
    from verl_tasks.config import load_config
    from verl_tasks.runner import make_context, train

    failed = []

    def fail_once(phase, epoch, batch, **_):
        if (phase, epoch, batch) == ("rollout", *FAILS_ONCE) and not failed:
            failed.append(True)
            raise RuntimeError(FAULT)

    ctx = make_context(load_config(config))
    hooks.register("before_commit", fail_once)
    try:
        status = train(ctx, EPOCHS)
    finally:
        hooks.unregister("before_commit", fail_once)
    assert failed, "the fault was never injected"
    from verl_tasks.execution.lineage import start_experiment

    child = make_context(load_config(config, {"experiment": CHILD, "epochs": 1}))
    start_experiment(child.store, child.config, resume="snapshot", parent=EXPERIMENT, version=None)
    train(child, 1)
    return status


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A folder with the experiment's YAML, its DAG file and its trained store; and the run's status."""
    root = tmp_path_factory.mktemp("dashboard-browser")
    status = _train(_layout(root))
    assert [e["epoch"] for e in status["epochs"]] == list(range(EPOCHS))
    return root, status


@pytest.fixture(scope="module")
def airflow_ui(trained):
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: run `make install` (it installs Debian's chromium)")
    root, status = trained
    password = write_passwords(root, {"admin": None})["admin"]
    env = airflow_env(root, {"admin": ("admin", None)}, AIRFLOW__CORE__DAGS_FOLDER=str(root / "dags"))
    airflow_cli(env, "db", "migrate")
    airflow_cli(env, "dags", "reserialize")
    with serving(root, env) as base:
        yield base, password, status


def test_dashboard_through_the_airflow_ui_in_chromium(airflow_ui, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    base, password, status = airflow_ui
    latest, last = status["latest_snapshot"], status["epochs"][-1]["metrics"]
    epoch, batch = FAILS_ONCE
    unit = f"{EXPERIMENT}/epochs/{epoch:05d}/rollout/b{batch:04d}"
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
            outer = page.frame_locator("iframe")
            expect(outer.locator("h2").first).to_have_text(EXPERIMENT, timeout=60_000)
            frame = outer.locator(f"section[id='{EXPERIMENT}']")
            # The run's own latest snapshot (the hash of the weights it trained) and base accuracy.
            source = frame.locator("p.src")
            expect(source).to_contain_text(f"latest snapshot: version {EPOCHS} at")
            expect(source).to_contain_text(f"sha256 {latest['weights_sha256'][:16]}")
            expect(source).to_contain_text(f"base accuracy {status['base']['metrics']['eval_accuracy']:.3f}")
            grid = frame.locator("table.grid tr")
            expect(grid).to_have_count(EPOCHS + 1)  # header + one row per epoch
            expect(frame.locator("table.grid td.committed")).not_to_have_count(0)
            expect(frame.locator("table.grid .failed")).to_have_count(0)  # the failed try was retried and committed
            reward, accuracy = grid.last.locator("td:nth-last-child(2)"), grid.last.locator("td:last-child")
            expect(reward).to_have_text(f"{last['reward_mean']:.3f}")  # the last epoch's real metrics
            expect(accuracy).to_have_text(f"{last['eval_accuracy']:.3f}")
            retried = frame.locator(f'a.retried[title^="{unit}: committed"]')
            expect(retried).to_have_attribute("title", re.compile(r"2 attempt\(s\), 1 failed"))
            expect(retried).to_have_text("2")  # the number of tries, drawn in the cell
            expect(frame.locator("table.grid a.retried")).to_have_count(1)  # no other unit was tried twice
            chart = frame.locator(".chart svg")
            expect(chart).to_be_visible()
            assert chart.locator("path").count() >= 6, "no curve drawn"  # one line per curve at least
            for title in ("reward (mean)", "eval accuracy", "KL", "clip fraction", "entropy", "grad norm"):
                expect(chart.get_by_text(title, exact=True)).to_be_visible()
            expect(frame.locator("table.snapshots tr")).to_have_count(EPOCHS + 1)
            # What the model says: a few rollout samples of the newest epochs (prompt, answer, reward, length).
            samples = frame.locator("table.samples tr")
            expect(samples).to_have_count(1 + 3 * 4)  # header + 4 samples of each of the 3 newest epochs
            expect(samples.nth(1).locator("td").first).to_have_text(str(EPOCHS - 1))
            expect(samples.nth(1).locator("td.text").first).to_have_text(re.compile(r"^\d+\+\d+=$"))
            # The child run, drawn over its parent: one chart, a line per experiment, both in its legend.
            child = outer.locator(f"section[id='{CHILD}']")
            expect(child.locator("h4.compare-title")).to_contain_text(
                f"Against {EXPERIMENT}, its parent: this run starts from its snapshot {EPOCHS}")
            overlay = child.locator(".chart.compare svg")
            expect(overlay).to_be_visible()
            for name in (EXPERIMENT, CHILD):
                expect(overlay.get_by_text(name, exact=True).first).to_be_visible()
            page.screenshot(path=str(shot), full_page=True)
            retried.click()  # each cell links to its unit's page, inside the same frame
            expect(outer.locator("h1")).to_have_text(unit, timeout=60_000)
            expect(outer.locator("table.events td", has_text=f"RuntimeError: {FAULT}")).to_have_count(1)
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
    targets = [Path(os.environ["VT_SCREENSHOT_PATH"])] if os.environ.get("VT_SCREENSHOT_PATH") else []
    if os.environ.get("VT_SAVE_SCREENSHOT") == "1":
        targets.append(REPO / "docs" / "img" / "dashboard.png")
    for target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, target)
