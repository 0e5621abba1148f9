"""LoRA adapters through PEFT: wrap the base, read and write an adapter, merge one into a full policy folder.

An adapter folder is PEFT's (``adapter_config.json`` + ``adapter_model.safetensors``, tensors named as
``get_peft_model_state_dict`` names them), plus the base's configs and tokenizer, so ``PeftModel`` or
vLLM's LoRA loader read it beside the base snapshot. Only safetensors and JSON are read.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from verl_tasks.errors import IntegrityError
from verl_tasks.models.checkpoint import load_policy, refuse_pickles, save_configs, save_policy
from verl_tasks.models.safetensors_io import Written, write_tensors
from verl_tasks.store.conventions import ADAPTER, ADAPTER_CONFIG, BASE_JSON


def peft_config(lora: Any) -> Any:
    """PEFT's LoraConfig for ``model.lora`` (rank, alpha, target modules, dropout); a causal LM's task."""
    from peft import LoraConfig, TaskType

    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=lora.target_modules, task_type=TaskType.CAUSAL_LM)


def with_adapter(base: torch.nn.Module, lora: Any, seed: int, adapter: Path | None = None) -> Any:
    """``base`` wrapped in a trainable LoRA adapter: PEFT's initialisation (A drawn from ``seed``, B zero: the
    wrapped model computes what the base does) or the adapter saved in folder ``adapter``."""
    from peft import get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = get_peft_model(base, peft_config(lora))
    finally:
        torch.random.set_rng_state(generator_state)
    if adapter is not None:
        refuse_pickles(adapter)
        state = load_file(str(adapter / ADAPTER), device=str(next(base.parameters()).device))
        result = set_peft_model_state_dict(model, state)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise IntegrityError(str(adapter), [f"adapter tensors the model lacks: {unexpected[:3]}"])
    return model


def save_adapter(model: Any, tokenizer: Any, folder: Path, base_sha256: str) -> dict[str, Written]:
    """Write the adapter folder: PEFT's config, the adapter's tensors, the base's configs and tokenizer, and
    ``base.json`` naming the base weights' sha256. Returns the adapter file's size and sha256."""
    import json

    from peft import get_peft_model_state_dict

    save_configs(model.get_base_model(), tokenizer, folder)
    model.peft_config["default"].save_pretrained(folder)
    state = sorted(get_peft_model_state_dict(model).items())
    (folder / BASE_JSON).write_text(json.dumps({"base_weights_sha256": base_sha256}))
    return {ADAPTER: write_tensors(folder / ADAPTER, [(n, t.detach().contiguous()) for n, t in state],
                                   {"format": "pt"})}


def merge_into(base_folder: Path, adapter_folder: Path, out: Path, dtype: str = "float32") -> Path:
    """A full HF policy folder in ``out``: the base's weights with the adapter merged in (``W + alpha/r B A``)."""
    from peft import PeftModel

    refuse_pickles(adapter_folder)
    if not (adapter_folder / ADAPTER_CONFIG).is_file() or not (adapter_folder / ADAPTER).is_file():
        raise IntegrityError(str(adapter_folder), [f"an adapter folder needs {ADAPTER_CONFIG} and {ADAPTER}"])
    base, tokenizer = load_policy(base_folder, dtype)
    merged = PeftModel.from_pretrained(base, str(adapter_folder)).merge_and_unload()
    save_policy(merged, tokenizer, out)
    return out


__all__ = ["merge_into", "peft_config", "save_adapter", "with_adapter"]
