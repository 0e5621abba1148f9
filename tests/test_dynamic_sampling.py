"""DAPO's dynamic sampling (``algorithm.filter_groups``): the ``top_up`` task, its extra batches and selection.

One small run with dynamic sampling is trained per module and read by several tests; each checks what the
committed units hold against what the epoch's own units say (scores per group, the plan's extra prompts).
"""
from __future__ import annotations

import pytest

from verl_tasks.config import load_config
from verl_tasks.errors import ConfigError, TooFewGroups
from verl_tasks.phase_registry import phases_for
from verl_tasks.phases.top_up import read_selection
from verl_tasks.phases.update_inputs import read_update_source
from verl_tasks.runner import make_context, train
from verl_tasks.store.units import read_json, read_jsonl, read_marker

from .conftest import TINY_YAML, small_overrides

DYNAMIC = {"algorithm.filter_groups": {"enable": True, "max_batches": 8}}


def config(tmp_path, **extra):
    return load_config(TINY_YAML, small_overrides(**{"storage.uri": f"file://{tmp_path}/store", **DYNAMIC, **extra}))


def prompts_whose_scores_differ(ctx, epoch: int, batch: int) -> list[str]:
    """From the batch's committed units: its prompts, in rollout order, whose samples' scores are not all equal."""
    samples = read_jsonl(ctx.store, read_marker(ctx.store, ctx.layout.rollout(epoch, batch)), "samples.jsonl")
    scores = {r["sample_id"]: r["score"] for r in
              read_jsonl(ctx.store, read_marker(ctx.store, ctx.layout.score(epoch, batch)), "scores.jsonl")}
    order = list(dict.fromkeys(s["prompt_id"] for s in samples))
    return [p for p in order if len({scores[s["sample_id"]] for s in samples if s["prompt_id"] == p}) > 1]


@pytest.fixture(scope="module")
def dynamic_run(tmp_path_factory):
    ctx = make_context(config(tmp_path_factory.mktemp("dynamic")))
    return ctx, train(ctx, ctx.config.epochs)


@pytest.mark.parametrize("overrides, says", [
    ({"algorithm.filter_groups": {"enable": True}}, "set algorithm.filter_groups.max_batches above"),
    ({"algorithm.filter_groups": {"enable": True, "max_batches": 2}}, "set algorithm.filter_groups.max_batches"),
    ({**DYNAMIC, "algorithm.group_size": 1, "algorithm.adv_estimator": "reinforce_plus_plus"}, "group_size >= 2"),
    ({**DYNAMIC, "fault_tolerance.min_committed_batch_fraction": 0.5}, "min_committed_batch_fraction: 1"),
])
def test_dynamic_sampling_that_cannot_fill_an_epoch_is_refused_on_load(tmp_path, overrides, says):
    with pytest.raises(ConfigError, match=says):
        load_config(TINY_YAML, small_overrides(**{"storage.uri": f"file://{tmp_path}/s", **overrides}))


def test_top_up_runs_between_score_and_validate_only_with_dynamic_sampling(tmp_path):
    plain = load_config(TINY_YAML, small_overrides(**{"storage.uri": f"file://{tmp_path}/s"}))
    assert "top_up" not in phases_for(plain)
    names = list(phases_for(config(tmp_path)))
    assert names.index("score") < names.index("top_up") < names.index("validate")


def test_the_update_trains_on_the_first_groups_whose_scores_differ(dynamic_run):
    ctx, status = dynamic_run
    cfg = ctx.config
    drawn_extra = 0
    for epoch in range(cfg.epochs):
        selection = read_selection(ctx, epoch)
        batches = selection["batches"]
        assert batches == list(range(len(batches))) and len(batches) >= cfg.rollout.batches_per_epoch
        drawn_extra += len(batches) - cfg.rollout.batches_per_epoch
        varied = [[b, prompt] for b in batches for prompt in prompts_whose_scores_differ(ctx, epoch, b)]
        assert selection["groups"] == varied[: cfg.prompts_per_epoch]
        assert len(selection["groups"]) == cfg.prompts_per_epoch
        # It stopped at the first batch that filled the epoch.
        assert len([g for g in varied if g[0] < batches[-1]]) < cfg.prompts_per_epoch
        samples = read_update_source(ctx, epoch).samples
        assert len(samples) == cfg.samples_per_epoch
        assert [[s["batch"], s["prompt_id"]] for s in samples[:: cfg.algorithm.group_size]] == selection["groups"]
        for b in batches:  # every batch drawn is committed, rollout and score, as its own unit
            assert read_marker(ctx.store, ctx.layout.score(epoch, b)) is not None
    assert drawn_extra > 0, "no epoch needed an extra batch: the test checks nothing beyond the planned ones"
    assert status["phases"] == list(phases_for(ctx.config))


def test_extra_batches_are_planned_ahead_from_other_prompts(dynamic_run):
    ctx, _ = dynamic_run
    cfg = ctx.config
    plan = read_json(ctx.store, read_marker(ctx.store, ctx.layout.plan(0)), "plan.json")
    batches = plan["batches"]
    assert len(batches) == cfg.algorithm.filter_groups.max_batches
    own = {p for b in batches[: cfg.rollout.batches_per_epoch] for p in b["prompt_ids"]}
    extra = [p for b in batches[cfg.rollout.batches_per_epoch:] for p in b["prompt_ids"]]
    assert extra and not own & set(extra)
    assert len({b["seed"] for b in batches}) == len(batches)


def test_reaching_max_batches_is_refused_and_keeps_what_was_drawn(tmp_path):
    """A policy that answers alike within every group (sampling at a temperature near 0) leaves no group to
    train on: top_up draws max_batches and refuses; each batch it drew stays committed."""
    ctx = make_context(config(tmp_path, **{"rollout.temperature": 0.001, "epochs": 1}))
    with pytest.raises(TooFewGroups, match="max_batches=8 rollout batches") as err:
        train(ctx, 1)
    assert "--resume-from tiny-arith --experiment NEW_NAME" in str(err.value)
    assert read_marker(ctx.store, ctx.layout.top_up(0)) is None
    assert all(read_marker(ctx.store, ctx.layout.score(0, b)) is not None for b in range(8))


def test_a_prompt_drawn_in_two_batches_is_two_groups():
    """GRPO's baseline is the group of one prompt's samples in one batch: a prompt dynamic sampling draws again
    in an extra batch is compared with its own samples there, not pooled with the first draw."""
    from verl_tasks.config import AlgorithmConfig
    from verl_tasks.phases.update_steps import epoch_inputs

    def sample(batch, score):
        return {"batch": batch, "prompt_id": "p", "prompt_ids": [5, 6], "response_ids": [7], "score": score}

    samples = [sample(0, 1.0), sample(0, 0.0), sample(4, 1.0), sample(4, 1.0)]
    advantages = epoch_inputs(samples, 0, AlgorithmConfig(group_size=2), 4).advantages[:, 0]
    assert advantages[2:].abs().sum() == 0  # alike within its own batch: no signal
    assert advantages[0] > 0 > advantages[1]


def test_extra_batches_never_repeat_a_prompt_within_a_batch(tmp_path):
    """With fewer unused prompts than a batch holds, extra batches draw from all prompts, each batch distinct."""
    from verl_tasks.phases.plan import extra_batches

    cfg = config(tmp_path, **{"algorithm.filter_groups": {"enable": True, "max_batches": 6}})
    ids = [f"q{i}" for i in range(cfg.prompts_per_epoch + 3)]  # 3 unused prompts, batches of 8
    chosen = set(ids[: cfg.prompts_per_epoch])
    batches = extra_batches(cfg, 0, ids, chosen)
    assert len(batches) == 4
    for batch in batches:
        assert len(set(batch["prompt_ids"])) == len(batch["prompt_ids"]) == cfg.rollout.prompts_per_batch
