"""Shared fixtures: both store backends (S3 through a real moto server over HTTP), tiny configs."""
from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = ROOT / "dags" / "experiments" / "tiny_arith.yaml"

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing-key-id")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing-secret-value")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
# This machine reaches no model hub: a lookup fails at once instead of retrying (the package itself sets nothing).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The suite runs torch in many processes at once on two cores (the workers, Ray actors, Airflow's tasks, the
# references): OpenMP threads that sleep instead of spinning (as verl-tasks' own processes do, quiet.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_collection_modifyitems(config, items):
    """Modules holding a ``slow`` test first, each module's tests together and in their order. With parallel
    workers (``make test``: one module per worker at a time, handed out in this order) the modules that take
    minutes start early, instead of one of them running alone at the end while the other workers idle."""
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow)


def free_port() -> int:
    """A free port on 127.0.0.1, below the kernel's ephemeral range (``verl_tasks.execution.ports``)."""
    from verl_tasks.execution.ports import free_port as below_ephemeral

    return below_ephemeral()


def default_sigint() -> None:
    """``preexec_fn`` of a child a test stops with SIGINT, as Ctrl-C in a terminal would: a shell that started
    pytest in the background leaves SIGINT ignored, an ignored signal stays ignored across exec, and bash
    cannot even trap it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)

@pytest.fixture(scope="session")
def moto_endpoint():
    """A moto S3 server on 127.0.0.1 (the real HTTP path, not the in-process mock)."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(moto_endpoint):
    import boto3

    name = f"vt-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    from verl_tasks.store import open_store

    if request.param == "local":
        return open_store(f"file://{tmp_path}/store")
    endpoint = request.getfixturevalue("moto_endpoint")
    bucket = request.getfixturevalue("s3_bucket")
    return open_store(f"s3://{bucket}/prefix", endpoint_url=endpoint)


def small_overrides(**extra) -> dict:
    """A smaller tiny experiment: 2 batches of 8 prompts x 4 samples, a short warm start."""
    base = {
        "epochs": 2,
        "data.train_size": 400,
        "data.eval_size": 40,
        "rollout.batches_per_epoch": 2,
        "rollout.prompts_per_batch": 8,
        "algorithm.group_size": 4,
        "algorithm.minibatch_size": 32,
        "evaluate.max_prompts": 40,
        "model.tiny.warm_start_steps": 300,  # base accuracy ~25%: mixed rewards, real gradients
    }
    base.update(extra)
    return base


def write_yaml(folder: Path, overrides: dict, base: Path = TINY_YAML) -> Path:
    """An experiment YAML (the tiny one by default) with dotted-key overrides applied.

    Written to ``folder/exp.yaml``.
    """
    import yaml

    raw = yaml.safe_load(base.read_text())
    for dotted, value in overrides.items():
        node = raw
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    path = folder / "exp.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture
def tiny_config(tmp_path):
    from verl_tasks.config import load_config

    def make(store_uri: str | None = None, **extra):
        overrides = small_overrides(**extra)
        overrides["storage.uri"] = store_uri or f"file://{tmp_path}/store"
        return load_config(TINY_YAML, overrides)

    return make


class FaultHooks:
    """Hooks at the package's hook points (:mod:`verl_tasks.hooks`) for one test, set like a dict:
    ``fault_hooks["before_commit"] = fn`` registers ``fn`` (in place of this test's earlier one of that
    name); ``clear()`` takes them all out. ``fn`` gets the point's keywords and ``experiment``."""

    def __init__(self) -> None:
        self._set: dict[str, object] = {}

    def __setitem__(self, name: str, fn) -> None:
        from verl_tasks import hooks

        self.pop(name)
        hooks.register(name, fn)
        self._set[name] = fn

    def pop(self, name: str) -> None:
        from verl_tasks import hooks

        fn = self._set.pop(name, None)
        if fn is not None:
            hooks.unregister(name, fn)

    def clear(self) -> None:
        for name in list(self._set):
            self.pop(name)


@pytest.fixture
def fault_hooks():
    """Faults injected into the units this test runs in its own process; all removed when it ends."""
    installed = FaultHooks()
    yield installed
    installed.clear()


@pytest.fixture
def allow_process_isolation(monkeypatch):
    """A deployment whose operators let experiments ask for ``rewards.isolation: process`` (the default allows
    namespaces only: ``verl_tasks.rewards.deployment``)."""
    from verl_tasks.rewards.deployment import ISOLATIONS_ENV

    monkeypatch.setenv(ISOLATIONS_ENV, "namespaces,process")
