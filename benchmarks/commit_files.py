"""Commit cost of an update-shaped unit on the local store: 7 files (weights, optimizer, JSON) + marker.

    .venv/bin/python benchmarks/commit_files.py [--repeats 120] [--rounds 3] [--output BENCHMARKS.md]

Each round is a fresh process that writes and commits ``--repeats`` units through ``UnitWriter``
(the files written into the attempt's folder, then the ``_SUCCESS`` marker, which waits for every
file's and folder's fsync). The first sixth of each round's units is left out: they also create the
folders the later ones share. The store lives under the repository's parent folder (the disk the
runs use), not /tmp. The section between this script's markers in ``--output`` is replaced.
To compare with another checkout, run that checkout's copy of this script with another ``--output``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OWNER = "benchmarks/commit_files.py"
SIZES = {"model.safetensors": 440_000, "optimizer.safetensors": 880_000, "config.json": 900,
         "tokenizer.json": 3_000, "generation_config.json": 200, "metrics.json": 500, "trainer_state.json": 400}


def measure(repeats: int) -> dict[str, float]:
    """Median and p90 ms of one unit's writes + commit."""
    from verl_tasks.store import open_store
    from verl_tasks.store.units import UnitWriter

    blobs = {name: os.urandom(size) for name, size in SIZES.items()}
    work = Path(tempfile.mkdtemp(dir=ROOT.parent))
    try:
        store = open_store(f"file://{work}/store")
        times = []
        for i in range(repeats):
            started = time.perf_counter()
            writer = UnitWriter(store, f"bench/epochs/{i:05d}/update")
            for name, data in blobs.items():
                writer.write_bytes(name, data)
            writer.commit({})
            times.append((time.perf_counter() - started) * 1000)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    steady = sorted(times[repeats // 6:])  # the first units also create the shared folders
    return {"median_ms": round(statistics.median(steady), 2), "p90_ms": round(steady[int(0.9 * len(steady))], 2),
            "units": len(steady)}


def markdown(rounds: list[dict], command: str) -> str:
    from benchmarks.run import provenance

    total = sum(SIZES.values())
    lines = [
        "## Commit cost of an update-shaped unit (local store)",
        "",
        provenance(command),
        "",
        f"One unit: {len(SIZES)} files ({SIZES['model.safetensors'] // 1000} KB weights, "
        f"{SIZES['optimizer.safetensors'] // 1000} KB optimizer state, five small JSON files; "
        f"{total / 1e6:.2f} MB in all) written through `UnitWriter` and committed: the `_SUCCESS` marker is "
        "written once every file and folder of the attempt is fsynced. Each round is a fresh process; "
        f"the milliseconds are per unit over its last {rounds[0]['units']} units (the first ones also create "
        "the folders the others share). The store is on the disk the repository is on.",
        "",
        "| round | median (ms) | p90 (ms) |",
        "|---|---:|---:|",
    ]
    for i, r in enumerate(rounds, 1):
        lines.append(f"| {i} | {r['median_ms']:.2f} | {r['p90_ms']:.2f} |")
    overall = statistics.median(r["median_ms"] for r in rounds)
    lines.append(f"| all rounds (median of the medians) | **{overall:.2f}** | |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.repeats)))
        return
    from benchmarks.run import write_section

    rounds = []
    for round_ in range(1, args.rounds + 1):
        done = subprocess.run([sys.executable, __file__, "--child", "--repeats", str(args.repeats)],
                              capture_output=True, text=True, check=True, cwd=ROOT)
        rounds.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"round {round_}: {rounds[-1]}", file=sys.stderr, flush=True)
    text = markdown(rounds, " ".join([".venv/bin/python benchmarks/commit_files.py", *sys.argv[1:]]))
    print(text)
    write_section(args.output, text, OWNER)


if __name__ == "__main__":
    main()
