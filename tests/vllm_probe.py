"""One vLLM engine's life, run in its own process for tests/test_vllm_engine.py; prints what it saw as JSON.

vLLM stays out of the pytest process: importing it and building an engine change the host
process (threads, random state). Usage: ``python -m tests.vllm_probe SPEC.json``, where the
spec names the policy folders the test built and the prompts to sample.
"""
from __future__ import annotations

import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import psutil


def scored(llm, prompt: list[int], seed: int) -> dict:
    """Tokens and their log-probs of two samples (log-probs show stale KV where tokens may not)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=seed, logprobs=0, detokenize=False)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], [params], use_tqdm=False)[0].outputs
    return {"tokens": [list(o.token_ids) for o in out], "logprob": [o.cumulative_logprob for o in out]}


def alive(pids: list[int]) -> list[int]:
    return [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


def main(spec_path: str) -> None:
    from verl_tasks.models import vllm_engine
    from verl_tasks.models.checkpoint import load_policy
    from verl_tasks.models.engines import EngineOptions, Policy, SamplingSpec, get_engine, stop_token_ids
    from verl_tasks.models.vllm_engine import HELD, engine_for, engine_processes

    spec = json.loads(Path(spec_path).read_text())
    v0, v1, work = Path(spec["v0"]), Path(spec["v1"]), Path(spec["work"])
    long_prompt, short_prompt = spec["long_prompt"], spec["short_prompt"]
    options = EngineOptions(dtype="float32", max_model_len=256)
    heard: list[str] = []
    seen: dict = {}

    llm = engine_for(v0, options, heard.append)
    seen["first_processes"] = list(HELD.processes)
    seen["v0"] = scored(llm, long_prompt, 11)
    tokenizer = load_policy(v0)[1]
    sampling = SamplingSpec(n=4, temperature=1.0, top_p=1.0, max_new_tokens=8, seed=5)
    same_prompt_twice = get_engine("vllm")(Policy(tokenizer, v0), [short_prompt, short_prompt], sampling, options)
    seen["same_prompt_twice"] = [[g.prompt_index, g.sample_index, g.response_ids] for g in same_prompt_twice]

    llm = engine_for(v1, options, heard.append)  # v1 holds optimizer state beside its weights
    seen["v1_reloaded"] = scored(llm, long_prompt, 11)

    # A policy that declares a second EOS id: the token greedy decoding emits first.
    greedy = SamplingSpec(n=1, temperature=1.0, top_p=1.0, max_new_tokens=8, seed=0, greedy=True)
    first = get_engine("vllm")(Policy(tokenizer, v1), [short_prompt], greedy, options)[0].response_ids[0]
    two_eos = work / "two-eos"
    shutil.copytree(v1, two_eos)
    config = json.loads((v1 / "generation_config.json").read_text())
    (two_eos / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [tokenizer.eos_token_id,
                                                                                           first]}))
    seen["stop_ids"] = stop_token_ids(tokenizer, two_eos)
    seen["second_eos"] = first
    vllm_out = get_engine("vllm")(Policy(tokenizer, two_eos), [short_prompt], greedy, options)[0]
    model = load_policy(two_eos)[0]
    hf_out = get_engine("hf")(Policy(tokenizer, two_eos, model), [short_prompt], greedy, options)[0]
    seen["eos"] = {name: {"ids": g.response_ids, "finished": g.finished} for name, g in
                   (("vllm", vllm_out), ("hf", hf_out))}

    # Other options (a longer context): a new engine, and the old one's processes gone before it exists.
    before = list(HELD.processes)
    llm = engine_for(v1, replace(options, max_model_len=200), heard.append)
    seen["rebuild"] = {"old": before, "old_alive": alive(before), "new": list(HELD.processes),
                       "engine_processes": engine_processes()}
    seen["v1_fresh"] = scored(llm, long_prompt, 11)

    # Tied input and output embeddings (SmolLM2's shape): reloaded, then the same folder under other options.
    tied_v0, tied_v1 = Path(spec["tied_v0"]), Path(spec["tied_v1"])
    seen["tied_v0"] = scored(engine_for(tied_v0, options, heard.append), short_prompt, 7)
    seen["tied_reloaded"] = scored(engine_for(tied_v1, options, heard.append), short_prompt, 7)
    seen["tied_fresh"] = scored(engine_for(tied_v1, replace(options, max_model_len=200), heard.append),
                                short_prompt, 7)
    seen["counts"] = {"builds": HELD.builds, "reloads": HELD.reloads}
    last = list(HELD.processes)
    seen["shutdown"] = {"held": last, "stopped": vllm_engine.shutdown(), "alive_after": alive(last),
                        "engine_processes": engine_processes()}
    seen["heard"] = heard
    print("PROBE " + json.dumps(seen), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
