"""No non-finite value is ever committed, whatever the quality gate says: scores that are NaN, infinite or out
of ``rewards.min_score..max_score`` become the default score with their reason, and an update whose gradient,
weights or optimizer state is not finite fails, typed, before anything is written."""
from __future__ import annotations

import math

import pytest
from safetensors.torch import load_file

from verl_tasks.errors import NonFiniteUpdate
from verl_tasks.execution.outcome import is_deterministic
from verl_tasks.runner import make_context, run_phase, train
from verl_tasks.store.units import read_jsonl, read_marker

GATE_OFF = {"quality.enabled": False, "epochs": 1, "model.tiny.warm_start_steps": 100, "evaluate.every": 0,
            "rewards.max_failure_fraction": 1.0}


def test_nan_infinite_and_huge_scores_are_never_trained_on(tiny_config):
    ctx = make_context(tiny_config(**{**GATE_OFF, "rewards.function": "tests.reward_fixtures:extreme_scores"}))
    train(ctx, 1)
    failed: dict[str, str] = {}
    for batch in range(ctx.config.rollout.batches_per_epoch):
        record = read_marker(ctx.store, ctx.layout.score(0, batch))
        scores = [row["score"] for row in read_jsonl(ctx.store, record, "scores.jsonl")]
        assert all(math.isfinite(s) and -1e6 <= s <= 1e6 for s in scores), scores
        failed.update(record.meta["failed_samples"])
    reasons = " ".join(failed.values())
    assert "outside rewards.min_score..max_score" in reasons  # 1e308
    assert "not a finite number" in reasons or "nan" in reasons.lower(), reasons  # NaN and infinity
    update = read_marker(ctx.store, ctx.layout.update(0))
    weights = load_file(str(ctx.store.root / ctx.layout.update(0) / ".attempts" / update.attempt / "model.safetensors"))
    assert all(t.isfinite().all() for t in weights.values())


def test_an_update_that_would_commit_nan_weights_fails_typed_and_commits_nothing(tiny_config):
    """Scores of 1e308 are in range when rewards.max_score allows them; their mean overflows, the gradient is
    NaN: the update refuses before writing, and is not retried (the same inputs give the same NaN)."""
    ctx = make_context(tiny_config(**{**GATE_OFF, "rewards.function": "tests.reward_fixtures:huge_scores",
                                      "rewards.max_score": 1e308, "model.tiny.warm_start_steps": 300}))
    for phase in ("plan", "rollout", "score", "validate"):
        for batch in (range(ctx.config.rollout.batches_per_epoch) if phase in ("rollout", "score") else [None]):
            run_phase(ctx, phase, 0, batch)
    scores = [row["score"] for b in range(ctx.config.rollout.batches_per_epoch)
              for row in read_jsonl(ctx.store, read_marker(ctx.store, ctx.layout.score(0, b)), "scores.jsonl")]
    assert 1e308 in scores, "no right answer scored: the overflow would not happen"
    with pytest.raises(NonFiniteUpdate, match=r"gradient norm .* is nan") as err:
        run_phase(ctx, "update", 0)
    assert err.value.unit == ctx.layout.update(0) and is_deterministic(err.value)
    assert read_marker(ctx.store, ctx.layout.update(0)) is None
