"""What the inline path keeps per process stays true to the store: pinned prompts parsed once, still verified."""
from __future__ import annotations

import os
import time
from pathlib import Path

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
    assert all(a is b for a, b in zip(first, second, strict=True))  # ... of rows parsed once
    evals = eval_rows(ctx)
    assert evals[0] is eval_rows(ctx)[0] and {r["id"] for r in evals}.isdisjoint(r["id"] for r in first)
    record = read_marker(ctx.store, ctx.layout.data("train"))
    path = ctx.store.root / record.key("prompts.jsonl")
    data = bytearray(path.read_bytes())
    data[10] ^= 1  # same size, other bytes: the cache must not hide it
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="prompts.jsonl"):
        train_rows(ctx)


def test_the_update_resumes_the_optimizer_it_kept_and_ends_on_the_bytes_of_one_read_back(tiny_config, fault_hooks,
                                                                                        monkeypatch):
    """Epoch 1's update reuses the AdamW that epoch 0's committed, instead of reading it back; a run
    whose process forgets everything after each snapshot reads it from the store: same bytes."""
    from verl_tasks.models.policy_cache import POLICIES
    from verl_tasks.phases import update as update_phase
    from verl_tasks.runner import train
    from verl_tasks.store.conventions import optimizer_state_id

    resumed, counts = update_phase.resumed_optimizer, {"warm": 0, "store": 0, "fresh": 0}

    def counted(model, algo, folder, state_id, warm):
        """Where each update's optimizer came from: the one kept warm, the store, or new."""
        optimizer = resumed(model, algo, folder, state_id, warm)
        kept = warm is not None and optimizer is warm.optimizer
        counts["warm" if kept else "store" if state_id is not None else "fresh"] += 1
        return optimizer

    monkeypatch.setattr(update_phase, "resumed_optimizer", counted)

    def trained(experiment: str, forget: bool) -> tuple[dict, str | None, dict]:
        ctx = make_context(tiny_config(experiment=experiment, epochs=3))
        if forget:
            fault_hooks["before_commit"] = lambda phase, **_: POLICIES.clear() if phase == "snapshot" else None
        POLICIES.clear()
        before = dict(counts)
        latest = train(ctx, 3)["latest_snapshot"]
        return latest, optimizer_state_id(read_marker(ctx.store, ctx.layout.snapshot(3))), {
            how: counts[how] - before[how] for how in before}

    kept, kept_state, kept_counts = trained("kept-optimizer", forget=False)
    read_back, read_state, read_counts = trained("read-back-optimizer", forget=True)
    assert kept_counts == {"fresh": 1, "warm": 2, "store": 0}, kept_counts
    assert read_counts == {"fresh": 1, "warm": 0, "store": 2}, read_counts
    assert kept["weights_sha256"] == read_back["weights_sha256"]
    assert kept_state is not None and kept_state == read_state


def test_parsed_json_lines_are_kept_within_a_byte_budget_and_every_read_is_verified(tmp_path, monkeypatch):
    from verl_tasks.store import LocalStore, units

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


def test_a_kept_optimizer_serves_only_its_own_state_over_its_own_model(tiny_config, tmp_path):
    import torch

    from verl_tasks.models.checkpoint import save_optimizer
    from verl_tasks.models.policy_cache import WarmOptimizer
    from verl_tasks.phases.update import resumed_optimizer

    algo = tiny_config().algorithm
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    kept = torch.optim.AdamW(model.parameters(), lr=algo.lr, betas=algo.betas, weight_decay=algo.weight_decay)
    model(torch.ones(1, 3)).sum().backward()
    kept.step()
    save_optimizer(kept, model, tmp_path)
    warm = WarmOptimizer("state-a", kept)

    assert resumed_optimizer(model, algo, tmp_path, "state-a", warm) is kept
    other_state = resumed_optimizer(model, algo, tmp_path, "state-b", warm)  # the snapshot lists other bytes
    twin = torch.nn.Linear(3, 2)
    twin.load_state_dict(model.state_dict())
    other_model = resumed_optimizer(twin, algo, tmp_path, "state-a", warm)  # kept over another module's params
    fresh = resumed_optimizer(model, algo, tmp_path, None, warm)  # a base snapshot: no state
    assert kept not in (other_state, other_model, fresh) and not fresh.state
    assert [p for g in other_model.param_groups for p in g["params"]] == list(twin.parameters())
    for loaded, params in ((other_state, model.parameters()), (other_model, twin.parameters())):
        for mine, theirs in zip(params, model.parameters(), strict=True):
            assert torch.equal(loaded.state[mine]["exp_avg"], kept.state[theirs]["exp_avg"])


def test_an_update_that_loses_its_commit_race_keeps_nothing_warm(tiny_config, fault_hooks):
    """The winner's record names the winner's bytes: the loser's model is not kept under them."""
    from verl_tasks.events import read_events
    from verl_tasks.models.policy_cache import POLICIES
    from verl_tasks.runner import train
    from verl_tasks.store.units import UnitWriter

    ctx = make_context(tiny_config(experiment="lost-race", epochs=2))

    def rival_commits_first(phase, unit, epoch, **_):
        if phase != "update" or epoch != 0:
            return
        [mine] = (ctx.store.root / unit / ".attempts").iterdir()
        rival = UnitWriter(ctx.store, unit)
        for path in sorted(mine.iterdir()):
            rival.write_bytes(path.name, path.read_bytes())
        assert rival.commit({"policy_version": 1, "update_workers": 1, "update_strategy": "ddp"})[1]

    fault_hooks["before_commit"] = rival_commits_first
    POLICIES.clear()
    train(ctx, 2)
    events = read_events(ctx.store, ctx.layout)
    [lost] = [e for e in events if e["kind"] == "lost_race"]
    assert lost["unit"] == ctx.layout.update(0) and lost["winner"] != lost["attempt"]
    loads = [(e["version"], e["how"]) for e in events if e["kind"] == "policy_loaded"]
    assert (1, "built") in loads or (1, "in_place") in loads, loads  # version 1 was loaded, not adopted
    assert not any(version == 2 for version, _ in loads), loads  # epoch 1's own update was adopted


@pytest.mark.parametrize("kl_type,kl_coef", [("none", 0.0), ("low_var_kl", 0.01)])
def test_one_process_loads_each_policy_version_once(tiny_config, kl_type, kl_coef):
    """The update trains a copy of the base, which its evaluation (and the KL reference) read again;
    every later version is the update's own trained model, kept."""
    from verl_tasks.events import read_events
    from verl_tasks.models.policy_cache import POLICIES
    from verl_tasks.runner import train

    ctx = make_context(tiny_config(experiment=f"loads-{kl_type}", epochs=3, **{"algorithm.kl_type": kl_type,
                                                                             "algorithm.kl_coef": kl_coef,
                                                                             "evaluate.every": 1}))
    POLICIES.clear()
    train(ctx, 3)
    events = read_events(ctx.store, ctx.layout)
    loads = [e["version"] for e in events if e["kind"] == "policy_loaded"]
    copies = [e["version"] for e in events if e["kind"] == "policy_copied"]
    assert loads == [0] and copies == [0], (loads, copies)


BUILDER = """\
import sys, time
from pathlib import Path
from verl_tasks.config import load_config
from verl_tasks.phases.prepare import _base_folder
from verl_tasks.runner import make_context

config, work, ready, go = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
ctx = make_context(load_config(config))
ready.touch()
while not go.exists():
    time.sleep(0.01)
work.mkdir()
print("FOLDER", _base_folder(ctx, work)[0])
"""


def test_two_units_on_one_node_build_the_same_warm_start_once(tmp_path):
    """Two processes that need the same tiny warm start at the same moment: one builds it, the other waits and
    takes the cached folder (with the same bytes), and no half-written folder is left in the cache."""
    import subprocess
    import sys

    from tests.conftest import ROOT, TINY_YAML, small_overrides, write_yaml

    config = write_yaml(tmp_path, small_overrides(**{"model.tiny.warm_start_steps": 150,
                                                      "storage.uri": f"file://{tmp_path}/store"}), base=TINY_YAML)
    env = {**os.environ, "VERL_TASKS_CACHE": str(tmp_path / "cache")}
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", BUILDER, str(config), str(tmp_path / f"work{i}"),
                               str(tmp_path / f"ready{i}"), str(go)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    deadline = time.monotonic() + 300
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.1)
    go.touch()  # both ask for the warm start within milliseconds of each other
    folders = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        folders.append(Path(out.split("FOLDER ", 1)[1].strip()))
    built = [f for f in folders if f.parent == tmp_path]
    cached = [f for f in folders if f.parent == tmp_path / "cache" / "warm-start"]
    assert len(built) == 1 and len(cached) == 1, folders
    assert (built[0] / "model.safetensors").read_bytes() == (cached[0] / "model.safetensors").read_bytes()
    assert sorted(p.name for p in cached[0].parent.iterdir() if p.is_dir()) == [cached[0].name]
