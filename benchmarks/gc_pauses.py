"""Full garbage collections in a warm worker: inline epochs with and without the frozen heap.

    .venv/bin/python benchmarks/gc_pauses.py [--epochs 150] [--rounds 2] [--output BENCHMARKS.md]

Runs ``--epochs`` inline epochs in a fresh process, alternately as shipped (``freeze_after_imports``
after each unit) and with the freeze left out, ``--rounds`` times each. An epoch is plan, rollout,
score, validate, update and snapshot of the tiny experiment's config, each committed to a local
store through ``run_in_process`` (the runner ``verl-tasks run`` uses), on a ~105k-parameter GPT-2
(built from a config with the character tokenizer, saved as an HF folder), 1 batch of 16 prompts
x 8 samples, 8 new tokens, no evaluation. Reports per-epoch median, mean and max, and Python's
generation-2 collections seen by ``gc.callbacks`` (count, ms). The section between this script's
markers in ``--output`` is replaced.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OWNER = "benchmarks/gc_pauses.py"
PROMPTS, GROUP, NEW_TOKENS, THREADS = 16, 8, 8, 2


def build_policy_folder(folder: Path) -> Path:
    """A ~105k-parameter GPT-2 and the character tokenizer, saved as an HF folder."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from verl_tasks.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=2, n_positions=64,
                        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


class InlineEpochs:
    """One call = one committed epoch (no evaluation) through ``run_in_process``."""

    def __init__(self, folder: Path, store: Path, epochs: int):
        from verl_tasks.config import load_config
        from verl_tasks.runner import make_context

        config = load_config(ROOT / "dags" / "experiments" / "tiny_arith.yaml", {
            "experiment": "bench-gc", "storage.uri": f"file://{store}", "epochs": epochs,
            "torch_threads": THREADS, "model.source": "hf", "model.name_or_path": str(folder),
            "rollout.batches_per_epoch": 1, "rollout.prompts_per_batch": PROMPTS,
            "rollout.max_new_tokens": NEW_TOKENS, "rollout.temperature": 1.0, "algorithm.group_size": GROUP,
            "algorithm.minibatch_size": PROMPTS * GROUP, "algorithm.lr": 1e-4, "evaluate.every": 0,
            "evaluate.max_prompts": 16, "data.train_size": 2000,
        })
        self.ctx = make_context(config)
        self.epoch = 0

    def step(self) -> None:
        from benchmarks.run import inline_epoch

        inline_epoch(self.ctx, self.epoch)
        self.epoch += 1


def child(epochs: int, freeze: bool) -> None:
    """One measured run in this process; prints one JSON line."""
    import gc

    import torch

    import verl_tasks.runner

    if not freeze:
        verl_tasks.runner.freeze_after_imports = lambda: False
    torch.set_num_threads(THREADS)
    work = Path(tempfile.mkdtemp(prefix="vt-gc-"))
    inline = InlineEpochs(build_policy_folder(work / "gpt2"), work / "store", epochs + 2)
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
    shutil.rmtree(work, ignore_errors=True)


def markdown(runs: dict[bool, list[dict]], epochs: int, rounds: int, command: str) -> str:
    from benchmarks.run import provenance

    lines = [
        "## Full garbage collections in a warm worker",
        "",
        provenance(command),
        "",
        f"{epochs} inline epochs per process (after one untimed epoch that imports, pins the data and writes "
        f"the base snapshot), {rounds} processes each way, alternating: as shipped (the runner calls "
        "`gc.freeze()` after every unit that imported modules, `verl_tasks/execution/heap.py`) and with that "
        f"freeze left out. An epoch: plan, rollout, score, validate, update and snapshot committed to a local "
        f"store, a ~105k-parameter GPT-2, {PROMPTS} prompts x {GROUP} samples, {NEW_TOKENS} new tokens, no "
        "evaluation. `gc.callbacks` times Python's generation-2 (full) collections; the last column is the "
        "number of objects a full collection walks at the end of the run (`gc.get_objects()`, frozen ones left out).",
        "",
        "| heap | epoch median (ms) | mean | max | full GCs per 100 epochs | ms per full GC (median) "
        "| full-GC ms per epoch | objects a full GC walks |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for freeze in (False, True):
        times = [t for r in runs[freeze] for t in r["epoch_ms"]]
        full = [t for r in runs[freeze] for t in r["full_gc_ms"]]
        walked = statistics.median(r["tracked"] for r in runs[freeze])  # gc.get_objects() leaves frozen ones out
        lines.append(f"| {'frozen after imports' if freeze else 'not frozen'} | {statistics.median(times):.1f} | "
                     f"{statistics.mean(times):.1f} | {max(times):.0f} | {100 * len(full) / len(times):.1f} | "
                     f"{statistics.median(full) if full else 0:.1f} | {sum(full) / len(times):.2f} | "
                     f"{walked:,.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md")
    parser.add_argument("--child", choices=("freeze", "no-freeze"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.epochs, args.child == "freeze")
        return
    from benchmarks.run import write_section

    runs: dict[bool, list[dict]] = {True: [], False: []}
    for i in range(args.rounds):
        for mode in ("no-freeze", "freeze"):
            out = subprocess.run([sys.executable, __file__, "--child", mode, "--epochs", str(args.epochs)],
                                 capture_output=True, text=True, check=True, cwd=ROOT)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            runs[result["freeze"]].append(result)
            print(f"round {i + 1}/{args.rounds}, {mode} done", file=sys.stderr, flush=True)
    text = markdown(runs, args.epochs, args.rounds,
                    " ".join([".venv/bin/python benchmarks/gc_pauses.py", *sys.argv[1:]]))
    print(text)
    write_section(args.output, text, OWNER)


if __name__ == "__main__":
    main()
