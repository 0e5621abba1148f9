"""Full garbage collections in a warm worker: the inline epoch with and without the frozen heap.

    .venv/bin/python benchmarks/gc_pauses.py [--epochs 150] [--rounds 2]

Runs ``--epochs`` inline epochs of the ``inline_step`` work (the 105k-parameter
GPT-2, 16 prompts x 8 samples, through ``run_in_process``) in a fresh process,
alternately as shipped (``freeze_after_imports`` after each unit) and with the
freeze left out, ``--rounds`` times each. Reports per-epoch median, mean and
max, and Python's generation-2 collections seen by ``gc.callbacks`` (count, ms).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(epochs: int, freeze: bool) -> None:
    """One measured run in this process; prints one JSON line."""
    import gc

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import inline_step
    import torch

    import verl_tasks.runner

    if not freeze:
        verl_tasks.runner.freeze_after_imports = lambda: False
    torch.set_num_threads(inline_step.THREADS)
    work = Path(tempfile.mkdtemp(prefix="vt-gc-"))
    folder = inline_step.build_policy_folder(work / "gpt2")
    inline = inline_step.InlineEpochs(folder, work / "store", 1, epochs + 2)
    inline.step()  # epoch 0: imports, pinning, the base snapshot
    full: list[float] = []
    began = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            full.append((time.perf_counter() - began[0]) * 1000)

    gc.callbacks.append(on_gc)
    times = []
    for _ in range(epochs):
        started = time.perf_counter()
        inline.step()
        times.append((time.perf_counter() - started) * 1000)
    gc.callbacks.remove(on_gc)
    print(json.dumps({"freeze": freeze, "epoch_ms": times, "full_gc_ms": full, "frozen": gc.get_freeze_count(),
                      "tracked": len(gc.get_objects())}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", choices=("freeze", "no-freeze"))
    args = parser.parse_args()
    if args.child:
        child(args.epochs, args.child == "freeze")
        return
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for _ in range(args.rounds):
        for mode in ("no-freeze", "freeze"):
            out = subprocess.run([sys.executable, __file__, "--child", mode, "--epochs", str(args.epochs)],
                                 capture_output=True, text=True, check=True, cwd=ROOT)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            runs[result["freeze"]].append(result)
    print(f"{args.epochs} epochs per run, {args.rounds} runs each, alternating; load "
          f"{open('/proc/loadavg').read().split()[:3]}")
    print("| heap | epoch median (ms) | mean | max | full GCs per 100 epochs | ms per full GC (median) "
          "| full-GC ms per epoch | objects a full GC walks |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for freeze in (False, True):
        times = [t for r in runs[freeze] for t in r["epoch_ms"]]
        full = [t for r in runs[freeze] for t in r["full_gc_ms"]]
        epochs = len(times)
        print(f"| {'frozen after imports' if freeze else 'not frozen'} | {statistics.median(times):.1f} | "
              f"{statistics.mean(times):.1f} | {max(times):.0f} | {100 * len(full) / epochs:.1f} | "
              f"{statistics.median(full) if full else 0:.1f} | {sum(full) / epochs:.2f} | "
              f"{statistics.median(r['tracked'] for r in runs[freeze]):,.0f} |")


if __name__ == "__main__":
    main()
