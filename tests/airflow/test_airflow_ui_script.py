"""`make airflow` (scripts/airflow_ui.sh) stops everything on Ctrl-C, promptly.

The script runs as a terminal would run it (its own process group); once the UI answers, the
group gets SIGINT, as Ctrl-C sends it. The script must exit within seconds and leave none of the
processes it started (standalone's scheduler, triggerer, api-server, dag-processor; the Ray head).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests

from tests.airflow.e2e_support import free_port, wait_for

REPO = Path(__file__).resolve().parents[2]
STOP_WITHIN_S = 30

pytestmark = [pytest.mark.airflow, pytest.mark.slow]


def test_ctrl_c_stops_standalone_and_leaves_no_dag_processor(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "VERL_TASKS_", "RAY_"))}
    env.update({"AIRFLOW_HOME": str(tmp_path / "home"), "AIRFLOW_PORT": str(port),
                "VERL_TASKS_HEAD_STATE": str(tmp_path / "head"), "VERL_TASKS_HEAD_PORT": str(free_port()),
                "VERL_TASKS_HEAD_DASHBOARD_PORT": str(free_port()),
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"})
    log = open(tmp_path / "ui.log", "wb")
    proc = subprocess.Popen(["bash", str(REPO / "scripts" / "airflow_ui.sh")], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
    log.close()
    seen: dict[int, str] = {}

    def up() -> bool:
        for child in psutil.Process(proc.pid).children(recursive=True):
            try:
                seen[child.pid] = " ".join(child.cmdline())[:200]
            except psutil.Error:
                continue
        assert proc.poll() is None, (tmp_path / "ui.log").read_text(errors="replace")[-3000:]
        ready = requests.get(f"http://127.0.0.1:{port}/api/v2/monitor/health", timeout=5).ok
        return ready and any("dag-processor" in cmd or "dag_processor" in cmd for cmd in seen.values())

    try:
        wait_for("make airflow's UI and dag-processor", up, 400,
                 diagnose=lambda: (tmp_path / "ui.log").read_text(errors="replace")[-3000:])
        head = json.loads((tmp_path / "head" / "head.json").read_text())["pid"]
        started = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
        proc.wait(timeout=STOP_WITHIN_S + 30)
        took = time.monotonic() - started
        left = {pid: cmd for pid, cmd in seen.items() if psutil.pid_exists(pid)
                and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE}
        assert not left, f"still running after Ctrl-C: {left}"
        assert not psutil.pid_exists(head) or psutil.Process(head).status() == psutil.STATUS_ZOMBIE, \
            "the Ray head outlived Ctrl-C"
        assert took < STOP_WITHIN_S, f"Ctrl-C took {took:.1f} s"
    finally:
        for pid in [proc.pid, *seen]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
