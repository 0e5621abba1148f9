"""ReMax (``algorithm.adv_estimator: remax``): each prompt's greedy answer is rolled out with its batch, scored
with it, and is the baseline of that prompt's samples.

A small ReMax run is trained once per module; the tests read its committed units.
"""
from __future__ import annotations

import pytest
import torch

from verl_tasks.config import load_config
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
    """Checked against the committed units themselves: each sample's score, and the score of its prompt's
    greedy answer in the same batch's baseline_scores.jsonl."""
    ctx = remax_run
    source = read_update_source(ctx, 0)
    inputs = epoch_inputs(source.samples, 0, ctx.config.algorithm, ctx.config.rollout.max_new_tokens)
    greedy = {}
    for b in range(ctx.config.rollout.batches_per_epoch):
        score = read_marker(ctx.store, ctx.layout.score(0, b))
        greedy.update({r["sample_id"]: r["score"] for r in read_jsonl(ctx.store, score, "baseline_scores.jsonl")})
    expected = torch.tensor([s["score"] - greedy[f"e00000-b{s['batch']:04d}-{s['prompt_id']}-greedy"]
                             for s in source.samples]).unsqueeze(-1) * inputs.data["response_mask"]
    torch.testing.assert_close(inputs.advantages, expected)
    assert expected.abs().sum() > 0


def test_the_baseline_is_the_greedy_answer_of_the_policy_that_sampled(remax_run):
    """The committed baseline is what greedy decoding of policy version 0 answers (the evaluation's decoding)."""
    from verl_tasks.models.engines import SamplingSpec, engine_options, get_engine
    from verl_tasks.phases.common import sampling_policy

    ctx = remax_run
    rollout = read_marker(ctx.store, ctx.layout.rollout(0, 0))
    baselines = read_jsonl(ctx.store, rollout, "baselines.jsonl")
    prompt_ids = {s["prompt_id"]: s["prompt_ids"] for s in read_jsonl(ctx.store, rollout, "samples.jsonl")}
    policy = sampling_policy(ctx, 0)
    spec = SamplingSpec(n=1, temperature=1.0, top_p=1.0, max_new_tokens=ctx.config.rollout.max_new_tokens, seed=1,
                        greedy=True)
    again = get_engine("hf")(policy, [prompt_ids[b["prompt_id"]] for b in baselines], spec, engine_options(ctx.config))
    assert [g.response_ids for g in again] == [b["response_ids"] for b in baselines]


def test_other_estimators_roll_out_no_greedy_answer(tmp_path):
    cfg = load_config(TINY_YAML, small_overrides(**{"storage.uri": f"file://{tmp_path}/store", "epochs": 1,
                                                     "evaluate.every": 0}))
    ctx = make_context(cfg)
    run_phase(ctx, "plan", 0)
    run_phase(ctx, "rollout", 0, 0)
    assert "baselines.jsonl" not in read_marker(ctx.store, ctx.layout.rollout(0, 0)).files
