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


def test_the_update_resumes_the_optimizer_it_kept_and_ends_on_the_bytes_of_one_read_back(tiny_config):
    """Epoch 1's update reuses the AdamW that epoch 0's committed, instead of reading it back; a run
    whose process forgets everything after each snapshot reads it from the store: same bytes."""
    from verl_tasks.models.policy_cache import POLICIES
    from verl_tasks.phases import update as update_phase
    from verl_tasks.runner import train
    from verl_tasks.store.conventions import optimizer_state_id

    def trained(experiment: str, forget: bool) -> tuple[dict, str | None, dict]:
        ctx = make_context(tiny_config(experiment=experiment, epochs=3))
        if forget:
            ctx.hooks["before_commit"] = lambda phase, **_: POLICIES.clear() if phase == "snapshot" else None
        POLICIES.clear()
        before = dict(update_phase.OPTIMIZERS)
        latest = train(ctx, 3)["latest_snapshot"]
        counts = {how: update_phase.OPTIMIZERS[how] - before[how] for how in before}
        return latest, optimizer_state_id(read_marker(ctx.store, ctx.layout.snapshot(3))), counts

    kept, kept_state, kept_counts = trained("kept-optimizer", forget=False)
    read_back, read_state, read_counts = trained("read-back-optimizer", forget=True)
    assert kept_counts == {"fresh": 1, "warm": 2, "store": 0}, kept_counts
    assert read_counts == {"fresh": 1, "warm": 0, "store": 2}, read_counts
    assert kept["weights_sha256"] == read_back["weights_sha256"]
    assert kept_state is not None and kept_state == read_state


def test_parsed_json_lines_are_kept_within_a_byte_budget_and_every_read_is_verified(tmp_path, monkeypatch):
    from verl_tasks.store import LocalStore
    from verl_tasks.store import units

    store = LocalStore(tmp_path)
    records = []
    for i in range(3):
        writer = units.UnitWriter(store, f"exp/unit{i}")
        writer.write_jsonl("rows.jsonl", [{"unit": i, "row": r, "pad": "x" * 40} for r in range(10)])
        records.append(writer.commit({})[0])
    size = records[0].files["rows.jsonl"].size
    monkeypatch.setattr(units, "PARSED_BYTES", 2 * size)  # room for two of the three files
    monkeypatch.setattr(units, "_PARSED", {})
    first = [units.read_jsonl(store, r, "rows.jsonl") for r in records]
    assert [rows[3] for rows in first] == [{"unit": i, "row": 3, "pad": "x" * 40} for i in range(3)]
    again = [units.read_jsonl(store, r, "rows.jsonl") for r in reversed(records)][::-1]
    assert again[2][0] is first[2][0] and again[2] is not first[2]  # kept: the same rows in a new list
    assert again[1][0] is first[1][0]
    assert again[0][0] is not first[0][0] and again[0] == first[0]  # pushed out by the third, parsed again
    path = store.root / records[2].key("rows.jsonl")
    path.write_bytes(path.read_bytes().replace(b'"row": 3', b'"row": 4'))
    with pytest.raises(IntegrityError, match="rows.jsonl"):
        units.read_jsonl(store, records[2], "rows.jsonl")
