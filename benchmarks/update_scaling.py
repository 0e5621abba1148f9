"""The tiny experiment with its update on 1, 2 and 4 workers, ddp and fsdp2: update time per epoch and accuracy.

    .venv/bin/python benchmarks/update_scaling.py [--epochs 8] [--json out.json]
        [--runs 1-ddp,1-fsdp2,2-ddp,2-fsdp2,4-ddp]

Every run trains ``dags/experiments/tiny_arith.yaml`` for ``--epochs`` epochs into a fresh store, in
this one process (the inline runner), with ``resources.update.workers``/``strategy`` set; the
first distributed run starts a local Ray that the others reuse (its start is not in any update
time). Reported per run: the median and total of the update units' durations (from the event
log: the ``committed`` event's ``duration_s``, i.e. loading, log-probs, training, writing), the
held-out accuracy of the base and after the last epoch, and the final weights' largest
difference from the 1-worker ddp run.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "dags" / "experiments" / "tiny_arith.yaml"
log = logging.getLogger("update_scaling")


def run(name: str, epochs: int, store: Path) -> dict:
    """Train one configuration; returns its timings, accuracies and the final update's weights file."""
    from verl_tasks.config import load_config
    from verl_tasks.events import read_events
    from verl_tasks.runner import make_context, train

    workers, strategy = name.split("-")
    config = load_config(CONFIG, {"resources.update.workers": int(workers), "resources.update.strategy": strategy,
                                  "storage.uri": f"file://{store}", "epochs": epochs})
    ctx = make_context(config)
    started = time.monotonic()
    status = train(ctx, epochs)
    wall = time.monotonic() - started
    updates = [e["duration_s"] for e in read_events(ctx.store, ctx.layout)
               if e.get("phase") == "update" and e.get("kind") == "committed"]
    accuracy = [e["metrics"].get("eval_accuracy") for e in status["epochs"]]
    record = ctx.store.root / ctx.layout.update(epochs - 1)
    marker = json.loads((record / "_SUCCESS").read_text())
    return {"run": name, "wall_s": round(wall, 1), "update_s_median": round(statistics.median(updates), 2),
            "update_s_total": round(sum(updates), 1), "update_s": updates,
            "base_accuracy": status["base"]["metrics"].get("eval_accuracy"), "accuracy": accuracy,
            "weights": str(record / ".attempts" / marker["attempt"] / "model.safetensors")}


def max_diff(a: str, b: str) -> float:
    from safetensors.torch import load_file

    wa, wb = load_file(a), load_file(b)
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--runs", default="1-ddp,1-fsdp2,2-ddp,2-fsdp2,4-ddp")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("great_expectations").setLevel(logging.WARNING)
    results = []
    with tempfile.TemporaryDirectory(prefix="vt-scaling-") as tmp:
        for name in args.runs.split(","):
            results.append(run(name, args.epochs, Path(tmp) / name))
            log.info("%s", {k: v for k, v in results[-1].items() if k != "weights"})
        baseline = results[0]
        for result in results:
            result["max_weight_diff_vs_first"] = max_diff(baseline["weights"], result["weights"])
            result["update_ratio_vs_first"] = round(result["update_s_median"] / baseline["update_s_median"], 2)
        for result in results:
            del result["weights"]  # a temporary path
    load = os.getloadavg()
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; {args.epochs} epochs")
    print("| run | update s/epoch (median) | ratio | update s total | wall s | base acc | final acc | gain (points) "
          "| max |w - w(first)| |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        gain = 100 * (r["accuracy"][-1] - r["base_accuracy"])
        print(f"| {r['run']} | {r['update_s_median']:.1f} | {r['update_ratio_vs_first']:.2f} "
              f"| {r['update_s_total']:.0f} | {r['wall_s']:.0f} | {r['base_accuracy']:.3f} "
              f"| {r['accuracy'][-1]:.3f} | {gain:+.1f} | {r['max_weight_diff_vs_first']:.2e} |")
    if args.json:
        args.json.write_text(json.dumps({"load_average": load, "results": results}, indent=1))


if __name__ == "__main__":
    main()
