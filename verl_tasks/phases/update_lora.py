"""The LoRA update's policy, shared by the one-process update and the resident worker group.

The trained policy is the base snapshot's weights (frozen, in ``model.train_dtype``) with the adapter of the
version the update starts from: PEFT's seeded initialisation when it starts from the base, else the committed
adapter and its AdamW state. Only the adapter and its optimizer state are written.
"""
from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from verl_tasks.models.checkpoint import (
    OPTIMIZER,
    OPTIMIZER_INDEX,
    WEIGHTS,
    load_optimizer,
    load_policy,
    save_optimizer,
)
from verl_tasks.models.lora import save_adapter, with_adapter
from verl_tasks.models.safetensors_io import Written
from verl_tasks.phases.common import PhaseContext, derive_seed, policy_folder
from verl_tasks.phases.update_inputs import PolicyState
from verl_tasks.store.conventions import ADAPTER, ADAPTER_CONFIG, check_adapter_base, is_adapter
from verl_tasks.store.units import download


def lora_policy(ctx: PhaseContext, start: PolicyState, device: torch.device
                ) -> tuple[Any, torch.optim.Optimizer, Any, str]:
    """(the PEFT model on ``device``, AdamW over the adapter's parameters, the tokenizer, the base weights'
    sha256) for training policy ``start``.

    Raises:
        ConfigError: ``start``'s adapter was trained on other base weights than snapshot 0 holds.
    """
    cfg, algo = ctx.config, ctx.config.algorithm
    assert cfg.model.lora is not None
    base_folder, base_record = policy_folder(ctx, 0)
    base, tokenizer = load_policy(base_folder, cfg.model.train_dtype)
    base.to(device)
    with tempfile.TemporaryDirectory() as tmp:
        adapter = None
        if is_adapter(start.record):
            check_adapter_base(ctx.store, start.record, base_record)
            adapter = Path(tmp)
            for name in sorted(n for n in start.record.files
                               if n in (ADAPTER, ADAPTER_CONFIG, OPTIMIZER, OPTIMIZER_INDEX)):
                download(ctx.store, start.record, name, adapter / name)
        model = with_adapter(base, cfg.model.lora, derive_seed(cfg.seed, 0, "lora_init"), adapter)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=algo.lr,
                                      betas=algo.betas, weight_decay=algo.weight_decay)
        if adapter is not None:
            load_optimizer(optimizer, model, adapter)
    return model, optimizer, tokenizer, base_record.files[WEIGHTS].sha256


def write_lora(model: Any, tokenizer: Any, optimizer: torch.optim.Optimizer, out: Path, base_sha256: str
               ) -> tuple[dict[str, Any], dict[str, Written]]:
    """Write the adapter folder and the adapter's AdamW state into ``out``; returns the optimizer's
    hyperparameters and each streamed file's size and sha256."""
    written = save_adapter(model, tokenizer, out, base_sha256)
    hyper, state = save_optimizer(optimizer, model, out)
    return hyper, {**written, **state}


@contextmanager
def seeded_dropout(device: torch.device, seed: int) -> Iterator[None]:
    """LoRA's dropout draws from the global generators: seeded per epoch (and worker), so a retry draws the
    same masks; the generators' state outside is left as it was."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


__all__ = ["lora_policy", "seeded_dropout", "write_lora"]
