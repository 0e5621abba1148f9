"""The Training page's content without a server: listing and search over real stores, the grid, the
curves, snapshots, the event filter, calm notices for unreachable stores, and the task links.

The stores are real (LocalStore on disk, S3 through the moto server) and filled the way a finished
run leaves them (``benchmarks/dashboard_render.fabricate``); the page is rendered by the plugin's own
functions, the ones its FastAPI routes call after Airflow's auth.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from benchmarks.dashboard_render import fabricate

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "dags" / "experiments" / "tiny_arith.yaml"


def _yaml(folder: Path, dag_id: str, experiment: str, store_uri: str, batches: int = 2, **storage) -> Path:
    raw = yaml.safe_load(TINY.read_text())
    raw.update(experiment=experiment, epochs=3)
    raw.setdefault("rollout", {})["batches_per_epoch"] = batches
    raw["storage"] = {"uri": store_uri, **storage}
    path = folder / "experiments" / f"{dag_id}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw))
    return path


def _sources(*pairs):
    from verl_tasks.airflow.plugin import open_source

    return [open_source(dag_id, path) for dag_id, path in pairs]


def _shown(page: str) -> list[str]:
    import re

    return re.findall(r"<h2>([^<]+)</h2>", page)


@pytest.fixture
def two_dags(tmp_path):
    """DAG a (store one: its experiment and one triggered under a new name), DAG b (store two)."""
    fabricate(tmp_path / "one", "exp-a", 3, 2)
    fabricate(tmp_path / "one", "renamed-run", 2, 2)
    fabricate(tmp_path / "two", "exp-b", 2, 2)
    a = _yaml(tmp_path, "dag_a", "exp-a", f"file://{tmp_path / 'one'}")
    b = _yaml(tmp_path, "dag_b", "exp-b", f"file://{tmp_path / 'two'}")
    return _sources(("dag_a", a), ("dag_b", b))


def test_experiments_are_listed_from_the_stores_including_new_names(two_dags):
    from verl_tasks.airflow.plugin import render_page

    page = render_page(two_dags, two_dags)
    assert sorted(_shown(page)) == ["exp-a", "exp-b", "renamed-run"]
    assert 'href="?experiment=renamed-run&amp;dag=dag_a"' in page


@pytest.mark.parametrize("name,dag", [("exp-b", "dag_b"), ("renamed-run", "dag_a"), ("exp-a", "dag_a")])
def test_search_finds_an_experiment_of_any_dag(two_dags, name, dag):
    from verl_tasks.airflow.plugin import render_page

    page = render_page(two_dags, two_dags, experiment=name)
    assert _shown(page) == [name]
    assert f"DAG <code>{dag}</code>" in page


def test_search_for_a_missing_name_says_so(two_dags):
    from verl_tasks.airflow.plugin import render_page

    page = render_page(two_dags, two_dags, experiment="nope")
    assert _shown(page) == [] and "No experiment &#39;nope&#39; in the store of a DAG you may read." in page


def _record_owner(root: Path, experiment: str, dag_id: str | None) -> None:
    """Write ``experiment.json`` as ``configure`` leaves it: with the DAG that made the experiment."""
    import json

    path = root / experiment / "experiment.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "dag_id": dag_id}))


def test_a_shared_store_shows_an_experiment_to_the_readers_of_the_dag_it_records(tmp_path):
    from verl_tasks.airflow.plugin import render_page

    store = f"file://{tmp_path / 'shared'}"
    for name in ("exp-a", "exp-b", "from-a-run", "from-b-run", "nobodys", "by-cli"):
        fabricate(tmp_path / "shared", name, 1, 2)
    _record_owner(tmp_path / "shared", "from-a-run", "dag_a")
    _record_owner(tmp_path / "shared", "from-b-run", "dag_b")
    _record_owner(tmp_path / "shared", "by-cli", None)  # made by verl-tasks run: no DAG's
    a, b = _sources(("dag_a", _yaml(tmp_path, "dag_a", "exp-a", store)),
                    ("dag_b", _yaml(tmp_path, "dag_b", "exp-b", store)))
    assert sorted(_shown(render_page([a], [a, b]))) == ["exp-a", "from-a-run"]
    assert sorted(_shown(render_page([b], [a, b]))) == ["exp-b", "from-b-run"]
    assert _shown(render_page([b], [a, b], experiment="from-a-run")) == []
    assert sorted(_shown(render_page([a, b], [a, b]))) == ["exp-a", "exp-b", "from-a-run", "from-b-run"]


def test_the_recorded_dag_wins_over_the_yaml_name_and_write_to_shares_the_view(tmp_path):
    """An experiment recorded as dag_b's is not dag_a's even under dag_a's YAML name; access.write_to: [dag_b]
    in dag_c's YAML shows dag_b's experiments to dag_c's readers (once, under dag_b for those who read both)."""
    from verl_tasks.airflow.plugin import render_page

    store = f"file://{tmp_path / 'shared'}"
    for name in ("exp-a", "exp-b"):
        fabricate(tmp_path / "shared", name, 1, 2)
    _record_owner(tmp_path / "shared", "exp-a", "dag_b")
    _record_owner(tmp_path / "shared", "exp-b", "dag_b")
    paths = {dag: _yaml(tmp_path, dag, f"exp-{dag[-1]}", store) for dag in ("dag_a", "dag_b", "dag_c")}
    raw = yaml.safe_load(paths["dag_c"].read_text())
    paths["dag_c"].write_text(yaml.safe_dump({**raw, "access": {"write_to": ["dag_b"]}}))
    a, b, c = _sources(*paths.items())
    assert _shown(render_page([a], [a, b, c])) == []  # exp-a records dag_b; exp-c has no store entry yet
    assert sorted(_shown(render_page([b], [a, b, c]))) == ["exp-a", "exp-b"]
    assert sorted(_shown(render_page([c], [a, b, c]))) == ["exp-a", "exp-b", "exp-c"]
    both = render_page([b, c], [a, b, c])
    assert sorted(_shown(both)) == ["exp-a", "exp-b", "exp-c"] and "DAG <code>dag_c</code>" in both


def test_an_s3_store_without_credentials_is_one_calm_line(tmp_path, monkeypatch, moto_endpoint, two_dags):
    from verl_tasks.airflow.plugin import render_page

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    gpu = _sources(("gpu", _yaml(tmp_path, "gpu", "gpu-exp", "s3://bucket/runs", endpoint_url=moto_endpoint)))
    page = render_page(two_dags + gpu, two_dags + gpu)
    notices = [line for line in page.splitlines() if 'class="notice"' in line and "s3://bucket/runs" in line]
    assert len(notices) == 1, page[:3000]
    assert "is not readable from the Airflow api-server (StoreError" in notices[0]
    assert 'class="alert"' not in page and "Traceback" not in page
    assert sorted(_shown(page)) == ["exp-a", "exp-b", "renamed-run"]  # the other experiments still show


def test_grid_chart_snapshots_and_event_filter(tmp_path):
    from verl_tasks.airflow.plugin import render_page
    from verl_tasks.layout import Layout
    from verl_tasks.store.units import MARKER

    fabricate(tmp_path / "s", "exp-a", 3, 2)
    (tmp_path / "s" / Layout("exp-a").rollout(2, 1) / MARKER).unlink()  # batch 1 of epoch 2: its marker gone
    sources = _sources(("dag_a", _yaml(tmp_path, "dag_a", "exp-a", f"file://{tmp_path / 's'}")))
    page = render_page(sources, sources)
    assert page.count("<svg") == 1 and "reward (mean)" in page and "grad norm" in page
    assert 'title="exp-a/epochs/00002/rollout/b0001: absent, 1 attempt(s), 0.50 s"' in page
    assert 'title="exp-a/epochs/00002/rollout/b0000: committed, 1 attempt(s), 0.50 s"' in page
    assert "<td>3</td><td class=\"committed\">committed</td>" in page.replace("\n", "")  # snapshot 3
    filtered = render_page(sources, sources, epoch=1, phase="rollout")
    rows = [line for line in filtered.split("<tr>") if "<td>started</td>" in line or "<td>committed</td>" in line]
    assert len(rows) == 4 and all("<td>1</td><td>rollout</td>" in row for row in rows), rows


def test_the_page_imports_no_torch(tmp_path):
    fabricate(tmp_path / "s", "exp-a", 1, 2)
    path = _yaml(tmp_path, "dag_a", "exp-a", f"file://{tmp_path / 's'}")
    code = ("import sys\nfrom verl_tasks.airflow.plugin import open_source, render_page\n"
            f"s = [open_source('dag_a', __import__('pathlib').Path({str(path)!r}))]\n"
            "assert '<h2>exp-a</h2>' in render_page(s, s)\nprint('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_unit_page_shows_the_committed_record(tmp_path):
    from verl_tasks.airflow.plugin import render_unit
    from verl_tasks.layout import Layout

    fabricate(tmp_path / "s", "exp-a", 1, 2)
    source, = _sources(("dag_a", _yaml(tmp_path, "dag_a", "exp-a", f"file://{tmp_path / 's'}")))
    key = Layout("exp-a").update(0)
    page = render_unit(source, "exp-a", key)
    assert f"<h1>{key}</h1>" in page and "model.safetensors" in page and "2.1 MB" in page
    assert page.count("<td>committed</td>") == 1 and "reward_mean" in page


def test_task_links_point_at_the_unit_page_and_the_ray_job(tmp_path, monkeypatch):
    from verl_tasks.airflow.links import RayJobLink, StoreUnitLink

    monkeypatch.setenv("VERL_TASKS_RAY_ADDRESS", "http://127.0.0.1:8265")
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "http://airflow.example:8080/prefix")
    path = _yaml(tmp_path, "dag_a", "exp-a", f"file://{tmp_path / 's'}")
    operator = SimpleNamespace(config_path=str(path), phase="rollout", epoch=2, batch=1, backend="ray",
                               ray_conn_id=None, _job_id="vt-exp-a-e2-rollout-b1-a1")
    ti = SimpleNamespace(dag_id="dag_a", task_id="rollout_e2", map_index=1)
    assert StoreUnitLink().get_link(operator, ti_key=ti) == (
        "/prefix/verl-tasks/unit?dag=dag_a&experiment=exp-a&key=exp-a%2Fepochs%2F00002%2Frollout%2Fb0001")
    assert RayJobLink().get_link(operator, ti_key=ti) == "http://127.0.0.1:8265/#/jobs/vt-exp-a-e2-rollout-b1-a1"
    operator.backend = "inline"
    assert RayJobLink().get_link(operator, ti_key=ti) == ""


def test_phase_tasks_carry_both_links():
    from verl_tasks.airflow.operators import VerlPhaseOperator

    assert [link.name for link in VerlPhaseOperator.operator_extra_links] == ["Unit in storage", "Ray job"]


def test_store_folders_are_bounded_and_experiments_need_experiment_json(store):
    from verl_tasks.airflow.dashboard import store_records

    for name in ("b-exp", "a-exp", "c-exp"):
        store.put(f"{name}/experiment.json", b"{}")
    store.put("b-exp/experiment.json", b'{"dag_id": "dag_b"}')
    store.put("not-an-experiment/readme.txt", b"x")
    store.put("top-level-file.txt", b"x")
    assert store.folders(10) == ["a-exp", "b-exp", "c-exp", "not-an-experiment"]
    assert store.folders(2) == ["a-exp", "b-exp"]
    assert store_records(store) == {"a-exp": {}, "b-exp": {"dag_id": "dag_b"}, "c-exp": {}}


def test_the_store_of_a_dag_the_user_may_not_read_is_never_opened(tmp_path, two_dags):
    from verl_tasks.airflow.plugin import _unopened, render_page

    hidden = _unopened("gpu", _yaml(tmp_path, "gpu", "gpu-exp", "s3://bucket/runs"))
    assert hidden.store is None and hidden.experiment == "gpu-exp"
    page = render_page(two_dags, two_dags + [hidden])
    assert "s3://bucket/runs" not in page and "gpu" not in _shown(page)


LINKS_RUNNER = '''
import json, runpy, sys
from datetime import datetime, timezone
from airflow.models import DagRun
from airflow.models.xcom import XComModel
from airflow.utils.session import create_session
from sqlalchemy import select
dag = runpy.run_path(sys.argv[1])["dag"]
when = datetime(2026, 1, 1, tzinfo=timezone.utc)
dag.test(run_after=when, logical_date=when)
with create_session() as session:
    rows = session.execute(select(XComModel.key, XComModel.value).where(XComModel.dag_id == dag.dag_id)).all()
    print("LINKS " + json.dumps({k: v for k, v in rows if k.startswith("_link_")}, default=str))
'''


def test_a_task_run_by_airflow_keeps_its_unit_link(tmp_path):
    """Through Airflow's task runner (dag.test on a migrated SQLite DB): the links are computed when the task ends."""
    import json

    from tests.airflow.test_clear_lifts_safe_mode import _airflow_env, _run

    fabricate(tmp_path / "store", "exp-a", 1, 2)
    path = _yaml(tmp_path, "vt_links", "exp-a", f"file://{tmp_path / 'store'}")
    dag_file = tmp_path / "dags" / "vt_links.py"
    dag_file.parent.mkdir()
    dag_file.write_text(
        "from datetime import datetime\nfrom airflow.sdk import DAG\n"
        "from verl_tasks.airflow.operators import VerlPhaseOperator\n"
        "with DAG('vt_links', schedule=None, start_date=datetime(2025, 1, 1)) as dag:\n"
        f"    VerlPhaseOperator(task_id='rollout', config_path={str(path)!r}, phase='rollout', epoch=0, batch=1,\n"
        "                      backend='ray', ray_conn_id=None)\n")
    env = _airflow_env(tmp_path)
    _run([str(Path(sys.executable).parent / "airflow"), "db", "migrate"], env)
    out = _run([sys.executable, "-c", LINKS_RUNNER, str(dag_file)], env)
    links = json.loads(next(x for x in out.splitlines() if x.startswith("LINKS "))[len("LINKS "):])
    assert links["_link_StoreUnitLink"].strip('"') == (
        "/verl-tasks/unit?dag=vt_links&experiment=exp-a&key=exp-a%2Fepochs%2F00000%2Frollout%2Fb0001"), links
    assert links["_link_RayJobLink"].strip('"') == "", links  # returned from its marker: no Ray job ran


def test_snapshot_verification_comes_from_loads_maintenance_and_quarantine(tmp_path):
    from verl_tasks.airflow.dashboard import experiment_view
    from verl_tasks.events import record_event
    from verl_tasks.layout import Layout
    from verl_tasks.store.units import quarantine

    fabricate(tmp_path / "s", "exp-a", 4, 2)
    source, = _sources(("dag_a", _yaml(tmp_path, "dag_a", "exp-a", f"file://{tmp_path / 's'}")))
    layout = Layout("exp-a")
    record_event(source.store, layout, "policy_loaded", version=1, how="loaded", device="cpu")
    record_event(source.store, layout, "maintenance", problems=[], gc_deleted_keys=0,
                 verified=[{"version": 2, "state": "OK", "problems": []},
                           {"version": 3, "state": "FAILED", "problems": ["model.safetensors: sha256 differs"]}])
    quarantine(source.store, layout.snapshot(4), "weights hash differs")
    cfg = source.config("exp-a").model_copy(update={"epochs": 4})
    rows = {s["version"]: s for s in experiment_view(cfg, source.store)["snapshots"]}
    assert rows[1]["ok"] and rows[1]["verification"].startswith("hashes verified when loaded (loaded)")
    assert rows[2]["ok"] and rows[2]["verification"].startswith("verified by maintenance (hashes, forward pass)")
    assert not rows[3]["ok"] and "model.safetensors: sha256 differs" in rows[3]["verification"]
    assert not rows[4]["ok"] and rows[4]["verification"] == "failed verification: weights hash differs"
    assert rows[4]["state"] == "absent"  # its marker moved aside: recomputed by the next run
    assert all(s["bytes"] == 2 << 20 for s in rows.values())


def test_an_s3_endpoint_that_is_down_is_one_line_within_seconds(tmp_path, two_dags):
    import socket
    import time

    from verl_tasks.airflow.plugin import render_page

    with socket.socket() as sock:  # a port nothing listens on: connections are refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    down = _sources(("down", _yaml(tmp_path, "down", "down-exp", "s3://bucket/runs",
                                   endpoint_url=f"http://127.0.0.1:{port}")))
    started = time.monotonic()
    page = render_page(two_dags + down, two_dags + down)
    assert time.monotonic() - started < 15
    notices = [line for line in page.splitlines() if 'class="notice"' in line and "s3://bucket/runs" in line]
    assert len(notices) == 1 and "(EndpointConnectionError" in notices[0], notices
    assert sorted(_shown(page)) == ["exp-a", "exp-b", "renamed-run"]


def test_a_scheduled_child_belongs_to_its_dag_in_a_shared_store(tmp_path):
    from verl_tasks.airflow.plugin import render_page

    store = f"file://{tmp_path / 'shared'}"
    for name in ("exp-a", "exp-b", "exp-a-20260101T000000"):
        fabricate(tmp_path / "shared", name, 1, 2)
    a, b = _sources(("dag_a", _yaml(tmp_path, "dag_a", "exp-a", store)),
                    ("dag_b", _yaml(tmp_path, "dag_b", "exp-b", store)))
    assert sorted(_shown(render_page([a], [a, b]))) == ["exp-a", "exp-a-20260101T000000"]
    assert _shown(render_page([b], [a, b])) == ["exp-b"]


# Epoch 2 of exp-a as Airflow leaves it after a bad night, every record written by the product's own code:
# the runner's run_unit (started / failed / committed events), the tasks' retry and failure callbacks
# (task_failed with try numbers; the last one enters safe mode through escalate), validate's write_skipped.
RETRIES = 3
LOG_TAIL = ('Traceback (most recent call last):\n  File "/work/verl_tasks/phases/rollout.py", line 88, in produce\n'
            '    samples = engine.generate(prompts)\nRuntimeError: CUDA error: device-side assert triggered')


def _context(path: Path, phase: str, batch: int, try_number: int, error: Exception) -> dict:
    """The parts of an Airflow task context the callbacks read (as in test_escalation)."""
    from verl_tasks.airflow.operators import VerlPhaseOperator

    task = VerlPhaseOperator(task_id=phase, config_path=str(path), phase=phase, epoch=2, batch=batch,
                             backend="ray", retries=RETRIES)
    ti = SimpleNamespace(task_id=f"epoch_002.{phase}", map_index=batch, try_number=try_number, max_tries=RETRIES,
                         dag_id="dag_a", run_id="manual__1")
    dag_run = SimpleNamespace(conf={}, run_type="manual", run_id="manual__1")
    return {"task": task, "ti": ti, "exception": error, "dag_run": dag_run, "params": {}}


def _try(ctx, path: Path, phase: str, batch: int, try_number: int, *, fails: bool, ran: bool = True) -> None:
    """One try of the batch's task: its unit runs (unless the try failed before it started, e.g. a lost Ray
    job) and, when it fails, Airflow's callback records it: a retry below the last try, else the failure."""
    from verl_tasks.airflow import callbacks
    from verl_tasks.errors import JobFailed
    from verl_tasks.phases.common import run_unit

    def produce(writer):
        if fails:
            raise RuntimeError("CUDA error: device-side assert triggered")
        writer.write_json("samples.json", {"batch": batch})
        return {}

    if ran:
        try:
            run_unit(ctx, phase, ctx.layout.unit(phase, 2, batch), 2, produce, batch)
        except RuntimeError:
            assert fails
    if fails:
        job = f"vt-exp-a-e2-{phase}-b{batch}-a{try_number}"
        error = JobFailed(job, "FAILED", LOG_TAIL) if ran else JobFailed(job, "FAILED (node lost)", "")
        callback = callbacks.on_failure if try_number > RETRIES else callbacks.on_retry
        callback(_context(path, phase, batch, try_number, error))


@pytest.fixture
def bad_night(tmp_path, monkeypatch):
    """exp-a (dag_a, 4 batches): epochs 0 and 1 finished; in epoch 2, rollout b0 failed once then committed,
    score b0 lost its Ray job once then committed, rollout b1 failed all 4 tries (safe mode), b2 was skipped."""
    from verl_tasks.phases.common import PhaseContext
    from verl_tasks.pinning import pin_experiment
    from verl_tasks.store.conventions import write_skipped

    monkeypatch.delenv("VERL_TASKS_AIRFLOW_API_CONN", raising=False)
    fabricate(tmp_path / "s", "exp-a", 2, 4)
    path = _yaml(tmp_path, "dag_a", "exp-a", f"file://{tmp_path / 's'}", batches=4)
    source, = _sources(("dag_a", path))
    ctx = PhaseContext(source.config("exp-a"), source.store)
    (tmp_path / "s" / ctx.layout.experiment_json).unlink()  # fabricate's has no config hash: pin this config
    pin_experiment(ctx)
    _try(ctx, path, "rollout", 0, 1, fails=True)
    _try(ctx, path, "rollout", 0, 2, fails=False)
    _try(ctx, path, "score", 0, 1, fails=True, ran=False)
    _try(ctx, path, "score", 0, 2, fails=False)
    for try_number in range(1, RETRIES + 2):
        _try(ctx, path, "rollout", 1, try_number, fails=True)
    write_skipped(source.store, ctx.layout, 2, [2], 4, 0.75)
    return source, ctx


def _cell(page: str, key: str) -> tuple[str, str, str]:
    """(class, title, text) of the grid cell of batch unit ``key``, checking that it links to the unit's page."""
    import html
    import re

    found = re.search(r'<a class="([^"]*)" title="(' + re.escape(key) + r':[^"]*)" href="([^"]*)">([^<]*)</a>', page)
    assert found, key
    assert html.unescape(found.group(3)) == f"/verl-tasks/unit?dag=dag_a&key={key}"
    return found.group(1), html.unescape(found.group(2)), found.group(4)


def test_the_grid_shows_failed_retried_and_skipped_units_and_links_each_to_its_page(bad_night):
    from verl_tasks.airflow.plugin import render_page

    source, ctx = bad_night
    page = render_page([source], [source])
    layout = ctx.layout
    css, title, text = _cell(page, layout.rollout(2, 0))
    assert (css, text) == ("committed retried", "2") and ": committed, 2 attempt(s), 1 failed" in title
    css, title, text = _cell(page, layout.score(2, 0))  # its failed try never started the unit: a lost Ray job
    assert (css, text) == ("committed retried", "2") and ": committed, 2 attempt(s), 1 failed" in title
    css, title, text = _cell(page, layout.rollout(2, 1))  # runner and callback told of each try: counted once
    assert (css, text) == ("failed retried", "4") and ": failed, 4 attempt(s), 4 failed" in title
    assert "failed for good: Clear its task" in title and "RuntimeError: CUDA error" in title
    assert _cell(page, layout.rollout(2, 2))[0] == "skipped"
    assert "the epoch went on without this batch" in _cell(page, layout.rollout(2, 2))[1]
    assert _cell(page, layout.rollout(2, 3))[:2] == ("absent", f"{layout.rollout(2, 3)}: absent, 0 attempt(s)")
    assert _cell(page, layout.rollout(1, 1))[0] == "committed"  # a unit that never failed is plain
    assert f'<a href="/verl-tasks/unit?dag=dag_a&amp;key={layout.update(1)}">committed 0.5s</a>' in page


def test_the_safe_mode_notice_says_what_happened_and_the_clear_to_do_first(bad_night):
    import html
    import re

    from verl_tasks.airflow.plugin import render_page

    source, ctx = bad_night
    page = render_page([source], [source])
    assert "{&#39;commands&#39;" not in page and "\\n" not in page  # no raw record
    block = re.search(r'<div class="safe-mode" role="alert">(.*?)</div>', page, re.S)
    assert block, page[:3000]
    first = re.search(r"<p[^>]*>(.*?)</p>", block.group(1), re.S).group(1)
    first = " ".join(html.unescape(re.sub(r"<[^>]+>", "", first)).split())
    unit = ctx.layout.rollout(2, 1)
    assert first.startswith(f"SAFE MODE: {unit} failed after all its retries. To continue: Clear "
                            "epoch_002.rollout (map index 1) in DAG dag_a with Downstream checked"), first
    assert ('<a href="/dags/dag_a/runs/manual__1/tasks/epoch_002.rollout/mapped/1" target="_top">'
            '<code>epoch_002.rollout</code></a>') in page  # the task instance's page: its log and its Clear
    what = block.group(1)
    assert f'<a href="/verl-tasks/unit?dag=dag_a&amp;key={unit}">{unit}</a>' in what
    assert ("try 4:\n<strong class=\"error-class\">JobFailed</strong>: Ray job vt-exp-a-e2-rollout-b1-a4 ended "
            "FAILED. Log tail:") in what
    assert what.index("Clear") < what.index("JobFailed") < what.index("verl-tasks resume")  # the Clear first
    folded = re.findall(r"<details[^>]*>\s*<summary>[^<]*</summary>\s*<pre>(.*?)</pre>\s*</details>", page, re.S)
    assert len(folded) == 1 and html.unescape(folded[0]) == LOG_TAIL
    assert page.count("Traceback (most recent call last)") == 1  # only there: folded


def test_a_task_safe_mode_refused_is_drawn_refused_and_the_clear_to_do_becomes_the_run_s(bad_night):
    """Batch 3's task started after safe mode was entered: the phase refused it. It is no failed batch and
    changes nothing of the record; the page draws it refused, and the first line asks for the run's Clear
    of its failed tasks, which reruns it with batch 1 (a Clear of batch 1 alone would leave it failed)."""
    import html
    import re

    from airflow.sdk.exceptions import AirflowFailException

    from verl_tasks.airflow import callbacks
    from verl_tasks.airflow.plugin import render_page
    from verl_tasks.errors import SafeMode
    from verl_tasks.ops.safe_mode import failed_batches, read_safe_mode
    from verl_tasks.phases.common import run_unit

    source, ctx = bad_night
    before = read_safe_mode(source.store, ctx.layout)
    with pytest.raises(SafeMode) as refusal:
        run_unit(ctx, "rollout", ctx.layout.rollout(2, 3), 2, lambda writer: pytest.fail("it ran"), 3)
    failure = AirflowFailException(f"{ctx.layout.rollout(2, 3)}: SafeMode: {refusal.value}")
    failure.__cause__ = refusal.value
    callbacks.on_failure(_context(source.path, "rollout", 3, 1, failure))
    assert failed_batches(source.store, ctx.layout, 2, final_only=True) == {1}
    assert read_safe_mode(source.store, ctx.layout) == before

    page = render_page([source], [source])
    css, title, text = _cell(page, ctx.layout.rollout(2, 3))
    assert (css, text) == ("refused", "") and "not run: the experiment was in safe mode" in title, title
    assert _cell(page, ctx.layout.rollout(2, 1))[0] == "failed retried"
    block = re.search(r'<div class="safe-mode" role="alert">(.*?)</div>', page, re.S).group(1)
    first = " ".join(html.unescape(re.sub(r"<[^>]+>", "", re.search(r"<p[^>]*>(.*?)</p>", block, re.S).group(1)))
                     .split())
    assert first == (f"SAFE MODE: {ctx.layout.rollout(2, 1)} failed after all its retries. To continue: Clear the "
                     "failed tasks of run manual__1 in DAG dag_a (the run's Clear, with \"Clear only failed tasks\"): "
                     "safe mode also refused epoch_002.rollout (map index 3), which never ran. The Clear lifts safe "
                     "mode and reruns only the units that are not committed."), first
    assert '<a href="/dags/dag_a/runs/manual__1" target="_top"><code>manual__1</code></a>' in block


def test_the_unit_page_links_its_airflow_task_and_folds_each_traceback(bad_night):
    import re

    from verl_tasks.airflow.plugin import render_unit

    source, ctx = bad_night
    page = render_unit(source, "exp-a", ctx.layout.rollout(2, 1))
    assert 'Airflow task <a href="/dags/dag_a/tasks/epoch_002.rollout" target="_top">' in page
    assert page.count("<td>task_failed</td>") == 4 and page.count("<td>failed</td>") == 4
    assert "<td>4 (last)</td>" in page and "<td>JobFailed: Ray job vt-exp-a-e2-rollout-b1-a4 ended FAILED." in page
    assert page.count("Traceback (most recent call last)") == 4
    assert len(re.findall(r"<details[^>]*><summary>[^<]*</summary><pre>Traceback \(most", page)) == 4


def test_a_safe_mode_without_a_dag_says_resume_then_run(tmp_path):
    from verl_tasks.airflow.plugin import render_page
    from verl_tasks.ops.safe_mode import escalate

    fabricate(tmp_path / "s", "exp-a", 1, 2)
    path = _yaml(tmp_path, "dag_a", "exp-a", f"file://{tmp_path / 's'}")
    source, = _sources(("dag_a", path))
    cfg = source.config("exp-a")
    unit = "exp-a/epochs/00001/update"
    escalate(cfg, [{"unit": unit, "error": "MemoryError: CUDA out of memory"}], f"{unit} failed after all its retries",
             source.store, config_path=path)
    page = render_page([source], [source])
    first = page.split('<p class="alert safe-mode-first">', 1)[1].split("</p>", 1)[0]
    assert first.startswith(f"SAFE MODE: {unit} failed after all its retries.\nTo continue: fix the cause, then "
                            "<code>verl-tasks resume "), first
    assert "<strong class=\"error-class\">MemoryError</strong>: CUDA out of memory" in page and "<details" not in page


def test_the_curves_per_optimizer_step_come_from_each_update_s_steps(tiny_config, tmp_path):
    """A real 2-epoch run: the page's curves per optimizer step have one point per committed step (each
    update's steps.jsonl) for every step curve; the default stays per epoch, and each links to the other."""
    from verl_tasks.airflow.dashboard import STEP_CURVES, experiment_view, step_chart_rows
    from verl_tasks.airflow.plugin import open_source, render_page
    from verl_tasks.runner import make_context, train
    from verl_tasks.store.conventions import TRAINER_STATE
    from verl_tasks.store.units import read_json, read_marker

    ctx = make_context(tiny_config(f"file://{tmp_path}/store", epochs=2))
    st = train(ctx, 2)
    steps = read_json(ctx.store, read_marker(ctx.store, ctx.layout.update(1)), TRAINER_STATE)["step"]
    rows = step_chart_rows(ctx.store, ctx.layout, st["epochs"])
    for _, title in STEP_CURVES:
        assert sorted(r["x"] for r in rows if r["metric"] == title) == list(range(1, steps + 1)), title
    view = experiment_view(ctx.config, ctx.store, per_step=True)
    assert view["per_step"] and "optimizer step" in view["chart"] and "learning rate" in view["chart"]
    assert "optimizer step" not in experiment_view(ctx.config, ctx.store)["chart"]

    path = tmp_path / "dags" / "experiments" / "steps_dag.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(yaml.safe_dump({**yaml.safe_load(TINY.read_text()), **_raw(ctx.config)}))
    source = open_source("steps_dag", path)
    page = render_page([source], [source], experiment=ctx.config.experiment, per_step=True)
    assert "<strong>per optimizer step</strong>" in page and "curves=epoch" in page
    assert "curves=step" in render_page([source], [source], experiment=ctx.config.experiment)


def _raw(cfg) -> dict:
    """The parts of a config a YAML needs to name the same experiment in the same store."""
    return {"experiment": cfg.experiment, "epochs": cfg.epochs, "storage": {"uri": cfg.storage.uri}}
