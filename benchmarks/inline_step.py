"""The loop around the model: one inline verl-tasks epoch vs a hand-written GRPO step, same work.

    .venv/bin/python benchmarks/inline_step.py [--repeats 9] [--json out.json] [--floor]

Both sides use the same 105k-parameter GPT-2 (built from a config in code, with
the built-in character tokenizer, saved to a folder and loaded by path), the
same 16 arithmetic prompts x 8 samples, 8 new tokens, temperature 1, one AdamW
step on the clipped GRPO loss. The hand loop keeps everything in memory and
writes nothing; the verl-tasks epoch runs plan, rollout, score, validate,
update and snapshot through the store (a local folder), with every unit
committed. They run alternately in one process, so machine noise hits both.
A second shape splits the same prompts into 4 batches of 4.

``--floor`` also times the 1-batch epoch with parts the product requires taken out
(the quality gate; every fsync, by making ``os.fsync`` a no-op while it runs), each
beside the hand loop again: what is left is the loop around the model without them.
The product has no such switches; they exist only here.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

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
    model = GPT2LMHeadModel(config)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


class HandLoop:
    """A minimal GRPO step written by hand: generate, score, advantage, one clipped-loss step."""

    def __init__(self, folder: Path):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from verl_tasks.data import arith_rows

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(folder)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.rows = arith_rows(0, "train", 2000)
        self.step_index = 0

    def step(self) -> None:
        torch, tok = self.torch, self.tokenizer
        start = (self.step_index * PROMPTS) % len(self.rows)
        batch = self.rows[start : start + PROMPTS]
        self.step_index += 1
        prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in batch]
        rows = [p for p in prompts for _ in range(GROUP)]
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), tok.pad_token_id)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, width - len(r):] = torch.tensor(r)
            mask[i, width - len(r):] = 1
        self.model.eval()
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                      max_new_tokens=NEW_TOKENS, pad_token_id=tok.pad_token_id,
                                      eos_token_id=tok.eos_token_id)
        responses = out[:, width:]
        resp_mask = torch.ones_like(responses, dtype=torch.float32)
        for i, row in enumerate(responses.tolist()):
            if tok.eos_token_id in row:
                resp_mask[i, row.index(tok.eos_token_id) + 1:] = 0
        texts = tok.batch_decode(responses, skip_special_tokens=True)
        truth = [r["ground_truth"] for r in batch for _ in range(GROUP)]
        rewards = [1.0 if t.strip() == g else 0.0 for t, g in zip(texts, truth, strict=True)]
        scores = torch.tensor(rewards).view(PROMPTS, GROUP)
        adv = ((scores - scores.mean(1, keepdim=True)) / (scores.std(1, keepdim=True) + 1e-6)).view(-1, 1)
        self.model.train()
        full_mask = torch.cat([mask, (resp_mask > 0).long()], dim=1)
        logits = self.model(input_ids=out, attention_mask=full_mask).logits[:, width - 1 : -1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())
        loss1, loss2 = -adv * ratio, -adv * ratio.clamp(0.8, 1.2)
        loss = (torch.maximum(loss1, loss2) * resp_mask).sum() / resp_mask.sum()
        self.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()


class InlineEpochs:
    """verl-tasks' inline path on the same work; one call = one committed epoch (no evaluation)."""

    def __init__(self, folder: Path, store: Path, batches: int, epochs: int, gate: bool = True):
        from verl_tasks.config import load_config
        from verl_tasks.runner import make_context

        per_batch = PROMPTS // batches
        config = load_config(ROOT / "dags" / "experiments" / "tiny_arith.yaml", {
            "experiment": f"bench-inline-{batches}b", "storage.uri": f"file://{store}", "epochs": epochs,
            "torch_threads": THREADS, "model.source": "hf", "model.name_or_path": str(folder),
            "rollout.batches_per_epoch": batches, "rollout.prompts_per_batch": per_batch,
            "rollout.max_new_tokens": NEW_TOKENS, "rollout.temperature": 1.0, "algorithm.group_size": GROUP,
            "algorithm.minibatch_size": PROMPTS * GROUP, "algorithm.lr": 1e-4, "evaluate.every": 0,
            "evaluate.max_prompts": 16, "data.train_size": 2000, "quality.enabled": gate,
        })
        self.ctx = make_context(config)
        self.epoch = 0

    def step(self) -> None:
        """One epoch through the runner ``verl-tasks run`` uses (``run_in_process``)."""
        from verl_tasks.runner import epoch_phases, run_in_process

        for phase, batches in epoch_phases(self.ctx, self.epoch, self.ctx.config.epochs):
            if phase != "evaluate":
                for _ in run_in_process(self.ctx, phase, self.epoch, batches):
                    pass
        self.epoch += 1


def measure(repeats: int, batches: int, work: Path, gate: bool = True, fsync: bool = True) -> dict:
    import os

    import torch

    torch.set_num_threads(THREADS)
    name = f"{batches}" + ("" if gate else "-nogate") + ("" if fsync else "-nofsync")
    folder = build_policy_folder(work / f"gpt2-{name}")
    hand = HandLoop(folder)
    inline = InlineEpochs(folder, work / f"store-{name}", batches, repeats + 2, gate)
    inline.step()  # epoch 0 pins data and the base snapshot: a one-time cost, not a step
    hand.step()
    real_fsync = os.fsync
    if not fsync:
        os.fsync = lambda fd: None
    try:
        hand_ms, inline_ms = timed_pairs(hand, inline, repeats)
    finally:
        os.fsync = real_fsync
    hand_median, inline_median = statistics.median(hand_ms), statistics.median(inline_ms)
    phases = phase_split(inline.ctx, range(1, repeats + 1))
    loads = policy_loads(inline.ctx, range(1, repeats + 1))
    return {"policy_loads": loads, "batches": batches, "prompts_per_batch": PROMPTS // batches,
            "gate": gate, "fsync": fsync, "hand_ms": round(hand_median, 1),
            "inline_ms": round(inline_median, 1), "ratio": round(inline_median / hand_median, 2),
            "params": sum(p.numel() for p in hand.model.parameters()), "phases_ms": phases,
            "validate_share": round(phases.get("validate", 0.0) / inline_median, 3)}


def timed_pairs(hand: HandLoop, inline: InlineEpochs, repeats: int) -> tuple[list[float], list[float]]:
    """``repeats`` hand steps and inline epochs, alternating (ms each)."""
    hand_ms, inline_ms = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        hand.step()
        hand_ms.append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        inline.step()
        inline_ms.append((time.perf_counter() - started) * 1000)
    return hand_ms, inline_ms


def policy_loads(ctx, epochs) -> int:
    """``policy_loaded`` events recorded while the timed epochs ran (a warm process records none)."""
    from verl_tasks.events import read_events

    events = read_events(ctx.store, ctx.layout)
    spans = [e["time"] for e in events if e["kind"] == "started" and e.get("epoch") in epochs]
    return sum(1 for e in events if e["kind"] == "policy_loaded" and spans and min(spans) <= e["time"])


def phase_split(ctx, epochs) -> dict[str, float]:
    """Median ms per epoch of each phase (its units' ``committed`` events' durations, batches summed)."""
    from verl_tasks.events import read_events

    per_epoch: dict[str, dict[int, float]] = {}
    for event in read_events(ctx.store, ctx.layout):
        if event["kind"] == "committed" and event.get("epoch") in epochs:
            by_epoch = per_epoch.setdefault(event["phase"], {})
            by_epoch[event["epoch"]] = by_epoch.get(event["epoch"], 0.0) + event["duration_s"] * 1000
    return {phase: round(statistics.median(v.values()), 1) for phase, v in per_epoch.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--floor", action="store_true",
                        help="also time 1 batch without the gate, without fsync, and without both")
    args = parser.parse_args()
    import logging

    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        results = [measure(args.repeats, batches, Path(tmp)) for batches in (1, 4)]
        if args.floor:
            results += [measure(args.repeats, 1, Path(tmp), gate, fsync)
                        for gate, fsync in ((False, True), (True, False), (False, False))]
    for r in results:
        removed = [part for part in ("gate", "fsync") if not r[part]]
        print(f"{r['batches']} batch(es) x {r['prompts_per_batch']} prompts x {GROUP} samples, {r['params']} params"
              + (f", WITHOUT {' and '.join(removed)}" if removed else "") + ": "
              f"hand loop {r['hand_ms']} ms, verl-tasks inline epoch {r['inline_ms']} ms, ratio {r['ratio']}x")
        print("  per phase (median ms per epoch, from the committed events): "
              + ", ".join(f"{k} {v}" for k, v in r["phases_ms"].items())
              + f"; validate {r['validate_share']:.0%} of the epoch; policy loads {r['policy_loads']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
