"""How long the Training page takes for a long experiment: 200 epochs x 8 batches (by default).

Fabricates a store with everything the page reads (markers with metrics, started/committed
events per unit, snapshots, latest.json), then renders the page through the plugin's own
functions (no Airflow server): the first render in a fresh process (cold), the median of the
following ones with the chart drawn again each time (as after every new commit), and with it cached.
The section between this script's markers in ``--output`` is replaced.

    .venv/bin/python benchmarks/dashboard_render.py [--epochs 200] [--batches 8] [--repeats 5] [--output BENCHMARKS.md]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "dags" / "experiments" / "tiny_arith.yaml"
OWNER = "benchmarks/dashboard_render.py"


def fabricate(root: Path, experiment: str, epochs: int, batches: int) -> None:
    """A store as a finished run leaves it (metrics shaped like real curves), written through LocalStore."""
    from verl_tasks.layout import Layout
    from verl_tasks.phase_registry import PHASES
    from verl_tasks.store.local import LocalStore
    from verl_tasks.store.units import MARKER, CommitRecord, FileEntry

    store = LocalStore(root)
    layout = Layout(experiment)
    store.put(layout.experiment_json, json.dumps({"experiment": experiment}).encode())
    clock = 1.7e9
    for epoch in range(epochs):
        for name, spec in PHASES.items():
            for batch in (range(batches) if spec.batched else [None]):
                unit = spec.unit(layout, epoch, batch)
                metrics = _metrics(name, epoch)
                files = {"model.safetensors": FileEntry(2 << 20, "0" * 64)}
                record = CommitRecord(unit, f"a{epoch}{name}{batch}", files, {"metrics": metrics}, clock)
                store.put(f"{unit}/{MARKER}", record.to_json())
                for kind in ("started", "committed"):
                    clock += 0.5
                    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(clock)) + f"{clock % 1:.6f}"[1:]
                    body = {"kind": kind, "time": clock, "unit": unit, "epoch": epoch, "phase": name, "batch": batch,
                            "attempt": record.attempt, "duration_s": 0.5, "bytes": 2 << 20}
                    store.put(f"{layout.events}/{stamp}-{kind}-{epoch:05d}{name[:3]}{batch or 0}.json",
                              json.dumps(body).encode())
    latest = {"version": epochs, "unit": layout.snapshot(epochs), "attempt": "a",
              "weights_sha256": "0" * 64, "uri": store.url(layout.snapshot(epochs))}
    store.put(layout.latest, json.dumps(latest).encode())


def _metrics(phase: str, epoch: int) -> dict[str, float]:
    progress = 1 - math.exp(-epoch / 50)
    if phase == "update":
        return {"reward_mean": 0.4 + 0.4 * progress, "actor/ppo_kl": 0.02 * (1 - progress) + 0.002,
                "actor/pg_clipfrac": 0.05 * (1 - progress), "actor/entropy": 1.5 - progress,
                "actor/grad_norm": 4 + math.sin(epoch)}
    if phase == "evaluate":
        return {"eval_accuracy": 0.5 + 0.3 * progress}
    return {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md")
    args = parser.parse_args()
    import yaml

    from benchmarks.run import provenance, write_section
    from verl_tasks.airflow.dashboard import _SVG_CACHE
    from verl_tasks.airflow.plugin import Source, open_source, render_page

    with tempfile.TemporaryDirectory() as tmp:
        raw = yaml.safe_load(CONFIG.read_text())
        raw.update(experiment="bench-dashboard", epochs=args.epochs)
        raw.setdefault("rollout", {})["batches_per_epoch"] = args.batches
        raw["storage"] = {"uri": f"file://{tmp}/store"}
        path = Path(tmp, "bench_dashboard.yaml")
        path.write_text(yaml.safe_dump(raw))
        started = time.monotonic()
        fabricate(Path(tmp, "store"), "bench-dashboard", args.epochs, args.batches)
        print(f"fabricated {args.epochs} epochs x {args.batches} batches in {time.monotonic() - started:.1f} s",
              file=sys.stderr)
        units = sum(1 for _ in Path(tmp, "store").rglob("_SUCCESS"))
        events = sum(1 for kind in ("started", "committed") for _ in Path(tmp, "store").rglob(f"*-{kind}-*.json"))
        source: Source = open_source("bench_dashboard", path)
        timings: dict[str, list[float]] = {"redrawn": [], "cached": []}
        page = ""
        for i in range(2 * args.repeats + 1):
            kind = "cached" if i > args.repeats else "redrawn"
            if kind == "redrawn":
                _SVG_CACHE.clear()  # as after a new commit: the chart is drawn again
            started = time.monotonic()
            page = render_page([source], [source])
            timings[kind].append(time.monotonic() - started)
        assert "<h2>bench-dashboard</h2>" in page and "<svg" in page, page[-2000:]
    first = timings["redrawn"].pop(0)
    redrawn, cached = timings["redrawn"], timings["cached"]
    command = " ".join([".venv/bin/python benchmarks/dashboard_render.py", *sys.argv[1:]])
    text = "\n".join([
        f"## The Training page for {args.epochs} epochs x {args.batches} batches",
        "",
        provenance(command),
        "",
        f"A finished run is fabricated in a local store ({args.epochs} epochs x {args.batches} batches: "
        f"{units:,} committed units with metrics, {events:,} `started`/`committed` events, the snapshots and "
        "`latest.json`; curves of a plausible shape), then the whole Training page is rendered through the "
        "plugin's own functions, without an Airflow server: status, the unit grid, snapshots, events and the "
        "curves drawn as SVG by vl-convert.",
        "",
        "| render | seconds |",
        "|---|---:|",
        f"| first, in a fresh process (imports altair and vl-convert, starts its renderer) | {first:.2f} |",
        f"| next ones, the chart drawn again each time (as after a new commit), median of {len(redrawn)} | "
        f"{statistics.median(redrawn):.2f} (max {max(redrawn):.2f}) |",
        f"| next ones, same data (the chart cached), median of {len(cached)} | {statistics.median(cached):.2f} |",
        "",
        f"Page size {len(page) / 1e6:.2f} MB. The api-server pays the first render's cost once per worker process.",
    ]) + "\n"
    print(text)
    write_section(args.output, text, OWNER)


if __name__ == "__main__":
    main()
