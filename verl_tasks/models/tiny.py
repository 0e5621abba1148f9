"""The built-in tiny model: a small Llama-shaped causal LM, a character tokenizer
made in code, and a deterministic supervised warm start on the arithmetic task.

The warm-start data is imperfect on purpose: a share of its examples shows the
"forgot the carry" answer (27+35=52). The base policy thus carries a systematic,
measurable flaw. Exact-answer rewards let GRPO find and fix it within a few
epochs on a CPU, which makes RL's effect visible and testable offline.
"""
from __future__ import annotations

import logging
import random
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from verl_tasks.config import TinyModelConfig
from verl_tasks.data import arith_pairs

log = logging.getLogger(__name__)

SPECIALS = ("<pad>", "<eos>", "<unk>")
CHARS = [chr(code) for code in range(32, 127)] + ["\n"]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character; saved as tokenizer.json, loadable by AutoTokenizer."""
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for char in CHARS:
        vocab[char] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", model_max_length=256
    )


def build_model(cfg: TinyModelConfig, vocab_size: int, seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def warm_start_answer(a: int, b: int, rng: random.Random, carry_error_rate: float) -> int:
    """The answer a warm-start example shows: right, or (sometimes) without the units carry."""
    carries = (a % 10) + (b % 10) >= 10
    if carries and rng.random() < carry_error_rate:
        return a + b - 10
    return a + b


def warm_start(cfg: TinyModelConfig, seed: int,
               tokenizer: PreTrainedTokenizerFast) -> tuple[LlamaForCausalLM, dict[str, Any]]:
    """Train the base policy with next-token loss on response tokens. Deterministic for a seed."""
    model = build_model(cfg, len(tokenizer), seed)
    train_pairs, _ = arith_pairs(seed)
    rng = random.Random(f"warm-start-{seed}")
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.warm_start_lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 50) * max(0.05, 1 - step / max(1, cfg.warm_start_steps))
    )
    model.train()
    losses = []
    for step in range(cfg.warm_start_steps):
        picks = torch.randint(len(train_pairs), (cfg.warm_start_batch_size,), generator=generator).tolist()
        batch = [train_pairs[i] for i in picks]
        input_ids, labels = [], []
        for a, b in batch:
            prompt = tokenizer(f"{a}+{b}=", add_special_tokens=False)["input_ids"]
            answer_text = str(warm_start_answer(a, b, rng, cfg.carry_error_rate))
            answer = tokenizer(answer_text, add_special_tokens=False)["input_ids"]
            ids = prompt + answer + [tokenizer.eos_token_id]
            input_ids.append(ids)
            labels.append([-100] * len(prompt) + answer + [tokenizer.eos_token_id])
        width = max(len(ids) for ids in input_ids)
        ids_t = torch.full((len(batch), width), tokenizer.pad_token_id)
        lab_t = torch.full((len(batch), width), -100)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (ids, lab) in enumerate(zip(input_ids, labels, strict=True)):
            ids_t[row, : len(ids)] = torch.tensor(ids)
            lab_t[row, : len(lab)] = torch.tensor(lab)
            mask[row, : len(ids)] = 1
        loss = model(input_ids=ids_t, attention_mask=mask, labels=lab_t).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 100 == 0:
            log.info("warm start step %d/%d loss %.4f", step, cfg.warm_start_steps, loss.item())
    model.eval()
    tail = losses[-20:] or [float("nan")]
    return model, {"warm_start_steps": cfg.warm_start_steps, "warm_start_final_loss": sum(tail) / len(tail)}
