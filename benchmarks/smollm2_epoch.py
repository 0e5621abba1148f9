"""A SmolLM2-135M epoch through verl-tasks (inline) beside a hand-written GRPO loop doing the same work.

    .venv/bin/python benchmarks/smollm2_epoch.py [--repeats 5] [--micro N] [--output BENCHMARKS.md]

Both sides: SmolLM2-135M-Instruct (float32, the imported HF folder), 16 chat prompts x 4 samples of
at most 12 new tokens from HF ``generate`` at temperature 1, the last-integer reward, GRPO
advantages, one AdamW step (lr 5e-6) over the 64 sequences in one forward and backward (as one
writes it when memory allows; ``--micro N``: in micro-batches of N, both sides), 2 torch threads.
The hand loop keeps everything in memory and writes nothing. The verl-tasks epoch is
``dags/experiments/smollm2_arith.yaml`` without evaluation, run by the runner ``verl-tasks run``
uses (``run_in_process``): plan, rollout, score (the reward in its sandbox process), validate (the
Great Expectations gate), update (weights and AdamW state written, fsynced and hashed into the
commit), snapshot, each unit committed to a local store. They alternate in one process after one
warm-up epoch each, so machine noise hits both; medians over the repeats.
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
OWNER = "benchmarks/smollm2_epoch.py"
PROMPTS, GROUP, NEW_TOKENS, LR, THREADS = 16, 4, 12, 5e-6, 2


class HandLoop:
    """GRPO as one would write it by hand: generate, score, advantages, one accumulated clipped-loss step."""

    def __init__(self, micro: int | None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        from verl_tasks.data import arith_rows

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
        self.model.generation_config = GenerationConfig()
        self.tokenizer = AutoTokenizer.from_pretrained(MODEL)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.rows = arith_rows(3, "train", 2000, chat=True)
        self.epoch = 0
        self.micro = micro or PROMPTS * GROUP

    def step(self) -> None:
        from verl_tasks.data import prompt_text
        from verl_tasks.rewards.builtin import last_integer

        torch, tok = self.torch, self.tokenizer
        batch = self.rows[self.epoch * PROMPTS: (self.epoch + 1) * PROMPTS]
        self.epoch += 1
        prompts = [tok(prompt_text(r["prompt"], tok), add_special_tokens=False)["input_ids"] for r in batch]
        width = max(map(len, prompts))
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts]).repeat_interleave(GROUP, 0)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]).repeat_interleave(GROUP, 0)
        self.model.eval()
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                      top_p=1.0, max_new_tokens=NEW_TOKENS, pad_token_id=tok.pad_token_id,
                                      eos_token_id=tok.eos_token_id)
        responses = out[:, width:]
        resp_mask = torch.ones_like(responses, dtype=torch.float32)
        for i, row in enumerate(responses.tolist()):
            if tok.eos_token_id in row:
                resp_mask[i, row.index(tok.eos_token_id) + 1:] = 0
        texts = tok.batch_decode(responses, skip_special_tokens=True)
        truth = [r["ground_truth"] for r in batch for _ in range(GROUP)]
        scores = torch.tensor([last_integer("arith", t, g) for t, g in zip(texts, truth, strict=True)])
        grouped = scores.view(PROMPTS, GROUP)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1, 1)
        full_mask = torch.cat([mask, (resp_mask > 0).long()], dim=1)
        tokens = resp_mask.sum()
        self.model.train()
        self.optimizer.zero_grad()
        for start in range(0, len(out), self.micro):
            part = slice(start, start + self.micro)
            logits = self.model(input_ids=out[part], attention_mask=full_mask[part]).logits[:, width - 1: -1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, responses[part].unsqueeze(-1)).squeeze(-1)
            ratio = torch.exp(logp - logp.detach())
            loss1, loss2 = -adv[part] * ratio, -adv[part] * ratio.clamp(0.8, 1.2)
            loss = (torch.maximum(loss1, loss2) * resp_mask[part]).sum() / tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()


class InlineEpochs:
    """verl-tasks on the same work; one call = one committed epoch through ``run_in_process``, no evaluation."""

    def __init__(self, store: Path, epochs: int, micro: int | None) -> None:
        from verl_tasks.config import load_config
        from verl_tasks.runner import make_context

        config = load_config(CONFIG, {
            "experiment": "bench-smollm2-epoch", "storage.uri": f"file://{store}", "epochs": epochs,
            "torch_threads": THREADS, "model.name_or_path": str(MODEL), "evaluate.every": 0,
            "resources.update.micro_batch_size": micro, "algorithm.lr": LR})
        self.ctx = make_context(config)
        self.epoch = 0

    def step(self) -> None:
        from benchmarks.run import inline_epoch

        inline_epoch(self.ctx, self.epoch)
        self.epoch += 1


def phase_split(ctx, epochs: range) -> tuple[dict[str, float], dict[str, float]]:
    """Median seconds per epoch of each phase (committed events), and the update's training/writing."""
    from verl_tasks.events import read_events
    from verl_tasks.store.units import read_marker

    per_phase: dict[str, list[float]] = {}
    for event in read_events(ctx.store, ctx.layout):
        if event["kind"] == "committed" and event.get("epoch") in epochs:
            per_phase.setdefault(event["phase"], []).append(event["duration_s"])
    ran = [read_marker(ctx.store, ctx.layout.update(e)).meta["ran"] for e in epochs]
    update = {key: round(statistics.median(r[key] for r in ran), 2) for key in ("train_s", "write_s")}
    update["write_bytes"] = statistics.median(r.get("write_bytes", 0) for r in ran)
    return {p: round(statistics.median(v), 2) for p, v in per_phase.items()}, update


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--micro", type=int, default=None, help="sequences per forward/backward; default: all")
    parser.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md")
    args = parser.parse_args()
    import logging

    import torch

    from benchmarks.run import write_section
    from verl_tasks.models.gguf_import import import_gguf, packaged_smollm2

    logging.basicConfig(level=logging.WARNING)
    import_gguf(packaged_smollm2(), MODEL)
    torch.set_num_threads(THREADS)
    with tempfile.TemporaryDirectory() as tmp:
        hand, inline = HandLoop(args.micro), InlineEpochs(Path(tmp) / "store", args.repeats + 1, args.micro)
        hand.step()
        inline.step()  # epoch 0 also pins the data and writes the base snapshot: not timed
        hand_s, inline_s = [], []
        for _ in range(args.repeats):
            started = time.perf_counter()
            hand.step()
            hand_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            inline.step()
            inline_s.append(time.perf_counter() - started)
        phases, update = phase_split(inline.ctx, range(1, args.repeats + 1))
    hand_median, inline_median = statistics.median(hand_s), statistics.median(inline_s)
    command = "python benchmarks/smollm2_epoch.py " + " ".join(sys.argv[1:])
    lines = [
        "## A SmolLM2-135M epoch: verl-tasks inline vs a hand-written GRPO loop",
        "",
        f"Produced by `{command.strip()}` on {platform.machine()} with {os.cpu_count()} cores, "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}: {args.repeats} epochs each, alternating in one process "
        f"after one warm-up epoch each; medians. Same work on both sides: {PROMPTS} chat prompts x {GROUP} samples, "
        f"{NEW_TOKENS} new tokens (HF generate), the last-integer reward, one AdamW step "
        + (f"in micro-batches of {args.micro}" if args.micro else "in one forward and backward over the 64 sequences")
        + "; verl-tasks also commits every unit (weights and AdamW state written, fsynced, hashed) and runs "
        "the quality gate. No evaluation on either side.",
        "",
        "| | seconds per epoch (median) | each epoch |",
        "|---|---:|---|",
        f"| hand-written loop | {hand_median:.2f} | {', '.join(f'{s:.1f}' for s in hand_s)} |",
        f"| verl-tasks inline epoch | {inline_median:.2f} | {', '.join(f'{s:.1f}' for s in inline_s)} |",
        f"| ratio | **{inline_median / hand_median:.2f}x** | |",
        "",
        "Where the verl-tasks epoch goes (median seconds per unit, from the committed events): "
        + ", ".join(f"{phase} {seconds}" for phase, seconds in phases.items())
        + f"; inside the update: training {update['train_s']} s, writing weights and AdamW state "
          f"{update['write_s']} s ({update['write_bytes'] / 1e6:.0f} MB, hashed as written, "
          f"{update['write_bytes'] / 1e6 / max(update['write_s'], 1e-9):.0f} MB/s; "
          f"{100 * update['write_s'] / phases.get('update', float('nan')):.0f}% of the update unit).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    write_section(args.output, text, OWNER)


if __name__ == "__main__":
    main()
