"""LoRA (``model.lora``): the update trains and commits the adapter only, snapshots name their base, the KL
reference is the base with the adapter off, rollout and evaluation load the adapter merged into the base, and
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


def test_lora_with_a_distributed_update_is_refused_on_load(tmp_path):
    with pytest.raises(ConfigError, match="model.lora trains the adapter in one process"):
        load_config(TINY_YAML, small_overrides(**{"storage.uri": f"file://{tmp_path}/s", **LORA,
                                                  "resources": {"update": {"workers": 2}}}))


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
