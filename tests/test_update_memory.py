"""The update's memory scales with the model, not the batch; float32 master weights with bfloat16 compute.

Micro-batches accumulate exactly the whole minibatch's gradient (any split over workers and
micro-batches, every loss aggregation mode); log-probs and entropies come from the LM head in
chunks, equal to a full-logits computation, and the update never makes ``[B, L, V]`` logits;
the trained weights and AdamW state stay in ``model.train_dtype`` while the forward computes in
``model.dtype``; GPU workers get a process group that runs CPU and CUDA collectives.
"""
from __future__ import annotations

import copy
import math
import shutil

import pytest
import torch
from safetensors import safe_open

from verl_tasks.algos.core import LOSS_AGG_MODES
from verl_tasks.config import AlgorithmConfig, ModelConfig
from verl_tasks.errors import ConfigError
from verl_tasks.models.checkpoint import OPTIMIZER, WEIGHTS
from verl_tasks.phases.update_steps import (
    UpdateInputs,
    accumulate,
    accumulate_gradients,
    collate,
    epoch_inputs,
    policy_module,
    train_steps,
)
from verl_tasks.runner import epoch_units, make_context, run_phase
from verl_tasks.store.units import read_marker
from verl_tasks.train import logprobs
from verl_tasks.train.logprobs import ResponseLogProbs
from verl_tasks.train.sharding import process_group_backend

VOCAB = 40


def _model(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=False, pad_token_id=0))


def _samples(count: int = 7, seed: int = 0) -> list[dict]:
    """Prompts and responses of different lengths (one response empty), two samples per prompt."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        prompt = torch.randint(1, VOCAB, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
        response = torch.randint(1, VOCAB, (0 if i == 3 else int(torch.randint(1, 6, (1,), generator=g)),),
                                 generator=g).tolist()
        out.append({"prompt_ids": prompt, "response_ids": response, "prompt_id": f"p{i // 2}",
                    "score": float(torch.rand(1, generator=g))})
    return out


def _inputs(model: torch.nn.Module, seed: int = 0) -> UpdateInputs:
    """An epoch's inputs with old and reference log-probs that differ from the policy's (ratios != 1)."""
    inputs = epoch_inputs(_samples(seed=seed), 0, AlgorithmConfig(), max_new_tokens=16)
    with torch.no_grad():
        logp = ResponseLogProbs(model)(**inputs.data, temperature=1.0)[0]
    g = torch.Generator().manual_seed(seed + 1)
    inputs.old_logp = logp + 0.1 * torch.randn(logp.shape, generator=g)
    inputs.ref_logp = logp + 0.3 * torch.randn(logp.shape, generator=g)
    return inputs


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_on_any_worker_split_accumulate_the_whole_minibatch_gradient(mode):
    model = _model()
    inputs = _inputs(model)
    algo = AlgorithmConfig(loss_agg_mode=mode, kl_type="low_var_kl", kl_coef=0.1, entropy_coef=0.01,
                           minibatch_size=len(inputs))
    module = ResponseLogProbs(model)
    rows = torch.tensor([5, 0, 3, 6, 2, 1, 4])
    seen: list[int] = []
    model.model.register_forward_hook(lambda _m, args, kwargs, _out: seen.append(kwargs["input_ids"].size(0)),
                                      with_kwargs=True)
    whole_metrics = accumulate_gradients(module, inputs, rows, algo, 0.7, None)
    whole = _grads(model)
    assert seen == [7] and sum(g.norm() for g in whole.values()) > 0
    for size, world in [(2, 1), (3, 1), (1, 1), (2, 2), (2, 3), (5, 3)]:
        model.zero_grad(set_to_none=True)
        seen.clear()
        metrics: dict[str, float] = {}
        for rank in range(world):  # the workers' gradients, summed here, are averaged by DDP/FSDP2
            accumulate(metrics, accumulate_gradients(module, inputs, rows, algo, 0.7, size, rank, world))
        assert max(seen) <= size and len(seen) == world * math.ceil(math.ceil(len(rows) / world) / size)
        for name, grad in _grads(model).items():
            torch.testing.assert_close(grad / world, whole[name], rtol=1e-5, atol=1e-7, msg=f"{size}x{world} {name}")
        assert metrics.keys() == whole_metrics.keys()
        for key, value in whole_metrics.items():
            assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (size, world, key)


def _full_logits_reference(model, batch, temperature):
    """The computation the update replaced: ``[B, L, V]`` logits, gathered at the response positions."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    index = batch["positions"].unsqueeze(-1).expand(-1, -1, logits.size(-1))
    log_probs = torch.log_softmax(torch.gather(logits, 1, index).float() / temperature, dim=-1)
    logp = log_probs.gather(-1, batch["response_ids"].unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    mask = batch["response_mask"]
    return logp * mask, entropy * mask


def test_chunked_logprobs_and_entropies_and_their_gradients_equal_full_logits(monkeypatch):
    monkeypatch.setattr(logprobs, "LOGITS_BUDGET", 3 * VOCAB)  # 3 tokens per chunk: many chunks
    model = _model()
    batch = collate(_samples(), 0)
    shapes: list[tuple[int, ...]] = []
    model.lm_head.register_forward_hook(lambda _m, _i, out: shapes.append(tuple(out.shape)))
    logp, entropy = ResponseLogProbs(model)(**batch, temperature=0.7, with_entropy=True)
    assert shapes and all(shape[0] <= 3 and len(shape) == 2 for shape in shapes), shapes
    assert len(shapes) == -(-int(batch["response_mask"].sum()) // 3)
    weights = torch.randn(logp.shape, generator=torch.Generator().manual_seed(3))
    (logp * weights + entropy).sum().backward()
    chunked = _grads(model)
    model.zero_grad(set_to_none=True)
    want_logp, want_entropy = _full_logits_reference(model, batch, 0.7)
    (want_logp * weights + want_entropy).sum().backward()
    torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-5, atol=1e-6)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(chunked[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert len(shapes) == 2 * -(-int(batch["response_mask"].sum()) // 3) + 1, "each chunk is recomputed in backward"


def test_models_that_change_logits_after_the_lm_head_are_refused_by_name():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    def gemma2(cap):
        torch.manual_seed(0)
        return Gemma2ForCausalLM(Gemma2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                              head_dim=8, final_logit_softcapping=cap))

    with pytest.raises(ConfigError, match=r"'gemma2' post-processes its logits .*final_logit_softcapping=30.0"):
        ResponseLogProbs(gemma2(30.0))
    model = gemma2(None)  # without the cap its logits are the LM head's: accepted, and exact
    batch = collate(_samples(), 0)
    with torch.no_grad():
        got = ResponseLogProbs(model)(**batch, temperature=1.0)[0]
        torch.testing.assert_close(got, _full_logits_reference(model, batch, 1.0)[0], rtol=1e-5, atol=1e-6)


def test_bf16_compute_over_fp32_master_weights_keeps_updates_a_bf16_copy_rounds_away():
    model = _model()
    inputs = _inputs(model)
    inputs.ref_logp = None  # no KL term
    before = copy.deepcopy(model)
    config = ModelConfig(dtype="bfloat16", train_dtype="float32")
    module = policy_module(model, config)
    computed: list[torch.dtype] = []
    model.lm_head.register_forward_hook(lambda _m, _i, out: computed.append(out.dtype))
    algo = AlgorithmConfig(lr=1e-5, minibatch_size=len(inputs))
    optimizer = torch.optim.AdamW(model.parameters(), lr=algo.lr)
    train_steps(module, optimizer, inputs, algo, 1.0, seed=0, on_step=lambda step: None)
    assert computed and set(computed) == {torch.bfloat16}, "the forward computes in model.dtype"
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {t.dtype for state in optimizer.state.values() for k, t in state.items() if k != "step"} == {torch.float32}

    bf16 = copy.deepcopy(before).bfloat16()  # the same step on weights held in bfloat16
    bf16_optimizer = torch.optim.AdamW(bf16.parameters(), lr=algo.lr)
    train_steps(ResponseLogProbs(bf16), bf16_optimizer, inputs, algo, 1.0, seed=0, on_step=lambda step: None)
    w0, w1, w_bf16 = before.lm_head.weight, model.lm_head.weight, bf16.lm_head.weight
    moved = w1 != w0
    below_bf16 = moved & (w1.bfloat16() == w0.bfloat16())  # moves smaller than bfloat16's spacing there
    print(f"fp32 master: {int(moved.sum())} of {w0.numel()} weights moved, {int(below_bf16.sum())} by less than "
          f"bf16 resolves; the bf16 copy kept {int((w_bf16 == w0.bfloat16())[below_bf16].sum())} of those unchanged")
    assert moved.float().mean() > 0.5 and below_bf16.float().mean() > 0.5
    kept = (w_bf16 == w0.bfloat16())[below_bf16].float().mean()
    assert kept > 0.9, "a bf16 copy rounds those updates away (all but where lr exceeds half of bf16's spacing)"


def test_gpu_workers_get_gloo_for_cpu_tensors_and_nccl_for_cuda_ones():
    from ray.train.torch.config import _is_backend_nccl
    from torch.distributed.distributed_c10d import Backend, BackendConfig

    gpu, cpu = process_group_backend(use_gpu=True), process_group_backend(use_gpu=False)
    assert (gpu, cpu) == ("cpu:gloo,cuda:nccl", "gloo")
    assert BackendConfig(Backend(gpu)).get_device_backend_map() == {"cpu": "gloo", "cuda": "nccl"}
    assert _is_backend_nccl(gpu) and not _is_backend_nccl(cpu)  # Ray then sets NCCL's async error handling


def test_micro_batch_size_and_train_dtype_config():
    from verl_tasks.config import ExperimentConfig

    base = ExperimentConfig(experiment="e")
    with pytest.raises(ValueError, match="model.train_dtype bfloat16"):
        ExperimentConfig(experiment="e", model={"dtype": "float32", "train_dtype": "bfloat16"})
    with pytest.raises(ValueError, match="so is micro_batch_size"):
        ExperimentConfig(experiment="e", resources={"rollout": {"micro_batch_size": 4}})
    micro = ExperimentConfig(experiment="e", resources={"update": {"micro_batch_size": 4}})
    assert micro.config_hash() == base.config_hash()  # resources are not hashed: lower it and resume
    assert "train_dtype" not in base.hashed_view()["model"]  # experiments pinned before the key still resume
    bf16 = ExperimentConfig(experiment="e", model={"dtype": "bfloat16", "train_dtype": "bfloat16"})
    assert bf16.hashed_view()["model"]["train_dtype"] == "bfloat16"


def _through_validate(ctx, epoch: int = 0) -> None:
    for phase, batch in epoch_units(ctx, epoch, ctx.config.epochs):
        if phase == "update":
            return
        if phase != "evaluate":
            run_phase(ctx, phase, epoch, batch)


def _dtypes(path) -> set[str]:
    with safe_open(str(path), "pt") as f:
        return {str(f.get_slice(name).get_dtype()) for name in f.keys() if not name.endswith("::step")}


def test_the_update_phase_trains_fp32_master_weights_with_bf16_compute_without_vocabulary_sized_batches(
        tiny_config, tmp_path):
    """The one-process update, micro-batched, with ``model.dtype: bfloat16`` over float32 weights: no module
    returns ``[B, L, V]`` logits, the committed weights and AdamW state are float32, the trained model is kept
    warm under its float32 key, and a retry commits the same bytes."""
    from verl_tasks.models.policy_cache import POLICIES, PolicyKey

    extra = {"model.dtype": "bfloat16", "resources.update.micro_batch_size": 6, "algorithm.kl_type": "low_var_kl",
             "algorithm.kl_coef": 0.01, "model.tiny.warm_start_steps": 20, "epochs": 1}
    ctx = make_context(tiny_config(f"file://{tmp_path}/a", **extra))
    _through_validate(ctx)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    vocab = len(__import__("verl_tasks.models.tiny", fromlist=["build_tokenizer"]).build_tokenizer())
    shapes: list[tuple[int, ...]] = []

    def vocabulary_outputs(_module, _args, out):
        if torch.is_tensor(out) and out.size(-1) == vocab:
            shapes.append(tuple(out.shape))

    POLICIES.clear()
    hook = torch.nn.modules.module.register_module_forward_hook(vocabulary_outputs)
    try:
        run_phase(ctx, "update", 0)
    finally:
        hook.remove()
    assert shapes, "the LM head never ran"
    assert all(len(shape) == 2 and shape[0] * shape[1] <= logprobs.LOGITS_BUDGET for shape in shapes), set(shapes)
    micro_tokens = 6 * ctx.config.rollout.max_new_tokens
    assert max(shape[0] for shape in shapes) <= micro_tokens  # a micro-batch's response tokens at most

    record = read_marker(ctx.store, ctx.layout.update(0))
    assert _dtypes(ctx.store.root / record.key(WEIGHTS)) == {"F32"}
    assert _dtypes(ctx.store.root / record.key(OPTIMIZER)) == {"F32"}
    kept = PolicyKey(record.files[WEIGHTS].sha256, "float32", "cpu")  # the next update takes it
    model, _tokenizer, loaded = POLICIES.get(kept, ctx.store.root / record.unit / ".attempts" / record.attempt)
    assert loaded is None and {p.dtype for p in model.parameters()} == {torch.float32}, "kept warm, in float32"

    retry = make_context(tiny_config(f"file://{tmp_path}/b", **extra))
    run_phase(retry, "update", 0)
    again = read_marker(retry.store, retry.layout.update(0))
    assert {n: again.files[n].sha256 for n in (WEIGHTS, OPTIMIZER)} == {n: record.files[n].sha256
                                                                        for n in (WEIGHTS, OPTIMIZER)}


def test_optimizer_state_read_back_keeps_nothing_on_the_files_memory_map(tmp_path):
    """safetensors hands out tensors on the file's memory map: one kept in the state (AdamW's ``step``)
    would keep the whole file mapped, and every page read counted in the process's memory, for the
    whole update (1 GiB for SmolLM2's state)."""
    from verl_tasks.models.checkpoint import load_optimizer, save_optimizer

    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    model(input_ids=torch.ones(1, 3, dtype=torch.long)).logits.sum().backward()
    optimizer.step()
    save_optimizer(optimizer, model, tmp_path)
    resumed = torch.optim.AdamW(model.parameters())
    assert load_optimizer(resumed, model, tmp_path)
    with open("/proc/self/maps") as maps:
        assert str(tmp_path / OPTIMIZER) not in maps.read()
    for param in model.parameters():
        assert torch.equal(resumed.state[param]["exp_avg"], optimizer.state[param]["exp_avg"])
        assert resumed.state[param]["step"] == optimizer.state[param]["step"]
