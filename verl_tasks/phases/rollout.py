"""Generate a group of ``n`` samples for each prompt of one planned batch.

With ReMax (``algorithm.adv_estimator: remax``) the unit also holds each prompt's greedy answer
(``baselines.jsonl``), generated from the same policy in the same attempt: the baseline is committed with
the samples it is compared to, so a retried score or update never generates it again.
"""
from __future__ import annotations

from typing import Any

from verl_tasks import data as data_mod
from verl_tasks.events import record_event
from verl_tasks.models.engines import SamplingSpec, engine_options, get_engine
from verl_tasks.phases.common import PhaseContext, require, run_unit, sampling_policy
from verl_tasks.phases.prepare import train_rows
from verl_tasks.store.units import CommitRecord, UnitWriter, read_json

BASELINES = "baselines.jsonl"


def sample_id(epoch: int, batch: int, prompt_id: str, index: int) -> str:
    return f"e{epoch:05d}-b{batch:04d}-{prompt_id}-s{index:02d}"


def baseline_id(epoch: int, batch: int, prompt_id: str) -> str:
    return f"e{epoch:05d}-b{batch:04d}-{prompt_id}-greedy"


def rollout(ctx: PhaseContext, epoch: int, batch: int) -> CommitRecord:
    cfg = ctx.config

    def produce(writer: UnitWriter) -> dict[str, Any]:
        planned = read_json(ctx.store, require(ctx, ctx.layout.plan(epoch), "plan"), "plan.json")
        if not 0 <= batch < len(planned["batches"]):
            raise ValueError(f"batch {batch} is not in the plan of epoch {epoch} ({len(planned['batches'])} batches)")
        spec_batch = planned["batches"][batch]
        rows = {row["id"]: row for row in train_rows(ctx)}
        policy = sampling_policy(ctx, planned["policy_version"])
        tokenizer = policy.tokenizer
        prompts = [rows[pid] for pid in spec_batch["prompt_ids"]]
        prompt_ids = [
            tokenizer(data_mod.prompt_text(p["prompt"], tokenizer), add_special_tokens=False)["input_ids"]
            for p in prompts
        ]
        spec = SamplingSpec(
            n=cfg.algorithm.group_size,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            max_new_tokens=cfg.rollout.max_new_tokens,
            seed=spec_batch["seed"],
        )
        ctx.hook("rollout_generate", epoch=epoch, batch=batch)
        generations = get_engine(cfg.rollout.engine)(
            policy, prompt_ids, spec, engine_options(cfg),
            on_engine=lambda how: record_event(ctx.store, ctx.layout, "engine_loaded", how=how,
                                               engine=cfg.rollout.engine, version=planned["policy_version"],
                                               epoch=epoch, batch=batch))
        samples = []
        for gen in generations:
            prompt = prompts[gen.prompt_index]
            samples.append(
                {
                    "sample_id": sample_id(epoch, batch, prompt["id"], gen.sample_index),
                    "prompt_id": prompt["id"],
                    "prompt_ids": prompt_ids[gen.prompt_index],
                    "response_ids": gen.response_ids,
                    "response": gen.text,
                    "finished": gen.finished,
                    "policy_version": planned["policy_version"],
                }
            )
        writer.write_jsonl("samples.jsonl", samples)
        if cfg.algorithm.adv_estimator == "remax":
            greedy = SamplingSpec(n=1, temperature=1.0, top_p=1.0, max_new_tokens=cfg.rollout.max_new_tokens,
                                  seed=spec_batch["seed"], greedy=True)
            writer.write_jsonl(BASELINES, [
                {"sample_id": baseline_id(epoch, batch, prompts[gen.prompt_index]["id"]),
                 "prompt_id": prompts[gen.prompt_index]["id"], "response_ids": gen.response_ids,
                 "response": gen.text, "finished": gen.finished}
                for gen in get_engine(cfg.rollout.engine)(policy, prompt_ids, greedy, engine_options(cfg))])
        finished = sum(s["finished"] for s in samples)
        return {"samples": len(samples), "finished_fraction": finished / max(1, len(samples)), "device": policy.device,
                "engine": cfg.rollout.engine}

    return run_unit(ctx, "rollout", ctx.layout.rollout(epoch, batch), epoch, produce, batch=batch)
