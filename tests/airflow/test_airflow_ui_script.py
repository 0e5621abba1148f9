"""`make airflow` (scripts/airflow_ui.sh) stops everything on Ctrl-C and on SIGTERM.

It runs as a terminal would run it (its own process group); once the UI answers, the group gets
SIGINT, as Ctrl-C sends it, or SIGTERM, as a service manager or `docker stop` sends it (then through
`make`, whose death must not orphan the script's cleanup). It must exit and leave none of the processes
it started: standalone's scheduler, triggerer, api-server, dag-processor, and every process of the Ray
head's session.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import requests

from tests.airflow.e2e_support import free_port, wait_for
from tests.conftest import default_sigint

REPO = Path(__file__).resolve().parents[2]
STOP_WITHIN_S = 120  # a liveness bound on a loaded machine; the stop takes seconds

pytestmark = [pytest.mark.airflow, pytest.mark.slow]


def session_of(sid: int) -> dict[int, str]:
    """The live processes of session ``sid`` (the Ray head runs under setsid: its pid is the session id)."""
    found = {}
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if os.getsid(proc.pid) == sid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found[proc.pid] = " ".join(proc.info["cmdline"] or [])[:200]
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return found


@pytest.mark.parametrize("how", ["ctrl-c-to-make", "sigterm-to-make"])
def test_a_signal_stops_standalone_and_the_ray_head(tmp_path, how):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "VERL_TASKS_", "RAY_"))}
    env.update({"AIRFLOW_HOME": str(tmp_path / "home"), "AIRFLOW_PORT": str(port),
                "VERL_TASKS_HEAD_STATE": str(tmp_path / "head"), "VERL_TASKS_HEAD_PORT": str(free_port()),
                "VERL_TASKS_HEAD_DASHBOARD_PORT": str(free_port()),
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"})
    log = open(tmp_path / "ui.log", "wb")
    command = ["make", "--no-print-directory", "airflow"] if how.endswith("-to-make") else \
        ["bash", str(REPO / "scripts" / "airflow_ui.sh")]
    proc = subprocess.Popen(command, env=env, stdout=log, preexec_fn=default_sigint,
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
        assert session_of(head), "the Ray head's session has no process"
        tmpdir = Path(json.loads((tmp_path / "head" / "head.json").read_text())["tmpdir"])
        assert any(tmpdir.glob("session_*")), "the Ray head wrote no session folder"
        os.killpg(proc.pid, signal.SIGINT if how.startswith("ctrl-c") else signal.SIGTERM)
        proc.wait(timeout=STOP_WITHIN_S)
        if how.startswith("ctrl-c"):  # the normal way to stop it: the script exits 0 and make reports no error
            shown = (tmp_path / "ui.log").read_text(errors="replace")
            # make itself gets the terminal's SIGINT too and dies of it, as after any Ctrl-C, silently.
            assert proc.returncode in (0, -signal.SIGINT), shown[-2000:]
            assert "make: ***" not in shown, shown[-2000:]

        def all_gone() -> bool:
            left = {pid: cmd for pid, cmd in seen.items() if psutil.pid_exists(pid)
                    and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE}
            return not left and not session_of(head)

        # make may return before the script's cleanup has finished stopping the head: wait on it.
        wait_for(f"every process gone after {how}", all_gone, STOP_WITHIN_S,
                 diagnose=lambda: f"left: {session_of(head)}; log: "
                                  + (tmp_path / "ui.log").read_text(errors="replace")[-2000:])
        wait_for("the head's session logs gone", lambda: not any(tmpdir.glob("session_*")), STOP_WITHIN_S,
                 diagnose=lambda: str(sorted(p.name for p in tmpdir.iterdir())))
    finally:
        for pid in [proc.pid, *seen]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
