"""The config pin holds in every phase; bad inputs fail with one line naming the problem and the fix."""
from __future__ import annotations

import json

import pytest

from verl_tasks.errors import ConfigMismatch, DataError, PhaseFailed, StoreError
from verl_tasks.runner import make_context, run_phase
from verl_tasks.store.units import is_committed, quarantine

FAST = {"model.tiny.warm_start_steps": 20}


def _markers(store, prefix: str) -> list[str]:
    return [k for k in store.list(prefix) if k.endswith("/_SUCCESS")]


def test_a_yaml_edited_mid_run_cannot_commit_units_under_another_config(tiny_config):
    ctx = make_context(tiny_config(**FAST))
    run_phase(ctx, "plan", 0)
    edited = make_context(tiny_config(**FAST, **{"algorithm.lr": 0.5}))
    with pytest.raises(ConfigMismatch) as err:
        run_phase(edited, "rollout", 0, 0)
    assert err.value.differing_keys == ["algorithm.lr"]
    assert not is_committed(ctx.store, ctx.layout.rollout(0, 0))
    assert not [k for k in ctx.store.list(ctx.layout.rollout(0, 0)) if "/.attempts/" in k]  # nothing computed
    run_phase(ctx, "rollout", 0, 0)  # the pinned config still runs
    assert is_committed(ctx.store, ctx.layout.rollout(0, 0))


def test_a_config_may_change_until_the_first_rollout_is_committed(tiny_config):
    ctx = make_context(tiny_config(**FAST))
    first_plan = run_phase(ctx, "plan", 0)
    changed = make_context(tiny_config(**FAST, **{"rollout.temperature": 0.7, "seed": 3}))
    second_plan = run_phase(changed, "plan", 0)  # re-pinned: data, base and plan recomputed under the new seed
    assert second_plan.attempt != first_plan.attempt
    pin = json.loads(ctx.store.get(ctx.layout.experiment_json))
    assert pin["config_hash"] == changed.config.config_hash()
    kinds = [json.loads(ctx.store.get(k))["kind"] for k in ctx.store.list(ctx.layout.events + "/")]
    assert "repinned" in kinds
    run_phase(changed, "rollout", 0, 0)
    with pytest.raises(ConfigMismatch, match="deleting everything under"):
        run_phase(ctx, "plan", 0)  # now final: the original config is refused


def test_a_damaged_experiment_json_is_one_clear_line(tiny_config):
    ctx = make_context(tiny_config(**FAST))
    run_phase(ctx, "plan", 0)
    ctx.store.put(ctx.layout.experiment_json, b"{not json")
    fresh = make_context(tiny_config(**FAST, **{"torch_threads": 1}))  # not cached as checked in this process
    with pytest.raises(StoreError) as err:
        run_phase(fresh, "rollout", 0, 0)
    message = str(err.value)
    assert "experiment.json is damaged" in message and "restore it" in message and "\n" not in message


def test_a_quarantined_data_unit_names_the_task_to_rerun(tiny_config):
    ctx = make_context(tiny_config(**FAST))
    run_phase(ctx, "plan", 0)
    quarantine(ctx.store, ctx.layout.data("train"), "test: damaged")
    with pytest.raises(PhaseFailed) as err:
        run_phase(ctx, "rollout", 0, 1)
    assert "pinned train prompts are not committed" in str(err.value)
    assert "epoch-0 plan task" in str(err.value)


def test_status_warns_of_quarantined_data_and_base_evaluate_units(tiny_config):
    from verl_tasks.runner import status
    from verl_tasks.store.units import UnitWriter

    ctx = make_context(tiny_config(**FAST))
    for unit in (ctx.layout.data("train"), ctx.layout.base_evaluate):
        writer = UnitWriter(ctx.store, unit)
        writer.write_bytes("data.json", b"{}")
        writer.commit()
        quarantine(ctx.store, unit, "config changed before any rollout: seed")
    st = status(ctx.config, ctx.store)
    assert sorted(q["unit"] for q in st["quarantined"]) == [ctx.layout.base_evaluate, ctx.layout.data("train")]
    assert len(st["warnings"]) == 2


def test_non_utf8_jsonl_names_the_line_and_the_fix(tiny_config, tmp_path):
    data = tmp_path / "prompts.jsonl"
    good = json.dumps({"prompt": "1+1=", "ground_truth": "2"})
    data.write_bytes((good + "\n" + '{"prompt": "caf\xe9", "ground_truth": "2"}\n').encode("latin-1"))
    ctx = make_context(tiny_config(**FAST, **{"data.train": str(data)}))
    with pytest.raises(DataError) as err:
        run_phase(ctx, "plan", 0)
    assert f"{data}:2: not UTF-8 (byte 0xe9" in str(err.value) and "re-encode the file as UTF-8" in str(err.value)
    assert not _markers(ctx.store, ctx.layout.root + "/")


def test_a_repin_killed_before_its_set_aside_is_finished_by_the_next_pin(tiny_config, monkeypatch):
    """The new pin is written first and says its set-aside is pending: a re-pin that dies right after
    (here: the set-aside raises once) is finished by the next pin, never taken for a finished one."""
    from verl_tasks import pinning

    ctx = make_context(tiny_config(**FAST))
    run_phase(ctx, "plan", 0)
    old_data = ctx.layout.data("train")
    assert is_committed(ctx.store, old_data)
    changed = make_context(tiny_config(**FAST, seed=3))
    real = pinning._set_prelude_aside

    def dies(*args, **kwargs):
        raise KeyboardInterrupt("killed between the pin and the set-aside")

    monkeypatch.setattr(pinning, "_set_prelude_aside", dies)
    with pytest.raises(KeyboardInterrupt):
        pinning.pin_experiment(changed)
    pin = json.loads(ctx.store.get(ctx.layout.experiment_json))
    assert pin["config_hash"] == changed.config.config_hash() and pinning.PENDING in pin
    assert is_committed(ctx.store, old_data)  # computed under the old seed, not yet set aside

    monkeypatch.setattr(pinning, "_set_prelude_aside", real)
    done = pinning.pin_experiment(changed)
    assert pinning.PENDING not in done and pinning.PENDING not in json.loads(ctx.store.get(ctx.layout.experiment_json))
    assert not is_committed(ctx.store, old_data), "the old config's data must be set aside"
    second = run_phase(changed, "plan", 0)  # recomputed under the new config
    assert is_committed(ctx.store, old_data) and second is not None
