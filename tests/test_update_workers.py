"""Data-parallel update workers: 2 workers match 1, a snapshot resumes on another worker count, determinism."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from verl_tasks.config import load_config
from verl_tasks.errors import PhaseFailed
from verl_tasks.models.checkpoint import OPTIMIZER, WEIGHTS
from verl_tasks.phases.update_parallel import shard_rows, train_parallel
from verl_tasks.phases.update_steps import UpdateInputs
from verl_tasks.runner import epoch_units, make_context, run_phase
from verl_tasks.store.units import read_json, read_marker

from .conftest import TINY_YAML, small_overrides

# A graded reward, so advantages (and gradients) are not all zero on the barely warm-started policy.
REWARD = {"rewards.function": "tests.reward_fixtures:shared_characters"}
ADAM_FIELDS = {"step", "exp_avg", "exp_avg_sq"}


def _ctx(store: Path, workers: int):
    overrides = {**small_overrides(**REWARD), "resources.update.workers": workers, "storage.uri": f"file://{store}"}
    return make_context(load_config(TINY_YAML, overrides))


def _run_epoch(ctx, epoch: int, through: str) -> None:
    """The epoch's units in order up to and including ``through`` (no evaluation)."""
    for phase, batch in epoch_units(ctx, epoch, ctx.config.epochs):
        if phase != "evaluate":
            run_phase(ctx, phase, epoch, batch)
        if phase == through:
            return


def _unit_file(ctx, unit: str, name: str) -> Path:
    record = read_marker(ctx.store, unit)
    return ctx.store.root / unit / ".attempts" / record.attempt / name


@pytest.fixture(scope="module")
def updated(tmp_path_factory):
    """Epoch 0 validated once; ``updated["w2"]`` etc. run its update on demand (1 worker, 2, 2 again)."""
    root = tmp_path_factory.mktemp("workers")
    _run_epoch(_ctx(root / "validated", 1), 0, "validate")
    return _Updates(root)


class _Updates(dict):
    def __init__(self, root: Path):
        super().__init__()
        self.root = root

    def __missing__(self, name: str):
        workers = int(name[1])
        shutil.copytree(self.root / "validated", self.root / name)
        ctx = _ctx(self.root / name, workers)
        started = time.monotonic()
        run_phase(ctx, "update", 0)
        print(f"update with {workers} worker(s): {time.monotonic() - started:.1f} s")
        self[name] = ctx
        return ctx


def test_two_workers_match_one_worker(updated):
    one, two = (updated[k] for k in ("w1", "w2"))
    unit = one.layout.update(0)
    w1, w2 = load_file(str(_unit_file(one, unit, WEIGHTS))), load_file(str(_unit_file(two, unit, WEIGHTS)))
    assert w1.keys() == w2.keys()
    diff = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    moved = max((w1[k] - w0).abs().max().item() for k, w0 in load_file(str(_unit_file(one, one.layout.snapshot(0), WEIGHTS))).items())
    print(f"max |w(1 worker) - w(2 workers)| = {diff:.3e}; max |w(1 worker) - w(base)| = {moved:.3e}")
    assert moved > 1e-5, "the update did not move the weights: the comparison would be empty"
    assert diff < 1e-5
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], atol=1e-5, rtol=1e-4)
    m1 = read_json(one.store, read_marker(one.store, unit), "metrics.json")
    m2 = read_json(two.store, read_marker(two.store, unit), "metrics.json")
    assert m1.keys() == m2.keys()
    for key, value in m1.items():
        assert m2[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert abs(m1["actor/grad_norm"]) > 0


def test_two_worker_runs_are_identical(updated):
    unit = updated["w2"].layout.update(0)
    a, b = (read_marker(updated[k].store, unit) for k in ("w2", "w2b"))
    assert a.files[WEIGHTS].sha256 == b.files[WEIGHTS].sha256
    assert a.files[OPTIMIZER].sha256 == b.files[OPTIMIZER].sha256


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_resume_on_another_worker_count(updated, tmp_path, before, after):
    """Epoch 0 trained on ``before`` workers, epoch 1 on ``after``: the snapshot carries no world size."""
    source = updated[f"w{before}"]
    shutil.copytree(source.store.root, tmp_path / "store")
    ctx = _ctx(tmp_path / "store", after)
    run_phase(ctx, "snapshot", 0)
    _run_epoch(ctx, 1, "update")

    snapshot_files = set(read_marker(ctx.store, ctx.layout.snapshot(1)).files)
    assert not [name for name in snapshot_files if any(s in name.lower() for s in ("rank", "world", "-of-"))]
    params = set(load_file(str(_unit_file(ctx, ctx.layout.snapshot(1), WEIGHTS))))
    state = load_file(str(_unit_file(ctx, ctx.layout.update(1), OPTIMIZER)))
    names = {key.rsplit("::", 1)[0] for key in state}
    fields = {key.rsplit("::", 1)[1] for key in state}
    assert names == params and fields == ADAM_FIELDS
    steps_per_epoch = ctx.config.samples_per_epoch // ctx.config.algorithm.minibatch_size
    # AdamW's step count continues from epoch 0: the optimizer state was loaded, not started afresh.
    assert {state[f"{name}::step"].item() for name in names} == {2.0 * steps_per_epoch}
    trainer_state = read_json(ctx.store, read_marker(ctx.store, ctx.layout.update(1)), "trainer_state.json")
    assert trainer_state["step"] == 2 * steps_per_epoch


def test_shards_partition_the_minibatch_and_weights_sum_to_one():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0], [1, 0, 0]], dtype=torch.float32)
    inputs = UpdateInputs({"response_mask": mask}, torch.zeros(5, 3), torch.zeros(5, 3), None)
    rows = torch.tensor([4, 0, 2, 1, 3])
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        parts = [shard_rows(inputs, rows, rank, 3, mode) for rank in range(3)]
        assert torch.cat([p[0] for p in parts]).tolist() == rows.tolist()
        assert sum(p[1] for p in parts) == pytest.approx(1.0)
        assert sum(p[2] for p in parts) == pytest.approx(1.0)
    empty = shard_rows(inputs, rows[:1], 1, 2, "token-mean")
    assert empty[1:] == (0.0, 0.0) and len(empty[0]) == 1


def test_a_failing_worker_fails_the_phase_quickly(tmp_path):
    config = load_config(TINY_YAML, {**small_overrides(), "resources.update.workers": 2})
    data = {key: torch.zeros(2, 3, dtype=torch.long) for key in ("input_ids", "attention_mask", "positions", "response_ids")}
    data["response_mask"] = torch.ones(2, 3)
    inputs = UpdateInputs(data, torch.zeros(2, 3), torch.zeros(2, 3), None)
    out = tmp_path / "out"
    out.mkdir()
    started = time.monotonic()
    with pytest.raises(PhaseFailed, match=r"update worker\(s\) \[.*\] of 2 failed"):
        train_parallel(
            unit="tiny/epochs/00000/update", config=config, inputs=inputs, policy_dir=tmp_path / "missing",
            optimizer_path=None, seed=1, out=out,
        )
    assert time.monotonic() - started < 150  # worker start-up (torch import) dominates on a loaded 2-core box
