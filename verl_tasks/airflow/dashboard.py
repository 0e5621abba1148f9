"""What the Training page shows, read from the store: no Airflow, no torch, no HTML here.

:func:`experiment_view` gathers one experiment's status (per epoch and phase, per batch for
the mapped phases), the attempts and durations of each unit from the event log, the
snapshots with their size and verification state, the curves of the training metrics and
the event log filtered by epoch and phase, and the safe-mode record as a person reads it
(:func:`safe_mode_view`: what happened, the Clear to do, the traceback apart). :func:`store_records`
lists the experiments a store holds (bounded), each with the DAG it records. The templates in
``templates/`` turn the view into HTML.

A unit's cell shows the store's state (committed, pruned, absent) and what the event log says of its
tries: ``failed`` (a try failed and none committed since; Airflow may still retry it), ``running``
(a try started and has not ended), ``skipped`` (the epoch went on without the batch:
:func:`verl_tasks.store.conventions.read_skipped`, through ``status``), and ``retried`` with the number
of tries when there was more than one. A failed try is counted once although two records may tell of
it: the runner's ``failed`` event and the task's ``task_failed`` (Airflow's retry or failure callback,
which also sees tries that failed before the unit started, e.g. a lost Ray job).

Events are immutable files, so each one is parsed once per process (:data:`_EVENT_CACHE`)
and a page reads at most :data:`MAX_EVENTS_READ` of them, the newest.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import quote

from verl_tasks.config import ExperimentConfig, check_name
from verl_tasks.errors import ConfigError, StoreError
from verl_tasks.layout import Layout
from verl_tasks.ownership import read_record
from verl_tasks.phase_registry import BATCHED, PHASE_NAMES, PHASES, phases_for
from verl_tasks.store.base import NotFound, ObjectStore
from verl_tasks.store.units import MARKER, read_marker

log = logging.getLogger(__name__)
EVENTS_SHOWN = 50
MAX_EVENTS_READ = 20_000
MAX_EXPERIMENTS_LISTED = 200
# (status key, chart title): the curves drawn, one panel each.
CURVES = (
    ("reward_mean", "reward (mean)"),
    ("eval_accuracy", "eval accuracy"),
    ("actor/ppo_kl", "KL"),
    ("actor/pg_clipfrac", "clip fraction"),
    ("actor/entropy", "entropy"),
    ("actor/grad_norm", "grad norm"),
)
# Per optimizer step (the update's steps.jsonl): what people read an RL run from.
STEP_CURVES = (
    ("actor/loss", "loss"),
    ("actor/ppo_kl", "KL"),
    ("actor/pg_clipfrac", "clip fraction"),
    ("actor/entropy", "entropy"),
    ("actor/grad_norm", "grad norm"),
    ("actor/lr", "learning rate"),
)
TASK_FAILED = "task_failed"  # verl_tasks.airflow.callbacks.TASK_FAILED: a failed try, as Airflow's callback saw it
UNIT_EVENTS = ("started", "failed", "committed", "lost_race", "skipped", TASK_FAILED)
TRACEBACK = "Traceback (most recent call last)"
MESSAGE_SHOWN = 400  # characters of an error's message shown in full; the rest goes with the traceback

SVGS_KEPT = 32
_SVG_CACHE: OrderedDict[str, str] = OrderedDict()
_EVENT_CACHE: OrderedDict[tuple[str, str], dict[str, Any] | None] = OrderedDict()


@dataclass
class UnitCell:
    """One unit in the epoch x phase grid: its state in the store and its tries from the event log."""

    state: str = "absent"  # the store's: committed, pruned or absent
    attempts: int = 0  # attempts started (distinct attempt ids of the runner's ``started`` events)
    failures: int = 0  # failed tries (a runner ``failed`` and the task's ``task_failed`` of one try count once)
    duration_s: float | None = None
    key: str = ""
    skipped: bool = False  # the epoch went on without this batch
    running: bool = False  # the newest try started and has not ended
    final: bool = False  # the newest failure was the task's last try: Airflow retries it no more
    refused: bool = False  # the newest try was refused by safe mode: the unit did not run
    error: str = ""  # the newest failure's error, its first line
    epoch: int | None = None

    @property
    def tries(self) -> int:
        """Tries so far: the failed ones, plus the one that committed or is running."""
        done = 1 if self.state in ("committed", "pruned") or self.running else 0
        return max(self.attempts, self.failures + done)

    @property
    def shown_state(self) -> str:
        if self.state in ("committed", "pruned"):
            return self.state
        if self.skipped:
            return "skipped"
        if self.running:
            return "running"
        if self.refused:
            return "refused"
        return "failed" if self.failures else self.state

    def shown(self, href: str = "", batched: bool = False) -> tuple[str, str, str, str]:
        """(CSS classes, tooltip, text, link) as the grid draws the cell: plain values, cheap to render in bulk.
        The link is ``href`` followed by the URL-quoted key. A batch's cell is small: its text is the number
        of tries when there was more than one."""
        state, tries = self.shown_state, self.tries
        css = state + (" retried" if tries > 1 else "")
        if batched:
            text = str(tries) if tries > 1 else ""
        else:
            text = state + (f" ×{tries}" if tries > 1 else "") + (
                f" {self.duration_s:.1f}s" if self.duration_s is not None else "")
        return css, self.title, text, href + quote(self.key, safe="/")

    @property
    def title(self) -> str:
        state = self.shown_state
        parts = [f"{self.key}: {state}", f"{self.tries} attempt(s)"]
        if self.failures:
            parts.append(f"{self.failures} failed")
        if self.duration_s is not None:
            parts.append(f"{self.duration_s:.2f} s")
        text = ", ".join(parts)
        if state == "skipped":
            text += "; the epoch went on without this batch"
        elif state == "refused":
            text += "; not run: the experiment was in safe mode; the Clear of the run's failed tasks runs it"
        elif state == "failed":
            text += ("; failed for good: Clear its task to run it again" if self.final
                     else "; Airflow retries it unless it was the last try")
        if self.error and state not in ("committed", "refused"):
            text += f"; last error: {self.error[:200]}"
        return text


@dataclass
class EpochRow:
    epoch: int
    phases: dict[str, str]
    metrics: dict[str, float]
    cells: dict[str, list[tuple[str, str, str, str]]] = field(default_factory=dict)  # UnitCell.shown per unit


def _event(store: ObjectStore, key: str) -> dict[str, Any] | None:
    """One parsed event, from the cache when this process read it before (events never change)."""
    cache_key = (store.uri, key)
    if cache_key in _EVENT_CACHE:
        return _EVENT_CACHE[cache_key]
    try:
        body = json.loads(store.get(key))
    except (NotFound, ValueError):
        body = None  # one unreadable event should not hide the rest
    _EVENT_CACHE[cache_key] = body
    while len(_EVENT_CACHE) > 2 * MAX_EVENTS_READ:
        _EVENT_CACHE.popitem(last=False)
    return body


def recent_events(store: ObjectStore, layout: Layout) -> list[dict[str, Any]]:
    """The newest :data:`MAX_EVENTS_READ` events in time order (one listing)."""
    keys = store.list(layout.events + "/")[-MAX_EVENTS_READ:]
    return [e for e in (_event(store, k) for k in keys) if isinstance(e, dict)]


def _unit_stats(events: list[dict[str, Any]]) -> dict[str, UnitCell]:
    """Per unit key, from the events in time order: attempts started, failed tries, whether a try is running,
    the newest error and the duration of the attempt that committed."""
    cells: dict[str, UnitCell] = {}
    seen: dict[str, set[str]] = {}
    told: set[str] = set()  # units whose newest failure the runner recorded and the task has not yet
    for event in events:
        unit, kind = event.get("unit"), event.get("kind")
        if kind not in UNIT_EVENTS or not isinstance(unit, str):
            continue
        cell = cells.setdefault(unit, UnitCell(key=unit))
        if isinstance(event.get("epoch"), int):
            cell.epoch = event["epoch"]
        if kind == "started":
            seen.setdefault(unit, set()).add(str(event.get("attempt")))
            cell.attempts, cell.running, cell.refused = len(seen[unit]), True, False
            told.discard(unit)
        elif kind == TASK_FAILED and event.get("refused"):  # safe mode refused the try: nothing ran or failed
            cell.running, cell.refused, cell.final = False, True, True
        elif kind == "failed":  # the runner: this attempt raised
            cell.failures += 1
            cell.refused = False
            cell.running, cell.final, cell.error = False, False, first_line(event.get("error"))
            told.add(unit)
        elif kind == TASK_FAILED:  # Airflow's callback: this try failed (its attempt's own "failed" may precede it)
            if unit in told:
                told.discard(unit)
            else:
                cell.failures += 1
                cell.error = first_line(event.get("error"))
            cell.running, cell.final, cell.refused = False, bool(event.get("final")), False
        elif kind in ("committed", "lost_race"):
            cell.running = False
            told.discard(unit)
            if kind == "committed":
                cell.duration_s = _number(event.get("duration_s"))
    return cells


def first_line(text: Any) -> str:
    return str(text or "").strip().split("\n", 1)[0]


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _batch_states(store: ObjectStore, layout: Layout, epoch: int, phase: str, batches: int) -> list[str]:
    """Each batch's state of a partly committed mapped phase (one listing of that phase's folder)."""
    unit_of = {b: PHASES[phase].unit(layout, epoch, b) for b in range(batches)}
    keys = set(store.list(f"{layout.epoch(epoch)}/{phase}/"))
    return ["committed" if f"{unit_of[b]}/{MARKER}" in keys else "absent" for b in range(batches)]


def _grid(cfg: ExperimentConfig, store: ObjectStore, rows: list[dict[str, Any]],
          stats: dict[str, UnitCell], href: str = "") -> list[EpochRow]:
    layout = Layout(cfg.experiment)
    batches = cfg.rollout.batches_per_epoch
    known = {row["epoch"] for row in rows}
    # An epoch whose units only failed so far has no row in ``status``: the grid shows it all the same.
    tried = {c.epoch for c in stats.values() if (c.failures or c.running or c.refused) and c.epoch is not None
             and 0 <= c.epoch < cfg.epochs and c.epoch not in known}
    if tried:
        rows = sorted(rows + [{"epoch": e, "phases": dict.fromkeys(phases_for(cfg), "absent"), "metrics": {}}
                              for e in tried], key=lambda row: row["epoch"])
    out = []
    for row in rows:
        epoch_row = EpochRow(row["epoch"], row["phases"], row["metrics"])
        skipped = set(row.get("skipped_batches") or ())
        for phase, state in row["phases"].items():
            if phase in BATCHED:
                states = (_batch_states(store, layout, row["epoch"], phase, batches) if "/" in state
                          else [state] * batches)
                epoch_row.cells[phase] = [
                    _cell(PHASES[phase].unit(layout, row["epoch"], b), s, stats, b in skipped).shown(href, True)
                    for b, s in enumerate(states)]
            else:
                epoch_row.cells[phase] = [_cell(PHASES[phase].unit(layout, row["epoch"]), state, stats).shown(href)]
        out.append(epoch_row)
    return out


def _cell(unit: str, state: str, stats: dict[str, UnitCell], skipped: bool = False) -> UnitCell:
    seen = stats.get(unit)
    if seen is None:
        return UnitCell(state=state, key=unit, skipped=skipped)
    return replace(seen, state=state, key=unit, skipped=skipped)


def split_error(text: Any) -> tuple[str, str, str]:
    """``(error class, message, detail)`` of an ``"ErrorClass: message\\n..."`` text as the events and the
    safe-mode record keep it: the detail is what follows the message's first line (a traceback, a Ray
    job's log tail), or the whole text when the message is too long to read at a glance."""
    text = str(text or "").strip()
    head, sep, rest = text.partition(": ")
    if sep and head[:1].isalpha() and head.replace(".", "").replace("_", "").isalnum():
        cls, body = head, rest
    else:
        cls, body = "", text
    message, _, detail = body.partition("\n")
    at = message.find(TRACEBACK)
    if at >= 0:  # a traceback run into the message's line
        detail = message[at:] + ("\n" + detail if detail else "")
        message = message[:at].rstrip()
    if len(message) > MESSAGE_SHOWN:
        detail = message + ("\n" + detail if detail else "")
        message = message[:MESSAGE_SHOWN].rstrip() + "…"
    return cls, message.strip(), detail.strip("\n")


def _map_index(value: Any) -> int | None:
    return value if isinstance(value, int) and value >= 0 else None


def refused_tasks(events: list[dict[str, Any]], stats: dict[str, UnitCell]) -> list[dict[str, Any]]:
    """The task instances safe mode refused whose units have not run since (a Clear must still rerun them):
    each ``{unit, task_id, map_index, run_id, dag_id}``, once per unit, oldest first."""
    found: dict[str, dict[str, Any]] = {}
    for event in events:
        unit = event.get("unit")
        if event.get("kind") != TASK_FAILED or not event.get("refused") or not isinstance(unit, str):
            continue
        cell = stats.get(unit)
        if cell is not None and cell.refused:
            found[unit] = {"unit": unit, "task_id": str(event.get("task_id") or ""),
                           "map_index": _map_index(event.get("map_index")),
                           "run_id": str(event["run_id"]) if event.get("run_id") else None,
                           "dag_id": str(event["dag_id"]) if event.get("dag_id") else None}
    return list(found.values())


def safe_mode_view(record: dict[str, Any] | None,
                   refused: Sequence[dict[str, Any]] = ()) -> dict[str, Any] | None:
    """The safe-mode record (:func:`verl_tasks.ops.safe_mode.escalate`) as the page shows it, or None.

    ``what`` (one line: why it halted, naming the failed units), ``units`` (each: unit, task_id, map_index,
    try_number, error_class, message, detail), ``dag_id`` and ``paused`` (the Clear to do, and whether to
    unpause first), ``commands`` (each runnable as printed), ``entered`` (when). ``refused``
    (:func:`refused_tasks`): tasks that failed only because safe mode refused them; with any, the Clear
    to do is the Clear of the failed tasks of each run in ``runs`` (``{dag_id, run_id}``), which reruns them
    with the failed units."""
    if not isinstance(record, dict):
        return None
    units: list[dict[str, Any]] = []
    for item in record.get("failed_units") or []:
        if not isinstance(item, dict):
            continue
        cls, message, detail = split_error(item.get("error"))
        units.append({
            "unit": str(item.get("unit") or "?"),
            "task_id": str(item["task_id"]) if item.get("task_id") else None,
            "map_index": _map_index(item.get("map_index")),
            "run_id": str(item["run_id"]) if item.get("run_id") else None,
            "dag_id": str(item.get("dag_id") or record.get("dag_id") or "") or None,
            "try_number": item.get("try_number"),
            "error_class": cls, "message": message, "detail": detail,
            "detail_lines": detail.count("\n") + 1 if detail else 0,
        })
    reason = str(record.get("reason") or record.get("summary") or "halted")
    unnamed = [str(u["unit"]) for u in units if u["unit"] not in reason]
    commands = record.get("commands")
    if not isinstance(commands, dict):
        commands = {}
    failed = {u["unit"] for u in units}  # a failed unit refused on a later try is shown failed
    refused = [{**t, "dag_id": t.get("dag_id") or record.get("dag_id")} for t in refused if t["unit"] not in failed]
    runs = [{"dag_id": dag, "run_id": run} for dag, run in dict.fromkeys(
        (t["dag_id"], t["run_id"]) for t in units + refused if t.get("run_id") and t.get("dag_id"))]
    return {
        "what": reason + (f" (failed: {', '.join(unnamed)})" if unnamed else ""),
        "units": units,
        "refused": refused,
        "runs": runs,
        "dag_id": str(record["dag_id"]) if record.get("dag_id") else None,
        "paused": bool(record.get("dag_paused")),
        "commands": {str(k): str(v) for k, v in commands.items() if v},
        "entered": _when({"time": record.get("entered_at")}) if record.get("entered_at") else None,
    }


def _when(event: dict[str, Any]) -> str:
    stamp = _number(event.get("time"))
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(stamp)) if stamp is not None else "?"


def _checks(events: list[dict[str, Any]]) -> dict[int, tuple[bool, str]]:
    """Snapshot version -> (ok, what) of its newest check: a policy load (hashes) or the maintenance DAG."""
    checks: dict[int, tuple[bool, str]] = {}
    for event in events:
        if event.get("kind") == "policy_loaded" and isinstance(event.get("version"), int):
            checks[event["version"]] = (True, f"hashes verified when loaded ({event.get('how', 'load')}), "
                                              f"{_when(event)}")
        elif event.get("kind") == "maintenance" and isinstance(event.get("verified"), list):
            for verdict in event["verified"]:
                if isinstance(verdict, dict) and isinstance(verdict.get("version"), int):
                    problems = "; ".join(map(str, verdict.get("problems") or []))
                    checks[verdict["version"]] = (
                        (True, f"verified by maintenance (hashes, forward pass), {_when(event)}") if not problems
                        else (False, f"maintenance {_when(event)}: {problems}"))
    return checks


def _snapshots(layout: Layout, rows: list[dict[str, Any]], events: list[dict[str, Any]],
               quarantined: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each snapshot version the grid knows: state, size (from its commit event) and verification."""
    sizes = {e.get("unit"): e.get("bytes") for e in events if e.get("kind") == "committed"}
    checks = _checks(events)
    bad = {q["unit"]: q for q in quarantined if not q["recovered"]}
    out = []
    for row in rows:
        version = row["epoch"] + 1
        unit = layout.snapshot(version)
        state = row["phases"]["snapshot"]
        ok = True
        if unit in bad:
            ok, check = False, f"failed verification: {bad[unit]['reason']}"
        elif state == "pruned":
            check = "weights pruned by retention"
        elif version in checks:
            ok, check = checks[version]
        elif state == "committed":
            check = "committed; not verified since"
        else:
            continue
        out.append({"version": version, "unit": unit, "state": state, "bytes": sizes.get(unit),
                    "verification": check, "ok": ok})
    return out


def chart_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Long-form (x, metric, value) rows of the per-epoch curves, for the chart."""
    titles = dict(CURVES)
    return [{"x": row["epoch"], "metric": titles[key], "value": float(row["metrics"][key])}
            for row in rows for key, _ in CURVES if isinstance(row["metrics"].get(key), (int, float))]


def step_chart_rows(store: ObjectStore, layout: Layout, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Long-form (x, metric, value) rows per optimizer step, from each committed update's ``steps.jsonl``
    (one read per epoch shown, in a few threads)."""
    from verl_tasks.store.conventions import STEPS_FILE
    from verl_tasks.store.units import read_jsonl

    def steps_of(epoch: int) -> list[dict[str, Any]]:
        record = read_marker(store, layout.update(epoch))
        return read_jsonl(store, record, STEPS_FILE) if record and STEPS_FILE in record.files else []

    epochs = [row["epoch"] for row in rows if row["phases"].get("update") in ("committed", "pruned")]
    with ThreadPoolExecutor(max_workers=8) as pool:
        per_epoch = list(pool.map(steps_of, epochs))
    titles = dict(STEP_CURVES)
    return [{"x": step["step"], "metric": titles[key], "value": float(step[key])}
            for steps in per_epoch for step in steps for key, _ in STEP_CURVES
            if isinstance(step.get(key), (int, float))]


def overlay_rows(own: list[dict[str, Any]], other: list[dict[str, Any]], names: tuple[str, str],
                 own_offset: int) -> list[dict[str, Any]]:
    """Long-form per-epoch rows of two experiments on one x axis, each row naming its ``experiment``: the
    other's epochs as they are, this one's shifted by ``own_offset`` (a child that started from its
    parent's snapshot ``V`` continues the parent's count at ``V``)."""
    return ([{**row, "x": row["x"] + own_offset, "experiment": names[0]} for row in chart_rows(own)]
            + [{**row, "experiment": names[1]} for row in chart_rows(other)])


def curves_svg(data: list[dict[str, Any]], x_title: str = "epoch") -> str:
    """The curves as one SVG (Vega-Lite through altair, rendered here by vl-convert: no JS, no CDN); rows
    naming an ``experiment`` are drawn one colour per experiment.

    The same data gives the same picture, so the newest few are kept (a page reloaded between two
    commits does not draw again)."""
    if not data:
        return ""
    body = json.dumps([x_title, data], sort_keys=True)
    key = hashlib.sha256(body.encode()).hexdigest()
    if key not in _SVG_CACHE:
        import vl_convert

        points = len({row["x"] for row in data}) <= 40
        titles = [title for _, title in (STEP_CURVES if x_title == "optimizer step" else CURVES)]
        colored = "experiment" in data[0]
        spec = dict(_curves_spec(points, x_title, tuple(titles), colored), datasets={"curves": data})
        _SVG_CACHE[key] = vl_convert.vegalite_to_svg(spec)
        while len(_SVG_CACHE) > SVGS_KEPT:
            _SVG_CACHE.popitem(last=False)
    return _SVG_CACHE[key]


@functools.lru_cache(maxsize=8)
def _curves_spec(points: bool, x_title: str, titles: tuple[str, ...], colored: bool = False) -> dict[str, Any]:
    """The chart without its data (a named dataset): one small panel per curve, each with its own scale;
    ``colored``: one line per ``experiment``, with a legend."""
    import altair as alt

    encoding: dict[str, Any] = {
        "x": alt.X("x:Q", title=x_title, axis=alt.Axis(tickMinStep=1, format="d")),
        "y": alt.Y("value:Q", title=None, scale=alt.Scale(zero=False)),
        "tooltip": [*(["experiment:N"] if colored else []), "metric:N", alt.Tooltip("x:Q", title=x_title),
                    alt.Tooltip("value:Q", format=".4f")]}
    if colored:
        encoding["color"] = alt.Color("experiment:N", title=None, legend=alt.Legend(orient="top"))
    chart = (
        alt.Chart(alt.NamedData(name="curves"))
        .mark_line(point=points)
        .encode(**encoding)
        .properties(width=230, height=130)
        .facet(facet=alt.Facet("metric:N", sort=list(titles), title=None), columns=3)
        .resolve_scale(y="independent")
    )
    return chart.to_dict()


SAMPLES_SHOWN = 4  # rollout samples per epoch on the page
SAMPLE_EPOCHS = 3  # the newest epochs whose samples are shown
SAMPLE_CHARS = 240


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, list):  # chat messages: what the user asked
        return " / ".join(str(m.get("content", "")) for m in prompt if isinstance(m, dict) and m.get("role") == "user")
    return str(prompt)


def rollout_samples(store: ObjectStore, layout: Layout, rows: list[dict[str, Any]], batches: int,
                    per_epoch: int = SAMPLES_SHOWN, epochs: int = SAMPLE_EPOCHS) -> list[dict[str, Any]]:
    """A few samples of the newest ``epochs`` epochs whose first batch is rolled out and scored: prompt,
    answer, reward and length (response tokens), read from what the units committed. Which samples is
    fixed by their ids (the smallest sha256 of the sample id), so a reload shows the same ones."""
    from verl_tasks.store.units import read_jsonl

    shown: list[dict[str, Any]] = []
    for row in sorted(rows, key=lambda r: r["epoch"], reverse=True):
        if len({s["epoch"] for s in shown}) >= epochs:
            break
        epoch = row["epoch"]
        for batch in range(batches):
            rollout, score = (read_marker(store, layout.rollout(epoch, batch)),
                              read_marker(store, layout.score(epoch, batch)))
            if rollout is None or score is None:
                continue
            try:
                scores = {r["sample_id"]: r["score"] for r in read_jsonl(store, score, "scores.jsonl")}
                samples = sorted(read_jsonl(store, rollout, "samples.jsonl"),
                                 key=lambda x: hashlib.sha256(str(x["sample_id"]).encode()).hexdigest())[:per_epoch]
            except (StoreError, NotFound, KeyError, TypeError, ValueError) as err:  # a damaged unit: not shown
                log.warning("no samples of %s shown: %s", layout.rollout(epoch, batch), err)
                continue
            shown += [{"epoch": epoch, "batch": batch, "sample_id": x["sample_id"], "prompt_id": x.get("prompt_id"),
                       "answer": str(x.get("response", ""))[:SAMPLE_CHARS], "reward": scores.get(x["sample_id"]),
                       "length": len(x.get("response_ids", []))} for x in samples]
            break
    prompts = _prompts(store, layout) if shown else {}
    for sample in shown:
        prompt_id = sample.pop("prompt_id")
        sample["prompt"] = _prompt_text(prompts.get(prompt_id, prompt_id))[:SAMPLE_CHARS]
    return shown


def _prompts(store: ObjectStore, layout: Layout) -> dict[Any, Any]:
    """Prompt id -> prompt of the committed train data; what cannot be read shows the ids instead."""
    from verl_tasks.store.units import read_jsonl

    try:
        data = read_marker(store, layout.data("train"))
        rows = read_jsonl(store, data, "prompts.jsonl") if data else []
    except (StoreError, NotFound, ValueError) as err:  # IntegrityError is a StoreError
        log.warning("prompts of %s not shown: %s", layout.data("train"), err)
        return {}
    return {row.get("id"): row["prompt"] for row in rows if isinstance(row, dict) and row.get("prompt") is not None}


def filter_events(events: list[dict[str, Any]], epoch: int | None, phase: str | None,
                  limit: int = EVENTS_SHOWN) -> list[dict[str, Any]]:
    """The newest ``limit`` events of ``epoch`` and ``phase`` (either may be None: any), newest first."""
    picked = [e for e in reversed(events)
              if (epoch is None or e.get("epoch") == epoch) and (phase is None or e.get("phase") == phase)]
    return picked[:limit]


def experiment_view(cfg: ExperimentConfig, store: ObjectStore, *, epoch: int | None = None,
                    phase: str | None = None, unit_href: str = "", per_step: bool = False,
                    compare: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything one experiment's section shows (see the module docstring); each grid cell links to
    ``unit_href`` followed by its unit's URL-quoted key (the unit's page). ``per_step``: the curves per
    optimizer step (each update's ``steps.jsonl``) instead of per epoch. ``compare``: another experiment
    the caller may show (``name``, ``rows``: its status's epochs, ``offset``: where this one's epochs
    start on its count, ``relation``), overlaid on this one's per-epoch curves."""
    from verl_tasks.status import status

    if phase is not None and phase not in PHASES:
        raise ConfigError(f"unknown phase {phase!r}; use one of {', '.join(PHASE_NAMES)}")
    layout = Layout(cfg.experiment)
    events = recent_events(store, layout)
    st = status(cfg, store, events)
    stats = _unit_stats(events)
    return {
        "status": st,
        "grid": _grid(cfg, store, st["epochs"], stats, unit_href),
        "safe_mode": safe_mode_view(st["safe_mode"], refused_tasks(events, stats) if st["safe_mode"] else []),
        "phases": tuple(phases_for(cfg)),
        "batched": BATCHED,
        "snapshots": _snapshots(layout, st["epochs"], events, st["quarantined"]),
        "chart": (curves_svg(step_chart_rows(store, layout, st["epochs"]), "optimizer step") if per_step
                  else curves_svg(chart_rows(st["epochs"]))),
        "per_step": per_step,
        "compare": None if compare is None else {
            "name": compare["name"], "relation": compare["relation"], "offset": compare["offset"],
            "chart": curves_svg(overlay_rows(st["epochs"], compare["rows"], (cfg.experiment, compare["name"]),
                                             compare["offset"]), f"epoch ({compare['name']}'s count)")},
        "samples": rollout_samples(store, layout, st["epochs"], cfg.rollout.batches_per_epoch),
        "events": filter_events(events, epoch, phase),
        "events_total": len(events),
        "filter": {"epoch": epoch, "phase": phase},
        "epochs": [row["epoch"] for row in st["epochs"]],
    }


def store_records(store: ObjectStore, limit: int = MAX_EXPERIMENTS_LISTED) -> dict[str, dict[str, Any]]:
    """The experiments in ``store`` (its first ``limit`` top-level folders that hold ``experiment.json``), each
    with that file as :func:`verl_tasks.ownership.read_record` reads it (the DAG it records)."""
    records = {}
    for name in store.folders(limit):
        try:
            check_name(name)
        except ConfigError:
            continue
        record = read_record(store, name)
        if record is not None:
            records[name] = record
    return records


__all__ = ["experiment_view", "store_records", "curves_svg", "chart_rows", "overlay_rows", "rollout_samples",
           "filter_events",
           "recent_events", "refused_tasks", "safe_mode_view", "split_error", "EVENTS_SHOWN", "MAX_EVENTS_READ",
           "MAX_EXPERIMENTS_LISTED", "CURVES"]
