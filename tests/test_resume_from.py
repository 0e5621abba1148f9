"""`verl-tasks run --resume-from EXPERIMENT[:VERSION]`: the fork policy Airflow's configure uses, from a shell."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from verl_tasks.cli import app
from verl_tasks.config import load_config
from verl_tasks.errors import ConfigError
from verl_tasks.execution.lineage import parse_source, start_experiment
from verl_tasks.layout import Layout
from verl_tasks.runner import make_context, run_phase
from verl_tasks.store.units import read_marker

from .conftest import TINY_YAML, small_overrides, write_yaml

FAST = {"epochs": 1, "evaluate.max_prompts": 8}


@pytest.fixture(scope="module")
def parent(tmp_path_factory):
    """A parent experiment whose published base (seed 99) differs from what the child would build (seed 7).

    Each test forks it under its own child name.
    """
    tmp_path = tmp_path_factory.mktemp("resume-from")
    uri = f"file://{tmp_path}/store"
    cfg = load_config(TINY_YAML, {**small_overrides(**FAST), "seed": 99, "experiment": "parent-x", "storage.uri": uri})
    ctx = make_context(cfg)
    run_phase(ctx, "plan", 0)  # pins data and publishes snapshot 0 (latest.json)
    return {"uri": uri, "ctx": ctx, "yaml": str(write_yaml(tmp_path, small_overrides(**FAST)))}


def _weights(ctx, experiment: str, version: int) -> str:
    return read_marker(ctx.store, Layout(experiment).snapshot(version)).files["model.safetensors"].sha256


def test_run_resumed_from_another_experiments_snapshot_starts_from_its_weights(parent, tmp_path):
    args = ["run", parent["yaml"], "--store", parent["uri"], "--experiment", "child-x", "--resume-from", "parent-x:0"]
    result = CliRunner().invoke(app, [*args, "--report", str(tmp_path / "curve.md")])
    assert result.exit_code == 0, result.output
    ctx = parent["ctx"]
    assert _weights(ctx, "child-x", 0) == _weights(ctx, "parent-x", 0)
    pin = json.loads(ctx.store.get(Layout("child-x").experiment_json))
    assert (pin["parent"]["experiment"], pin["parent"]["version"]) == ("parent-x", 0)
    plan = read_marker(ctx.store, Layout("child-x").plan(0))
    assert plan is not None and read_marker(ctx.store, Layout("child-x").snapshot(1)) is not None
    assert "child-x starts from parent-x snapshot 0" in result.output
    # version 0 is the parent's snapshot, not a warm-started base model: the summary and the curve say so
    assert "parent: parent-x snapshot 0" in " ".join(result.output.split())
    curve = (tmp_path / "curve.md").read_text()
    assert "| parent-x snapshot 0 (parent) | |" in curve and "warm start" not in curve
    # the same command again continues the same fork (latest by default); nothing is redone
    again = CliRunner().invoke(app, args[:-1] + ["parent-x"])
    assert again.exit_code == 0, again.output
    assert read_marker(ctx.store, Layout("child-x").plan(0)).attempt == plan.attempt


@pytest.mark.parametrize("source,message", [
    ("parent-x:latest", "EXPERIMENT:VERSION with VERSION a snapshot number"),
    ("parent-x:7", "has no committed snapshot 7"),
    ("nobody", "'nobody' has no published snapshot"),
    ("../parent-x", "invalid experiment name"),
    ("child-y", "pick a name other than 'child-y'"),
])
def test_resume_from_refuses_bad_sources_with_one_line(parent, source, message):
    args = ["run", parent["yaml"], "--store", parent["uri"], "--experiment", "child-y", "--resume-from", source]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
    assert not parent["ctx"].store.exists(Layout("child-y").experiment_json)


def test_policy_is_shared_with_airflow(parent):
    ctx = parent["ctx"]
    cfg = load_config(TINY_YAML, {**small_overrides(**FAST), "experiment": "child-z", "storage.uri": parent["uri"]})
    with pytest.raises(ConfigError, match="resume='later'"):
        start_experiment(ctx.store, cfg, resume="later")
    with pytest.raises(ConfigError, match="already exists"):
        start_experiment(ctx.store, ctx.config, resume="fresh")
    started = start_experiment(ctx.store, cfg, scheduled_parent="parent-x")
    assert started["parent"]["version"] == 0 and _weights(ctx, "child-z", 0) == _weights(ctx, "parent-x", 0)
    assert parse_source("parent-x") == ("parent-x", None) and parse_source("parent-x:12") == ("parent-x", 12)


def test_the_resume_and_fork_policy_imports_no_torch(parent):
    """Airflow's configure runs it before any compute: a fork and a resume leave torch unimported."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import sys
        from verl_tasks.config import load_config
        from verl_tasks.execution.lineage import start_experiment
        from verl_tasks.store import open_store
        cfg = load_config({str(TINY_YAML)!r}, {{"storage.uri": {parent["uri"]!r}, "experiment": "child-no-torch"}})
        store = open_store(cfg.storage.uri)
        forked = start_experiment(store, cfg, resume="snapshot", parent="parent-x")
        again = start_experiment(store, cfg, resume="latest")
        assert forked["parent"]["experiment"] == again["parent"]["experiment"] == "parent-x", (forked, again)
        print("torch imported:", "torch" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torch imported: False" in done.stdout, done.stdout + done.stderr[-2000:]
