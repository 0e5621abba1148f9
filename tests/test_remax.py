"""ReMax (``algorithm.adv_estimator: remax``): each prompt's greedy answer is rolled out with its batch, scored
with it, and is the baseline of that prompt's samples.

A small ReMax run is trained once per module; the tests read its committed units.
"""
from __future__ import annotations

import pytest
import torch

from verl_tasks.config import load_config
from verl_tasks.errors import PhaseFailed
from verl_tasks.phases.update_inputs import read_update_source
from verl_tasks.phases.update_steps import epoch_inputs
from verl_tasks.runner import make_context, run_phase, train
from verl_tasks.store.units import read_jsonl, read_marker

from .conftest import TINY_YAML, small_overrides


@pytest.fixture(scope="module")
def remax_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("remax")
    cfg = load_config(TINY_YAML, small_overrides(**{"storage.uri": f"file://{root}/store",
                                                     "algorithm.adv_estimator": "remax", "epochs": 1}))
    ctx = make_context(cfg)
    train(ctx, 1)
    return ctx


def test_each_prompt_has_one_greedy_answer_committed_and_scored_with_its_batch(remax_run):
    ctx = remax_run
    for b in range(ctx.config.rollout.batches_per_epoch):
        rollout = read_marker(ctx.store, ctx.layout.rollout(0, b))
        samples = read_jsonl(ctx.store, rollout, "samples.jsonl")
        baselines = read_jsonl(ctx.store, rollout, "baselines.jsonl")
        assert sorted(r["prompt_id"] for r in baselines) == sorted({s["prompt_id"] for s in samples})
        scored = read_jsonl(ctx.store, read_marker(ctx.store, ctx.layout.score(0, b)), "baseline_scores.jsonl")
        assert [r["sample_id"] for r in scored] == [r["sample_id"] for r in baselines]
        assert len(read_jsonl(ctx.store, read_marker(ctx.store, ctx.layout.score(0, b)), "scores.jsonl")) \
            == len(samples)


def test_a_samples_advantage_is_its_score_less_its_prompts_greedy_score(remax_run):
    ctx = remax_run
    source = read_update_source(ctx, 0)
    inputs = epoch_inputs(source.samples, 0, ctx.config.algorithm, ctx.config.rollout.max_new_tokens)
    mask = inputs.data["response_mask"]
    expected = torch.tensor([s["score"] - s["baseline_score"] for s in source.samples]).unsqueeze(-1) * mask
    torch.testing.assert_close(inputs.advantages, expected)
    assert any(s["score"] != s["baseline_score"] for s in source.samples)


def test_a_score_unit_without_the_baselines_scores_says_to_clear_it(remax_run):
    """A batch scored before the experiment's rollouts carried baselines cannot give ReMax its baseline."""
    from verl_tasks.phases.update_inputs import scored_record
    from verl_tasks.store.units import UnitWriter

    ctx = remax_run
    unit = ctx.layout.score(0, 9)
    writer = UnitWriter(ctx.store, unit)
    writer.write_jsonl("scores.jsonl", [])
    writer.commit({})
    with pytest.raises(PhaseFailed, match="clear the rollout and score tasks"):
        scored_record(ctx, 0, 9)


def test_other_estimators_roll_out_no_greedy_answer(tmp_path):
    cfg = load_config(TINY_YAML, small_overrides(**{"storage.uri": f"file://{tmp_path}/store", "epochs": 1,
                                                     "evaluate.every": 0}))
    ctx = make_context(cfg)
    run_phase(ctx, "plan", 0)
    run_phase(ctx, "rollout", 0, 0)
    assert "baselines.jsonl" not in read_marker(ctx.store, ctx.layout.rollout(0, 0)).files
