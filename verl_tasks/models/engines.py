"""Generation engines behind one signature: ``hf`` (transformers ``generate``) and ``vllm``.

Both sample ``n`` responses per prompt from a seed, so a retried rollout reproduces
its samples; both sample exactly what the config says (nothing inherited from the
checkpoint's ``generation_config.json`` but its EOS ids), and both stop at, and trim
after, every EOS id the checkpoint declares. The vLLM engine itself lives in
:mod:`verl_tasks.models.vllm_engine`.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from verl_tasks.errors import ConfigError


@dataclass(frozen=True)
class SamplingSpec:
    n: int
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int
    greedy: bool = False


@dataclass(frozen=True)
class Generation:
    prompt_index: int
    sample_index: int
    response_ids: list[int]
    text: str
    finished: bool  # ended with an EOS id within the token budget


@dataclass(frozen=True)
class Policy:
    """What an engine samples from: the verified snapshot folder on local disk and its tokenizer;
    ``model`` is the loaded module for the HF engine, None where vLLM serves (it loads the folder).
    ``adapter``: a LoRA snapshot's verified adapter folder, which vLLM applies to the base weights in
    ``folder`` with its own LoRA kernels (the HF engine's model has it merged in already)."""

    tokenizer: Any
    folder: Path
    model: torch.nn.Module | None = None
    adapter: Path | None = None

    @property
    def device(self) -> str:
        """Where the HF module computes, or "vllm" (its engine's own device)."""
        return "vllm" if self.model is None else str(next(self.model.parameters()).device)


@dataclass(frozen=True)
class EngineOptions:
    """The engine settings of an experiment (``rollout.*``, ``model.dtype``, ``data``): the one set
    every caller builds an engine from (rollout, evaluation, the GPU check). Only vLLM reads them.

    ``enforce_eager`` None: eager on the CPU (no graphs to capture), CUDA graphs on a GPU. ``lora_rank``: the
    rank of the experiment's LoRA adapters (``model.lora``), which a vLLM engine is then built to apply.
    """

    gpu_memory_utilization: float = 0.5
    dtype: str = "float32"
    tensor_parallel_size: int = 1
    enforce_eager: bool | None = None
    max_model_len: int | None = None
    batch_invariant: bool = False
    lora_rank: int | None = None


def engine_options(config: Any) -> EngineOptions:
    """The engine settings of an experiment config."""
    rollout = config.rollout
    return EngineOptions(rollout.gpu_memory_utilization, config.model.dtype, rollout.tensor_parallel_size,
                         rollout.enforce_eager, config.data.max_prompt_tokens + rollout.max_new_tokens,
                         rollout.batch_invariant, config.model.lora.rank if vllm_applies_adapters(config) else None)


def vllm_applies_adapters(config: Any) -> bool:
    """Whether this worker's vLLM engine applies a LoRA experiment's adapters itself (``rollout.vllm_lora``; auto:
    where it runs on a GPU) rather than loading each version merged into the base."""
    if config.model.lora is None or config.rollout.engine != "vllm":
        return False
    mode = config.rollout.vllm_lora
    return mode == "adapter" or (mode == "auto" and torch.cuda.is_available())


Engine = Callable[..., list[Generation]]
ENGINES: dict[str, Engine] = {}


def register_engine(name: str) -> Callable[[Engine], Engine]:
    def wrap(fn: Engine) -> Engine:
        ENGINES[name] = fn
        return fn

    return wrap


def get_engine(name: str) -> Engine:
    if name not in ENGINES:
        raise ConfigError(f"unknown rollout engine {name!r}; valid: {sorted(ENGINES)}")
    return ENGINES[name]


def stop_token_ids(tokenizer: Any, folder: Path) -> list[int]:
    """Every EOS id of the policy: the tokenizer's and those of its ``generation_config.json``
    (chat models list several, e.g. end-of-turn and end-of-text); vLLM stops on all of them."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    path = Path(folder) / "generation_config.json"
    if path.is_file():
        declared = json.loads(path.read_text()).get("eos_token_id")
        ids += declared if isinstance(declared, list) else [declared] if declared is not None else []
    return sorted(set(ids))


def trim_at_stop(ids: list[int], stop: list[int]) -> tuple[list[int], bool]:
    """The response up to and including its first EOS id, and whether it had one."""
    for position, token in enumerate(ids):
        if token in stop:
            return ids[: position + 1], True
    return ids, False


def _generation(prompt: int, sample: int, ids: list[int], tokenizer: Any, stop: list[int]) -> Generation:
    ids, finished = trim_at_stop(ids, stop)
    text = tokenizer.decode([t for t in ids if t not in stop], skip_special_tokens=True)
    return Generation(prompt, sample, ids, text, finished)


@contextmanager
def sampling_only_as_configured(model: Any) -> Iterator[None]:
    """``generate`` fills every setting the call leaves unset from the checkpoint's generation config
    (a repetition penalty, top-k, ...): samples would then come from another distribution than the
    one the update scores. Swap in an empty one for the call; the saved snapshot keeps the original."""
    from transformers import GenerationConfig

    kept = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = kept


@register_engine("hf")
@torch.no_grad()
def generate_hf(policy: Policy, prompts: list[list[int]], spec: SamplingSpec, options: EngineOptions | None = None,
                on_engine: Callable[[str], None] | None = None) -> list[Generation]:
    """Left-padded batched ``generate`` on the (warm, cached) policy module; no engine to build."""
    from transformers import GenerationConfig

    del options, on_engine
    # A transformers causal LM (PreTrainedModel + GenerationMixin): no one base types both .device and .generate.
    model: Any = policy.model
    tokenizer = policy.tokenizer
    if model is None:
        raise ValueError("the hf engine samples from a loaded model; none was given")
    stop, pad = stop_token_ids(tokenizer, policy.folder), tokenizer.pad_token_id
    width = max(len(ids) for ids in prompts)
    padded = [[pad] * (width - len(ids)) + ids for ids in prompts]  # left-padded, one row per prompt
    masks = [[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts]
    input_ids = torch.tensor(padded, dtype=torch.long).repeat_interleave(spec.n, dim=0).to(model.device)
    mask = torch.tensor(masks, dtype=torch.long).repeat_interleave(spec.n, dim=0).to(model.device)
    if spec.greedy:
        settings = GenerationConfig(do_sample=False)
    else:
        settings = GenerationConfig(do_sample=True, temperature=spec.temperature, top_p=spec.top_p, top_k=0)
    settings.update(max_new_tokens=spec.max_new_tokens, pad_token_id=pad, eos_token_id=stop)
    torch.manual_seed(spec.seed)  # seeds the CPU and every CUDA device
    with sampling_only_as_configured(model):
        out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=settings)
    return [_generation(i // spec.n, i % spec.n, row, tokenizer, stop) for i, row in enumerate(out[:, width:].tolist())]


@register_engine("vllm")
def generate_vllm(policy: Policy, prompts: list[list[int]], spec: SamplingSpec, options: EngineOptions | None = None,
                  on_engine: Callable[[str], None] | None = None) -> list[Generation]:
    """vLLM generation from the policy folder's inference files; sample ``j`` of prompt ``i`` is seeded
    ``seed + i * n + j`` (:func:`verl_tasks.models.vllm_engine.request_seeds`); a LoRA policy's adapter is
    applied to the base by vLLM's LoRA kernels."""
    from verl_tasks.models import vllm_engine

    stop = stop_token_ids(policy.tokenizer, policy.folder)
    completions = vllm_engine.generate(policy.folder, prompts, spec, options or EngineOptions(), stop, on_engine,
                                       adapter=policy.adapter)
    return [_generation(i, j, ids, policy.tokenizer, stop) for i, samples in enumerate(completions)
            for j, ids in enumerate(samples)]


__all__ = ["SamplingSpec", "Generation", "Policy", "EngineOptions", "engine_options", "get_engine", "stop_token_ids",
           "trim_at_stop", "vllm_applies_adapters"]
