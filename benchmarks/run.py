"""The tiny experiment end to end and the commit protocol's cost; written into BENCHMARKS.md.

    .venv/bin/python benchmarks/run.py [--output BENCHMARKS.md]

Measured side by side in one run, medians over repeats, on whatever machine runs it:
1. the tiny experiment end to end: first run (warm start included) vs an idempotent rerun;
2. unit commit latency: LocalStore vs S3Store (moto server over HTTP), and the marker check a skip costs.
The Airflow end-to-end test's figures (``benchmarks/airflow.md``, written by that test) follow them.

Every script in benchmarks/ writes its own section of BENCHMARKS.md through ``replace_generated``;
``make bench`` runs them all (``make bench BENCH_LONG=0`` leaves out the multi-minute ones).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "dags" / "experiments" / "tiny_arith.yaml"


def _run_cli(*args: str, env: dict | None = None) -> float:
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "verl_tasks.cli", *args], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return time.monotonic() - started


def bench_end_to_end(workdir: Path) -> dict:
    store = f"file://{workdir}/e2e"
    env = dict(os.environ, VERL_TASKS_CACHE=str(workdir / "cache"))  # cold: warm start included
    first = _run_cli("run", str(CONFIG), "--store", store, "--report", str(workdir / "curve.md"), env=env)
    reruns = [_run_cli("run", str(CONFIG), "--store", store, env=env) for _ in range(3)]
    out = subprocess.run([sys.executable, "-m", "verl_tasks.cli", "status", str(CONFIG), "--store", store, "--json"],
                         cwd=ROOT, check=True, capture_output=True, text=True, env=env)
    status = json.loads(out.stdout)
    accs = [e["metrics"].get("eval_accuracy") for e in status["epochs"]]
    return {
        "first_run_s": round(first, 1),
        "rerun_median_s": round(statistics.median(reruns), 2),
        "rerun_over_first": round(statistics.median(reruns) / first, 3),
        "base_accuracy": status["base"]["metrics"]["eval_accuracy"],
        "final_accuracy": accs[-1],
        "weights_sha256": status["latest_snapshot"]["weights_sha256"],
        "accuracy_curve": accs,
        "curve_md": (workdir / "curve.md").read_text(),
    }


def bench_commit(workdir: Path, repeats: int = 30) -> dict:
    import boto3
    from moto.server import ThreadedMotoServer

    from verl_tasks.store import open_store
    from verl_tasks.store.units import UnitWriter

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server._server.server_address  # noqa: SLF001 - the bound port
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="bench")
    stores = {"local": open_store(f"file://{workdir}/commit"),
              "s3 (moto)": open_store("s3://bench/p", endpoint_url=endpoint)}
    payload = os.urandom(64 << 10)
    results = {}
    for name, store in stores.items():
        commit_times, skip_times = [], []
        for i in range(repeats):
            unit = f"exp/epochs/00000/rollout/b{i:04d}"
            t0 = time.perf_counter()
            writer = UnitWriter(store, unit)
            writer.write_bytes("samples.jsonl", payload)
            writer.commit({"i": i})
            commit_times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            from verl_tasks.store.units import read_marker

            assert read_marker(store, unit) is not None
            skip_times.append(time.perf_counter() - t0)
        results[name] = {
            "commit_64KiB_ms": round(statistics.median(commit_times) * 1000, 2),
            "marker_check_ms": round(statistics.median(skip_times) * 1000, 2),
        }
    server.stop()
    return results


def write_markdown(e2e: dict, commit: dict, command: str) -> str:
    lines = [
        "# Benchmarks",
        "",
        f"Produced by `{command}` on {platform.machine()} with {os.cpu_count()} cores, "
        f"Python {platform.python_version()},",
        f"{time.strftime('%Y-%m-%d', time.gmtime())}. Medians; everything in one run, side by side.",
        "",
        "## Tiny experiment end to end (inline CLI, `dags/experiments/tiny_arith.yaml`)",
        "",
        "| measurement | value |",
        "|---|---|",
        f"| first run, cold cache (warm start + 8 epochs) | {e2e['first_run_s']} s |",
        f"| rerun with everything committed (median of 3) | {e2e['rerun_median_s']} s |",
        f"| rerun / first run | {e2e['rerun_over_first']:.1%} |",
        f"| held-out accuracy, base -> after 8 epochs | {e2e['base_accuracy']:.1%} -> {e2e['final_accuracy']:.1%} |",
        f"| final `weights_sha256` (the same on every run on one CPU type) | `{e2e['weights_sha256'][:16]}...` |",
        "",
        e2e["curve_md"],
        "## Commit protocol cost per unit (64 KiB file + `_SUCCESS` marker)",
        "",
        "| store | commit (ms) | marker check / skip (ms) |",
        "|---|---|---|",
    ]
    for name, r in commit.items():
        lines.append(f"| {name} | {r['commit_64KiB_ms']} | {r['marker_check_ms']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", default=str(ROOT / "BENCHMARKS.md"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        commit = bench_commit(work)
        e2e = bench_end_to_end(work)
    text = write_markdown(e2e, commit, " ".join([".venv/bin/python benchmarks/run.py", *sys.argv[1:]]))
    extra = ROOT / "benchmarks" / "airflow.md"
    if extra.exists():
        text += "\n" + extra.read_text()
    output = Path(args.output)
    output.write_text(replace_generated(output.read_text() if output.exists() else "", text))
    print(text)


START, END = "<!-- make bench: generated from here -->", "<!-- make bench: generated up to here -->"


def replace_generated(document: str, generated: str, owner: str = "make bench") -> str:
    """The document with ``owner``'s generated block replaced; the sections written by hand (each with
    the command that produced it) and other owners' blocks are kept. A document without the block gets
    it at the top (``make bench``'s) or at the end (any other script's section)."""
    start, end = f"<!-- {owner}: generated from here -->", f"<!-- {owner}: generated up to here -->"
    block = f"{start}\n{generated.rstrip()}\n{end}\n"
    if start in document and end in document:
        head, rest = document.split(start, 1)
        return head + block + "\n" + rest.split(end, 1)[1].lstrip("\n")
    if owner != "make bench":
        return (document.rstrip("\n") + "\n\n" if document else "") + block
    return block + ("\n" + document if document else "")


def provenance(command: str) -> str:
    """The line every section starts with: the command that produced it, the machine and the date."""
    return (f"Produced by `{command}` on {platform.machine()} with {os.cpu_count()} cores, "
            f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d', time.gmtime())}.")


def inline_epoch(ctx, epoch: int) -> None:
    """One epoch through the inline runner, every phase but evaluate (what the epoch benchmarks time)."""
    from verl_tasks.runner import epoch_phases, run_in_process

    for phase, batches in epoch_phases(ctx, epoch, ctx.config.epochs):
        if phase != "evaluate":
            for _ in run_in_process(ctx, phase, epoch, batches):
                pass


def write_section(output: Path, text: str, owner: str) -> None:
    """Replace ``owner``'s section of ``output`` (BENCHMARKS.md) with ``text``; the rest of the file stays."""
    output.write_text(replace_generated(output.read_text() if output.exists() else "", text, owner=owner))


if __name__ == "__main__":
    main()
