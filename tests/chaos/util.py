"""Helpers shared by the chaos matrix and the ops tests: one small config, CLI calls, unit accounting."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from verl_tasks.config import load_config
from verl_tasks.events import read_events
from verl_tasks.layout import Layout
from verl_tasks.store.base import ObjectStore

from ..conftest import ROOT, TINY_YAML, small_overrides, write_yaml

SEED = int(os.environ.get("VT_CHAOS_SEED", "20261130"))
EPOCHS = 2
# The smallest run that still exercises every phase twice: evaluate only after the last epoch.
CHAOS = {"epochs": EPOCHS, "evaluate.every": 0, "evaluate.max_prompts": 8}
RESULTS = ROOT / "benchmarks" / "results" / "chaos.json"


def small_batches() -> int:
    """The planned rollout batches of an epoch of the chaos config."""
    return int(overrides()["rollout.batches_per_epoch"])


def overrides(**extra: Any) -> dict[str, Any]:
    return small_overrides(**{**CHAOS, **extra})


def config(store_uri: str, **extra: Any):
    return load_config(TINY_YAML, {**overrides(**extra), "storage.uri": store_uri})


def write_config(folder: Path, **extra: Any) -> Path:
    return write_yaml(folder, overrides(**extra))


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "verl_tasks.cli", *args]


def run_cli(*args: str, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cli(*args), cwd=ROOT, capture_output=True, text=True, check=check,
                          env={**os.environ, **(env or {})})


def markers(store: ObjectStore, layout: Layout) -> list[str]:
    """Committed unit keys (each appears once by construction of a key space)."""
    keys = store.list(layout.root + "/epochs/") + store.list(layout.snapshots + "/")
    return sorted(k[: -len("/_SUCCESS")] for k in keys if k.endswith("/_SUCCESS"))


def assert_exactly_once(store: ObjectStore, layout: Layout, cfg) -> None:
    """Every expected unit committed once, its attempt intact, no duplicate/missing sample ids."""
    from verl_tasks.store.units import read_jsonl, read_marker, verify_unit

    expected = []
    for epoch in range(cfg.epochs):
        expected += [layout.plan(epoch), layout.validate(epoch), layout.update(epoch), layout.snapshot(epoch + 1)]
        if cfg.critic is not None:
            expected.append(layout.critic(epoch))
        for b in range(cfg.rollout.batches_per_epoch):
            expected += [layout.rollout(epoch, b), layout.score(epoch, b)]
    have = markers(store, layout)
    missing = sorted(set(expected) - set(have))
    assert not missing, f"units not committed: {missing}"
    ids: list[str] = []
    for epoch in range(cfg.epochs):
        for b in range(cfg.rollout.batches_per_epoch):
            rec = read_marker(store, layout.rollout(epoch, b))
            assert not verify_unit(store, rec)
            rows = read_jsonl(store, rec, "samples.jsonl")
            ids += [r["sample_id"] for r in rows]
            scores = read_jsonl(store, read_marker(store, layout.score(epoch, b)), "scores.jsonl")
            scored = {r["sample_id"] for r in scores}
            assert scored == {r["sample_id"] for r in rows}, f"scores of e{epoch} b{b} do not match its samples"
    assert len(ids) == len(set(ids)), "duplicate sample ids across rollout units"
    per_batch = cfg.rollout.prompts_per_batch * cfg.algorithm.group_size
    assert len(ids) == cfg.epochs * cfg.rollout.batches_per_epoch * per_batch, "samples lost"


def started_count(store: ObjectStore, layout: Layout) -> int:
    return sum(1 for e in read_events(store, layout) if e["kind"] == "started")


def latest_sha(store: ObjectStore, layout: Layout) -> str:
    return json.loads(store.get(layout.latest))["weights_sha256"]


def record(fault: str, **numbers: Any) -> None:
    """Append one fault's measurements to benchmarks/results/chaos.json when VT_CHAOS_RECORD=1."""
    if os.environ.get("VT_CHAOS_RECORD") != "1":
        return
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data[fault] = {**numbers, "seed": SEED, "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    RESULTS.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
