"""``verl-tasks``: run, inspect and repair experiments from a shell."""
from __future__ import annotations

import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from verl_tasks.config import ExperimentConfig, load_config
from verl_tasks.errors import VerlTasksError

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = Console(stderr=True)
out = Console()


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(message)s",
        handlers=[RichHandler(console=console, show_path=False)],
    )
    for noisy in ("botocore", "urllib3", "filelock", "great_expectations", "transformers", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _load(config: Path, store: Optional[str], experiment: Optional[str], epochs: Optional[int] = None) -> ExperimentConfig:
    overrides: dict[str, object] = {}
    if store:
        overrides["storage.uri"] = store
    if experiment:
        overrides["experiment"] = experiment
    if epochs is not None:
        overrides["epochs"] = epochs
    return load_config(config, overrides)


def _fail(err: Exception) -> None:
    console.print(f"[bold red]error:[/] {err}")
    raise typer.Exit(code=2)


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@app.command()
def run(
    config: Path = typer.Argument(..., help="experiment YAML"),
    store: Optional[str] = typer.Option(None, help="store URI (file://PATH or s3://BUCKET/PREFIX)"),
    experiment: Optional[str] = typer.Option(None, help="experiment name (overrides the YAML)"),
    epochs: Optional[int] = typer.Option(None, help="train until this many epochs are committed"),
    report: Optional[Path] = typer.Option(None, help="write the reward/accuracy curve as a Markdown table here"),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Run every phase inline, in order, resuming from whatever is committed."""
    _setup_logging(verbose)
    signal.signal(signal.SIGTERM, _on_sigterm)
    from verl_tasks.runner import epoch_units, make_context, train

    try:
        cfg = _load(config, store, experiment, epochs)
        ctx = make_context(cfg)
        total = sum(len(epoch_units(ctx, e, cfg.epochs)) for e in range(cfg.epochs))
        started = time.monotonic()
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), console=console, transient=False) as bar:
            task = bar.add_task(f"{cfg.experiment}", total=total)

            def progress(phase: str, epoch: int, batch: int | None) -> None:
                if phase == "epoch-skipped":
                    bar.advance(task, len(epoch_units(ctx, epoch, cfg.epochs)))
                else:
                    bar.advance(task)
                    bar.update(task, description=f"{cfg.experiment} epoch {epoch} {phase}" + (f" b{batch}" if batch is not None else ""))

            result = train(ctx, cfg.epochs, progress)
        _print_summary(result)
        if report:
            from verl_tasks.report import curve_markdown

            report.parent.mkdir(parents=True, exist_ok=True)
            report.write_text(curve_markdown(result))
            console.print(f"curve written to {report}")
        console.print(f"done in {time.monotonic() - started:.1f}s")
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: the unit in progress was not committed and will rerun next time")
        raise typer.Exit(code=130)
    except VerlTasksError as err:
        _fail(err)


def _print_summary(result: dict) -> None:
    table = Table(title=f"{result['experiment']}")
    for col in ("epoch", "reward_mean", "eval_accuracy", "clipfrac", "approx_kl", "grad_norm"):
        table.add_column(col, justify="right")
    base = result["base"]["metrics"].get("eval_accuracy")
    table.add_row("base", "", f"{base:.3f}" if base is not None else "", "", "", "")
    for row in result["epochs"]:
        m = row["metrics"]
        fmt = lambda k: f"{m[k]:.3f}" if k in m else ""  # noqa: E731
        table.add_row(str(row["epoch"]), fmt("reward_mean"), fmt("eval_accuracy"), fmt("actor/pg_clipfrac"), fmt("actor/ppo_kl"), fmt("actor/grad_norm"))
    console.print(table)
    if result["latest_snapshot"]:
        console.print(f"latest snapshot: {result['latest_snapshot']['uri']} sha256 {result['latest_snapshot']['weights_sha256'][:16]}")


@app.command()
def status(
    config: Path = typer.Argument(..., help="experiment YAML"),
    store: Optional[str] = typer.Option(None),
    experiment: Optional[str] = typer.Option(None),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Per epoch: each phase's state and metrics, and the latest snapshot."""
    _setup_logging(False)
    from verl_tasks.runner import status as get_status
    from verl_tasks.runner import store_for

    try:
        cfg = _load(config, store, experiment)
        result = get_status(cfg, store_for(cfg))
    except VerlTasksError as err:
        _fail(err)
    if as_json:
        out.print_json(json.dumps(result))
        return
    table = Table(title=f"{result['experiment']} @ {result['store']}")
    table.add_column("epoch")
    for phase in ("plan", "rollout", "score", "validate", "update", "snapshot", "evaluate"):
        table.add_column(phase)
    table.add_column("reward")
    table.add_column("eval acc")
    for row in result["epochs"]:
        m = row["metrics"]
        table.add_row(str(row["epoch"]), *[row["phases"][p] for p in row["phases"]],
                      f"{m['reward_mean']:.3f}" if "reward_mean" in m else "", f"{m['eval_accuracy']:.3f}" if "eval_accuracy" in m else "")
    out.print(table)
    if result["safe_mode"]:
        out.print(f"[bold red]SAFE MODE[/]: {result['safe_mode'].get('summary')}")
    out.print(f"latest snapshot: {result['latest_snapshot']}")


def main() -> None:  # pragma: no cover - console entry
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":  # pragma: no cover
    app()
