"""Airflow plugin: a "Training" page in Airflow's main navigation, per experiment the curves, the
epoch x phase grid, the snapshots and the event log (``dashboard.py`` reads them, ``templates/`` draws them).

Mounted on the api-server at ``/verl-tasks`` (``fastapi_apps``) and shown inside the UI as a top-level
nav entry (``external_views``, ``nav_top_level``). Airflow does not put a plugin's app behind its auth,
so every request goes through Airflow's own ``get_user`` (401/403 without a valid token) and shows only
experiments of DAGs the auth manager lets the user read: each YAML in ``dags/experiments`` is the DAG
named after its stem, and the stores of other YAMLs are never opened.

Experiments are listed from the stores (each root's top-level folders holding ``experiment.json``,
bounded), so runs triggered under a new name appear. Which DAG's readers see one is
:func:`verl_tasks.ownership.may_see`: the DAG ``experiment.json`` records (or one whose YAML lists that
DAG in ``access.write_to``); for an experiment that records no DAG (made by the CLI, or pinned before
DAGs were recorded), the DAG whose YAML names it (its experiment, a scheduled ``<experiment>-<stamp>``,
``access.adopt``), else the one DAG whose store it sits in when no other YAML uses that store. A name
in a run's trigger form proves nothing and is not looked at. ``?experiment=NAME`` finds it in any
readable DAG's store; ``?dag=ID`` narrows to one DAG; ``?epoch=E&phase=P`` filters the event log. A
store the api-server cannot reach shows one calm line instead of its error.
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field
from datetime import UTC
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.plugins_manager import AirflowPlugin
from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

if TYPE_CHECKING:  # pragma: no cover - typing only (the plugin imports the package lazily)
    from verl_tasks.ownership import DagAccess
    from verl_tasks.store import S3Options

log = logging.getLogger(__name__)

PREFIX = "/verl-tasks"
SECTIONS_SHOWN = 6  # full sections on the overview; the rest are links
# A page waits seconds, not minutes, for an S3 endpoint that is down (training keeps its patient client).
PAGE_S3_OPTIONS: S3Options = {"max_attempts": 2, "connect_timeout": 3, "read_timeout": 20}


def experiments_dir() -> Path:
    configured = os.environ.get("VERL_TASKS_EXPERIMENTS_DIR")
    if configured:
        return Path(configured)
    from airflow.configuration import conf

    return Path(conf.get("core", "dags_folder")) / "experiments"


def experiment_yamls() -> dict[str, Path]:
    """DAG id -> experiment YAML: each YAML is one DAG named after its stem (``factory.build_dag``)."""
    return {path.stem: path for path in sorted(experiments_dir().glob("*.yaml"))}


def readable_dag_ids(user, dag_ids: set[str]) -> set[str]:
    """The subset of ``dag_ids`` the auth manager lets ``user`` read (teams included)."""
    from airflow.api_fastapi.app import get_auth_manager

    return dag_ids & get_auth_manager().get_authorized_dag_ids(user=user, method="GET")


@dataclass
class Source:
    """One experiment YAML (a DAG) and the store it names; ``error`` when either is unusable here."""

    dag_id: str
    path: Path
    experiment: str = ""
    store_uri: str = ""
    raw: dict[str, Any] = field(default_factory=dict)
    store: Any = None
    error: str | None = None
    access: DagAccess | None = None  # what the YAML names and permits (verl_tasks.ownership)

    def config(self, experiment: str):
        from verl_tasks.config import parse_config

        return parse_config(self.raw, {"storage.uri": self.store_uri, "experiment": experiment})


def open_source(dag_id: str, path: Path) -> Source:
    """Read the YAML and open its store with the YAML's ``storage.aws_conn_id`` (as the tasks do)."""
    from verl_tasks.airflow.connections import s3_access
    from verl_tasks.airflow.runconfig import read_yaml
    from verl_tasks.config import parse_config
    from verl_tasks.ownership import DagAccess
    from verl_tasks.store import absolute_uri, open_store

    source = Source(dag_id, path)
    try:
        raw = read_yaml(path)
        parse_config(raw)  # validated before any of its values is used
        source.raw = raw
        source.store_uri = absolute_uri((raw.get("storage") or {}).get("uri", "file://.store"))
        cfg = parse_config(raw, {"storage.uri": source.store_uri})
        source.experiment = cfg.experiment
        source.access = DagAccess(dag_id, cfg.experiment, str(path), cfg.schedule.parent, cfg.access)
        s = cfg.storage
        # A connection that is not defined gives the default credential chain (s3_access logs it); one that
        # exists but cannot be read is this experiment's error below, never a silent fallback.
        access = s3_access(s.aws_conn_id) if s.uri.startswith("s3://") else None
        source.store = open_store(
            s.uri, endpoint_url=s.endpoint_url or (access.endpoint_url if access else None),
            region=s.region or (access.region if access else None), sse=s.sse, sse_kms_key_id=s.sse_kms_key_id,
            credentials=access.credentials if access else None, s3_options=PAGE_S3_OPTIONS)
    except Exception as err:  # noqa: BLE001 - one broken YAML must not hide the others
        source.error = f"{path.name}: {type(err).__name__}: {err}"
    return source


def unreachable(source: Source, err: Exception) -> str:
    """One calm line for a store the api-server cannot read (no credentials here, endpoint down)."""
    first = str(err).splitlines()[0][:200] if str(err) else ""
    return (f"{source.dag_id}: store {source.store_uri} is not readable from the Airflow api-server "
            f"({type(err).__name__}{': ' + first if first else ''}); the page shows it once the api-server has "
            f"access (storage.aws_conn_id or the AWS environment)")


def owner(name: str, record: dict[str, Any] | None, source: Source, sources: list[Source]) -> bool:
    """Whether readers of ``source``'s DAG see experiment ``name`` (its ``experiment.json`` is ``record``) found
    in that DAG's store. See the module docstring and :mod:`verl_tasks.ownership`."""
    from verl_tasks.ownership import may_see

    if source.access is None:
        return False
    verdict = may_see(record, name, source.access)
    if verdict is not None:
        return verdict
    return [s.store_uri for s in sources].count(source.store_uri) == 1  # no other YAML uses its store


def _list_store(source: Source) -> dict[str, dict[str, Any]]:
    from verl_tasks.airflow.dashboard import store_records

    return store_records(source.store)


def find_experiments(readable: list[Source], everyone: list[Source]) -> tuple[list[tuple[Source, str]], list[str]]:
    """(source, experiment) pairs the readable DAGs may show, each experiment once (under the DAG that owns it
    when that one is readable), and a notice per store that could not be listed."""
    from verl_tasks.ownership import owner_of

    found: dict[tuple[str, str], tuple[Source, str]] = {}
    notices: list[str] = []
    listed: dict[str, dict[str, dict[str, Any]] | None] = {}
    for source in readable:
        if source.error:
            notices.append(source.error)
            continue
        if source.store_uri not in listed:
            try:
                listed[source.store_uri] = _list_store(source)
            except Exception as err:  # noqa: BLE001 - an unreachable store is one line, not a traceback
                listed[source.store_uri] = None
                notices.append(unreachable(source, err))
        records = listed[source.store_uri]
        if records is None:
            continue
        names = list(records)
        if source.experiment not in records:  # the DAG's own experiment shows before its first run
            names = [source.experiment, *names]
        for name in names:
            record = records.get(name)
            if not owner(name, record, source, everyone):
                continue
            key = (source.store_uri, name)
            if key not in found or owner_of(record) == source.dag_id:
                found[key] = (source, name)
    return list(found.values()), notices


@functools.lru_cache(maxsize=1)
def _templates():
    """The page templates (package data), compiled once per process."""
    from jinja2 import Environment, PackageLoader, select_autoescape

    return Environment(loader=PackageLoader("verl_tasks.airflow", "templates"), autoescape=select_autoescape())


def compare_with(source: Source, experiment: str, found: list[tuple[Source, str]],
                 requested: str | None) -> dict[str, Any] | None:
    """The experiment whose per-epoch curves ``experiment``'s are overlaid with: ``requested`` (``?compare=``),
    else the parent a retrained or forked run started from; only one the user may read (among ``found``).
    Returns what :func:`verl_tasks.airflow.dashboard.experiment_view` takes, or None."""
    from verl_tasks.config import parse_config
    from verl_tasks.layout import Layout
    from verl_tasks.pinning import read_pin
    from verl_tasks.status import base_origin, status

    wanted, relation, offset = requested, "chosen", 0
    if wanted is None:
        origin = base_origin(source.store, experiment)
        if not origin:
            return None
        wanted, relation, offset = str(origin["experiment"]), "parent", int(origin.get("version") or 0)
    match = next(((s, n) for s, n in found if n == wanted and n != experiment), None)
    if match is None:
        return None
    other_source, other = match
    pin = read_pin(other_source.store, Layout(other))
    config = parse_config(pin["config"], {"storage.uri": other_source.store_uri}) if pin and "config" in pin \
        else other_source.config(other)  # its own epochs, not this DAG's
    return {"name": other, "rows": status(config, other_source.store)["epochs"], "offset": offset,
            "relation": relation}


def render_section(source: Source, experiment: str, epoch: int | None = None, phase: str | None = None,
                   per_step: bool = False, found: list[tuple[Source, str]] | None = None,
                   compare: str | None = None) -> dict[str, Any] | str:
    """One experiment's view for the template, or a one-line notice when its store cannot be read.

    Each unit cell links to the unit's page; the safe-mode notice links each failed or refused unit's page,
    its task instance in Airflow's UI and the run whose Clear it asks for. The per-epoch curves are also
    drawn against another readable experiment (``compare``, else its parent), when there is one."""
    from verl_tasks.airflow.dashboard import experiment_view
    from verl_tasks.airflow.links import run_url, task_instance_url, task_url, unit_page

    try:
        against = None if per_step else compare_with(source, experiment, found or [], compare)
        view = experiment_view(source.config(experiment), source.store, epoch=epoch, phase=phase,
                               unit_href=unit_page(source.dag_id), per_step=per_step, compare=against)
    except Exception as err:  # noqa: BLE001 - one broken experiment must not hide the others
        if _is_access_error(err):
            return unreachable(source, err)
        return f"{source.dag_id} / {experiment}: {type(err).__name__}: {err}"
    halted = view["safe_mode"]
    if halted:
        for run in halted["runs"]:
            run["url"] = run_url(run["dag_id"], run["run_id"])
        for unit in halted["units"] + halted["refused"]:
            dag_id = unit["dag_id"] or source.dag_id
            unit["unit_url"] = unit_page(source.dag_id, unit["unit"])
            unit["task_url"] = None if not unit["task_id"] else (
                task_instance_url(dag_id, unit["run_id"], unit["task_id"], unit["map_index"]) if unit["run_id"]
                else task_url(dag_id, unit["task_id"]))
    return {"dag": source.dag_id, "yaml": source.path.name, "view": view}


def _is_access_error(err: Exception) -> bool:
    from botocore.exceptions import BotoCoreError

    from verl_tasks.errors import StoreError

    return isinstance(err, (StoreError, BotoCoreError, PermissionError))


def render_page(readable: list[Source], everyone: list[Source], *,
                experiment: str | None = None, dag: str | None = None, epoch: int | None = None,
                phase: str | None = None, per_step: bool = False, compare: str | None = None) -> str:
    """The whole page for the DAGs a user may read (``per_step``: the curves per optimizer step)."""
    found, notices = find_experiments(readable, everyone)
    listed = [{"name": name, "dag": source.dag_id} for source, name in found]
    if experiment:
        chosen = [(s, n) for s, n in found if n == experiment]
        empty = f"No experiment {experiment!r} in the store of a DAG you may read."
    else:
        defaults = [(s, n) for s, n in found if n == s.experiment]
        chosen = (defaults + [p for p in found if p not in defaults])[:SECTIONS_SHOWN]
        empty = "No experiment yet in the store of a DAG you may read." if readable else \
            "No experiment DAG you may read."
    sections: list[dict[str, Any]] = []
    for source, name in chosen:
        section = render_section(source, name, epoch, phase, per_step, found, compare)
        if isinstance(section, dict):
            sections.append(section)
        else:
            notices.append(section)
    return _templates().get_template("dashboard.html").render(
        listed=listed, sections=sections, notices=notices, empty=empty,
        query={"experiment": experiment, "dag": dag, "curves": "step" if per_step else "epoch", "compare": compare})


def render_unit(source: Source, experiment: str, key: str) -> str:
    """The page of one unit in storage: its committed record, files, events (each error's traceback folded) and
    a link to its task in Airflow's UI (the task's extra link and the Training page's cells lead here)."""
    from datetime import datetime
    from urllib.parse import urlencode

    from verl_tasks.airflow.dashboard import recent_events, split_error
    from verl_tasks.airflow.links import base_path, task_id, task_url
    from verl_tasks.layout import Layout
    from verl_tasks.store.units import is_pruned, read_marker

    record = read_marker(source.store, key)
    events = [e for e in recent_events(source.store, Layout(experiment)) if e.get("unit") == key]
    committed_at = (datetime.fromtimestamp(record.committed_at, UTC).isoformat(timespec="seconds")
                    if record and record.committed_at else None)
    task = next((str(e["task_id"]) for e in reversed(events) if e.get("task_id")), None) or next(
        (task_id(e["phase"], e["epoch"]) for e in reversed(events)
         if isinstance(e.get("phase"), str) and isinstance(e.get("epoch"), int)), None)
    shown = []
    for event in reversed(events):
        cls, message, detail = split_error(event.get("error"))
        shown.append({**event, "error_head": f"{cls}: {message}" if cls else message, "error_detail": detail})
    return _templates().get_template("unit.html").render(
        unit=key, experiment=experiment, dag=source.dag_id, url=source.store.url(key), record=record,
        committed_at=committed_at, pruned=is_pruned(source.store, key), events=shown,
        task=task, task_url=task_url(source.dag_id, task) if task else None,
        back=f"{base_path()}{PREFIX}/?{urlencode({'experiment': experiment, 'dag': source.dag_id})}")


async def airflow_user(request: Request,
                       credentials: HTTPAuthorizationCredentials | None = Depends(HTTPBearer(auto_error=False))):
    """The caller as Airflow's own ``get_user`` resolves it (bearer header, else the UI's ``_token`` cookie;
    401/403 otherwise). Imported per request: the module costs every plugin-loading process ~1.5 s."""
    from airflow.api_fastapi.core_api.security import get_user

    return await get_user(request, _oauth_token=None, bearer_credentials=credentials)


def _readable_sources(user, dag: str | None) -> tuple[list[Source], list[Source]]:
    """(sources the user may read, all sources)."""
    from fastapi import HTTPException

    yamls = experiment_yamls()
    readable = readable_dag_ids(user, set(yamls))
    if dag is not None and dag not in readable:
        raise HTTPException(403, f"no experiment DAG {dag!r} you may read")
    shown = [dag] if dag else sorted(readable)
    everyone = [open_source(dag_id, path) if dag_id in readable else _unopened(dag_id, path)
                for dag_id, path in yamls.items()]
    by_id = {s.dag_id: s for s in everyone}
    return [by_id[d] for d in shown], everyone


def _unopened(dag_id: str, path: Path) -> Source:
    """A YAML the user may not read: only its experiment name and store URI (to attribute names); no store."""
    from verl_tasks.airflow.runconfig import read_yaml
    from verl_tasks.config import parse_config
    from verl_tasks.ownership import DagAccess
    from verl_tasks.store import absolute_uri

    source = Source(dag_id, path)
    try:
        raw = read_yaml(path)
        parse_config(raw)  # validated before any of its values is used
        source.experiment = str(raw["experiment"])
        source.store_uri = absolute_uri((raw.get("storage") or {}).get("uri", "file://.store"))
        source.access = DagAccess.from_yaml(dag_id, raw, str(path))
    except Exception as err:  # noqa: BLE001 - unreadable YAML: it claims nothing
        source.error = str(err)
    return source


def metrics_response(found: list[tuple[Source, str]], experiment: str | None):
    """The ``/metrics`` reply: ``verl_tasks.metrics`` text of each (source, experiment) found, or of ``experiment``."""
    from fastapi.responses import Response

    from verl_tasks.metrics import CONTENT_TYPE, render_reachable

    pairs = [(source.config(name), source.store) for source, name in found if experiment in (None, name)]
    return Response(render_reachable(pairs), media_type=CONTENT_TYPE)


def create_app():
    """The dashboard app; every request is authenticated (a plugin's mount is not behind Airflow's auth)."""
    from fastapi import FastAPI, HTTPException, Query
    from fastapi.responses import HTMLResponse

    app = FastAPI(title="verl-tasks dashboard")

    @app.get("/", response_class=HTMLResponse)
    def dashboard(user=Depends(airflow_user), experiment: str | None = Query(None), dag: str | None = Query(None),
                  epoch: str | None = Query(None), phase: str | None = Query(None),
                  curves: str = Query("epoch"), compare: str | None = Query(None)) -> str:
        if curves not in ("epoch", "step"):
            raise HTTPException(400, f"curves={curves!r}: use epoch or step")
        readable, everyone = _readable_sources(user, dag or None)
        return render_page(readable, everyone, experiment=experiment or None, dag=dag,
                           epoch=_epoch(epoch), phase=phase or None, per_step=curves == "step",
                           compare=compare or None)

    @app.get("/unit", response_class=HTMLResponse)
    def unit(user=Depends(airflow_user), dag: str = Query(...), experiment: str | None = Query(None),
             key: str = Query(...)) -> str:
        """One unit's page; ``experiment`` defaults to the key's first part (the grid's links leave it out)."""
        experiment = experiment or key.split("/", 1)[0]
        readable, everyone = _readable_sources(user, dag)
        found, _ = find_experiments(readable, everyone)
        source = next((s for s, name in found if name == experiment), None)
        if source is None or not key.startswith(experiment + "/"):
            raise HTTPException(404, f"no unit {key!r} of experiment {experiment!r} in DAG {dag!r}")
        return render_unit(source, experiment, key)

    @app.get("/metrics")
    def metrics(user=Depends(airflow_user), dag: str | None = Query(None), experiment: str | None = Query(None)):
        """Prometheus text of the experiments the user may read (``?dag=ID``, ``?experiment=NAME`` narrow it)."""
        readable, everyone = _readable_sources(user, dag or None)
        return metrics_response(find_experiments(readable, everyone)[0], experiment or None)

    def _epoch(value: str | None) -> int | None:
        if not value:
            return None
        if not value.isdigit():
            raise HTTPException(400, f"epoch={value!r}: use a whole number")
        return int(value)

    return app


class VerlTasksPlugin(AirflowPlugin):
    name = "verl_tasks"

    # Creating the app is cheap; the store and status code load on the first request.
    fastapi_apps = [{"app": create_app(), "url_prefix": PREFIX, "name": "verl-tasks dashboard"}]

    # A top-level entry of the main navigation (not under Browse); opens the page inside the UI.
    external_views = [{"name": "Training", "href": PREFIX + "/", "destination": "nav", "nav_top_level": True,
                       "url_route": "verl-tasks"}]
