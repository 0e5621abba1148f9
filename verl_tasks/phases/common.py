"""What every phase shares: the context, the commit-or-skip wrapper, seeds and policy loading.

A phase is ``fn(ctx, epoch, batch=None) -> CommitRecord``: deterministic, and a
no-op returning the existing record when its unit is already committed.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from verl_tasks import hooks as process_hooks
from verl_tasks.config import ExperimentConfig
from verl_tasks.errors import IntegrityError, PhaseFailed, SafeMode
from verl_tasks.events import record_event
from verl_tasks.layout import Layout
from verl_tasks.local_cache import CACHE_DIR
from verl_tasks.models import handover
from verl_tasks.models.checkpoint import WEIGHTS, refuse_pickles
from verl_tasks.models.device import resolve_device
from verl_tasks.models.engines import Policy, vllm_applies_adapters
from verl_tasks.models.policy_cache import POLICIES, PolicyKey, WarmOptimizer
from verl_tasks.ops.safe_mode import halted_message, read_safe_mode
from verl_tasks.phases.fallback import fall_back
from verl_tasks.pinning import check_pinned
from verl_tasks.store import LocalStore, ObjectStore
from verl_tasks.store.conventions import (
    ADAPTER,
    check_adapter_base,
    check_not_pruned,
    is_adapter,
    is_critic_file,
    is_optimizer_state,
    optimizer_state_id,
    weights_file,
    weights_sha256,
)
from verl_tasks.store.units import (
    CommitRecord,
    ConfigPin,
    UnitWriter,
    check_not_fenced,
    download,
    quarantine,
    read_marker,
)
from verl_tasks.tracking import track_commit

log = logging.getLogger(__name__)

@dataclass
class PhaseContext:
    config: ExperimentConfig
    store: ObjectStore
    layout: Layout = field(init=False)
    # The attempt id a dispatcher chose (so it can fence it on cancel); None: a fresh one per unit.
    attempt: str | None = None

    def __post_init__(self) -> None:
        self.layout = Layout(self.config.experiment)

    def hook(self, name: str, **info: Any) -> None:
        """Fire the process's hook point ``name`` (:mod:`verl_tasks.hooks`, empty in production)."""
        process_hooks.fire(name, experiment=self.config.experiment, **info)


def derive_seed(seed: int, epoch: int, phase: str, batch: int | None = None) -> int:
    """A 31-bit seed from (experiment seed, epoch, phase, batch): the only source of randomness."""
    digest = hashlib.sha256(f"{seed}/{epoch}/{phase}/{batch}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def set_determinism(config: ExperimentConfig) -> None:
    """Fixed thread count and deterministic kernels: a retry reproduces the same bytes."""
    if torch.cuda.is_available():  # cuBLAS is deterministic only with this workspace, read at its first handle
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if torch.get_num_threads() != config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    deterministic_kernels()


def deterministic_kernels() -> None:
    """``torch.use_deterministic_algorithms(True, warn_only=True)``, without its import of
    ``torch._inductor`` (~800 modules, 1.8 s per process) to set a flag only compiled code reads."""
    if "torch._inductor.config" in sys.modules:  # something compiles here: set inductor's flag too
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        torch._C._set_deterministic_algorithms(True, warn_only=True)


def check_not_halted(ctx: PhaseContext) -> None:
    halted = read_safe_mode(ctx.store, ctx.layout)
    if halted is not None:
        raise SafeMode(halted_message(ctx.config.experiment, halted))


def committed(ctx: PhaseContext, unit: str) -> CommitRecord | None:
    """The unit's record; a corrupt marker is quarantined and read as absent (the unit is recomputed)."""
    try:
        return read_marker(ctx.store, unit)
    except IntegrityError as err:
        quarantine(ctx.store, unit, str(err))
        record_event(ctx.store, ctx.layout, "quarantined", unit=unit, error=str(err))
        return None


def require(ctx: PhaseContext, unit: str, producer: str) -> CommitRecord:
    """The committed record of an input unit, or a PhaseFailed saying which task to run first."""
    record = committed(ctx, unit)
    if record is None:
        raise PhaseFailed(unit, f"input is not committed; run (or clear) the {producer} task first")
    return record


def run_unit(
    ctx: PhaseContext,
    phase: str,
    unit: str,
    epoch: int,
    produce: Callable[[UnitWriter], dict[str, Any]],
    batch: int | None = None,
) -> CommitRecord:
    """Skip if committed; else produce the files in a fresh attempt and commit them."""
    existing = committed(ctx, unit)
    ids = {"phase": phase, "unit": unit, "epoch": epoch, "batch": batch}
    if existing is not None:
        record_event(ctx.store, ctx.layout, "skipped", attempt=existing.attempt, **ids)
        return existing
    check_not_halted(ctx)
    check_pinned(ctx.config, ctx.store)
    # An attempt cancelled while it waited in an actor's queue: its commit would be refused anyway, after the work.
    check_not_fenced(ctx.store, unit, ctx.attempt)
    set_determinism(ctx.config)
    # The pin is checked again inside commit: the experiment may be re-pinned while this attempt computes.
    pin = ConfigPin(ctx.layout.experiment_json, ctx.config.config_hash())
    writer = UnitWriter(ctx.store, unit, ctx.attempt, pin=pin)
    started = time.monotonic()
    record_event(ctx.store, ctx.layout, "started", attempt=writer.attempt, **ids)
    try:
        meta = produce(writer)
        ctx.hook("before_commit", phase=phase, unit=unit, epoch=epoch, batch=batch)
        committing = time.monotonic()  # the store's share: check the attempt's files, write the marker
        record, won = writer.commit(meta)
        commit_s = time.monotonic() - committing
    except BaseException as err:  # a deadline or Ctrl-C ends the attempt too: the log says so
        record_event(
            ctx.store, ctx.layout, "failed", attempt=writer.attempt, error=f"{type(err).__name__}: {err}"[:2000],
            duration_s=round(time.monotonic() - started, 3), **ids,
        )
        raise
    size = sum(entry.size for entry in record.files.values())
    record_event(
        ctx.store, ctx.layout, "committed" if won else "lost_race", attempt=writer.attempt,
        winner=record.attempt, duration_s=round(time.monotonic() - started, 3), commit_s=round(commit_s, 4),
        bytes=size, **ids,
    )
    if won:
        track_commit(ctx, phase, unit, epoch, record)
    return record


def policy_folder(ctx: PhaseContext, version: int, record: CommitRecord | None = None, *,
                  weights: bool = True, optimizer: bool = False) -> tuple[Path, CommitRecord]:
    """A local folder holding policy ``version``'s files, each verified against the manifest: its configs
    and tokenizer, its weights unless ``weights`` is False (they come from memory), its optimizer state
    only with ``optimizer`` (the update reads it; rollout and evaluation never do). ``record``: the
    snapshot's, when the caller read it already.

    Raises:
        SnapshotPruned: retention deleted the snapshot's weights; it is unavailable, not
            corrupt, so nothing is quarantined and ``latest.json`` stays.
        PhaseFailed: the snapshot is not committed, or it failed verification; in the
            latter case it was quarantined (``phases.fallback``) and the next run recomputes it.
    """
    check_not_pruned(ctx.store, ctx.layout, version)
    try:
        return _policy_folder(ctx, version, record, weights, optimizer)
    except IntegrityError as err:
        raise _quarantined(ctx, version, err) from err


def _quarantined(ctx: PhaseContext, version: int, err: IntegrityError) -> PhaseFailed:
    """Snapshot ``version`` failed verification: quarantine it (``phases.fallback``); the error to raise."""
    info = fall_back(ctx, version, err.problems)
    return PhaseFailed(err.unit, f"snapshot {version} failed verification ({'; '.join(err.problems)}); it was "
                                 f"quarantined and latest.json points at snapshot {info['fell_back_to']}: rerun to "
                                 "recompute it")


# Policy folders a node keeps downloaded from a remote store (each keyed by its weights' sha256): the
# versions a worker reads at once (the policy, the base as KL reference, the one an evaluation lags behind).
POLICY_CACHE_KEEP = 4
# Bytes this process read from the store for policies, and received in memory (the handover): for benchmarks.
POLICY_BYTES = {"store": 0, "memory": 0}


def _needed(record: CommitRecord, weights: bool, optimizer: bool) -> list[str]:
    """The policy's files (a PPO snapshot's ``critic.*`` files are the critic phase's to read)."""
    return sorted(name for name in record.files if (name != WEIGHTS or weights) and not is_critic_file(name)
                  and (optimizer or not is_optimizer_state(name)))


def _policy_folder(ctx: PhaseContext, version: int, record: CommitRecord | None, weights: bool,
                   optimizer: bool) -> tuple[Path, CommitRecord]:
    if record is None:
        record = require(ctx, ctx.layout.snapshot(version), "snapshot" if version else "plan (base snapshot)")
    if is_adapter(record):
        return _merged_folder(ctx, record), record
    names = _needed(record, weights, optimizer)
    if isinstance(ctx.store, LocalStore):
        folder = ctx.store.root / f"{record.unit}/.attempts/{record.attempt}"
        if all((folder / name).is_file() and (folder / name).stat().st_size == record.files[name].size
               for name in names):
            if weights:
                _verify_weights(folder / WEIGHTS, record.files[WEIGHTS].sha256, record.unit)
            return folder, record
        raise IntegrityError(record.unit, ["snapshot files missing or truncated"])
    # Keyed by the weights' hash; another snapshot with the same weights may carry other files (e.g. no
    # optimizer state). Each file is verified before it is renamed in, so a name present is a verified file.
    folder = CACHE_DIR / "policies" / record.files[WEIGHTS].sha256
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        if (folder / name).is_file() and (folder / name).stat().st_size == record.files[name].size:
            continue
        partial = folder / f".tmp-{os.getpid()}-{name}"
        download(ctx.store, record, name, partial)
        POLICY_BYTES["store"] += record.files[name].size
        os.replace(partial, folder / name)
    os.utime(folder)
    _prune_policy_cache(folder)
    return folder, record


def _adapter_folder(ctx: PhaseContext, record: CommitRecord) -> tuple[Path, Path]:
    """A LoRA snapshot on this node as vLLM applies it: the base snapshot's verified folder, and a folder of the
    snapshot's adapter files, each verified, kept per adapter like a downloaded policy."""
    base_folder, base = policy_folder(ctx, 0)  # a corrupt base is quarantined as the base, not as this version
    check_adapter_base(ctx.store, record, base)
    return base_folder, _cached_folder(f"adapter-{weights_sha256(record)}", ADAPTER,
                                       lambda work: _download_adapter(ctx, record, work))


def _merged_folder(ctx: PhaseContext, record: CommitRecord) -> Path:
    """A LoRA snapshot as a full policy folder on this node: the base snapshot's weights with the snapshot's
    adapter merged in, made once per adapter and kept like a downloaded policy. What the HF engine, vLLM
    (``rollout.vllm_lora: merged``) and the checks load: no adapter code in their path."""
    from verl_tasks.models.lora import merge_into

    base_folder, base = policy_folder(ctx, 0)  # a corrupt base is quarantined as the base, not as this version
    check_adapter_base(ctx.store, record, base)

    def merge(work: Path) -> None:
        _download_adapter(ctx, record, work.with_name("adapter"))
        merge_into(base_folder, work.with_name("adapter"), work, ctx.config.model.train_dtype)

    return _cached_folder(f"lora-{base.files[WEIGHTS].sha256[:16]}-{weights_sha256(record)}", WEIGHTS, merge)


def _download_adapter(ctx: PhaseContext, record: CommitRecord, into: Path) -> None:
    into.mkdir()
    for name in _needed(record, weights=True, optimizer=False):
        download(ctx.store, record, name, into / name)
        POLICY_BYTES["store"] += record.files[name].size


def _cached_folder(name: str, marker: str, make: Callable[[Path], Any]) -> Path:
    """This node's policy-cache folder ``name``, made by ``make`` (writing folder ``made`` in a private work
    folder) unless it holds ``marker`` already: made aside, renamed in whole, so a folder present is complete;
    one without its marker (a prune killed half-way) is replaced."""
    folder = CACHE_DIR / "policies" / name
    if (folder / marker).is_file():
        os.utime(folder)
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
    try:
        make(work / "made")
        try:
            (work / "made").rename(folder)
        except OSError:  # another process of this node made it first, or a partial folder is in the way
            if not (folder / marker).is_file():
                shutil.rmtree(folder, ignore_errors=True)
                (work / "made").rename(folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _prune_policy_cache(folder)
    return folder


def _prune_policy_cache(using: Path) -> None:
    """Keep the ``POLICY_CACHE_KEEP`` most recently used policy folders of this node (and ``using``); work folders
    other processes are filling (``.tmp-*``) are theirs."""
    folders = sorted((p for p in using.parent.iterdir() if p.is_dir() and not p.name.startswith(".tmp-")),
                     key=lambda p: p.stat().st_mtime, reverse=True)
    for stale in folders[POLICY_CACHE_KEEP:]:
        if stale != using:
            shutil.rmtree(stale, ignore_errors=True)


_VERIFIED: set[tuple[str, str, int, int]] = set()


def _verify_weights(path: Path, sha: str, unit: str) -> None:
    from verl_tasks.store.units import sha256_file

    stat = path.stat()
    key = (str(path), sha, stat.st_mtime_ns, stat.st_size)
    if key in _VERIFIED:
        return
    POLICY_BYTES["store"] += stat.st_size
    if sha256_file(path) != sha:
        raise IntegrityError(unit, [f"{WEIGHTS}: sha256 differs from manifest"])
    _VERIFIED.add(key)


def _policy_key(ctx: PhaseContext, record: CommitRecord, dtype: str) -> PolicyKey:
    device = resolve_device(ctx.config.model.device)
    return PolicyKey(weights_sha256(record), dtype, str(device))


def load_version(ctx: PhaseContext, version: int, record: CommitRecord | None = None
                 ) -> tuple[torch.nn.Module, Any, Path]:
    """Policy ``version`` on the configured device: from this process's warm cache when it holds it, else
    from the update's in-memory handover when it is there under the committed checksum, else the store.

    Returns:
        (model, tokenizer, local folder of the verified snapshot's configs and tokenizer).
    """
    if record is None:
        check_not_pruned(ctx.store, ctx.layout, version)
        record = require(ctx, ctx.layout.snapshot(version), "snapshot" if version else "plan (base snapshot)")
    key = _policy_key(ctx, record, ctx.config.model.dtype)
    tensors = None if POLICIES.holds(key) else handover.fetch(ctx.config, record)
    folder, record = policy_folder(ctx, version, record, weights=tensors is None)
    model, tokenizer, how = POLICIES.get(key, folder, tensors)
    if tensors is not None and how is not None:
        POLICY_BYTES["memory"] += record.files[weights_file(record)].size
    _record_load(ctx, version, key, how, "memory" if tensors is not None else "store")
    return model, tokenizer, folder


_TOKENIZERS: dict[str, Any] = {}


def sampling_policy(ctx: PhaseContext, version: int) -> Policy:
    """What the configured engine samples policy ``version`` from. vLLM loads the folder itself: no HF
    copy of the weights is loaded beside it (on a GPU it would hold memory the engine was promised). Its
    weights come from the update's in-memory handover when they are there under the committed checksum
    (written into a local folder, verified as written), else from the store. A LoRA snapshot is the base
    snapshot's folder and the snapshot's adapter where vLLM applies adapters itself (``rollout.vllm_lora``),
    else its merged folder."""
    if ctx.config.rollout.engine == "hf":
        model, tokenizer, folder = load_version(ctx, version)
        return Policy(tokenizer, folder, model)
    check_not_pruned(ctx.store, ctx.layout, version)
    record = require(ctx, ctx.layout.snapshot(version), "snapshot" if version else "plan (base snapshot)")
    if is_adapter(record) and vllm_applies_adapters(ctx.config):
        try:
            base_folder, adapter = _adapter_folder(ctx, record)
        except IntegrityError as err:
            raise _quarantined(ctx, version, err) from err
        return Policy(_tokenizer(base_folder), base_folder, adapter=adapter)
    held = handover.local_folder(record)
    if held is None:
        tensors = handover.fetch(ctx.config, record)
        if tensors is not None:
            configs, record = policy_folder(ctx, version, record, weights=False)
            held = handover.materialize(tensors, record, configs)
            if held is not None:
                POLICY_BYTES["memory"] += record.files[WEIGHTS].size
    folder = held if held is not None else policy_folder(ctx, version, record)[0]
    return Policy(_tokenizer(folder), folder)


def _tokenizer(folder: Path) -> Any:
    key = str(folder)
    if key not in _TOKENIZERS:
        from transformers import AutoTokenizer

        refuse_pickles(folder)
        _TOKENIZERS.clear()  # one version at a time is read: keep only the newest
        _TOKENIZERS[key] = AutoTokenizer.from_pretrained(folder)
    return _TOKENIZERS[key]


def take_version(ctx: PhaseContext, version: int, *, keep: bool = False, record: CommitRecord | None = None
                 ) -> tuple[torch.nn.Module, Any, Path, WarmOptimizer | None]:
    """Like :func:`load_version` for a caller that will change the weights (the update): the model, in
    ``model.train_dtype``, leaves the cache, with the optimizer kept beside it, if any (the caller checks
    its ``state_id``). ``keep``: the version stays cached for later readers and the caller trains a copy
    of it (useful when those readers' ``model.dtype`` is the same)."""
    folder, record = policy_folder(ctx, version, record, optimizer=True)
    key = _policy_key(ctx, record, ctx.config.model.train_dtype)
    model, tokenizer, how, optimizer = POLICIES.take(key, folder, keep=keep)
    _record_load(ctx, version, key, how)
    if keep:
        record_event(ctx.store, ctx.layout, "policy_copied", version=version, device=key.device,
                     weights_sha256=key.weights_sha256)
    return model, tokenizer, folder, optimizer


def _record_load(ctx: PhaseContext, version: int, key: PolicyKey, how: str | None, source: str = "store") -> None:
    if how is not None:
        record_event(ctx.store, ctx.layout, "policy_loaded", version=version, how=how, device=key.device,
                     weights_sha256=key.weights_sha256, weights_from=source)


def keep_policy(ctx: PhaseContext, record: CommitRecord, model: torch.nn.Module, tokenizer: Any, folder: Path,
                optimizer: torch.optim.Optimizer | None = None) -> None:
    """After an update committed ``record`` from this ``model`` (and ``optimizer``), keep both warm
    for the next epoch's units, keyed by ``model.train_dtype``: the next update takes it; readers
    in another ``model.dtype`` load their own copy."""
    state_id = optimizer_state_id(record)
    warm = WarmOptimizer(state_id, optimizer) if optimizer is not None and state_id is not None else None
    POLICIES.adopt(_policy_key(ctx, record, ctx.config.model.train_dtype), model, tokenizer, folder, warm)
