"""Generation engines behind one signature: ``hf`` (transformers generate, CPU/GPU)
and ``vllm`` (GPU, optional extra). Both sample ``n`` responses per prompt from a
seed, so a retried rollout reproduces its samples."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from verl_tasks.errors import ConfigError

log = logging.getLogger(__name__)


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
    finished: bool  # ended with EOS within the token budget


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


def _trim(ids: list[int], eos_id: int) -> tuple[list[int], bool]:
    if eos_id in ids:
        return ids[: ids.index(eos_id) + 1], True
    return ids, False


@register_engine("hf")
@torch.no_grad()
def generate_hf(
    model: Any, tokenizer: Any, prompts: list[list[int]], spec: SamplingSpec, policy_dir: Path | None = None,
    options: "EngineOptions | None" = None, on_engine: Callable[[str], None] | None = None,
) -> list[Generation]:
    """Left-padded batched ``generate``; responses are trimmed at (and keep) the first EOS.

    The HF engine is the (warm, cached) policy module itself: no engine to build, no options."""
    del policy_dir, options, on_engine
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    width = max(len(ids) for ids in prompts)
    padded = [[pad] * (width - len(ids)) + ids for ids in prompts]  # left-padded, one row per prompt
    masks = [[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts]
    input_ids = torch.tensor(padded, dtype=torch.long).repeat_interleave(spec.n, dim=0).to(model.device)
    mask = torch.tensor(masks, dtype=torch.long).repeat_interleave(spec.n, dim=0).to(model.device)
    torch.manual_seed(spec.seed)  # seeds the CPU and every CUDA device
    kwargs: dict[str, Any] = dict(max_new_tokens=spec.max_new_tokens, pad_token_id=pad, eos_token_id=eos)
    if spec.greedy:
        kwargs.update(do_sample=False)
    else:
        kwargs.update(do_sample=True, temperature=spec.temperature, top_p=spec.top_p, top_k=0)
    out = model.generate(input_ids=input_ids, attention_mask=mask, **kwargs)
    results = []
    for i, row in enumerate(out[:, width:].tolist()):
        ids, finished = _trim(row, eos)
        text = tokenizer.decode([t for t in ids if t != eos], skip_special_tokens=True)
        results.append(Generation(i // spec.n, i % spec.n, ids, text, finished))
    return results


@register_engine("vllm")
def generate_vllm(
    model: Any, tokenizer: Any, prompts: list[list[int]], spec: SamplingSpec, policy_dir: Path | None = None,
    options: "EngineOptions | None" = None, on_engine: Callable[[str], None] | None = None,
) -> list[Generation]:
    """vLLM generation from the policy folder, one seed per request (prompt)."""
    del model
    try:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
    except ImportError as err:
        raise ConfigError("rollout.engine 'vllm' needs the extra: pip install 'verl-tasks[vllm]' on a GPU node") from err
    if policy_dir is None:
        raise ConfigError("the vllm engine needs the policy folder on local disk")
    llm = _vllm_engine(str(policy_dir), options or EngineOptions(), on_engine)
    params = [
        SamplingParams(
            n=spec.n,
            temperature=0.0 if spec.greedy else spec.temperature,
            top_p=1.0 if spec.greedy else spec.top_p,
            max_tokens=spec.max_new_tokens,
            seed=spec.seed + i,
        )
        for i in range(len(prompts))
    ]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False)
    eos = tokenizer.eos_token_id
    results = []
    for i, output in enumerate(outputs):
        for j, completion in enumerate(output.outputs):
            ids, finished = _trim(list(completion.token_ids), eos)
            text = tokenizer.decode([t for t in ids if t != eos], skip_special_tokens=True)
            results.append(Generation(i, j, ids, text, finished))
    return results


@dataclass(frozen=True)
class EngineOptions:
    """Engine settings from the config (``rollout.*``, ``model.dtype``); only vLLM reads them."""

    gpu_memory_utilization: float = 0.5
    dtype: str = "float32"
    tensor_parallel_size: int = 1


def engine_options(config: Any) -> EngineOptions:
    """The engine settings of an experiment config."""
    return EngineOptions(config.rollout.gpu_memory_utilization, config.model.dtype,
                         config.rollout.tensor_parallel_size)


_VLLM: dict[str, Any] = {}  # one engine per process: {"engine", "key", "path"}


def drop_vllm_engine() -> None:
    """Forget the process's engine (its weights may be half reloaded); the next rollout builds one."""
    _VLLM.clear()


def _vllm_engine(path: str, options: EngineOptions, on_engine: Callable[[str], None] | None = None) -> Any:
    """The process's vLLM engine holding policy ``path``.

    Same folder: reused. Another folder of the same architecture and options: its weights
    are reloaded into the running engine (``collective_rpc``; no new engine, no new CUDA
    graphs); if that engine cannot reload in place, a new engine is built. ``on_engine``
    hears "built" or "reloaded". Not yet run on a GPU (no GPU was lent to this project).
    """
    from vllm import LLM

    key = (json.dumps(json.loads((Path(path) / "config.json").read_text()), sort_keys=True), options)
    current = _VLLM.get("engine")
    if current is not None and _VLLM["path"] == path:
        return current
    if current is not None and _VLLM["key"] == key:
        try:
            _VLLM["path"] = None  # until the reload completes: one interrupted half way is never reused
            current.collective_rpc("update_config", args=({"model_config": {"model": path}},))
            current.collective_rpc("reload_weights")
            _VLLM["path"] = path
            if on_engine:
                on_engine("reloaded")
            return current
        except Exception as err:  # noqa: BLE001 - an engine without in-place reload is rebuilt
            log.warning("vLLM engine could not reload weights in place (%s); building a new one", err)
    _VLLM.clear()
    sharded = options.tensor_parallel_size > 1  # its workers go into the pool actor's placement group
    engine = LLM(model=path, seed=0, enforce_eager=True, dtype=options.dtype,
                 gpu_memory_utilization=options.gpu_memory_utilization,
                 tensor_parallel_size=options.tensor_parallel_size,
                 distributed_executor_backend="ray" if sharded else None)
    _VLLM.update(engine=engine, key=key, path=path)
    if on_engine:
        on_engine("built")
    return engine
