"""A forked experiment keeps the origin it recorded: its base never follows the parent forward, and is never
rebuilt from the configured model.

The parent's snapshots are fabricated (tiny weights files, real markers): nothing here trains or loads them.
"""
from __future__ import annotations

import json

import pytest

from verl_tasks.config import load_config
from verl_tasks.errors import ConfigError, StoreError
from verl_tasks.execution.lineage import start_experiment
from verl_tasks.layout import Layout
from verl_tasks.phases.fallback import check_resume_point
from verl_tasks.phases.prepare import prepare
from verl_tasks.runner import make_context
from verl_tasks.store.conventions import WEIGHTS, write_latest
from verl_tasks.store.units import UnitWriter, read_marker, verify_unit

from .conftest import TINY_YAML, small_overrides

PARENT = "parent-a"


def publish(store, version: int) -> None:
    """Commit the parent's snapshot ``version`` and point its latest.json at it (it trained on)."""
    layout = Layout(PARENT)
    writer = UnitWriter(store, layout.snapshot(version))
    writer.write_bytes(WEIGHTS, f"parent weights v{version}".encode())
    writer.write_json("config.json", {"model_type": "tiny"})
    record, _ = writer.commit({"version": version})
    write_latest(store, layout, version, record)


@pytest.fixture
def setup(tmp_path):
    """A parent with snapshots 0-3 (latest 3), and a child config in the same store."""
    overrides = small_overrides(**{"model.tiny.warm_start_steps": 5, "data.train_size": 40, "data.eval_size": 8,
                                   "storage.uri": f"file://{tmp_path}/store"})
    cfg = load_config(TINY_YAML, {**overrides, "experiment": "child-20260101"})
    ctx = make_context(cfg)
    for version in range(4):
        publish(ctx.store, version)
    return ctx


def weights(store, experiment: str, version: int) -> str:
    return read_marker(store, Layout(experiment).snapshot(version)).files[WEIGHTS].sha256


def corrupt_base(ctx) -> None:
    """Overwrite the child's base weights after commit, then resume: the fallback quarantines snapshot 0."""
    record = read_marker(ctx.store, ctx.layout.snapshot(0))
    ctx.store.put(record.key(WEIGHTS), b"flipped bits")
    assert check_resume_point(ctx)["quarantined"] == [ctx.layout.snapshot(0)]
    assert read_marker(ctx.store, ctx.layout.snapshot(0)) is None


def test_a_quarantined_forked_base_is_reseeded_from_its_parent_snapshot(setup):
    ctx = setup
    start_experiment(ctx.store, ctx.config, resume="snapshot", parent=PARENT, version=2)
    prepare(ctx)
    corrupt_base(ctx)
    record = prepare(ctx)  # the next run's first plan
    assert record.meta["source"] == "parent" and record.meta["parent"]["version"] == 2
    assert weights(ctx.store, ctx.config.experiment, 0) == weights(ctx.store, PARENT, 2)
    assert verify_unit(ctx.store, record) == []
    pin = json.loads(ctx.store.get(ctx.layout.experiment_json))
    assert (pin["parent"]["experiment"], pin["parent"]["version"]) == (PARENT, 2)


@pytest.mark.parametrize("fault", ["corrupt", "gone"])
def test_a_quarantined_forked_base_whose_parent_snapshot_is_unusable_fails_clearly(setup, fault):
    ctx = setup
    start_experiment(ctx.store, ctx.config, resume="snapshot", parent=PARENT, version=2)
    prepare(ctx)
    corrupt_base(ctx)
    parent_unit = Layout(PARENT).snapshot(2)
    if fault == "corrupt":
        ctx.store.put(read_marker(ctx.store, parent_unit).key(WEIGHTS), b"also flipped")
    else:
        ctx.store.delete(f"{parent_unit}/_SUCCESS")
    with pytest.raises(StoreError) as err:
        prepare(ctx)
    message = str(err.value)
    assert f"re-seeded from its parent, {PARENT} snapshot 2 ({parent_unit})" in message, message
    assert f"--resume-from {PARENT}:VERSION" in message, message
    assert read_marker(ctx.store, ctx.layout.snapshot(0)) is None  # not rebuilt from the configured model


def test_a_cleared_scheduled_run_keeps_the_base_it_started_from(setup):
    ctx = setup
    first = start_experiment(ctx.store, ctx.config, scheduled_parent=PARENT)
    base = read_marker(ctx.store, ctx.layout.snapshot(0))
    assert first["parent"]["version"] == 3
    publish(ctx.store, 4)
    publish(ctx.store, 5)  # the parent trained on while the child ran
    again = start_experiment(ctx.store, ctx.config, scheduled_parent=PARENT)  # Clear of the whole run
    assert again["parent"] == first["parent"]
    assert read_marker(ctx.store, ctx.layout.snapshot(0)).attempt == base.attempt
    # a base quarantined meanwhile is re-seeded from the recorded snapshot 3, not the parent's new latest
    prepare(ctx)
    corrupt_base(ctx)
    start_experiment(ctx.store, ctx.config, scheduled_parent=PARENT)
    assert weights(ctx.store, ctx.config.experiment, 0) == weights(ctx.store, PARENT, 3)


def test_a_rerun_resume_from_the_parent_continues_its_fork(setup):
    ctx = setup
    first = start_experiment(ctx.store, ctx.config, resume="snapshot", parent=PARENT)
    publish(ctx.store, 4)
    again = start_experiment(ctx.store, ctx.config, resume="snapshot", parent=PARENT)
    assert first["parent"]["version"] == again["parent"]["version"] == 3
    with pytest.raises(ConfigError, match="already starts from .*'version': 3"):
        start_experiment(ctx.store, ctx.config, resume="snapshot", parent=PARENT, version=4)
    publish_other = Layout("other-parent")
    writer = UnitWriter(ctx.store, publish_other.snapshot(0))
    writer.write_bytes(WEIGHTS, b"other")
    write_latest(ctx.store, publish_other, 0, writer.commit()[0])
    with pytest.raises(ConfigError, match="already starts from .*'parent-a'"):
        start_experiment(ctx.store, ctx.config, resume="snapshot", parent="other-parent")
    with pytest.raises(ConfigError, match="already starts from .*'parent-a'"):
        start_experiment(ctx.store, ctx.config, scheduled_parent="other-parent")


def test_resume_from_on_an_experiment_built_from_its_model_is_refused(tmp_path):
    """Forking into a name whose base was built from the configured model would silently keep that base."""
    import pytest

    from verl_tasks.errors import ConfigError
    from verl_tasks.execution.lineage import seed_base_from
    from verl_tasks.store import open_store
    from verl_tasks.store.conventions import WEIGHTS
    from verl_tasks.store.units import UnitWriter

    store = open_store(f"file://{tmp_path}/store")
    for unit in ("own/snapshots/00000", "parent/snapshots/00003"):
        writer = UnitWriter(store, unit)
        writer.write_bytes(WEIGHTS, b"weights of " + unit.encode())
        writer.commit({"source": "tiny"})
    with pytest.raises(ConfigError, match="already exists with a base built from its configured model"):
        seed_base_from(store, "own", "parent", 3, seed=0)
