"""End to end on the tiny model, inline: determinism, resume, idempotent reruns, bad input."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verl_tasks.errors import DataError, RewardFailureRate, ValidationFailed
from verl_tasks.events import read_events
from verl_tasks.runner import make_context, status, train
from verl_tasks.store.units import read_marker

from .conftest import ROOT, small_overrides, write_yaml


def test_two_runs_give_identical_weights_and_rerun_computes_nothing(tiny_config, tmp_path):
    first = make_context(tiny_config(f"file://{tmp_path}/a"))
    result = train(first, 2)
    second = make_context(tiny_config(f"file://{tmp_path}/b"))
    assert train(second, 2)["latest_snapshot"]["weights_sha256"] == result["latest_snapshot"]["weights_sha256"]
    assert [e["phases"]["snapshot"] for e in result["epochs"]] == ["committed", "committed"]
    base_sha = read_marker(first.store, first.layout.snapshot(0)).files["model.safetensors"].sha256
    assert result["latest_snapshot"]["weights_sha256"] != base_sha, "the updates must move the weights"
    assert 0 < result["epochs"][0]["metrics"]["reward_mean"] < 1, "mixed rewards, so GRPO has a signal"
    assert "eval_accuracy" in result["base"]["metrics"]

    before = len(read_events(first.store, first.layout))
    train(first, 2)
    new = read_events(first.store, first.layout)[before:]
    assert not [e for e in new if e["kind"] in ("started", "committed")]


def test_status_shape(tiny_config, tmp_path):
    ctx = make_context(tiny_config(f"file://{tmp_path}/s", epochs=1))
    train(ctx, 1)
    st = status(ctx.config, ctx.store)
    epoch = st["epochs"][0]
    assert epoch["epoch"] == 0
    assert set(epoch["phases"]) == {"plan", "rollout", "score", "validate", "update", "snapshot", "evaluate"}
    assert all(v == "committed" for v in epoch["phases"].values())
    assert {"reward_mean", "eval_accuracy"} <= set(epoch["metrics"])
    assert st["latest_snapshot"]["epoch"] == 0 and len(st["latest_snapshot"]["weights_sha256"]) == 64


def _cli(*args, env=None):
    return [sys.executable, "-m", "verl_tasks.cli", *args]


def _write_config(tmp_path: Path, **extra) -> Path:
    return write_yaml(tmp_path, small_overrides(**extra))


def _status_json(config: Path, store: str) -> dict:
    out = subprocess.run(_cli("status", str(config), "--store", store, "--json"), capture_output=True, text=True,
                         check=True, cwd=ROOT)
    return json.loads(out.stdout)


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_gives_identical_weights(tmp_path):
    config = _write_config(tmp_path, epochs=2)
    reference = f"file://{tmp_path}/reference"
    started = time.monotonic()
    subprocess.run(_cli("run", str(config), "--store", reference), check=True, cwd=ROOT, capture_output=True)
    duration = time.monotonic() - started
    expected = _status_json(config, reference)["latest_snapshot"]["weights_sha256"]

    rng = random.Random(int(os.environ.get("VT_CHAOS_SEED", "20261130")))
    for trial in range(2):
        store = f"file://{tmp_path}/killed{trial}"
        proc = subprocess.Popen(_cli("run", str(config), "--store", store), cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.3, 0.9) * duration)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        subprocess.run(_cli("run", str(config), "--store", store), check=True, cwd=ROOT, capture_output=True)
        got = _status_json(config, store)
        assert got["latest_snapshot"]["weights_sha256"] == expected, f"trial {trial}"


def test_rerun_with_all_epochs_committed_returns_without_compute(tmp_path):
    config = _write_config(tmp_path, epochs=1)
    store = f"file://{tmp_path}/store"
    subprocess.run(_cli("run", str(config), "--store", store), check=True, cwd=ROOT, capture_output=True)
    started = time.time()
    out = subprocess.run(_cli("run", str(config), "--store", store, "--epochs", "1"), check=True, cwd=ROOT,
                         capture_output=True, text=True)
    assert "already trained (1 epochs committed" in out.stderr and "nothing recomputed" in out.stderr, out.stderr
    from verl_tasks.config import load_config

    ctx = make_context(load_config(config, {"storage.uri": store}))
    assert "started" not in {e["kind"] for e in read_events(ctx.store, ctx.layout) if e["time"] > started}


def test_malformed_prompt_file_names_the_line(tiny_config, tmp_path):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "1+1=", "ground_truth": "2"}\n{"prompt": "2+2=", oops}\n')
    ctx = make_context(tiny_config(**{"data.train": str(bad)}))
    with pytest.raises(DataError, match=r"prompts.jsonl:2: not valid JSON"):
        train(ctx, 1)
    assert read_marker(ctx.store, ctx.layout.snapshot(0)) is None  # no compute was spent


def test_empty_data_set_is_refused(tiny_config, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="holds no prompts"):
        train(make_context(tiny_config(**{"data.train": str(empty)})), 1)


def test_too_few_prompts_for_an_epoch(tiny_config, tmp_path):
    few = tmp_path / "few.jsonl"
    few.write_text("".join(json.dumps({"prompt": f"{i}+1=", "ground_truth": str(i + 1)}) + "\n" for i in range(5)))
    with pytest.raises(DataError, match="an epoch needs 16"):
        train(make_context(tiny_config(**{"data.train": str(few)})), 1)


def test_prompt_longer_than_limit_is_refused_before_compute(tiny_config, tmp_path):
    rows = tmp_path / "long.jsonl"
    rows.write_text(
        json.dumps({"id": "long-one", "prompt": "9" * 80 + "+1=", "ground_truth": "1"}) + "\n"
        + "".join(json.dumps({"prompt": f"{i}+1=", "ground_truth": str(i + 1)}) + "\n" for i in range(40))
    )
    ctx = make_context(tiny_config(**{"data.train": str(rows), "data.max_prompt_tokens": 16}))
    with pytest.raises(DataError, match=r"1 prompt\(s\) exceed data.max_prompt_tokens=16: long-one \(83 tokens\)"):
        train(ctx, 1)


def test_verl_parquet_format_is_read(tiny_config, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "data_source": "arith",
            "prompt": [{"role": "user", "content": f"{i}+{i}="}],
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"index": i, "split": "train"},
        }
        for i in range(20)
    ]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    from verl_tasks.data import load_rows

    loaded = load_rows(str(path), "train", 0, 0)
    assert loaded[3]["ground_truth"] == "6" and loaded[3]["prompt"][0]["content"] == "3+3="
    assert loaded[3]["id"] == "3"


def test_reward_failures_above_threshold_fail_the_batch_and_keep_commits(tiny_config, monkeypatch):
    ctx = make_context(tiny_config(epochs=2, **{"rewards.function": "tests.reward_fixtures:env_switch",
                                                "fault_tolerance.retries": 1, "fault_tolerance.retry_delay_s": 0}))
    train(ctx, 1)
    committed_before = {k for k in ctx.store.list(ctx.config.experiment + "/") if k.endswith("_SUCCESS")}
    monkeypatch.setenv("VT_TEST_REWARD_FAIL", "1")
    with pytest.raises(RewardFailureRate, match=r"32/32 samples could not be scored"):
        train(ctx, 2)
    committed_after = {k for k in ctx.store.list(ctx.config.experiment + "/") if k.endswith("_SUCCESS")}
    assert committed_before <= committed_after
    assert read_marker(ctx.store, ctx.layout.score(1, 0)) is None
    monkeypatch.delenv("VT_TEST_REWARD_FAIL")
    assert train(ctx, 2)["epochs"][1]["phases"]["snapshot"] == "committed"


def test_few_reward_failures_get_the_default_and_are_recorded(tiny_config):
    from tests.reward_fixtures import flaky
    from verl_tasks.phases.prepare import train_rows
    from verl_tasks.store.units import read_jsonl

    default = 0.25  # neither a right (1.0) nor a wrong (0.0) answer's score
    ctx = make_context(tiny_config(epochs=1, **{"rewards.function": "tests.reward_fixtures:flaky",
                                                "rewards.default_score": default,
                                                "rewards.max_failure_fraction": 0.5}))
    train(ctx, 1)
    rows = {row["id"]: row for row in train_rows(ctx)}
    for batch in range(ctx.config.rollout.batches_per_epoch):
        samples = read_jsonl(ctx.store, read_marker(ctx.store, ctx.layout.rollout(0, batch)), "samples.jsonl")
        expected: dict[str, float | None] = {}  # what the fixture returns for each sample, None where it raises
        for s in samples:
            row = rows[s["prompt_id"]]
            try:
                expected[s["sample_id"]] = flaky(row["data_source"], s["response"], row["ground_truth"],
                                                 row["extra_info"])
            except RuntimeError:
                expected[s["sample_id"]] = None
        should_fail = {sid for sid, value in expected.items() if value is None}
        assert 0 < len(should_fail) <= len(samples) // 2, (batch, len(should_fail), len(samples))
        record = read_marker(ctx.store, ctx.layout.score(0, batch))
        assert set(record.meta["failed_samples"]) == should_fail, (batch, record.meta["failed_samples"])
        assert all("flaky" in reason for reason in record.meta["failed_samples"].values()), record.meta
        assert record.meta["samples"] == len(samples)
        scores = {r["sample_id"]: r["score"] for r in read_jsonl(ctx.store, record, "scores.jsonl")}
        assert scores == {sid: default if value is None else value for sid, value in expected.items()}
        assert record.meta["reward_mean"] == pytest.approx(sum(scores.values()) / len(scores))


def test_failing_quality_gate_blocks_the_update(tiny_config):
    """An untrained tiny model ends some answers at once; a gate that asks for no empty answers stops the epoch
    before its update."""
    ctx = make_context(tiny_config(epochs=1, **{"model.tiny.warm_start_steps": 0,
                                                "quality.min_nonempty_response_fraction": 1.0}))
    with pytest.raises(ValidationFailed) as err:
        train(ctx, 1)
    assert "expect_column_values_to_be_between(batch_nonempty_fraction)" in str(err.value), str(err.value)
    assert read_marker(ctx.store, ctx.layout.validate(0)) is None
    assert read_marker(ctx.store, ctx.layout.update(0)) is None


def test_hf_name_or_path_route(tmp_path, tiny_config):
    """A model saved to a local folder trains through the same path a real HF model takes."""
    from transformers import AutoModelForCausalLM

    from verl_tasks.config import TinyModelConfig
    from verl_tasks.models.checkpoint import save_policy
    from verl_tasks.models.tiny import build_model, build_tokenizer

    folder = tmp_path / "my-model"
    tok = build_tokenizer()
    save_policy(build_model(TinyModelConfig(hidden_size=64, num_layers=1), len(tok), seed=3), tok, folder)
    ctx = make_context(tiny_config(epochs=1, **{"model.source": "hf", "model.name_or_path": str(folder)}))
    result = train(ctx, 1)
    assert result["latest_snapshot"]["version"] == 1
    snap = Path(result["latest_snapshot"]["uri"][len("file://"):])
    record = read_marker(ctx.store, ctx.layout.snapshot(1))
    loaded = AutoModelForCausalLM.from_pretrained(snap / ".attempts" / record.attempt)
    assert loaded.config.hidden_size == 64
