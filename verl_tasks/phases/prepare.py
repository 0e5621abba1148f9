"""Pin an experiment: its config (hash), its prompt data and its base policy (snapshot 0).

Runs before the first plan, and is a no-op afterwards. A different config under
the same experiment name is refused here, before any compute.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from verl_tasks import data as data_mod
from verl_tasks.errors import DataError, PhaseFailed
from verl_tasks.execution.lineage import seed_base_from
from verl_tasks.local_cache import CACHE_DIR
from verl_tasks.models.checkpoint import save_policy
from verl_tasks.phases.common import PhaseContext, committed, run_unit, set_determinism
from verl_tasks.pinning import pin_experiment
from verl_tasks.store.units import CommitRecord, UnitWriter, committed_record, is_committed, read_jsonl

log = logging.getLogger(__name__)


def _tokenizer_for(ctx: PhaseContext):
    model_cfg = ctx.config.model
    if model_cfg.source == "tiny":
        from verl_tasks.models.tiny import build_tokenizer

        return build_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_cfg.name_or_path, trust_remote_code=model_cfg.trust_remote_code)


def prepare_data(ctx: PhaseContext, split: str) -> CommitRecord:
    """Normalise and pin one split; prompts over the token limit fail here, before any compute."""
    cfg = ctx.config
    source = cfg.data.train if split == "train" else cfg.data.eval
    size = cfg.data.train_size if split == "train" else cfg.data.eval_size

    def produce(writer: UnitWriter) -> dict[str, Any]:
        try:
            rows = data_mod.load_rows(source, split, cfg.seed, size)
        except DataError as err:  # name the phase that read the file: the task that failed is plan's
            raise DataError(f"prepare, reading data.{split}: {err}") from None
        tokenizer = _tokenizer_for(ctx)
        too_long = []
        for row in rows:
            text = data_mod.prompt_text(row["prompt"], tokenizer)
            row["prompt_tokens"] = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            if row["prompt_tokens"] > cfg.data.max_prompt_tokens:
                too_long.append(f"{row['id']} ({row['prompt_tokens']} tokens)")
        if too_long:
            shown = ", ".join(too_long[:5]) + (f" and {len(too_long) - 5} more" if len(too_long) > 5 else "")
            raise DataError(
                f"data.{split}: {len(too_long)} prompt(s) exceed data.max_prompt_tokens="
                f"{cfg.data.max_prompt_tokens}: {shown}; raise the limit or drop those prompts"
            )
        if split == "train" and len(rows) < cfg.prompts_per_epoch:
            raise DataError(
                f"data.train has {len(rows)} prompts but an epoch needs {cfg.prompts_per_epoch} "
                f"(rollout.batches_per_epoch x rollout.prompts_per_batch); lower those or add data"
            )
        writer.write_jsonl("prompts.jsonl", rows)
        return {"rows": len(rows), "source": source}

    return run_unit(ctx, "prepare", ctx.layout.data(split), 0, produce)


def _base_folder(ctx: PhaseContext, work: Path) -> tuple[Path, dict[str, Any]]:
    """Build (tiny) or fetch (HF) the base policy into ``work``; the tiny warm start is cached locally."""
    cfg = ctx.config
    if cfg.model.source == "hf":
        import torch
        from transformers import AutoModelForCausalLM

        # In the dtype the update trains (the snapshots'), not the checkpoint's own.
        name = cfg.model.name_or_path
        assert name is not None  # the config requires it for source hf
        model = AutoModelForCausalLM.from_pretrained(
            name, use_safetensors=True, trust_remote_code=cfg.model.trust_remote_code,
            dtype=getattr(torch, cfg.model.train_dtype),
        )
        save_policy(model, _tokenizer_for(ctx), work)
        return work, {"source": "hf", "name_or_path": cfg.model.name_or_path}
    from verl_tasks.models import tiny as tiny_mod
    from verl_tasks.models.tiny import build_tokenizer, warm_start

    # The code that builds the warm start (the model and the arithmetic it is warmed on) is part of the key: a
    # cache made by another version of it is not the model this version would build.
    builder = hashlib.sha256(b"".join(Path(str(m.__file__)).read_bytes() for m in (tiny_mod, data_mod))).hexdigest()
    key = json.dumps({"tiny": cfg.model.tiny.model_dump(), "seed": cfg.seed, "threads": cfg.torch_threads,
                      "builder": builder}, sort_keys=True)
    cache = CACHE_DIR / "warm-start" / hashlib.sha256(key.encode()).hexdigest()[:20]
    with _building(cache):  # units on one node that need the same warm start build it once: the rest wait
        if (cache / "info.json").exists():
            return cache, json.loads((cache / "info.json").read_text())
        tiny, info = warm_start(cfg.model.tiny, cfg.seed, build_tokenizer())
        save_policy(tiny, build_tokenizer(), work)
        info = {"source": "tiny", **info}
        _keep(work, info, cache)
    return work, info


@contextlib.contextmanager
def _building(cache: Path) -> Iterator[None]:
    """Hold ``cache``'s lock file while the block runs (no lock where the cache cannot be written)."""
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(cache.parent / f"{cache.name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as err:
        log.info("warm-start cache not locked: %s", err)
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _keep(work: Path, info: dict[str, Any], cache: Path) -> None:
    """Copy the built warm start into ``cache`` (all or nothing: a folder renamed into place)."""
    tmp: Path | None = None
    try:
        tmp = Path(tempfile.mkdtemp(dir=cache.parent))
        for path in work.iterdir():
            (tmp / path.name).write_bytes(path.read_bytes())
        (tmp / "info.json").write_text(json.dumps(info))
        tmp.rename(cache)
    except OSError as err:  # a cache we cannot write only costs time
        log.info("warm-start cache not written: %s", err)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def base_snapshot(ctx: PhaseContext, parent: dict[str, Any] | None = None) -> CommitRecord:
    """Snapshot 0: the policy every RL epoch starts from.

    A forked experiment's (``parent``: its pin's origin) is re-seeded from that parent snapshot,
    never built from ``model``: that would silently change its base and KL reference.
    """
    if parent:
        seed_base_from(ctx.store, ctx.config.experiment, parent["experiment"], parent["version"], ctx.config.seed)
        return committed_record(ctx.store, ctx.layout.snapshot(0))

    def produce(writer: UnitWriter) -> dict[str, Any]:
        set_determinism(ctx.config)
        with tempfile.TemporaryDirectory() as tmp:
            folder, info = _base_folder(ctx, Path(tmp))
            for path in sorted(folder.iterdir()):
                if path.is_file() and path.name != "info.json":
                    writer.write_file(path.name, path)
            if ctx.config.critic is not None:  # PPO: critic version 0 is pinned with the policy it starts beside
                from verl_tasks.phases.critic import initial_critic
                from verl_tasks.store.conventions import CRITIC_PREFIX

                for path in initial_critic(ctx, folder, Path(tmp) / "critic"):
                    writer.write_file(CRITIC_PREFIX + path.name, path)
            writer.write_json("trainer_state.json", {"version": 0, "step": 0, "epoch": None, "seed": ctx.config.seed})
        return {"version": 0, **info}

    return run_unit(ctx, "prepare", ctx.layout.snapshot(0), 0, produce)


def prepare(ctx: PhaseContext) -> CommitRecord:
    """Idempotent; the fast path (all pinned) costs three small reads."""
    pin = pin_experiment(ctx)
    base = committed(ctx, ctx.layout.snapshot(0))
    if base is not None and all(is_committed(ctx.store, ctx.layout.data(s)) for s in ("train", "eval")):
        return base
    prepare_data(ctx, "train")
    prepare_data(ctx, "eval")
    record = base_snapshot(ctx, pin.get("parent"))
    _point_latest(ctx, 0, record)
    return record


def _point_latest(ctx: PhaseContext, version: int, record: CommitRecord) -> None:
    from verl_tasks.store.conventions import write_latest

    if committed(ctx, ctx.layout.snapshot(version)) is not None and not ctx.store.exists(ctx.layout.latest):
        write_latest(ctx.store, ctx.layout, version, record)


def _pinned_rows(ctx: PhaseContext, split: str) -> list[dict[str, Any]]:
    unit = ctx.layout.data(split)
    record = committed(ctx, unit)
    if record is None:
        raise PhaseFailed(
            unit, f"the pinned {split} prompts are not committed (never pinned, or quarantined: see "
                  f"`verl-tasks status`); run the epoch-0 plan task (or `verl-tasks run`) to pin data.{split} again",
        )
    return read_jsonl(ctx.store, record, "prompts.jsonl")  # verified on every read, parsed once per process


def train_rows(ctx: PhaseContext) -> list[dict[str, Any]]:
    return _pinned_rows(ctx, "train")


def eval_rows(ctx: PhaseContext) -> list[dict[str, Any]]:
    return _pinned_rows(ctx, "eval")


__all__ = ["prepare", "pin_experiment", "train_rows", "eval_rows"]
