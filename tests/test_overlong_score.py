"""DAPO's overlong penalty and the score range: ``rewards.min_score..max_score`` bounds what the reward
function returns, the penalty comes after that check, so a penalised answer is a scored sample (below
``min_score``), not a failed one, and the quality gate passes it."""
from __future__ import annotations

from verl_tasks.runner import make_context, run_phase
from verl_tasks.store.units import read_jsonl, read_marker


def test_a_penalised_answer_below_min_score_is_scored_and_passes_the_gate(tiny_config):
    config = tiny_config(**{"rewards.min_score": 0.0, "rewards.overlong_buffer.enable": True,
                            "rewards.overlong_buffer.len": 4, "rewards.overlong_buffer.penalty_factor": 0.5,
                            "rollout.max_new_tokens": 4, "quality.min_nonempty_response_fraction": 0.0})
    ctx = make_context(config)
    run_phase(ctx, "plan", 0, None)
    for batch in range(config.rollout.batches_per_epoch):
        run_phase(ctx, "rollout", 0, batch)
        run_phase(ctx, "score", 0, batch)
    scores, lengths = [], []
    for batch in range(config.rollout.batches_per_epoch):
        record = read_marker(ctx.store, ctx.layout.score(0, batch))
        assert record is not None and not record.meta.get("failed_samples"), record
        scores += [row["score"] for row in read_jsonl(ctx.store, record, "scores.jsonl")]
        rollout = read_marker(ctx.store, ctx.layout.rollout(0, batch))
        lengths += [len(row["response_ids"]) for row in read_jsonl(ctx.store, rollout, "samples.jsonl")]
    assert any(length > 0 for length in lengths), lengths  # some answers are long enough to be penalised
    assert min(scores) < 0.0 and min(scores) >= -0.5, scores
    run_phase(ctx, "validate", 0, None)  # the gate allows min_score - penalty_factor
    assert read_marker(ctx.store, ctx.layout.validate(0)) is not None
