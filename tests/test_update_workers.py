"""The update on the resident worker group (CPU, gloo): worker counts and strategies agree, a run switches between
them keeping its optimizer state, and a worker SIGKILLed mid-step fails the attempt fast and the retry
commits the same bytes.

One local Ray serves the module: the first distributed update starts it (``train.group.ensure_ray``),
with the test fault hooks (tests/faults) on its workers' PYTHONPATH.

Tolerance: weights within ``WEIGHT_ATOL`` = 1e-5 of the one-worker update. Worker counts and
strategies change only float summation order (each worker's share of the rows, the gradient
all-reduce or reduce-scatter, the norm for clipping); AdamW normalises every step, so a relative
gradient difference of ~1e-7 moves a weight by far less than ``lr`` per step. Measured: 2.1e-7
(lr 1e-4, 2 steps); 1e-5 is 5% of the largest move of the update itself, so a wrong gradient
(a missing share, a doubled average, a reset optimizer) cannot pass.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.faults import harness_env, kill_update_worker
from verl_tasks.config import load_config
from verl_tasks.errors import PhaseFailed
from verl_tasks.models.checkpoint import OPTIMIZER_INDEX, WEIGHTS, check_optimizer_index
from verl_tasks.ops.checkpoint import SnapshotRef, verify
from verl_tasks.phases.update_steps import UpdateInputs, micro_batches
from verl_tasks.runner import epoch_units, make_context, run_phase
from verl_tasks.store.units import read_json, read_marker

from .conftest import TINY_YAML, small_overrides

# The module takes minutes (each test forms its own group of Ray workers): marked slow, it is handed out first
# (tests/conftest.py), not left to run alone at the end of a parallel run.
pytestmark = pytest.mark.slow

# A graded reward, so advantages (and gradients) are not all zero on the barely warm-started policy;
# a KL term, so the reference log-probs are computed by the workers too.
OVERRIDES = {"rewards.function": "tests.reward_fixtures:shared_characters", "model.tiny.warm_start_steps": 20,
             "algorithm.kl_type": "low_var_kl", "algorithm.kl_coef": 0.01}
WEIGHT_ATOL = 1e-5
ADAM_FIELDS = {"step", "exp_avg", "exp_avg_sq"}
FAIL_WITHIN_S = 30


def _ctx(store: Path, workers: int, strategy: str = "ddp", **extra):
    overrides = {**small_overrides(**OVERRIDES), "resources.update.workers": workers,
                 "resources.update.strategy": strategy, "storage.uri": f"file://{store}", **extra}
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


def _weights(ctx, unit: str) -> dict[str, torch.Tensor]:
    return load_file(str(_unit_file(ctx, unit, WEIGHTS)))


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory):
    """The fault plan folder; the Ray this module starts carries the test hooks (set before it starts).

    Tests before this module may have joined other heads from this process: Ray keeps the token it
    read then, so the local Ray started here would refuse it; the environment and that state are reset.
    """
    import ray
    from ray._private.authentication_test_utils import reset_auth_token_state

    if ray.is_initialized():
        ray.shutdown()
    plan = tmp_path_factory.mktemp("faults")
    with pytest.MonkeyPatch.context() as mp:
        for key in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_TMPDIR", "RAY_ADDRESS"):
            mp.delenv(key, raising=False)
        for key, value in harness_env(plan).items():
            mp.setenv(key, value)
        reset_auth_token_state()
        yield plan
        ray.shutdown()


@pytest.fixture(scope="module")
def updated(tmp_path_factory, plan_dir):
    """Epoch 0 validated once; ``updated["w2-fsdp2"]`` etc. run its update on demand on a copy."""
    root = tmp_path_factory.mktemp("workers")
    _run_epoch(_ctx(root / "validated", 1), 0, "validate")
    return _Updates(root)


class _Updates(dict):
    def __init__(self, root: Path):
        super().__init__()
        self.root = root

    def __missing__(self, name: str):
        """``w<workers>-<strategy>[-m<micro-batch size>]``."""
        workers, strategy, *micro = name[1:].split("-")
        shutil.copytree(self.root / "validated", self.root / name)
        extra = {"resources.update.micro_batch_size": int(micro[0][1:])} if micro else {}
        ctx = _ctx(self.root / name, int(workers), strategy, **extra)
        started = time.monotonic()
        run_phase(ctx, "update", 0)
        print(f"update with {workers} {strategy} worker(s): {time.monotonic() - started:.1f} s")
        self[name] = ctx
        return ctx


@pytest.mark.parametrize("name", ["w2-ddp", "w4-ddp", "w2-fsdp2", "w1-ddp-m5", "w2-ddp-m5", "w2-fsdp2-m5"])
def test_worker_counts_and_strategies_match_one_worker(updated, name):
    """Also micro-batched (``-m5``: 5 rows per forward/backward, gradients accumulated): the same update."""
    one, other = updated["w1-ddp"], updated[name]
    unit = one.layout.update(0)
    w1 = _weights(one, unit)
    moved = _max_diff(w1, _weights(one, one.layout.snapshot(0)))
    diff = _max_diff(w1, _weights(other, unit))
    print(f"{name}: max |w(1 worker) - w({name})| = {diff:.3e}; the update moved weights by up to {moved:.3e}")
    assert moved > 20 * WEIGHT_ATOL, "the update barely moved the weights: the comparison would be empty"
    assert diff < WEIGHT_ATOL
    m1 = read_json(one.store, read_marker(one.store, unit), "metrics.json")
    m2 = read_json(other.store, read_marker(other.store, unit), "metrics.json")
    assert m1.keys() == m2.keys()
    for key, value in m1.items():
        assert m2[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    meta = read_marker(other.store, unit).meta
    assert name.startswith(f"w{meta['update_workers']}-{meta['update_strategy']}")


def test_fsdp2_writes_one_optimizer_shard_per_worker_and_an_hf_loadable_snapshot(updated):
    ctx = updated["w2-fsdp2"]
    record = read_marker(ctx.store, ctx.layout.update(0))
    assert {"optimizer.rank00000.safetensors", "optimizer.rank00001.safetensors", OPTIMIZER_INDEX} <= set(record.files)
    index = read_json(ctx.store, record, OPTIMIZER_INDEX)
    assert check_optimizer_index(index, set(record.files)) == []
    rows = index["shards"]["optimizer.rank00000.safetensors"]
    assert any(stop - start < shape for start, stop, shape, *_ in rows.values()), "rank 0 holds every row: not sharded"
    run_phase(ctx, "snapshot", 0)
    verdict = verify(SnapshotRef(ctx.store, ctx.layout, 1))  # every file's hash, the index, a forward pass
    assert verdict.ok, verdict.line()


def test_fsdp2_with_bf16_compute_moves_like_fp32_within_sign_flips(updated, tmp_path):
    """bf16 compute (fp32 master weights and reduction) changes gradients by ~1e-3 relative: AdamW's
    normalised steps then differ by at most 2 lr per step where a gradient's sign flips. CPU offload is
    accepted and ignored on a CPU worker (its shards are in host memory already)."""
    shutil.copytree(updated.root / "validated", tmp_path / "store")
    ctx = _ctx(tmp_path / "store", 2, "fsdp2", **{"resources.update.mixed_precision": "bf16",
                                                  "resources.update.cpu_offload": True})
    run_phase(ctx, "update", 0)
    one = updated["w1-ddp"]
    diff = _max_diff(_weights(one, one.layout.update(0)), _weights(ctx, ctx.layout.update(0)))
    steps = ctx.config.samples_per_epoch // ctx.config.algorithm.minibatch_size
    print(f"bf16 fsdp2: max |w(1 worker fp32) - w| = {diff:.3e}")
    assert WEIGHT_ATOL < diff <= 2 * ctx.config.algorithm.lr * steps * 1.01


@pytest.mark.parametrize(("first", "second"), [("w2-fsdp2", "w1-ddp"), ("w1-ddp", "w2-fsdp2")])
def test_switching_strategy_and_workers_carries_the_optimizer_state(updated, tmp_path, first, second):
    """Epoch 0 on ``first``, epoch 1 on ``second``, both on epoch 1 samples of a run that never switched."""
    never = _never_switched(updated)
    shutil.copytree(updated[first].store.root, tmp_path / "store")
    workers, strategy = second[1:].split("-")
    ctx = _ctx(tmp_path / "store", int(workers), strategy)
    run_phase(ctx, "snapshot", 0)
    for unit in ("plan", "rollout", "score", "validate"):  # the same epoch 1 inputs as the unswitched run
        source = never.store.root / never.layout.epoch(1) / unit
        shutil.copytree(source, tmp_path / "store" / ctx.layout.epoch(1) / unit)
    run_phase(ctx, "update", 1)

    unit = ctx.layout.update(1)
    diff = _max_diff(_weights(never, unit), _weights(ctx, unit))
    print(f"{first} then {second}: max |w - w(never switched)| = {diff:.3e}")
    assert diff < WEIGHT_ATOL
    steps_per_epoch = ctx.config.samples_per_epoch // ctx.config.algorithm.minibatch_size
    state = _optimizer_state(ctx, unit)
    assert {key.rsplit("::", 1)[1] for key in state} == ADAM_FIELDS
    # AdamW's step count continues from epoch 0 and its moments match the unswitched run's:
    # the state was carried over, not started afresh.
    assert {v.item() for k, v in state.items() if k.endswith("::step")} == {2.0 * steps_per_epoch}
    reference = _optimizer_state(never, unit)
    assert state.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(state[key], value, atol=1e-6, rtol=1e-3, msg=key)


def _never_switched(updated):
    """The one-worker run through epoch 1's update (built once)."""
    if "never" not in updated:
        root = updated.root / "never"
        shutil.copytree(updated["w1-ddp"].store.root, root)
        ctx = _ctx(root, 1)
        run_phase(ctx, "snapshot", 0)
        _run_epoch(ctx, 1, "update")
        updated["never"] = ctx
    return updated["never"]


def _optimizer_state(ctx, unit: str) -> dict[str, torch.Tensor]:
    """The full AdamW state of an update unit by ``name::field``, joined from its shards."""
    record = read_marker(ctx.store, unit)
    index = read_json(ctx.store, record, OPTIMIZER_INDEX)
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for file, rows in index["shards"].items():
        tensors = load_file(str(_unit_file(ctx, unit, file)))
        for key, tensor in tensors.items():
            parts.setdefault(key, []).append((rows[key.rsplit("::", 1)[0]][0], tensor))
    return {key: p[0][1] if p[0][1].dim() == 0 else torch.cat([t for _, t in sorted(p, key=lambda x: x[0])])
            for key, p in parts.items()}


def test_a_killed_worker_fails_the_attempt_fast_and_the_retry_commits_the_same_bytes(updated, plan_dir, tmp_path):
    reference = updated["w2-fsdp2"]
    shutil.copytree(updated.root / "validated", tmp_path / "store")
    ctx = _ctx(tmp_path / "store", 2, "fsdp2")
    killed = kill_update_worker(plan_dir, ctx.config.experiment, 0, rank=1)
    with pytest.raises(PhaseFailed, match="update worker failed") as failure:
        run_phase(ctx, "update", 0)
    failed_at = time.time()
    assert killed.exists(), f"worker 1 was not killed; the attempt failed otherwise: {failure.value}"
    killed_at = killed.stat().st_ctime  # the rename, an instant before the SIGKILL
    print(f"attempt failed {failed_at - killed_at:.1f} s after worker 1 was killed")
    assert failed_at - killed_at < FAIL_WITHIN_S
    assert read_marker(ctx.store, ctx.layout.update(0)) is None

    run_phase(ctx, "update", 0)  # the retry: a new attempt from the same committed inputs
    got, want = (read_marker(c.store, c.layout.update(0)) for c in (ctx, reference))
    weights_and_state = {n for n in want.files if n == WEIGHTS or n.startswith("optimizer.")}
    assert {n: got.files[n].sha256 for n in weights_and_state} == {n: want.files[n].sha256 for n in weights_and_state}


@pytest.fixture
def own_groups():
    """The groups a test forms are dismissed after it: later tests count the workers and CPUs groups hold."""
    from verl_tasks.train import group

    yield
    group.release()


LORA = {"model.lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]},
        "algorithm.lr": 1e-3}


def test_a_lora_update_on_two_workers_trains_the_adapter_one_process_trains(plan_dir, tmp_path, own_groups):
    """``model.lora`` on two ddp workers: each holds the frozen base with the adapter, only the adapter's
    gradients are all-reduced, the KL reference is the base with the adapter off, and rank 0 commits the
    adapter and its AdamW state only. The adapter equals the one-process update's within ``WEIGHT_ATOL``;
    the next epoch trains on the adapter the group holds."""
    from verl_tasks.store.conventions import ADAPTER

    _run_epoch(_ctx(tmp_path / "validated", 1, **LORA), 0, "validate")
    runs = {}
    for workers in (1, 2):
        shutil.copytree(tmp_path / "validated", tmp_path / f"w{workers}")
        runs[workers] = ctx = _ctx(tmp_path / f"w{workers}", workers, **LORA)
        run_phase(ctx, "update", 0)
    unit = runs[1].layout.update(0)
    one, two = (load_file(str(_unit_file(runs[w], unit, ADAPTER))) for w in (1, 2))
    moved = max(t.abs().max().item() for name, t in one.items() if "lora_B" in name)  # B starts at zero
    diff = _max_diff(one, two)
    print(f"LoRA: max |adapter(1 process) - adapter(2 workers)| = {diff:.3e}; lora_B moved by up to {moved:.3e}")
    assert moved > 20 * WEIGHT_ATOL, "the update barely moved the adapter: the comparison would be empty"
    assert diff < WEIGHT_ATOL
    record = read_marker(runs[2].store, unit)
    assert record.meta["update_workers"] == 2 and WEIGHTS not in record.files
    assert {ADAPTER, OPTIMIZER_INDEX, "optimizer.safetensors"} <= set(record.files)
    state = load_file(str(_unit_file(runs[2], unit, "optimizer.safetensors")))
    assert state and all("lora_" in key for key in state), "optimizer state beyond the adapter's"

    # Epoch 1 starts from a trained adapter (its AdamW state too): the group trains the one it holds, the one
    # process reads it from the store, and the KL to the base (the adapter off) is no longer zero.
    for ctx in runs.values():
        run_phase(ctx, "snapshot", 0)
        _run_epoch(ctx, 1, "update")
    unit = runs[1].layout.update(1)
    later = read_marker(runs[2].store, unit)
    assert later.meta["ran"]["policy"] == "resident" and later.meta["ran"]["trainable_parameters"] > 0
    assert later.files[ADAPTER].sha256 != record.files[ADAPTER].sha256
    one, two = (load_file(str(_unit_file(runs[w], unit, ADAPTER))) for w in (1, 2))
    moved, diff = _max_diff(one, load_file(str(_unit_file(runs[1], runs[1].layout.update(0), ADAPTER)))), \
        _max_diff(one, two)
    print(f"LoRA epoch 1: max |adapter(1 process) - adapter(2 workers)| = {diff:.3e}; moved by up to {moved:.3e}")
    assert moved > 20 * WEIGHT_ATOL and diff < WEIGHT_ATOL
    kl = [read_json(runs[w].store, read_marker(runs[w].store, unit), "metrics.json")["actor/kl_loss"] for w in (1, 2)]
    assert kl[0] > 0 and kl[1] == pytest.approx(kl[0], rel=1e-4), kl
    run_phase(runs[2], "snapshot", 1)
    verdict = verify(SnapshotRef(runs[2].store, runs[2].layout, 2))
    assert verdict.ok, verdict.line()


PPO = {"algorithm.adv_estimator": "gae", "critic": {"lr": 3e-4}}
CRITIC_GROUP = {"resources.critic.workers": 2, "resources.critic.micro_batch_size": 5}


@pytest.fixture(scope="module")
def ppo_runs(plan_dir, tmp_path_factory):
    """A PPO epoch 0 validated once; its critic and update run on a copy with the critic in one process (``1``)
    and on two workers taking 5 rows per forward (``2``: several micro-batches, DDP's ``no_sync``, a worker's last
    part shorter). The groups formed are dismissed after."""
    from verl_tasks.train import group

    root = tmp_path_factory.mktemp("ppo")
    _run_epoch(_ctx(root / "validated", 1, **PPO), 0, "validate")
    runs: dict = {"validated": root / "validated"}
    for workers in (1, 2):
        shutil.copytree(root / "validated", root / f"w{workers}")
        runs[workers] = ctx = _ctx(root / f"w{workers}", 1, **PPO, **CRITIC_GROUP if workers == 2 else {})
        run_phase(ctx, "critic", 0)
        run_phase(ctx, "update", 0)
    group.release()
    return runs


def test_the_critic_on_two_workers_values_and_trains_as_one_process(ppo_runs):
    """``resources.critic.workers: 2``: DDP workers each value their share of the rows (all-gathered), compute the
    same GAE, and train on their share of every minibatch. The committed critic is within ``WEIGHT_ATOL`` of the
    one-process critic, the advantages and metrics agree, and the policy update trained on them does too."""
    from verl_tasks.phases.update_inputs import ADVANTAGES

    one, two = ppo_runs[1], ppo_runs[2]
    unit = one.layout.critic(0)
    record = read_marker(two.store, unit)
    assert record.meta["ran"]["workers"] == 2, record.meta["ran"]  # what the group's rank 0 reported
    critic = [load_file(str(_unit_file(run, unit, "critic.model.safetensors"))) for run in (one, two)]
    start = load_file(str(_unit_file(one, one.layout.snapshot(0), "critic.model.safetensors")))
    moved, diff = _max_diff(critic[0], start), _max_diff(*critic)
    print(f"critic: max |w(1 process) - w(2 workers)| = {diff:.3e}; the update moved it by up to {moved:.3e}")
    assert moved > 20 * WEIGHT_ATOL and diff < WEIGHT_ATOL
    advantages = [load_file(str(_unit_file(run, unit, ADVANTAGES))) for run in (one, two)]
    for key in ("values", "returns", "advantages"):
        torch.testing.assert_close(advantages[1][key], advantages[0][key], atol=1e-5, rtol=1e-4, msg=key)
    m1, m2 = (read_json(run.store, read_marker(run.store, unit), "metrics.json") for run in (one, two))
    assert m1.keys() == m2.keys()
    for key, value in m1.items():
        assert m2[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    policy = one.layout.update(0)
    assert _max_diff(_weights(one, policy), _weights(two, policy)) < WEIGHT_ATOL


def test_a_killed_critic_worker_fails_the_attempt_fast_and_the_retry_commits_the_same_bytes(
        ppo_runs, plan_dir, tmp_path, own_groups):
    """Critic worker 1 SIGKILLed mid-step: the attempt fails within ``FAIL_WITHIN_S``, nothing is committed, and
    the retry (a fresh group) commits the critic and advantages the fault-free two-worker unit committed, byte for
    byte."""
    shutil.copytree(ppo_runs["validated"], tmp_path / "store")
    ctx = _ctx(tmp_path / "store", 1, **PPO, **CRITIC_GROUP)
    killed = kill_update_worker(plan_dir, ctx.config.experiment, 0, rank=1, phase="critic")
    with pytest.raises(PhaseFailed, match="critic worker failed") as failure:
        run_phase(ctx, "critic", 0)
    failed_at = time.time()
    assert killed.exists(), f"critic worker 1 was not killed; the attempt failed otherwise: {failure.value}"
    assert failed_at - killed.stat().st_ctime < FAIL_WITHIN_S
    assert read_marker(ctx.store, ctx.layout.critic(0)) is None
    run_phase(ctx, "critic", 0)
    got, want = (read_marker(c.store, c.layout.critic(0)) for c in (ctx, ppo_runs[2]))
    assert {n: e.sha256 for n, e in got.files.items()} == {n: e.sha256 for n, e in want.files.items()}


def test_shards_partition_the_minibatch_and_weights_sum_to_one():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0], [1, 0, 0]], dtype=torch.float32)
    inputs = UpdateInputs({"response_mask": mask}, torch.zeros(5, 3), torch.zeros(5, 3), None)
    rows = torch.tensor([4, 0, 2, 1, 3])
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        parts = [part for rank in range(3) for part in micro_batches(inputs, rows, rank, 3, None, mode)]
        assert len(parts) == 3  # one part per worker without a micro-batch size
        assert torch.cat([p[0] for p in parts]).tolist() == rows.tolist()
        assert sum(p[1] for p in parts) == pytest.approx(1.0)
        assert sum(p[2] for p in parts) == pytest.approx(1.0)
    [empty] = micro_batches(inputs, rows[:1], 1, 2, None, "token-mean")
    assert empty[1:] == (0.0, 0.0) and len(empty[0]) == 1


def test_the_optimizer_index_check_finds_gaps_overlaps_and_missing_shards():
    good = {"shards": {"a": {"w": [0, 3, 5, 2]}, "b": {"w": [3, 5, 5, 2]}}}
    assert check_optimizer_index(good, {"a", "b"}) == []
    assert check_optimizer_index(good, {"a"}) == ["optimizer.json names b, which is not in the snapshot"]
    gap = {"shards": {"a": {"w": [0, 2, 5, 2]}, "b": {"w": [3, 5, 5, 2]}}}
    overlap = {"shards": {"a": {"w": [0, 4, 5, 2]}, "b": {"w": [3, 5, 5, 2]}}}
    short = {"shards": {"a": {"w": [0, 3, 5, 2]}}}
    for index in (gap, overlap, short):
        assert len(check_optimizer_index(index, set(index["shards"]))) == 1, index


def test_the_group_trains_on_what_it_holds_only_when_it_is_the_committed_input(updated, tmp_path, fault_hooks):
    """A first attempt trains on the store's policy and fails after its work, before its commit: the group
    then holds weights nothing committed, so the retry (which starts from policy 0 again) reads the store
    and commits the bytes an unfailed attempt commits. The next epoch starts from exactly what the group
    holds and trains on it without reading the store."""
    reference = updated["w2-ddp"]
    shutil.copytree(updated.root / "validated", tmp_path / "store")
    ctx = _ctx(tmp_path / "store", 2)
    failed: list[str] = []

    def fail_first_commit(*, phase: str, **_) -> None:
        if phase == "update" and not failed:
            failed.append(phase)
            raise RuntimeError("injected: the attempt fails after its work")

    fault_hooks["before_commit"] = fail_first_commit
    with pytest.raises(RuntimeError, match="injected"):
        run_phase(ctx, "update", 0)
    run_phase(ctx, "update", 0)
    got, want = (read_marker(c.store, c.layout.update(0)) for c in (ctx, reference))
    assert got.meta["ran"]["policy"] == "store"
    assert got.files[WEIGHTS].sha256 == want.files[WEIGHTS].sha256
    run_phase(ctx, "snapshot", 0)
    _run_epoch(ctx, 1, "update")
    assert read_marker(ctx.store, ctx.layout.update(1)).meta["ran"]["policy"] == "resident"


def test_a_unit_past_its_deadline_stops_every_worker_and_the_retry_commits_the_same_bytes(updated, tmp_path):
    """Inline, the deadline interrupts the driver while the group forms or trains: the group is dismissed
    (its workers gone), nothing is committed, and the retry forms a new group."""
    import ray

    from verl_tasks.errors import UnitTimeout
    from verl_tasks.execution.deadline import unit_deadline
    from verl_tasks.train import group

    reference = updated["w2-ddp"]
    shutil.copytree(updated.root / "validated", tmp_path / "store")
    ctx = _ctx(tmp_path / "store", 2)
    with pytest.raises(UnitTimeout), unit_deadline(ctx.layout.update(0), "update", 0.5):
        run_phase(ctx, "update", 0)
    assert group._HELD == []
    assert read_marker(ctx.store, ctx.layout.update(0)) is None

    def held_cpus() -> float:  # what live actors of this Ray reserve: only the group's workers reserve CPUs
        return ray.cluster_resources()["CPU"] - ray.available_resources().get("CPU", 0.0)

    deadline = time.monotonic() + 60
    while held_cpus() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert held_cpus() == 0, "the dismissed group's workers still hold their CPUs"
    run_phase(ctx, "update", 0)
    got, want = (read_marker(c.store, c.layout.update(0)) for c in (ctx, reference))
    assert got.files[WEIGHTS].sha256 == want.files[WEIGHTS].sha256
