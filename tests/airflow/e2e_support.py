"""Helpers for the end-to-end test: a throwaway PostgreSQL database, `airflow standalone` as a
process group we own, and a small REST API v2 client. Everything started here is stopped by
its own PID (never by name)."""
from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VENV_BIN = Path(sys.executable).parent
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def free_port(span: int = 1) -> int:
    """A port p such that p..p+span-1 are all free on 127.0.0.1 right now, below the kernel's ephemeral range:
    a port from that range can be taken by any connection (a Ray head opens many) before the server binds it."""
    from verl_tasks.execution.ports import free_port as below_ephemeral

    return below_ephemeral(span)


# -- PostgreSQL ------------------------------------------------------------------------------
PG_HOST, PG_PORT = "127.0.0.1", 5432


def _psql(sql: str, user: str, database: str = "postgres", *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(["psql", "-h", PG_HOST, "-p", str(PG_PORT), "-U", user, "-d", database, "-v",
                           "ON_ERROR_STOP=1", "-qAtc" if not flags else "-qc", sql, *flags],
                          capture_output=True, text=True, timeout=60)


def pg_user() -> str | None:
    """The first role that can log in without a password (trust auth), or None."""
    for user in ("postgres", "root"):
        try:
            if _psql("select 1", user).returncode == 0:
                return user
        except (FileNotFoundError, subprocess.TimeoutExpired):
            return None
    return None


@dataclass
class PgDatabase:
    name: str
    user: str

    @property
    def sync_url(self) -> str:
        return f"postgresql+psycopg2://{self.user}@{PG_HOST}:{PG_PORT}/{self.name}"

    @property
    def async_url(self) -> str:
        return f"postgresql+asyncpg://{self.user}@{PG_HOST}:{PG_PORT}/{self.name}"

    @classmethod
    def create(cls, user: str) -> PgDatabase:
        name = f"vt_e2e_{uuid.uuid4().hex[:10]}"
        done = _psql(f"CREATE DATABASE {name}", user)
        if done.returncode:
            raise RuntimeError(f"CREATE DATABASE {name} failed: {done.stderr}")
        return cls(name, user)

    def table(self, sql: str) -> str:
        """A query's result as a printed table (diagnosis only: never raises)."""
        try:
            done = _psql(sql, self.user, self.name, "-P", "pager=off")
        except (OSError, subprocess.TimeoutExpired) as err:
            return f"({sql[:60]}...: {err})"
        return done.stdout if done.returncode == 0 else f"({done.stderr.strip()})"

    def drop(self) -> None:
        done = _psql(f"DROP DATABASE IF EXISTS {self.name} WITH (FORCE)", self.user)
        if done.returncode:
            sys.stderr.write(f"could not drop database {self.name}: {done.stderr}\n")


# -- airflow standalone ----------------------------------------------------------------------
def standalone_env(home: Path, dags: Path, plugins: Path, port: int, log_ports: tuple[int, int], database: str,
                   **settings: str) -> dict[str, str]:
    """The environment of an Airflow a test starts: this process's, without its own Airflow, verl-tasks and Ray
    settings; LocalExecutor on ``database``, examples off, DAGs unpaused, every user an admin, the API on
    127.0.0.1:``port`` with fresh secrets, fast scheduling, the worker's and triggerer's log servers on
    ``log_ports``. ``settings`` add or override."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "VERL_TASKS_", "RAY_"))}
    env.update({
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(plugins),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__PARALLELISM": "4",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        "AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": "60",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": database,
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
        "AIRFLOW__API__SECRET_KEY": secrets.token_hex(16),
        "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
        "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "0.2",
        "AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL": "1",
        # On a loaded 2-core machine the api-server's first execution-API call can take tens of
        # seconds; with the default 5 s timeout the worker retries and the retry gets HTTP 400.
        "AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT": "90",
        # Log servers of the worker and the triggerer bind all interfaces on fixed ports by default.
        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(log_ports[0]),
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(log_ports[1]),
        "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "300",
        **settings,
    })
    return env


# On a busy 2-core machine a component's heartbeat lapses for tens of seconds (seen: the triggerer's, 43.6 s).
# Past 30 s (the default) the scheduler counts its own job dead and resets its queued and running task
# instances; the triggerer's triggers are reassigned.
SLOW_HEARTBEATS = {"AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_THRESHOLD": "120",
                   "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": "120"}

@dataclass
class Standalone:
    home: Path
    port: int
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    log_path: Path = field(default=None)  # type: ignore[assignment]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.log_path = self.home / "standalone.log"
        out = open(self.log_path, "ab")
        self.proc = subprocess.Popen([str(VENV_BIN / "airflow"), "standalone"], env=self.env, stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True, cwd=str(self.home))
        out.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """Kill standalone and its children (its process group) at once: a test that is done needs no graceful
        stop, which costs 10-15 s here (test_airflow_ui_script checks that a signal stops standalone)."""
        if self.proc is not None:
            kill_group(self.proc)

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no standalone log)"

    def api_version(self, api: Any) -> Any:
        """The API's answer to ``/api/v2/version`` (a probe for :func:`wait_for`); raises
        :class:`ServerDidNotBind` at once when a component logged that its port was taken."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            text = ""
        failed = [line for line in text.splitlines()
                  if "error while attempting to bind" in line or "address already in use" in line.lower()]
        if failed:
            raise ServerDidNotBind(f"an Airflow server could not bind its port: {ANSI.sub('', failed[0])}")
        return self.alive() and api.request("GET", "/api/v2/version")

    def log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def component_tail(self, component: str, lines: int = 40) -> str:
        """The last lines one component (scheduler, triggerer, dag-processor, api-server) wrote."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return f"--- {component}: (no standalone log)"
        mine = [line for line in (ANSI.sub("", raw) for raw in text.splitlines())
                if line.split("|", 1)[0].strip() == component]
        return f"--- {component} (last {min(lines, len(mine))} of {len(mine)} lines)\n" + "\n".join(mine[-lines:])

    def task_logs(self, dag_id: str, run_id: str) -> dict[str, str]:
        """Every task log file of a run (relative path -> text)."""
        root = self.home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}"
        return {str(p.relative_to(root)): p.read_text(errors="replace") for p in sorted(root.rglob("*.log"))}


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group ``proc`` leads (started with ``start_new_session``) and wait until it is gone."""
    pgid = proc.pid
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (proc.poll() is None or _group_alive(pgid)):
        time.sleep(0.1)
    proc.wait(timeout=5)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- REST API v2 -----------------------------------------------------------------------------
class DagImportError(AssertionError):
    """A DAG file Airflow could not import: waiting longer cannot help, so :func:`wait_for` raises it at once."""


class ServerDidNotBind(DagImportError):
    """An Airflow server exited because its port was taken: standalone lives on without it, so a wait for it
    would only run into its limit. Raised at once by :meth:`Standalone.api_version`."""


class ApiError(RuntimeError):
    def __init__(self, status: int, body: str, what: str):
        super().__init__(f"{what}: HTTP {status}: {body[:2000]}")
        self.status = status


class Api:
    """Just enough of Airflow's REST API v2. All-admins simple auth: the server adds the token;
    if it answers 401 anyway, a token is fetched from ``POST /auth/token`` once."""

    def __init__(self, base_url: str):
        self.base = base_url.rstrip("/")
        self.token: str | None = None

    # A poll that gives up leaves its request running in the api-server (one process, shared with the
    # workers' execution API); polling again at once piles requests up on a starved machine until
    # the workers' calls time out and their tasks stay queued. So: wait long for each answer.
    def request(self, method: str, path: str, body: Any = None, timeout: float = 180) -> Any:
        for attempt in range(2):
            data = None if body is None else json.dumps(body).encode()
            req = urllib.request.Request(self.base + path, data=data, method=method)
            req.add_header("Content-Type", "application/json")
            req.add_header("Accept", "application/json")
            if self.token:
                req.add_header("Authorization", f"Bearer {self.token}")
            try:
                with urllib.request.urlopen(req, timeout=timeout) as resp:
                    text = resp.read().decode()
                    return json.loads(text) if text else None
            except urllib.error.HTTPError as err:
                text = err.read().decode(errors="replace")
                if err.code == 401 and attempt == 0 and path != "/auth/token":
                    self.token = self.request("POST", "/auth/token", {})["access_token"]
                    continue
                raise ApiError(err.code, text, f"{method} {path}") from None
        raise AssertionError("unreachable")

    # convenience
    def dag_parsed(self, dag_id: str) -> Any:
        """The DAG's record once Airflow parsed it; falsy while not yet parsed. Raises :class:`DagImportError`
        with the traceback Airflow recorded when a DAG file failed to import."""
        errors = self.request("GET", "/api/v2/importErrors?limit=100")["import_errors"]
        if errors:
            raise DagImportError("\n".join(f"{e['filename']}: {e['stack_trace'][-3000:]}" for e in errors))
        try:
            return self.request("GET", f"/api/v2/dags/{dag_id}")
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    def task_instances(self, dag_id: str, run_id: str) -> list[dict[str, Any]]:
        out = self.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances?limit=500")
        return out["task_instances"]

    def dag_run(self, dag_id: str, run_id: str) -> dict[str, Any]:
        return self.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}")

    def clear(self, dag_id: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.request("POST", f"/api/v2/dags/{dag_id}/clearTaskInstances", {"dry_run": False, **body})


def ti_key(ti: dict[str, Any]) -> str:
    return ti["task_id"] if ti.get("map_index", -1) < 0 else f"{ti['task_id']}[{ti['map_index']}]"


def states(tis: list[dict[str, Any]]) -> dict[str, str | None]:
    return {ti_key(ti): ti["state"] for ti in sorted(tis, key=lambda t: (t["task_id"], t.get("map_index", -1)))}


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float, every: float = 1.0,
             diagnose: Callable[[], str] | None = None, progress: Callable[[], Any] | None = None,
             limit_s: float | None = None) -> Any:
    """Call ``probe`` until it returns something truthy; on giving up raise with ``diagnose()``.

    Without ``progress``, give up after ``timeout_s``. With it, give up only when nothing moved
    for ``timeout_s``: ``progress()`` returns a picture of what can move (task states, events,
    job statuses) and each change restarts the clock, so a loaded machine slows a test down
    without failing it; ``limit_s`` (default 10 x ``timeout_s``) still bounds the whole wait.
    """
    started = moved = time.monotonic()
    limit = limit_s if limit_s is not None else (10 * timeout_s if progress else timeout_s)
    picture: Any = None
    last_err: Exception | None = None
    while True:
        try:
            value = probe()
            if value:
                return value
        except DagImportError:
            raise
        except Exception as err:  # noqa: BLE001 - retried until giving up
            last_err = err
        now = time.monotonic()
        if progress is not None:
            try:
                seen = progress()
            except Exception as err:  # noqa: BLE001 - an unreadable picture is no progress
                last_err, seen = err, picture
            if seen != picture:
                picture, moved = seen, now
        if now - moved >= timeout_s or now - started >= limit:
            break
        time.sleep(every)
    why = (f"nothing moved for {now - moved:.0f}s ({now - started:.0f}s in all)" if progress is not None
           and now - started < limit else f"timed out after {now - started:.0f}s")
    extra = diagnose() if diagnose else ""
    seen_text = f"\nlast progress picture: {picture}" if progress is not None else ""
    raise TimeoutError(f"{why} waiting for {what} (last error: {last_err}){seen_text}\n{extra}")
