"""Commit cost of an update-shaped unit on the local store: 7 files (weights, optimizer, JSON) + marker.

    .venv/bin/python benchmarks/commit_files.py [--repeats 120] [--checkout DIR] [--rounds 3]

``--checkout DIR`` also times another checkout's ``verl_tasks`` (e.g. a worktree of an
earlier commit), alternating whole processes with this one, so the disk's mood hits both.
The store lives under the repository's parent folder (the disk the runs use), not /tmp.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"model.safetensors": 440_000, "optimizer.safetensors": 880_000, "config.json": 900,
         "tokenizer.json": 3_000, "generation_config.json": 200, "metrics.json": 500, "trainer_state.json": 400}


def measure(checkout: Path, repeats: int) -> dict[str, float]:
    """Median and p90 ms of one unit's writes + commit, with ``checkout``'s store code."""
    sys.path.insert(0, str(checkout))
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
    return {"median_ms": round(statistics.median(steady), 2), "p90_ms": round(steady[int(0.9 * len(steady))], 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=120)
    parser.add_argument("--checkout", type=Path, help="another checkout to time beside this one")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(measure(args.child, args.repeats))
        return
    checkouts = [ROOT] + ([args.checkout.resolve()] if args.checkout else [])
    for round_ in range(1, args.rounds + 1):
        for checkout in checkouts:
            done = subprocess.run([sys.executable, __file__, "--child", str(checkout), "--repeats", str(args.repeats)],
                                  capture_output=True, text=True, check=True)
            print(f"round {round_} {checkout}: {done.stdout.strip()}")


if __name__ == "__main__":
    main()
