"""The tiny experiment with its update on 1, 2 and 4 workers, ddp and fsdp2: update time per epoch and accuracy.

    .venv/bin/python benchmarks/update_scaling.py [--epochs 8] [--json out.json]
        [--runs 1-ddp,1-fsdp2,2-ddp,2-fsdp2,4-ddp] [--output BENCHMARKS.md]

Every run trains ``dags/experiments/tiny_arith.yaml`` for ``--epochs`` epochs into a fresh store, in
this one process (the inline runner), with ``resources.update.workers``/``strategy`` set; the
first distributed run starts a local Ray that the others reuse (its start is not in any update
time). Reported per run: the first epoch's update, the median over the later epochs and the total of
the update units' durations (from the event log: the ``committed`` event's ``duration_s``, i.e.
loading, log-probs, training, writing), the
held-out accuracy of the base and after the last epoch, and the final weights' largest
difference from the first run. The section between this script's markers in ``--output`` is replaced.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "dags" / "experiments" / "tiny_arith.yaml"
OWNER = "benchmarks/update_scaling.py"
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
    return {"run": name, "wall_s": round(wall, 1), "update_s_first": round(updates[0], 2),
            "update_s_median": round(statistics.median(updates[1:] or updates), 2),
            "update_s_total": round(sum(updates), 1), "update_s": updates,
            "base_accuracy": status["base"]["metrics"].get("eval_accuracy"), "accuracy": accuracy,
            "weights": str(record / ".attempts" / marker["attempt"] / "model.safetensors")}


def max_diff(a: str, b: str) -> float:
    from safetensors.torch import load_file

    wa, wb = load_file(a), load_file(b)
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


def markdown(results: list[dict], epochs: int, command: str) -> str:
    from benchmarks.run import provenance

    first = results[0]["run"]
    lines = [
        "## The update on 1, 2 and 4 workers, ddp and fsdp2",
        "",
        provenance(command),
        "",
        f"`dags/experiments/tiny_arith.yaml` trained for {epochs} epochs once per row, in one process (the inline "
        "runner), each into a fresh store, changing only `resources.update.workers` and `strategy`. One ddp "
        "worker runs in the unit's own process; every other row runs the update on the resident update group "
        "(`verl_tasks/train/group.py`: Ray actors with a gloo process group, formed by the row's first update "
        "and kept across epochs with the policy and its AdamW state; a local Ray started by the first such row "
        "and reused, its start in no update time). The update time is the update unit's `committed` event's "
        "duration: loading (the first epoch: forming the group, every worker importing torch and "
        "transformers and reading the policy from the store; later epochs: nothing, the policy is held), "
        "log-probs, training, writing into the store. The median is over the epochs after the first. The "
        f"last column compares the final weights with the first row's (`{first}`).",
        "",
        "| run | first epoch's update (s) | update s/epoch after it (median) | ratio to the first row "
        f"| update s, all epochs | run wall (s) | held-out accuracy, base -> epoch {epochs - 1} "
        f"| max \\|w - w({first})\\| |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in results:
        gain = 100 * (r["accuracy"][-1] - r["base_accuracy"])
        lines.append(f"| {r['run']} | {r['update_s_first']:.1f} | {r['update_s_median']:.2f} "
                     f"| {r['update_ratio_vs_first']:.2f} "
                     f"| {r['update_s_total']:.0f} | {r['wall_s']:.0f} | {r['base_accuracy']:.3f} -> "
                     f"{r['accuracy'][-1]:.3f} ({gain:+.1f} points) | {r['max_weight_diff_vs_first']:.1e} |")
    same = all(r["accuracy"] == results[0]["accuracy"] for r in results)
    lines += ["", "Held-out accuracy after every epoch: "
              + ("the same in every row (" + ", ".join(f"{a:.3f}" for a in results[0]["accuracy"]) + ")."
                 if same else "; ".join(f"{r['run']} " + ", ".join(f"{a:.3f}" for a in r["accuracy"])
                                        for r in results) + ".")]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--runs", default="1-ddp,1-fsdp2,2-ddp,2-fsdp2,4-ddp")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md")
    args = parser.parse_args()
    from benchmarks.run import write_section

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
    if args.json:
        args.json.write_text(json.dumps({"results": results}, indent=1))
    text = markdown(results, args.epochs, " ".join([".venv/bin/python benchmarks/update_scaling.py", *sys.argv[1:]]))
    print(text)
    write_section(args.output, text, OWNER)


if __name__ == "__main__":
    main()
