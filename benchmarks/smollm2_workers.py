"""A SmolLM2-135M epoch with the update in one process beside the same epoch with the update on two resident
ddp workers.

    .venv/bin/python benchmarks/smollm2_workers.py [--repeats 4] [--output BENCHMARKS.md]

Both sides run ``dags/experiments/smollm2_arith.yaml`` without evaluation through the inline runner
(``run_in_process``: plan, rollout, score, validate, update, snapshot, each committed to its own local
store), one epoch at a time, alternating in this one process so that machine noise hits both. The
only difference: ``resources.update.workers`` 1 (the update in this process, 2 torch threads) or 2
(two Ray actors of the resident group, one thread each, gloo all-reduce; the rollout then gets the
new weights through Ray's object store). The first epoch of each side (the base snapshot, the
group's start-up) is not timed; medians over the repeats. On 2 cores two workers cannot compute
faster than one: the figure is what the distributed path costs over one process.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "dags" / "experiments" / "smollm2_arith.yaml"
MODEL = ROOT / ".models" / "smollm2-135m-instruct"
OWNER = "benchmarks/smollm2_workers.py"


def context(store: Path, workers: int, epochs: int):
    from verl_tasks.config import load_config
    from verl_tasks.runner import make_context

    return make_context(load_config(CONFIG, {
        "experiment": f"bench-smollm2-w{workers}", "storage.uri": f"file://{store}", "epochs": epochs,
        "model.name_or_path": str(MODEL), "evaluate.every": 0, "resources.update.workers": workers}))


def update_split(ctx, epochs: range) -> dict[str, float]:
    """Median seconds of the update unit and, inside it, loading, training and writing."""
    from verl_tasks.events import read_events
    from verl_tasks.store.units import read_marker

    units = [e["duration_s"] for e in read_events(ctx.store, ctx.layout)
             if e["kind"] == "committed" and e.get("phase") == "update" and e.get("epoch") in epochs]
    ran = [read_marker(ctx.store, ctx.layout.update(e)).meta["ran"] for e in epochs]
    out = {"update_s": round(statistics.median(units), 2)}
    out.update({key: round(statistics.median(r.get(key, 0.0) for r in ran), 2)
                for key in ("load_s", "train_s", "write_s")})
    out["resident"] = sum(r.get("policy") == "resident" for r in ran)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md")
    args = parser.parse_args()
    import logging

    from benchmarks.run import inline_epoch, write_section
    from verl_tasks.models.gguf_import import import_gguf, packaged_smollm2
    from verl_tasks.train import group

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("verl_tasks.train.group").setLevel(logging.INFO)
    import_gguf(packaged_smollm2(), MODEL)
    epochs = args.repeats + 1
    times: dict[int, list[float]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        sides = {w: context(Path(tmp) / f"w{w}", w, epochs) for w in (1, 2)}
        for epoch in range(epochs):
            for workers, ctx in sides.items():
                started = time.perf_counter()
                inline_epoch(ctx, epoch)
                if epoch:  # epoch 0 also writes the base snapshot and starts the group: not timed
                    times[workers].append(time.perf_counter() - started)
        splits = {w: update_split(ctx, range(1, epochs)) for w, ctx in sides.items()}
        group.release()
    one, two = statistics.median(times[1]), statistics.median(times[2])
    command = "python benchmarks/smollm2_workers.py " + " ".join(sys.argv[1:])
    lines = [
        "## A SmolLM2-135M epoch: the update on two resident workers vs one process",
        "",
        f"Produced by `{command.strip()}` on {platform.machine()} with {os.cpu_count()} cores, "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}: `dags/experiments/smollm2_arith.yaml` without evaluation, "
        f"{args.repeats} epochs per side after an untimed first one, alternating in one process; medians. "
        "Same work on both sides (16 chat prompts x 4 samples, HF generate, one AdamW step over the 64 "
        "sequences in the YAML's micro-batches of 16, each worker taking its half); only "
        "`resources.update.workers` differs.",
        "",
        "| update on | seconds per epoch (median) | each epoch | update unit (s) | load / train / write (s) "
        "| epochs trained on the resident policy |",
        "|---|---:|---|---:|---|---:|",
    ]
    for workers, label in ((1, "one process"), (2, "two resident ddp workers")):
        split = splits[workers]
        lines.append(f"| {label} | {statistics.median(times[workers]):.2f} | "
                     f"{', '.join(f'{s:.1f}' for s in times[workers])} | {split['update_s']} | "
                     f"{split['load_s']} / {split['train_s']} / {split['write_s']} | "
                     f"{split['resident'] if workers > 1 else '-'} of {args.repeats} |")
    lines += ["", f"Two workers / one process: **{two / one:.2f}x** per epoch."]
    text = "\n".join(lines) + "\n"
    print(text)
    write_section(args.output, text, OWNER)


if __name__ == "__main__":
    main()
