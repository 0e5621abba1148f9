"""Policy weights and optimizer state as safetensors; nothing here ever unpickles.

A policy folder is what ``transformers.AutoModelForCausalLM.from_pretrained``
loads: ``config.json``, ``model.safetensors``, ``generation_config.json`` and
the tokenizer files. Optimizer state is keyed by parameter *name*: one file
(``optimizer.safetensors``) when one process held it all (ddp), or one file per
worker holding that worker's rows (fsdp2), and ``optimizer.json`` indexes the rows
each file holds, so a snapshot resumes on any number of workers and either strategy.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import safe_open

from verl_tasks.errors import IntegrityError
from verl_tasks.models.safetensors_io import Written, unique_state, write_tensors
from verl_tasks.store.conventions import OPTIMIZER, WEIGHTS

__all__ = ["WEIGHTS", "OPTIMIZER", "OPTIMIZER_INDEX", "refuse_pickles", "save_policy", "save_configs", "load_policy",
           "save_optimizer", "save_optimizer_shard", "optimizer_tensors", "save_policy_and_optimizer",
           "optimizer_index", "read_optimizer_index", "check_optimizer_index", "load_optimizer"]

OPTIMIZER_INDEX = "optimizer.json"
OPTIMIZER_FORMAT = "verl-tasks/optimizer-v1"

ALLOWED_SUFFIXES = (".safetensors", ".json", ".txt", ".model", ".jinja")
PICKLE_NAMES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def refuse_pickles(folder: Path) -> None:
    """Raise if a folder we are about to load holds pickled weights (or any unknown format)."""
    for path in Path(folder).iterdir():
        if path.name.endswith(PICKLE_NAMES):
            raise IntegrityError(
                str(folder), [f"{path.name} is a pickle-based file; verl-tasks loads safetensors and JSON only"]
            )


def save_configs(model: Any, tokenizer: Any, folder: Path) -> None:
    """Every file of an HF policy folder but the weights: ``config.json``, the generation config, the tokenizer's."""
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def save_policy(model: Any, tokenizer: Any, folder: Path) -> dict[str, Written]:
    """Write an HF-loadable folder: the config files, the tokenizer's and the weights (streamed and
    hashed in one pass, every tensor once, tied ones under their first name, as HF saves them).

    Returns ``{"model.safetensors": Written}``: the size and sha256 the commit lists, so nothing is read back.
    """
    save_configs(model, tokenizer, folder)
    return {WEIGHTS: write_tensors(folder / WEIGHTS, unique_state(model), {"format": "pt"})}


@contextmanager
def params_on_meta() -> Iterator[None]:
    """Create parameters on the meta device (no memory, no initialisation); buffers stay real (rotary
    tables are made at init)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":  # tied weights arrive on meta already
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]  # for this block only
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def load_policy(folder: Path, dtype: str = "float32", state: dict[str, torch.Tensor] | None = None
                ) -> tuple[torch.nn.Module, Any]:
    """The causal LM and tokenizer of an HF policy folder, in ``dtype``; the weights from ``state`` when
    given (tensors handed over in memory: the folder then needs no weights file), else the folder's."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    refuse_pickles(folder)
    if state is not None:
        with params_on_meta():  # no random initialisation of weights about to be replaced
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=getattr(torch, dtype))
        owned = {name: tensor.to(getattr(torch, dtype), copy=True) for name, tensor in state.items()}
        _missing, unexpected = model.load_state_dict(owned, strict=False, assign=True)
        model.tie_weights()  # a tied head is not in the state: it points at the embedding again
        empty = [name for name, param in model.named_parameters() if param.is_meta]
        if unexpected or empty:
            raise IntegrityError(str(folder), [f"handed-over weights do not fit the model: missing {empty[:3]}, "
                                               f"unexpected {unexpected[:3]}"])
    else:
        if not (folder / WEIGHTS).exists() and not any(folder.glob("model-*.safetensors")):
            raise IntegrityError(str(folder), [f"no {WEIGHTS} in the policy folder"])
        model = AutoModelForCausalLM.from_pretrained(folder, use_safetensors=True, dtype=getattr(torch, dtype))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model.eval()
    return model, tokenizer


def optimizer_shard_name(rank: int) -> str:
    """The file of one worker's slice of the optimizer state (fsdp2); the index says which rows it holds."""
    return f"optimizer.rank{rank:05d}.safetensors"


def local_rows(param: torch.Tensor) -> tuple[int, int]:
    """The rows (dim 0) of the full parameter this process holds: all of them unless it is an fsdp2 shard."""
    if not hasattr(param, "device_mesh"):
        return 0, param.shape[0]
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                          param.placements)  # type: ignore[attr-defined]
    return offset[0], offset[0] + shape[0]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def optimizer_tensors(optimizer: torch.optim.Optimizer, model: torch.nn.Module
                      ) -> tuple[list[tuple[str, torch.Tensor]], dict[str, list[int]]]:
    """This process's slice of every parameter's AdamW state as ``(name::field, tensor)`` in parameter
    order, and the rows it holds of each parameter.

    Rows are ``[start, stop, *full shape]``: the index (``optimizer_index``) needs no other
    record of how the model was sharded, so a reader with any worker count finds its rows.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    tensors: list[tuple[str, torch.Tensor]] = []
    rows: dict[str, list[int]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not state:
                continue
            name = names[id(param)]
            rows[name] = [*local_rows(param), *param.shape]
            for key, value in sorted(state.items()):
                tensor = _local(value) if torch.is_tensor(value) else torch.tensor(value)
                tensors.append((f"{name}::{key}", tensor.detach()))
    return tensors, rows


def save_optimizer_shard(optimizer: torch.optim.Optimizer, model: torch.nn.Module, path: Path
                         ) -> tuple[dict[str, list[int]], Written]:
    """Write this process's slice of the AdamW state (``name::field``), streamed and hashed in one pass;
    returns its rows per parameter and the file's size and sha256."""
    tensors, rows = optimizer_tensors(optimizer, model)
    return rows, write_tensors(path, tensors)


def optimizer_index(optimizer: torch.optim.Optimizer, shards: dict[str, dict[str, list[int]]]) -> dict[str, Any]:
    """The JSON index over the shard files: ``{file: {name: [start, stop, *shape]}}`` and the hyperparameters."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"format": OPTIMIZER_FORMAT, "shards": shards, "param_groups": json.loads(json.dumps(groups, default=list))}


def save_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module, folder: Path
                   ) -> tuple[dict[str, Any], dict[str, Written]]:
    """One process holding the whole state: ``optimizer.safetensors`` plus its index.

    Returns the hyperparameters and ``{"optimizer.safetensors": Written}``.
    """
    rows, written = save_optimizer_shard(optimizer, model, folder / OPTIMIZER)
    index = optimizer_index(optimizer, {OPTIMIZER: rows})
    (folder / OPTIMIZER_INDEX).write_text(json.dumps(index, sort_keys=True, indent=1))
    return {"param_groups": index["param_groups"]}, {OPTIMIZER: written}


def save_policy_and_optimizer(model: Any, tokenizer: Any, optimizer: torch.optim.Optimizer, folder: Path
                              ) -> tuple[dict[str, Any], dict[str, Written]]:
    """``save_policy`` and ``save_optimizer`` side by side in two threads (the weights and the AdamW state
    are separate files; hashing and writing release the GIL). Returns the hyperparameters and every
    streamed file's size and sha256."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2, thread_name_prefix="verl-tasks-save") as pool:
        weights = pool.submit(save_policy, model, tokenizer, folder)
        hyper, state = save_optimizer(optimizer, model, folder)
        return hyper, {**weights.result(), **state}


def read_optimizer_index(folder: Path) -> dict[str, Any] | None:
    """The index of the optimizer state in ``folder``; a state saved before indexes existed gets one made up.

    Returns None when the folder holds no optimizer state (a base snapshot: the optimizer starts fresh).
    """
    if (folder / OPTIMIZER_INDEX).is_file():
        index = json.loads((folder / OPTIMIZER_INDEX).read_text())
        if index.get("format") != OPTIMIZER_FORMAT:
            raise IntegrityError(str(folder), [f"{OPTIMIZER_INDEX}: unknown format {index.get('format')!r}"])
        return index
    if not (folder / OPTIMIZER).is_file():
        return None
    with safe_open(str(folder / OPTIMIZER), "pt") as f:
        rows = {}
        for key in f.keys():
            shape = f.get_slice(key).get_shape()
            if key.endswith("::exp_avg"):
                rows[key.rsplit("::", 1)[0]] = [0, shape[0], *shape]
    return {"format": OPTIMIZER_FORMAT, "shards": {OPTIMIZER: rows}}


def check_optimizer_index(index: dict[str, Any], files: set[str]) -> list[str]:
    """Problems with an index: a shard file missing, or a parameter whose rows are not covered exactly once."""
    problems = [f"{OPTIMIZER_INDEX} names {name}, which is not in the snapshot"
                for name in sorted(index["shards"]) if name not in files]
    covered: dict[str, list[list[int]]] = {}
    for rows in index["shards"].values():
        for name, entry in rows.items():
            covered.setdefault(name, []).append(entry)
    for name, entries in sorted(covered.items()):
        spans = sorted((e[0], e[1]) for e in entries if e[1] > e[0])
        full = entries[0][2] if len(entries[0]) > 2 else spans[-1][1]
        edges = [0] + [b for _, b in spans]
        if [a for a, _ in spans] != edges[:-1] or edges[-1] != full:
            problems.append(f"optimizer state of {name}: shards cover rows {spans}, not [0, {full}) exactly once")
    return problems


def load_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module, folder: Path) -> bool:
    """Restore the moments saved in ``folder`` (any worker count, either strategy) into a fresh optimizer.

    Each parameter gets the rows this process holds (``local_rows``), read from whichever
    shard files hold them; nothing else is read. Returns False when ``folder`` has no state.

    Raises:
        IntegrityError: the state names a parameter the model lacks, or misses rows of one.
    """
    index = read_optimizer_index(folder)
    if index is None:
        return False
    params = dict(model.named_parameters())
    unknown = sorted({n for rows in index["shards"].values() for n in rows} - set(params))
    if unknown:
        raise IntegrityError(str(folder), [f"optimizer state for unknown parameter {unknown[0]}"])
    files = {name: safe_open(str(folder / name), "pt") for name in index["shards"]}
    for name, param in params.items():
        state = _read_rows(files, index["shards"], name, *local_rows(param))
        if state:
            optimizer.state[param].update({k: _like(param, v) for k, v in state.items()})
    return True


def _read_rows(files: dict[str, Any], shards: dict[str, dict[str, list[int]]], name: str, start: int,
               stop: int) -> dict[str, torch.Tensor]:
    """Rows ``[start, stop)`` of each state field of ``name``, joined from the shards that hold them."""
    parts: dict[str, list[torch.Tensor]] = {}
    got = start
    for file, rows in sorted(shards.items(), key=lambda item: item[1].get(name, [0])[0]):
        if name not in rows:
            continue
        lo, hi = rows[name][0], rows[name][1]
        a, b = max(lo, got), min(hi, stop)
        handle = files[file]
        for key in (k for k in handle.keys() if k.startswith(f"{name}::")):
            field = key.rsplit("::", 1)[1]
            view = handle.get_slice(key)
            if not view.get_shape():  # a scalar (AdamW's step): the same in every shard
                parts.setdefault(field, [handle.get_tensor(key)])
            elif b > a:
                parts.setdefault(field, []).append(view[a - lo : b - lo])
        got = max(got, b)
    if parts and got < stop:
        raise IntegrityError(name, [f"optimizer state of {name} lacks rows [{got}, {stop})"])
    # Copies (cat, clone): safetensors' tensors live on the file's memory map, and one left in the state
    # would keep the whole file mapped, its pages read here counted in the process's memory as long.
    return {field: t[0].clone() if t[0].dim() == 0 else torch.cat(t) for field, t in parts.items()}


def _like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A state tensor placed as ``param`` is: a DTensor shard for fsdp2, a plain tensor otherwise; moments
    in the parameter's dtype (a state saved when weights were trained in another dtype, e.g. before
    ``model.train_dtype`` existed, resumes)."""
    if value.dim() == 0:
        return value.to(_local(param).device)
    value = value.to(_local(param).device, dtype=param.dtype)
    if not hasattr(param, "device_mesh"):
        return value
    from torch.distributed.tensor import DTensor

    sharded = cast(DTensor, param)
    return DTensor.from_local(value, sharded.device_mesh, sharded.placements, shape=param.shape, stride=param.stride())
