"""Policy weights and optimizer state as safetensors; nothing here ever unpickles.

A policy folder is what ``transformers.AutoModelForCausalLM.from_pretrained``
loads: ``config.json``, ``model.safetensors``, ``generation_config.json`` and
the tokenizer files. Optimizer state is keyed by parameter *name*, never by
rank or index, so a snapshot resumes on any number of workers.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from verl_tasks.errors import IntegrityError
from verl_tasks.store.conventions import OPTIMIZER, WEIGHTS

__all__ = ["WEIGHTS", "OPTIMIZER", "refuse_pickles", "save_policy", "load_policy", "save_optimizer", "load_optimizer"]

ALLOWED_SUFFIXES = (".safetensors", ".json", ".txt", ".model", ".jinja")
PICKLE_NAMES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def refuse_pickles(folder: Path) -> None:
    """Raise if a folder we are about to load holds pickled weights (or any unknown format)."""
    for path in Path(folder).iterdir():
        if path.name.endswith(PICKLE_NAMES):
            raise IntegrityError(
                str(folder), [f"{path.name} is a pickle-based file; verl-tasks loads safetensors and JSON only"]
            )


def save_policy(model: torch.nn.Module, tokenizer: Any, folder: Path) -> list[Path]:
    """Write an HF-loadable folder; returns the files written."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return sorted(p for p in folder.iterdir() if p.is_file())


def load_policy(folder: Path, dtype: str = "float32") -> tuple[torch.nn.Module, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    refuse_pickles(folder)
    if not (folder / WEIGHTS).exists() and not any(folder.glob("model-*.safetensors")):
        raise IntegrityError(str(folder), [f"no {WEIGHTS} in the policy folder"])
    model = AutoModelForCausalLM.from_pretrained(folder, use_safetensors=True, dtype=getattr(torch, dtype))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model.eval()
    return model, tokenizer


def save_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module, path: Path) -> dict[str, Any]:
    """Save AdamW moments by parameter name; returns the JSON-able hyperparameters."""
    names = {id(p): n for n, p in model.named_parameters()}
    tensors: dict[str, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not state:
                continue
            name = names[id(param)]
            for key, value in state.items():
                tensor = value if torch.is_tensor(value) else torch.tensor(value)
                tensors[f"{name}::{key}"] = tensor.detach().contiguous().cpu()
    save_file(tensors, str(path))
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"param_groups": json.loads(json.dumps(groups, default=list))}


def load_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module, path: Path) -> None:
    """Restore moments saved by ``save_optimizer`` into a fresh optimizer over ``model``."""
    tensors = load_file(str(path))
    params = dict(model.named_parameters())
    for key, tensor in tensors.items():
        name, field = key.rsplit("::", 1)
        if name not in params:
            raise IntegrityError(str(path), [f"optimizer state for unknown parameter {name}"])
        optimizer.state[params[name]][field] = tensor
