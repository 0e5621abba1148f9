"""Verify, inspect and export snapshots, addressed by URI.

A URI names one snapshot (``file:///data/store/exp/snapshots/00003``,
``s3://bucket/prefix/exp/snapshots/00003``), the snapshots folder, or an
experiment root (every snapshot of it). Loading uses safetensors and JSON only.
"""
from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from verl_tasks.errors import ConfigError, IntegrityError, StoreError
from verl_tasks.layout import Layout
from verl_tasks.models.checkpoint import OPTIMIZER_INDEX, check_optimizer_index, load_policy, refuse_pickles
from verl_tasks.store import ObjectStore, open_store
from verl_tasks.store.conventions import (
    TRAINING_ONLY,
    check_adapter_base,
    has_policy,
    is_adapter,
    is_critic_file,
    is_optimizer_state,
    read_best,
    snapshot_versions,
    weights_sha256,
)
from verl_tasks.store.units import (
    CommitRecord,
    download,
    is_pruned,
    pinned_hash,
    read_json,
    read_marker,
    verify_unit,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SnapshotRef:
    """Where a snapshot lives: the store, the experiment's layout and the version."""

    store: ObjectStore
    layout: Layout
    version: int

    @property
    def unit(self) -> str:
        return self.layout.snapshot(self.version)


@dataclass
class Verdict:
    version: int
    unit: str
    ok: bool
    state: str  # OK | FAILED | PRUNED | ABSENT
    problems: list[str] = field(default_factory=list)
    weights_sha256: str | None = None
    size: int = 0

    def line(self) -> str:
        sha = f" sha256 {self.weights_sha256[:16]}" if self.weights_sha256 else ""
        detail = "; ".join(self.problems) if self.problems else "hashes match, forward pass ok"
        return f"{self.state:<6} {self.unit}{sha} {self.size} bytes: {detail}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve(uri: str, endpoint_url: str | None = None) -> tuple[ObjectStore, Layout, int | None]:
    """Split a URI into (store, layout, version); version is None for "every snapshot".

    Raises:
        ConfigError: the URI names neither a snapshot nor an experiment.
    """
    scheme = "file://" if uri.startswith("file://") else "s3://" if uri.startswith("s3://") else None
    if scheme is None:
        raise ConfigError(f"unsupported URI {uri!r}: use file://PATH or s3://BUCKET/PREFIX")
    body = uri[len(scheme):].rstrip("/")
    parts = body.split("/")
    version: int | None = None
    if len(parts) >= 2 and parts[-2] == "snapshots" and parts[-1].isdigit():
        version = int(parts[-1])
        parts = parts[:-2]
    elif parts and parts[-1] == "snapshots":
        parts = parts[:-1]
    if scheme == "s3://" and len(parts) < 2:
        raise ConfigError(f"{uri!r}: an S3 URI must name s3://BUCKET/[PREFIX/]EXPERIMENT[/snapshots/NNNNN]")
    if len(parts) < 2 or not parts[-1]:
        raise ConfigError(f"{uri!r} does not name an experiment folder")
    experiment = parts[-1]
    root = "/".join(parts[:-1]) or "/"
    store = open_store(scheme + root, endpoint_url=endpoint_url)
    return store, Layout(experiment), version


def refs(uri: str, endpoint_url: str | None = None) -> list[SnapshotRef]:
    store, layout, version = resolve(uri, endpoint_url)
    versions = [version] if version is not None else snapshot_versions(store, layout)
    if not versions:
        raise StoreError(f"no committed snapshot under {uri}")
    return [SnapshotRef(store, layout, v) for v in versions]


def fetch(ref: SnapshotRef, record: CommitRecord, folder: Path, names: list[str] | None = None) -> Path:
    """Download (and verify) a snapshot's files into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names if names is not None else sorted(record.files):
        download(ref.store, record, name, folder / name)
    return folder


def forward_check(folder: Path) -> list[str]:
    """Load the policy (safetensors only) and run one forward pass; problems found, empty if fine."""
    import torch

    try:
        refuse_pickles(folder)
        model, tokenizer = load_policy(folder)
    except IntegrityError as err:
        return list(err.problems)
    except Exception as err:  # noqa: BLE001 - any load failure is a verdict, not a crash
        return [f"load failed: {type(err).__name__}: {err}"[:500]]
    ids = tokenizer("1+1=", add_special_tokens=False)["input_ids"] or [0]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    if not torch.isfinite(logits).all():
        return ["forward pass produced non-finite logits"]
    return []


def critic_check(folder: Path) -> list[str]:
    """A PPO snapshot's critic (its ``critic.*`` files in ``folder``): load it and value one short response;
    problems found, empty if fine."""
    import torch

    from verl_tasks.models.checkpoint import WEIGHTS
    from verl_tasks.models.critic import CONFIG, load_critic, stored_name

    critic = Path(tempfile.mkdtemp(prefix="critic-", dir=folder.parent))
    for name in (CONFIG, WEIGHTS):
        (critic / name).symlink_to(folder / stored_name(name))
    try:
        model = load_critic(critic, "float32").eval()
        with torch.no_grad():
            values = model(input_ids=torch.tensor([[0, 1, 2, 3]]), attention_mask=torch.ones(1, 4, dtype=torch.long),
                           positions=torch.tensor([[1, 2]]), response_mask=torch.ones(1, 2))
    except IntegrityError as err:
        return list(err.problems)
    except Exception as err:  # noqa: BLE001 - any load or forward failure is a verdict, not a crash
        return [f"critic load failed: {type(err).__name__}: {err}"[:500]]
    finally:
        shutil.rmtree(critic, ignore_errors=True)
    return [] if torch.isfinite(values).all() else ["the critic's forward pass produced non-finite values"]


def verify(ref: SnapshotRef, forward: bool = True) -> Verdict:
    """Hash every file (each optimizer shard too) against the manifest, check the optimizer index covers
    every parameter, then (``forward``) load the weights and run a forward pass, and a PPO snapshot's critic
    and value a response with it."""

    try:
        record = read_marker(ref.store, ref.unit)
    except IntegrityError as err:
        return Verdict(ref.version, ref.unit, False, "FAILED", list(err.problems))
    if record is None:
        return Verdict(ref.version, ref.unit, False, "ABSENT", ["no _SUCCESS marker: not committed (or quarantined)"])
    sha = weights_sha256(record) if has_policy(record) else None
    size = sum(e.size for e in record.files.values())
    if is_pruned(ref.store, ref.unit):
        return Verdict(ref.version, ref.unit, True, "PRUNED", ["weights deleted by retention (metadata kept)"],
                       sha, size)
    problems = verify_unit(ref.store, record) or optimizer_problems(ref, record)
    if not problems and forward:
        with tempfile.TemporaryDirectory() as tmp:
            folder = fetch(ref, record, Path(tmp) / "snapshot")
            try:
                if is_adapter(record):  # LoRA: the adapter merged into the base snapshot is what runs
                    folder = merged_with_base(ref, folder, Path(tmp))
            except (IntegrityError, StoreError, ConfigError) as err:
                problems = [str(err)]
            else:
                problems = forward_check(folder)
            if not problems and any(is_critic_file(name) for name in record.files):
                problems = critic_check(Path(tmp) / "snapshot")
    return Verdict(ref.version, ref.unit, not problems, "OK" if not problems else "FAILED", problems, sha, size)


def optimizer_problems(ref: SnapshotRef, record: CommitRecord) -> list[str]:
    """Every optimizer shard the index names is in the snapshot, and each parameter's rows are covered once."""
    if OPTIMIZER_INDEX not in record.files:
        return []
    return check_optimizer_index(read_json(ref.store, record, OPTIMIZER_INDEX), set(record.files))


def inspect(ref: SnapshotRef) -> dict[str, Any]:
    """Epoch, step, lr schedule, sizes, config hash, metrics, parent and whether ``best.json`` names it."""
    record = read_marker(ref.store, ref.unit)
    if record is None:
        raise StoreError(f"{ref.store.url(ref.unit)} is not committed")
    state = read_json(ref.store, record, "trainer_state.json") if "trainer_state.json" in record.files else {}
    config_hash = state.get("config_hash")
    if not config_hash:  # a snapshot whose trainer state does not name it: the experiment's pin does
        try:
            config_hash = pinned_hash(ref.store, ref.layout.experiment_json)  # None: nothing pinned
        except StoreError as err:  # a damaged pin, or a failed read: inspect still reports the rest
            log.warning("config hash of %s not reported: %s", ref.unit, err)
    parent = state.get("parent_version")
    return {
        "uri": ref.store.url(ref.unit),
        "experiment": ref.layout.experiment,
        "version": ref.version,
        "epoch": state.get("epoch"),
        "step": state.get("step"),
        "lr_schedule": state.get("lr_schedule"),
        "best": (read_best(ref.store, ref.layout) or {}).get("version") == ref.version,
        "config_hash": config_hash,
        "parent": ref.store.url(ref.layout.snapshot(parent)) if isinstance(parent, int) else None,
        "parent_version": parent,
        "attempt": record.attempt,
        "committed_at": record.committed_at,
        "weights_sha256": weights_sha256(record) if has_policy(record) else None,
        "sizes": {name: entry.size for name, entry in sorted(record.files.items())},
        "total_bytes": sum(e.size for e in record.files.values()),
        "metrics": state.get("metrics") or record.meta.get("metrics", {}),
    }


def merged_with_base(ref: SnapshotRef, adapter: Path, work: Path) -> Path:
    """A LoRA snapshot's adapter folder merged into its experiment's base snapshot (fetched and verified).

    Raises:
        StoreError: the base snapshot is not committed.
        IntegrityError: a base file does not match its manifest.
    """
    from verl_tasks.models.lora import merge_into

    base_ref = SnapshotRef(ref.store, ref.layout, 0)
    base = read_marker(ref.store, base_ref.unit)
    if base is None:
        raise StoreError(f"{ref.store.url(base_ref.unit)}, the adapter's base, is not committed")
    adapter_record = read_marker(ref.store, ref.unit)
    if adapter_record is not None:
        check_adapter_base(ref.store, adapter_record, base)
    names = [n for n in sorted(base.files) if n not in TRAINING_ONLY and not is_optimizer_state(n)
             and not is_critic_file(n)]
    return merge_into(fetch(base_ref, base, work / "base", names), adapter, work / "merged")


def export_hf(ref: SnapshotRef, target: Path, merge: bool = False) -> list[Path]:
    """Write a folder ``AutoModelForCausalLM``/``AutoTokenizer.from_pretrained`` load (no optimizer state). A LoRA
    snapshot gives PEFT's adapter folder (``PeftModel.from_pretrained`` on the base), or with ``merge`` the base
    snapshot's weights with the adapter merged in; either is checked by a forward pass of the merged model.

    Raises:
        IntegrityError: a file does not match the manifest, or the folder does not load.
        StoreError: the snapshot is not committed, or ``target`` exists and is not empty.
    """
    record = read_marker(ref.store, ref.unit)
    if record is None:
        raise StoreError(f"{ref.store.url(ref.unit)} is not committed")
    target = Path(target)
    if target.exists() and any(target.iterdir()):
        raise StoreError(f"{target} exists and is not empty; choose a new folder")
    names = [n for n in sorted(record.files)
             if n not in TRAINING_ONLY and not is_optimizer_state(n) and not is_critic_file(n)]
    with tempfile.TemporaryDirectory(dir=target.parent if target.parent.exists() else None) as tmp:
        folder = fetch(ref, record, Path(tmp) / "export", names)
        checked = folder
        if is_adapter(record):  # LoRA: the adapter on the base snapshot, merged to check it (and to export it)
            checked = merged_with_base(ref, folder, Path(tmp))
            if merge:
                folder = checked
        problems = forward_check(checked)
        if problems:
            raise IntegrityError(ref.unit, problems)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            target.rmdir()
        shutil.move(str(folder), str(target))
    return sorted(target.iterdir())

