"""``make gpu-check``: the GPU paths, checked on a machine that has a CUDA device.

1. tokens/s of the vLLM and HF engines side by side, same policy, same prompts, same seeds;
2. the tiny experiment for two epochs with ``rollout.engine: vllm`` and ``model.device: cuda``
   (rollout on vLLM with an in-place weight reload between epochs, update and evaluation on the GPU),
   printing the engine and policy loads the state log recorded.

Prints one JSON object at the end; exits 2 at once when no CUDA device is visible.
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def tokens_per_second(engine: str, folder: Path, prompts: list[list[int]], tokenizer, model) -> float:
    from verl_tasks.models.engines import EngineOptions, SamplingSpec, get_engine

    spec = SamplingSpec(n=8, temperature=1.0, top_p=1.0, max_new_tokens=32, seed=1)
    run = get_engine(engine)
    run(model, tokenizer, prompts[:4], spec, policy_dir=folder, options=EngineOptions(0.3, "float32"))  # warm-up
    started = time.perf_counter()
    out = run(model, tokenizer, prompts, spec, policy_dir=folder, options=EngineOptions(0.3, "float32"))
    return sum(len(g.response_ids) for g in out) / (time.perf_counter() - started)


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu-check needs a CUDA device; none is visible here", file=sys.stderr)
        return 2
    from verl_tasks.config import load_config
    from verl_tasks.events import read_events
    from verl_tasks.models.checkpoint import load_policy
    from verl_tasks.phases.common import policy_folder
    from verl_tasks.runner import make_context, run_phase, train

    report: dict = {"device": torch.cuda.get_device_name(0)}
    with tempfile.TemporaryDirectory() as tmp:
        overrides = {"storage.uri": f"file://{tmp}/store", "epochs": 2, "rollout.engine": "vllm",
                     "model.device": "cuda", "evaluate.every": 1}
        ctx = make_context(load_config(ROOT / "dags" / "experiments" / "tiny_arith.yaml", overrides))
        run_phase(ctx, "plan", 0)
        folder, _ = policy_folder(ctx, 0)
        model, tokenizer = load_policy(folder)
        model.to("cuda")
        prompts = [tokenizer(f"{a}+{b}=", add_special_tokens=False)["input_ids"] for a in range(16) for b in range(16)]
        report["hf_tokens_per_s"] = round(tokens_per_second("hf", folder, prompts, tokenizer, model), 1)
        report["vllm_tokens_per_s"] = round(tokens_per_second("vllm", folder, prompts, tokenizer, model), 1)
        started = time.perf_counter()
        status = train(ctx, 2)
        report["two_epochs_s"] = round(time.perf_counter() - started, 1)
        report["eval_accuracy"] = [e["metrics"].get("eval_accuracy") for e in status["epochs"]]
        events = read_events(ctx.store, ctx.layout)
        report["engine_loads"] = [e.get("how") for e in events if e["kind"] == "engine_loaded"]
        report["policy_loads"] = [(e.get("version"), e.get("how"), e.get("device")) for e in events
                                  if e["kind"] == "policy_loaded"]
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
