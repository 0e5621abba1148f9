"""Peak memory of the update phase on SmolLM2-135M-Instruct at two batch sizes; written into BENCHMARKS.md.

    .venv/bin/python benchmarks/update_memory.py [--batches 64 256] [--micro-batch-size 4 ...] [--whole]
                                                 [--before CHECKOUT] [--output BENCHMARKS.md]

The model is the HF folder ``.models/smollm2-135m-instruct`` (``verl-tasks model import-gguf
.models/smollm2-135m-instruct``; 134.5M parameters, vocabulary 49,152, tied embeddings, float32).
Per batch size, a setup process prepares a local store up to epoch 1's update: the experiment is
pinned and its base snapshot written by ``prepare``, each epoch planned by ``plan`` and gated by
``validate`` (all real), its rollout batches and scores written directly (synthetic: 64 prompt
tokens and 12 response tokens per sample, drawn at random, scores 0 or 1; no generation runs),
and epoch 0 updated and snapshotted (real). Then a fresh process runs epoch 1's update
(``run_phase(ctx, "update", 1)``: load policy 1 and its AdamW state, the base as KL reference,
the old and reference log-prob passes, AdamW over minibatches of 64, write the weights and the
optimizer state, commit) and reports its peak RSS (``ru_maxrss``) and its RSS before the phase.
Epoch 1, not 0: epoch 0 starts without optimizer state, so an epoch of one optimizer step (64
sequences) would never hold the AdamW moments and a micro-batch's activations at once.

Rows: this checkout with ``resources.update.micro_batch_size`` set; with ``--whole`` also without
it (chunked log-probs, a whole minibatch per forward/backward); with ``--before``, the same store
updated by another checkout's code (e.g. ``git archive`` of the commit before micro-batches and
chunked log-probs: ``[B, L, V]`` logits, whole-batch frozen passes). The section between this
script's markers in ``--output`` is replaced.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / ".models" / "smollm2-135m-instruct"
PROMPT_TOKENS, RESPONSE_TOKENS, GROUP, PROMPTS_PER_BATCH = 64, 12, 4, 16
OWNER = "benchmarks/update_memory.py"


def overrides(store: Path, batch: int, micro: int | None) -> dict:
    """The measured experiment: SmolLM2 in float32, GRPO with a KL term, minibatches of 64 sequences."""
    out = {"experiment": f"smollm2-update-{batch}", "storage.uri": f"file://{store}", "model.source": "hf",
           "model.name_or_path": str(MODEL), "model.dtype": "float32", "epochs": 2, "data.train_size": 400,
           "data.eval_size": 20, "data.max_prompt_tokens": 256, "rollout.max_new_tokens": RESPONSE_TOKENS,
           "rollout.prompts_per_batch": PROMPTS_PER_BATCH,
           "rollout.batches_per_epoch": batch // (GROUP * PROMPTS_PER_BATCH), "algorithm.group_size": GROUP,
           "algorithm.minibatch_size": 64, "algorithm.lr": 5e-6,
           "algorithm.kl_type": "low_var_kl", "algorithm.kl_coef": 0.001}
    if micro is not None:
        out["resources.update.micro_batch_size"] = micro
    return out


def context(store: Path, batch: int, micro: int | None):
    from verl_tasks.config import load_config
    from verl_tasks.runner import make_context

    return make_context(load_config(ROOT / "dags" / "experiments" / "tiny_arith.yaml", overrides(store, batch, micro)))


def prepare_store(store: Path, batch: int) -> None:
    """Setup process: epoch 0 up to its snapshot, epoch 1 up to its update (synthetic rollouts and scores)."""
    from verl_tasks.runner import run_phase

    ctx = context(store, batch, 8)
    synthetic_epoch(ctx, 0, batch)
    run_phase(ctx, "update", 0)
    run_phase(ctx, "snapshot", 0)
    synthetic_epoch(ctx, 1, batch)


def synthetic_epoch(ctx, epoch: int, batch: int) -> None:
    """Plan the epoch (real), write its rollout batches and scores (synthetic), validate them (real)."""
    from verl_tasks.runner import run_phase
    from verl_tasks.store.units import UnitWriter, read_json, read_marker

    run_phase(ctx, "plan", epoch)
    planned = read_json(ctx.store, read_marker(ctx.store, ctx.layout.plan(epoch)), "plan.json")
    rng = random.Random(f"{batch}/{epoch}")
    vocab = json.loads((MODEL / "config.json").read_text())["vocab_size"]
    for b, spec in enumerate(planned["batches"]):
        samples, scores = [], []
        for prompt_id in spec["prompt_ids"]:
            prompt = [rng.randrange(vocab) for _ in range(PROMPT_TOKENS)]
            for i in range(GROUP):
                sid = f"e{epoch:05d}-b{b:04d}-{prompt_id}-s{i:02d}"
                samples.append({"sample_id": sid, "prompt_id": prompt_id, "prompt_ids": prompt,
                                "response_ids": [rng.randrange(vocab) for _ in range(RESPONSE_TOKENS)],
                                "response": "synthetic", "finished": False, "policy_version": epoch})
                scores.append({"sample_id": sid, "score": float(rng.random() < 0.5)})
        for unit, name, rows in ((ctx.layout.rollout(epoch, b), "samples.jsonl", samples),
                                 (ctx.layout.score(epoch, b), "scores.jsonl", scores)):
            writer = UnitWriter(ctx.store, unit)
            writer.write_jsonl(name, rows)
            writer.commit({"samples": len(rows), "synthetic": True})
    run_phase(ctx, "validate", epoch)


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def measure_update(store: Path, batch: int, micro: int | None) -> dict:
    """Child process: epoch 1's update phase; its memory and time."""
    from verl_tasks.runner import run_phase

    ctx = context(store, batch, micro)
    before = rss_mib()
    started = time.monotonic()
    run_phase(ctx, "update", 1)
    return {"before_mib": before, "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "s": time.monotonic() - started}


def child(args: list[str], checkout: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run([sys.executable, __file__, *args, "--checkout", str(checkout)], check=True, cwd=checkout,
                          capture_output=True, text=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def parameters() -> int:
    from safetensors import safe_open

    with safe_open(str(MODEL / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())


def run(batches: list[int], micros: list[int], whole: bool, before: Path | None) -> list[dict]:
    rows = []
    variants = [(f"micro-batches of {micro}, chunked log-probs", ROOT, micro) for micro in micros]
    if whole:
        variants.append(("whole minibatches, chunked log-probs", ROOT, None))
    if before is not None:
        variants.append((f"before ({git_head(before)}): whole batches, `[B, L, V]` logits", before, None))
    for batch in batches:
        with tempfile.TemporaryDirectory(prefix="vt-update-memory-") as tmp:
            store = Path(tmp) / "store"
            subprocess.run([sys.executable, __file__, "--setup", str(store), "--batch", str(batch)], check=True,
                           cwd=ROOT, capture_output=True, text=True)
            for name, checkout, size in variants:
                work = Path(tmp) / f"copy-{len(rows)}"  # each variant updates the same committed inputs
                shutil.copytree(store, work)
                micro = [] if size is None else ["--micro", str(size)]
                result = child(["--measure", str(work), "--batch", str(batch), *micro], checkout)
                rows.append({"variant": name, "batch": batch, **result})
                print(json.dumps(rows[-1]), flush=True)
                shutil.rmtree(work)
    return rows


def git_head(checkout: Path) -> str:
    return subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or str(checkout)


def markdown(rows: list[dict], params: int, command: str) -> str:
    state_mib = params * 16 / 2**20
    load = os.getloadavg()
    lines = [
        "## Update memory: micro-batches and chunked log-probs (SmolLM2-135M-Instruct)",
        "",
        f"Produced by `{command}` on {platform.machine()} with {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average "
        f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at the end (a machine shared with other engineers' tests).",
        "",
        f"{params / 1e6:.1f}M parameters: float32 parameters + gradients + AdamW moments, 16 bytes each, are "
        f"**{state_mib:,.0f} MiB**. Each row is a fresh process running epoch 1's update phase "
        f"(`run_phase(ctx, \"update\", 1)`) on sequences of {PROMPT_TOKENS} prompt + {RESPONSE_TOKENS} response "
        "tokens: policy 1 and its AdamW state read from the store, the base policy held beside it as the "
        "low-variance-KL reference, the old-policy pass (when the epoch has more than one minibatch) and the "
        "reference pass, one optimizer step per minibatch of 64 sequences, weights and optimizer state written "
        "and committed. Inputs are synthetic (see the script's docstring). Peak is the process's `ru_maxrss`, "
        "\"before\" its RSS when the phase started (torch and verl_tasks imported).",
        "",
        "| variant | sequences | RSS before (MiB) | peak RSS (MiB) | peak / (params+grads+AdamW) | "
        "peak vs the fewest sequences | seconds |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    smallest: dict[str, dict] = {}
    for r in sorted(rows, key=lambda r: r["batch"]):
        smallest.setdefault(r["variant"], r)
    for r in sorted(rows, key=lambda r: (list(smallest).index(r["variant"]), r["batch"])):
        ref = smallest[r["variant"]]
        extra = "" if r is ref else f"{(r['peak_mib'] / ref['peak_mib'] - 1) * 100:+.1f}%"
        lines.append(f"| {r['variant']} | {r['batch']} | {r['before_mib']:,.0f} | {r['peak_mib']:,.0f} | "
                     f"{r['peak_mib'] / state_mib:.2f} | {extra} | {r['s']:.0f} |")
    return "\n".join(lines) + "\n"


def write_section(output: Path, text: str) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from run import replace_generated

    output.write_text(replace_generated(output.read_text() if output.exists() else "", text, owner=OWNER))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--micro-batch-size", type=int, nargs="+", default=[4])
    parser.add_argument("--whole", action="store_true", help="also this checkout without micro-batches")
    parser.add_argument("--before", type=Path, help="another checkout to measure on the same stores")
    parser.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md")
    parser.add_argument("--setup", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--micro", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--checkout", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.setup:
        prepare_store(args.setup, args.batch)
        return
    if args.measure:
        sys.path.insert(0, str(args.checkout))
        print(json.dumps(measure_update(args.measure, args.batch, args.micro)))
        return
    rows = run(args.batches, args.micro_batch_size, args.whole, args.before.resolve() if args.before else None)
    command = " ".join([".venv/bin/python benchmarks/update_memory.py", *sys.argv[1:]])
    text = markdown(rows, parameters(), command)
    write_section(args.output, text)
    print(text)


if __name__ == "__main__":
    main()
