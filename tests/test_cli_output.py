"""What a person sees of a run and of its state: `verl-tasks run` into a log file says each committed unit as it
happens, `status` fits an 80-column terminal without cutting a cell, and a failed prepare shows in it."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.chaos import util
from tests.conftest import ROOT

QUIET_FOR_S = 300.0  # a run that prints nothing new for this long is reported as stuck


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "verl_tasks.cli", *args]


def test_a_run_into_a_log_file_says_each_committed_unit_while_it_runs_and_status_fits_80_columns(tmp_path):
    yaml = util.write_config(tmp_path)
    store = f"file://{tmp_path}/store"
    log, errors = tmp_path / "run.log", tmp_path / "run.err"
    with open(log, "w") as stdout, open(errors, "w") as stderr:
        proc = subprocess.Popen(_cli("run", str(yaml), "--store", store), cwd=ROOT, stdout=stdout, stderr=stderr)
        seen_while_running, last_size, last_change = [], 0, time.monotonic()
        while proc.poll() is None and time.monotonic() - last_change < QUIET_FOR_S:
            size = log.stat().st_size
            if size != last_size:
                last_size, last_change = size, time.monotonic()
                if proc.poll() is None:
                    seen_while_running = [line for line in log.read_text().splitlines() if " committed (" in line]
            time.sleep(0.2)
        if proc.poll() is None:
            proc.kill()
            raise AssertionError(f"no new output for {QUIET_FOR_S:g} s; log so far:\n{log.read_text()[-3000:]}\n"
                                 f"stderr:\n{errors.read_text()[-3000:]}")
    assert proc.returncode == 0, errors.read_text()[-3000:]
    assert seen_while_running, "nothing was printed before the run ended"
    lines = log.read_text().splitlines()
    committed = [line for line in lines if " committed (" in line]
    total = int(committed[-1].rsplit("/", 1)[1].rstrip(")"))
    assert len(committed) == total and committed[0].endswith(f"(1/{total})"), committed
    assert [line.split("] ", 1)[1].split(" done:")[0] for line in lines if " done: " in line] == \
        [f"epoch {e}" for e in range(util.EPOCHS)]
    assert any("eval accuracy" in line for line in lines if line.startswith("[") and "epoch 1 done" in line)
    assert "log file: " in errors.read_text()  # where every library's lines went
    assert "Warning" not in errors.read_text(), errors.read_text()[-2000:]  # vendor warnings go to the log file

    shown = subprocess.run(_cli("status", str(yaml), "--store", store), cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "COLUMNS": "80"}, check=True).stdout
    assert max(len(line) for line in shown.splitlines()) <= 80, shown
    assert "…" not in shown, shown  # no cell was cut
    assert shown.count("all committed") == util.EPOCHS, shown


def test_a_failed_prepare_shows_in_status_with_its_error(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "ground_truth": "2"}\n{"prompt": "2+2=, "ground_truth": "4"}\n')
    yaml = util.write_config(tmp_path, **{"data.train": str(data)})
    store = f"file://{tmp_path}/store"
    failed = subprocess.run(_cli("run", str(yaml), "--store", store), cwd=ROOT, capture_output=True, text=True)
    assert failed.returncode == 2, failed.stderr[-2000:]
    shown = subprocess.run(_cli("status", str(yaml), "--store", store), cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "COLUMNS": "80"}, check=True).stdout
    flat = "".join(shown.split())  # status fits 80 columns, so a long path wraps wherever its length puts it
    assert "failed:" in flat and "(prepare,attempt" in flat and "prompts.jsonl:2:notvalidJSON" in flat, shown
