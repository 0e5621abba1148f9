"""Airflow plugin: a "Training" page inside Airflow with, per experiment, the epochs, each phase's
state, the reward / accuracy curve (inline SVG), the latest snapshot and the recent events.

Mounted on the api-server at ``/verl-tasks`` (``fastapi_apps``) and linked from the nav bar
(``external_views``). Airflow does not put a plugin's app behind its auth, so every request goes through
Airflow's own ``get_user`` (401/403 without a valid token) and lists only the experiments whose DAG the
auth manager lets the user read: each YAML in ``dags/experiments`` is the DAG named after its stem.
``?dag=ID`` shows one of them, ``?experiment=NAME`` another experiment name (a scheduled child, a fork)
in that DAG's store. Data comes from ``verl_tasks.status.status`` and ``verl_tasks.events.read_events``
(the newest ``EVENTS_SHOWN`` events): a handful of listings per experiment, one per prefix.
"""
from __future__ import annotations

import html
import os
from pathlib import Path
from typing import Any

from airflow.plugins_manager import AirflowPlugin
from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

PREFIX = "/verl-tasks"
EVENTS_SHOWN = 15


def experiments_dir() -> Path:
    configured = os.environ.get("VERL_TASKS_EXPERIMENTS_DIR")
    if configured:
        return Path(configured)
    from airflow.configuration import conf

    return Path(conf.get("core", "dags_folder")) / "experiments"


def _svg_curve(rows: list[dict[str, Any]], base: float | None) -> str:
    """Two polylines over epochs: reward_mean (orange) and eval_accuracy (blue), both in [0, 1]."""
    width, height, pad = 560, 200, 30
    n = max(1, len(rows))
    series = {"reward_mean": "#e8710a", "eval_accuracy": "#1a73e8"}
    parts = [f'<svg width="{width}" height="{height}" role="img" aria-label="reward and accuracy per epoch">',
             f'<rect x="{pad}" y="10" width="{width - 2 * pad}" height="{height - 40}" fill="#fafafa" stroke="#ddd"/>']

    def xy(i: int, v: float) -> tuple[float, float]:
        x = pad + 12 + (width - 2 * pad - 24) * (i + 1) / n
        y = 10 + (height - 40) * (1 - max(0.0, min(1.0, v)))
        return x, y

    for tick in (0.0, 0.25, 0.5, 0.75, 1.0):
        y = xy(0, tick)[1]
        parts.append(f'<line x1="{pad}" x2="{width - pad}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>'
                     f'<text x="2" y="{y + 4:.1f}" font-size="10">{tick:.2f}</text>')
    for i in range(-1, n):
        x = xy(i, 0)[0]
        parts.append(f'<text x="{x - 8:.1f}" y="{height - 20}" font-size="10">{"base" if i < 0 else i}</text>')
    for key, colour in series.items():
        pts = [(i, r["metrics"][key]) for i, r in enumerate(rows) if key in r["metrics"]]
        if key == "eval_accuracy" and base is not None:
            pts = [(-1, base)] + pts
        if pts:
            coords = " ".join("%.1f,%.1f" % xy(i, v) for i, v in pts)
            parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{coords}"/>')
            parts += [f'<circle cx="{xy(i, v)[0]:.1f}" cy="{xy(i, v)[1]:.1f}" r="3" fill="{colour}"><title>{key} epoch {i}: {v:.3f}</title></circle>' for i, v in pts]
    parts.append(f'<text x="{pad}" y="{height - 8}" font-size="11">reward_mean (orange), eval_accuracy (blue); x = epoch, y in [0, 1]</text>')
    parts.append("</svg>")
    return "".join(parts)


def render_experiment(cfg, store) -> str:
    from verl_tasks.events import read_events
    from verl_tasks.layout import Layout
    from verl_tasks.status import status

    st = status(cfg, store)
    e = html.escape
    from verl_tasks.phase_registry import PHASE_NAMES as phases

    head = "".join(f"<th>{p}</th>" for p in phases)
    body = []
    for row in st["epochs"]:
        m = row["metrics"]
        cells = "".join(f'<td class="{e(row["phases"][p].split("/")[0] if "/" not in row["phases"][p] else "partial")}">{e(row["phases"][p])}</td>' for p in phases)
        body.append(f"<tr><td>{row['epoch']}</td>{cells}<td>{m.get('reward_mean', float('nan')):.3f}</td>"
                    f"<td>{m.get('eval_accuracy', float('nan')):.3f}</td></tr>")
    base = st["base"]["metrics"].get("eval_accuracy")
    events = read_events(store, Layout(cfg.experiment), limit=EVENTS_SHOWN)
    ev = "".join(
        f"<tr><td>{e(str(x.get('kind')))}</td><td>{e(str(x.get('unit', '')))}</td><td>{e(str(x.get('attempt', ''))[:26])}</td>"
        f"<td>{e(str(x.get('duration_s', '')))}</td><td>{e(str(x.get('error', ''))[:160])}</td></tr>" for x in reversed(events)
    )
    latest = st["latest_snapshot"]
    latest_html = (f"version {latest['version']} at <code>{e(latest['uri'])}</code> (sha256 {e(latest['weights_sha256'][:16])}…)"
                   if latest else "none yet")
    safe = f'<p class="alert">SAFE MODE: {e(str(st["safe_mode"]))}</p>' if st["safe_mode"] else ""
    return (
        f"<h2>{e(cfg.experiment)}</h2><p>store <code>{e(st['store'])}</code> · latest snapshot: {latest_html}"
        f"{' · base accuracy %.3f' % base if base is not None else ''}</p>{safe}"
        f"{_svg_curve(st['epochs'], base)}"
        f"<table><tr><th>epoch</th>{head}<th>reward</th><th>eval acc</th></tr>{''.join(body)}</table>"
        f"<h3>Recent events</h3><table><tr><th>kind</th><th>unit</th><th>attempt</th><th>s</th><th>error</th></tr>{ev}</table>"
    )


STYLE = """<style>body{font-family:system-ui,sans-serif;margin:1.5rem;color:#222}table{border-collapse:collapse;margin:.5rem 0 1rem}
td,th{border:1px solid #ddd;padding:3px 8px;font-size:13px}td.committed{background:#e6f4ea}td.absent{color:#999}
td.partial{background:#fef7e0}td.pruned{background:#eee}.alert{color:#b00;font-weight:bold}code{font-size:12px}</style>"""


def experiment_yamls() -> dict[str, Path]:
    """DAG id -> experiment YAML: each YAML is one DAG named after its stem (``factory.build_dag``)."""
    return {path.stem: path for path in sorted(experiments_dir().glob("*.yaml"))}


def readable_dag_ids(user, dag_ids: set[str]) -> set[str]:
    """The subset of ``dag_ids`` the auth manager lets ``user`` read (teams included)."""
    from airflow.api_fastapi.app import get_auth_manager

    return dag_ids & get_auth_manager().get_authorized_dag_ids(user=user, method="GET")


def _section(path: Path, experiment: str | None) -> str:
    """One experiment's block; a broken YAML or store shows its error instead of hiding the others."""
    from verl_tasks.airflow.runconfig import _absolute_store, read_yaml
    from verl_tasks.config import parse_config
    from verl_tasks.store import store_for

    try:
        raw = read_yaml(path)
        overrides = {"storage.uri": _absolute_store((raw.get("storage") or {}).get("uri", "file://.store"))}
        if experiment:
            overrides["experiment"] = experiment
        cfg = parse_config(raw, overrides)
        return f"<p class=src>from <code>{html.escape(path.name)}</code></p>" + render_experiment(cfg, store_for(cfg))
    except Exception as err:  # noqa: BLE001 - one broken experiment must not hide the others
        return f"<p class=alert>{html.escape(path.name)}: {html.escape(type(err).__name__ + ': ' + str(err))}</p>"


async def airflow_user(request: Request,
                       credentials: HTTPAuthorizationCredentials | None = Depends(HTTPBearer(auto_error=False))):
    """The caller as Airflow's own ``get_user`` resolves it (bearer header, else the UI's ``_token`` cookie;
    401/403 otherwise). Imported per request: the module costs every plugin-loading process ~1.5 s."""
    from airflow.api_fastapi.core_api.security import get_user

    return await get_user(request, _oauth_token=None, bearer_credentials=credentials)


def create_app():
    """The dashboard app; every request is authenticated (a plugin's mount is not behind Airflow's auth)."""
    from fastapi import FastAPI, HTTPException, Query
    from fastapi.responses import HTMLResponse

    app = FastAPI(title="verl-tasks dashboard")

    @app.get("/", response_class=HTMLResponse)
    def dashboard(user=Depends(airflow_user), experiment: str | None = Query(None), dag: str | None = Query(None)) -> str:
        yamls = experiment_yamls()
        readable = readable_dag_ids(user, set(yamls))
        if dag is not None and dag not in readable:
            raise HTTPException(403, f"no experiment DAG {dag!r} you may read")
        shown = [dag] if dag else sorted(readable)
        if experiment:  # another experiment name (a scheduled child, a fork) in the store of one readable DAG
            shown = shown[:1]
        sections = [_section(yamls[dag_id], experiment) for dag_id in shown]
        if not sections:
            sections = ["<p>No experiment DAG you may read.</p>"]
        form = ('<form method="get"><label>experiment <input name="experiment" value="%s"></label> '
                '<label>DAG <input name="dag" value="%s"></label> <button>show</button></form>'
                % (html.escape(experiment or ""), html.escape(dag or "")))
        return f"<!doctype html><html><head><title>verl-tasks</title>{STYLE}</head><body><h1>verl-tasks training</h1>{form}{''.join(sections)}</body></html>"

    return app


class VerlTasksPlugin(AirflowPlugin):
    name = "verl_tasks"

    # Creating the app is cheap; the store, torch and status code load on the first request.
    fastapi_apps = [{"app": create_app(), "url_prefix": PREFIX, "name": "verl-tasks dashboard"}]

    external_views = [{"name": "Training", "href": PREFIX + "/", "destination": "nav", "category": "browse",
                       "url_route": "verl-tasks"}]
