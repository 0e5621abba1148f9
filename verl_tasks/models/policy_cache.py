"""Loaded policies kept warm in a worker process, keyed by the snapshot's weights sha256.

The store stays the truth: an entry is only ever built from a verified
snapshot folder, or adopted from an update whose weights were just committed
under that sha256. A unit of the same version reuses the entry; a new version
of the same architecture loads its weights into an evicted entry in place
(no model construction); anything else builds the model. The update takes its
model *out* of the cache before training it (or trains a copy, when this process
reads that version again), so a cached entry never holds weights other than its
key says. An adopted entry may carry the optimizer whose state was committed
beside those weights, named by that state's checksums, so the next update resumes
from it without reading the state back.
"""
from __future__ import annotations

import copy
import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from verl_tasks.models.checkpoint import WEIGHTS, load_policy, refuse_pickles

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PolicyKey:
    weights_sha256: str
    dtype: str
    device: str


@dataclass
class _Entry:
    model: torch.nn.Module
    tokenizer: Any
    architecture: str  # config.json, canonical: in-place reloads need the same one
    optimizer: WarmOptimizer | None = None


@dataclass(frozen=True)
class WarmOptimizer:
    """An optimizer over an entry's model, holding exactly the state committed as ``state_id``
    (:func:`verl_tasks.store.conventions.optimizer_state_id` of the update's record)."""

    state_id: str
    optimizer: torch.optim.Optimizer


def architecture_of(folder: Path) -> str:
    return json.dumps(json.loads((folder / "config.json").read_text()), sort_keys=True)


class PolicyCache:
    """An LRU of loaded policies (``capacity`` entries: the policy and a reference model fit).

    Thread-safe; ``loads`` counts how each miss was served ("built" or "in_place").
    """

    def __init__(self, capacity: int = 2):
        self.capacity = capacity
        self._entries: OrderedDict[PolicyKey, _Entry] = OrderedDict()
        self._lock = threading.RLock()  # take holds it around get
        self.loads = {"built": 0, "in_place": 0}

    def holds(self, key: PolicyKey) -> bool:
        with self._lock:
            return key in self._entries

    def get(self, key: PolicyKey, folder: Path, tensors: dict[str, torch.Tensor] | None = None
            ) -> tuple[torch.nn.Module, Any, str | None]:
        """The policy of ``key`` from ``folder`` (its weights from ``tensors`` when given: the committed
        weights handed over in memory); returns (model, tokenizer, how) with how None on a hit."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                return entry.model, entry.tokenizer, None
            entry, how = self._load(key, folder, tensors)
            self._entries[key] = entry
            self.loads[how] += 1
            return entry.model, entry.tokenizer, how

    def take(self, key: PolicyKey, folder: Path, keep: bool = False
             ) -> tuple[torch.nn.Module, Any, str | None, WarmOptimizer | None]:
        """Like ``get`` but the caller owns the model afterwards (it will change its weights);
        also hands over the entry's warm optimizer, if it has one.

        ``keep``: this process will read the version again (the base: its evaluation, the KL
        reference), so the entry stays and the caller gets a copy made in memory, not a second load.
        """
        with self._lock:
            model, tokenizer, how = self.get(key, folder)
            if keep:
                return copy.deepcopy(model), tokenizer, how, None
            entry = self._entries.pop(key)
        return model, tokenizer, how, entry.optimizer

    def adopt(self, key: PolicyKey, model: torch.nn.Module, tokenizer: Any, folder: Path,
              optimizer: WarmOptimizer | None = None) -> None:
        """Keep a model whose weights (and ``optimizer``'s state) were just committed under ``key``."""
        model.eval()
        for param in model.parameters():
            param.grad = None
        with self._lock:
            self._entries[key] = _Entry(model, tokenizer, architecture_of(folder), optimizer)
            self._entries.move_to_end(key)
            self._trim(keep=self.capacity)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def _trim(self, keep: int) -> list[tuple[PolicyKey, _Entry]]:
        evicted = []
        while len(self._entries) > keep:
            evicted.append(self._entries.popitem(last=False))
        return evicted

    def _load(self, key: PolicyKey, folder: Path, tensors: dict[str, torch.Tensor] | None) -> tuple[_Entry, str]:
        architecture = architecture_of(folder)
        evicted = self._trim(keep=self.capacity - 1)
        for old_key, old in evicted:
            if old.architecture == architecture and (old_key.dtype, old_key.device) == (key.dtype, key.device):
                refuse_pickles(folder)
                from safetensors.torch import load_file

                state = tensors if tensors is not None else load_file(str(folder / WEIGHTS), device=key.device)
                missing, unexpected = old.model.load_state_dict(state, strict=False)
                # Tied weights (lm_head = embeddings) are absent from the file by design.
                if not unexpected and all(name in _tied_names(old.model) for name in missing):
                    old.model.eval()
                    old.optimizer = None  # its state belonged to the old weights
                    return old, "in_place"
        model, tokenizer = load_policy(folder, key.dtype, tensors)
        model.to(key.device)
        return _Entry(model, tokenizer, architecture), "built"


def _tied_names(model: torch.nn.Module) -> set[str]:
    """Parameter names that share storage with another parameter (tied embeddings)."""
    seen: dict[int, str] = {}
    tied = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        pointer = tensor.data_ptr()
        if pointer in seen:
            tied.add(name)
            tied.add(seen[pointer])
        seen[pointer] = name
    return tied


POLICIES = PolicyCache()

__all__ = ["PolicyCache", "PolicyKey", "POLICIES", "WarmOptimizer", "architecture_of"]
