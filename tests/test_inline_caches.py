"""What the inline path keeps per process stays true to the store: pinned prompts parsed once, still verified."""
from __future__ import annotations

import pytest

from verl_tasks.errors import IntegrityError
from verl_tasks.phases.plan import plan
from verl_tasks.phases.prepare import eval_rows, train_rows
from verl_tasks.runner import make_context
from verl_tasks.store.units import read_marker


def test_pinned_prompts_are_parsed_once_per_process_and_verified_on_every_read(tiny_config):
    ctx = make_context(tiny_config(epochs=1))
    plan(ctx, 0)  # pins the data
    first, second = train_rows(ctx), train_rows(ctx)
    assert first == second and first is not second  # a new list each time ...
    assert all(a is b for a, b in zip(first, second))  # ... of rows parsed once
    evals = eval_rows(ctx)
    assert evals[0] is eval_rows(ctx)[0] and {r["id"] for r in evals}.isdisjoint(r["id"] for r in first)
    record = read_marker(ctx.store, ctx.layout.data("train"))
    path = ctx.store.root / record.key("prompts.jsonl")
    data = bytearray(path.read_bytes())
    data[10] ^= 1  # same size, other bytes: the cache must not hide it
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="prompts.jsonl"):
        train_rows(ctx)
