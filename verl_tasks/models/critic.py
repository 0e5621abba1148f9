"""PPO's value model: a pretrained decoder with a scalar head, saved as safetensors and JSON only.

A critic folder holds ``config.json`` (the causal LM's config, whose decoder it keeps),
``model.safetensors`` (``decoder.*`` and ``head.*``) and, once trained, the optimizer state in
the policy's format (``optimizer.safetensors`` + ``optimizer.json``, keyed by parameter name).
In a unit or a snapshot the same files carry the ``critic.`` prefix (``critic.model.safetensors``
...), so the snapshot stays a policy folder that HF and vLLM load as before; :func:`stored_name`
and :func:`local_name` translate.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from verl_tasks.errors import IntegrityError
from verl_tasks.models.checkpoint import (
    OPTIMIZER,
    OPTIMIZER_INDEX,
    WEIGHTS,
    params_on_meta,
    refuse_pickles,
    save_optimizer,
)
from verl_tasks.models.safetensors_io import Written, unique_state, write_tensors
from verl_tasks.store.conventions import CRITIC_PREFIX as PREFIX
from verl_tasks.store.conventions import is_critic_file

CONFIG = "config.json"
CRITIC_FILES = (CONFIG, WEIGHTS, OPTIMIZER, OPTIMIZER_INDEX)


def stored_name(local: str) -> str:
    """The unit's name of a critic folder's file: ``model.safetensors`` -> ``critic.model.safetensors``."""
    return PREFIX + local


def local_name(stored: str) -> str:
    return stored.removeprefix(PREFIX)


def _hidden_size(config: Any) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.hidden_size)


class ValueModel(torch.nn.Module):
    """``V(s_t)`` for every response token: the decoder's hidden state at the position whose logits predict
    the token (the state before it is emitted, as verl's critic reads ``values[:, -R-1:-1]``), through a
    linear head, in float32. ``autocast``: the decoder's compute dtype when narrower than its parameters'."""

    def __init__(self, decoder: torch.nn.Module, config: Any, autocast: torch.dtype | None = None):
        super().__init__()
        self.decoder = decoder
        self.head = torch.nn.Linear(_hidden_size(config), 1)
        self.autocast = autocast
        self.config = config  # the causal LM's, written as the folder's config.json

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor,
                response_mask: torch.Tensor) -> torch.Tensor:
        """Values ``[B, R]``, 0 where ``response_mask`` is 0."""
        device = input_ids.device.type
        with torch.autocast(device, dtype=self.autocast) if self.autocast is not None else torch.autocast(
                device, enabled=False):
            hidden = self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        picked = hidden.gather(1, positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))  # [B, R, D]
        values = torch.nn.functional.linear(picked.float(), self.head.weight.float(), self.head.bias.float())
        return values.squeeze(-1) * response_mask


def new_critic(lm: torch.nn.Module, seed: int, autocast: torch.dtype | None = None) -> ValueModel:
    """A value model on ``lm``'s decoder (its LM head dropped), the head drawn from ``seed`` as transformers
    initialises a classification head (normal, std ``initializer_range``; bias 0)."""
    config: Any = lm.config
    model = ValueModel(lm.get_decoder(), config, autocast)  # type: ignore[operator]
    generator = torch.Generator().manual_seed(seed)
    std = float(getattr(config, "initializer_range", 0.02))
    dtype = next(lm.parameters()).dtype
    with torch.no_grad():
        weight = torch.randn(model.head.weight.shape, generator=generator, dtype=torch.float32) * std
        model.head.weight.copy_(weight)
        model.head.bias.zero_()
    model.head.to(dtype)
    return model


def load_critic(folder: Path, dtype: str, autocast: torch.dtype | None = None) -> ValueModel:
    """The value model of a critic folder (``config.json`` + ``model.safetensors``), in ``dtype``."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    refuse_pickles(folder)
    if not (folder / WEIGHTS).is_file() or not (folder / CONFIG).is_file():
        raise IntegrityError(str(folder), [f"a critic folder needs {CONFIG} and {WEIGHTS}"])
    config = AutoConfig.from_pretrained(folder)
    with params_on_meta():
        lm = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
        model = ValueModel(lm.get_decoder(), config, autocast)
    state = {name: tensor.to(getattr(torch, dtype)) for name, tensor in load_file(str(folder / WEIGHTS)).items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    empty = [name for name, param in model.named_parameters() if param.is_meta]
    if unexpected or empty:
        raise IntegrityError(str(folder), [f"critic weights do not fit its config: missing {empty[:3]}, "
                                           f"unexpected {unexpected[:3]}"])
    return model


def save_critic(model: ValueModel, optimizer: torch.optim.Optimizer | None, folder: Path
                ) -> tuple[dict[str, Any], dict[str, Written]]:
    """Write a critic folder: config, weights and (when given) optimizer state. Returns the optimizer's
    hyperparameters and the streamed files' sizes and sha256 (by local name)."""
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    written = {WEIGHTS: write_tensors(folder / WEIGHTS, unique_state(model), {"format": "pt"})}
    hyper: dict[str, Any] = {}
    if optimizer is not None:
        hyper, state = save_optimizer(optimizer, model, folder)
        written.update(state)
    return hyper, written


__all__ = ["CONFIG", "CRITIC_FILES", "PREFIX", "ValueModel", "is_critic_file", "load_critic",
           "local_name", "new_critic", "save_critic", "stored_name"]
