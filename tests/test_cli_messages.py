"""What the CLI tells a person: a finished run answered from the store alone, a watch that does not replay
the past as new, a misspelt key with its likely spelling, and a failed try that says whether it is retried."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from verl_tasks.config import load_config
from verl_tasks.errors import ConfigError, DataError
from verl_tasks.runner import make_context, train

from .chaos import util

# Runs the CLI in a fresh interpreter and reports, after it returns, whether torch was ever imported.
PROBE = """
import sys
from verl_tasks.cli import app
try:
    app(sys.argv[1:], standalone_mode=False)
finally:
    print("TORCH_IMPORTED", "torch" in sys.modules)
"""


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-epoch run, and a YAML naming it."""
    root = tmp_path_factory.mktemp("cli")
    uri = f"file://{root}/store"
    train(make_context(util.config(uri)), util.EPOCHS)
    return {"uri": uri, "yaml": str(util.write_config(root)), "root": root}


def probe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE, *args], cwd=util.ROOT, capture_output=True, text=True)


def test_a_finished_run_is_answered_from_the_store_without_torch(finished, tmp_path):
    report = tmp_path / "curve.md"
    done = probe("run", finished["yaml"], "--store", finished["uri"], "--report", str(report))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "already trained (2 epochs committed" in done.stderr and "nothing recomputed" in done.stderr, done.stderr
    assert "TORCH_IMPORTED False" in done.stdout, done.stdout
    assert "| base" in report.read_text() or "base" in report.read_text()


def test_a_changed_config_is_not_answered_from_the_store(finished, tmp_path):
    """The fast path needs the pinned config: another lr goes the full way (torch loaded, the runner decides)."""
    changed = util.write_config(tmp_path, **{"algorithm.lr": 0.123})
    full = probe("run", str(changed), "--store", finished["uri"])
    assert "already trained" not in full.stderr and "TORCH_IMPORTED True" in full.stdout, full.stderr[-3000:]


def test_watch_summarises_what_happened_before_it_started(finished):
    shown = util.run_cli("watch", finished["yaml"], "--store", finished["uri"], "--until-epochs", "2", "--every", "0.1")
    lines = shown.stdout.strip().splitlines()
    assert len(lines) == 1 and "earlier lines of" in lines[0] and "--history" in lines[0], shown.stdout
    replayed = util.run_cli("watch", finished["yaml"], "--store", finished["uri"], "--until-epochs", "2",
                            "--every", "0.1", "--history")
    assert sum(" committed " in line for line in replayed.stdout.splitlines()) >= 2 * 4, replayed.stdout


def test_a_misspelt_key_is_named_with_its_likely_spelling(tmp_path):
    path = util.write_config(tmp_path)
    text = path.read_text().replace("epochs:", "epoch:", 1)
    path.write_text(text + "\nrollout_typo: 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "epoch: unknown key; did you mean epochs?" in str(err.value)
    assert "rollout_typo: unknown key; did you mean rollout?" in str(err.value)


def test_a_bad_input_try_says_it_is_not_retried(tiny_config, tmp_path, caplog):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "ground_truth": "2"}\n{"prompt": "2+2=, "ground_truth": "4"}\n')
    ctx = make_context(tiny_config(**{"data.train": str(data)}))
    with caplog.at_level(logging.WARNING, logger="verl_tasks.runner"), pytest.raises(DataError) as err:
        train(ctx, 1)
    assert "prompts.jsonl:2: not valid JSON (Expecting ',' delimiter at column" in str(err.value), err.value
    assert str(err.value).startswith("prepare, reading data.train: "), err.value  # the phase that read the file
    failed = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(failed) == 1, failed  # one try: never retried
    assert failed[0].startswith("plan of epoch 0 failed: DataError") and "not retried" in failed[0], failed
    assert "(try " not in failed[0], failed  # no try count for an error that is never retried


def test_a_repeated_prompt_is_named_by_the_lines_that_hold_it(tiny_config, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "ground_truth": "2"}\n{"prompt": "2+2=", "ground_truth": "4"}\n'
                    '{"prompt": "1+1=", "ground_truth": "2"}\n')
    ctx = make_context(tiny_config(**{"data.train": str(data)}))
    with pytest.raises(DataError, match=r"prompts\.jsonl:3 repeats the prompt of .*prompts\.jsonl:1"):
        train(ctx, 1)


def test_a_second_demo_says_already_trained_and_shows_the_curve(tmp_path):
    """scripts/demo.sh over a store whose experiment is finished: no Ray head, no Airflow run, the curve."""
    store_root = tmp_path / "root"
    train(make_context(load_config(util.TINY_YAML, {"epochs": 1, "storage.uri": f"file://{store_root}/.store"})), 1)
    env = {**os.environ, "VERL_TASKS_STORE_ROOT": str(store_root), "AIRFLOW_HOME": str(tmp_path / "airflow"),
           "DEMO_EPOCHS": "1"}
    shown = util.run_cli("status", "dags/experiments/tiny_arith.yaml", "--store", f"file://{store_root}/.store",
                         "--epochs", "1", "--json", check=False)
    assert shown.returncode == 0 and json.loads(shown.stdout)["finished"], shown.stdout[-3000:] + shown.stderr[-3000:]
    shown = subprocess.run(["bash", "scripts/demo.sh"], cwd=util.ROOT, capture_output=True, text=True, env=env)
    assert shown.returncode == 0, shown.stdout[-2000:] + shown.stderr[-2000:]
    assert "tiny-arith is already trained (1 epochs committed" in shown.stdout, shown.stdout
    assert "nothing recomputed" in shown.stdout, shown.stdout
    assert re.search(r"Held-out accuracy: \d+\.\d% -> \d+\.\d% \([+-]\d+\.\d points\)", shown.stdout), shown.stdout
    assert not (tmp_path / "airflow" / "airflow.db").exists()  # no Airflow run was started


def test_the_console_entry_skips_teardown_but_loses_nothing(finished, tmp_path):
    """`verl-tasks` ends with os._exit after its exit handlers (cli.main): what it wrote is complete, its
    output is flushed into a pipe, and no child it started (the reward sandbox, its workers) outlives it."""
    store_root = tmp_path / "copy"
    shutil.copytree(finished["root"] / "store", store_root)
    uri, report = f"file://{store_root}", tmp_path / "curve.md"
    entry = str(Path(sys.executable).parent / "verl-tasks")
    ran = subprocess.Popen([entry, "run", finished["yaml"], "--store", uri, "--epochs", str(util.EPOCHS + 1),
                            "--report", str(report)], cwd=util.ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    out, err = ran.communicate()
    assert ran.returncode == 0, err[-3000:]
    left = [p.info for p in psutil.process_iter(["pid", "cmdline"]) if _session(p.pid) == ran.pid]
    assert not left, f"processes of the CLI's session outlived it: {left}"
    assert f"after epoch {util.EPOCHS}" in report.read_text(), report.read_text()  # the new epoch's row, whole
    shown = subprocess.run([entry, "status", finished["yaml"], "--store", uri, "--epochs", str(util.EPOCHS + 1),
                            "--json"], cwd=util.ROOT, capture_output=True, text=True, check=True)
    assert json.loads(shown.stdout)["finished"] is True  # the whole JSON object reached the pipe


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except (ProcessLookupError, PermissionError):
        return None
