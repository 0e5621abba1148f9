"""The reward sandbox as a boundary: each probe a reviewer ran against the old one, run for real.

The probes (tests/sandbox_probes.py) return 1.0 when an attack worked. Under the default
``rewards.isolation: namespaces`` every one must fail; several are also run under ``process``,
where they succeed, to show the probe itself would notice.
"""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from verl_tasks.config import parse_config
from verl_tasks.errors import ConfigError
from verl_tasks.rewards import sandbox as sandbox_mod
from verl_tasks.rewards.isolation import bwrap_command, check_namespaces
from verl_tasks.rewards.sandbox import RewardSandbox, preflight
from verl_tasks.secrets import REWARD_ENV_COPIED, REWARD_ENV_SET, is_secret_name

from .conftest import ROOT, TINY_YAML

# These rows stand for a deployment that lets experiments ask for process isolation as well; the default
# deployment's refusal of it is tested in tests/test_sandbox_bounds.py.
pytestmark = pytest.mark.usefixtures("allow_process_isolation")

PROBES = "tests.sandbox_probes"
SECRET = "vt-sandbox-secret-3c9e71"
# What the reviewer found in a reward function's reach: none may reach the sandbox.
ISSUE_ENV = {
    "AWS_SECRET_ACCESS_KEY": SECRET, "AIRFLOW_CONN_AWS_DEFAULT": f"aws://AKIA:{SECRET}@",
    "RAY_AUTH_TOKEN": SECRET, "DATABASE_URL": f"postgresql://airflow:{SECRET}@127.0.0.1/airflow",
    "SQL_ALCHEMY_CONN": f"postgresql+psycopg2://airflow:{SECRET}@127.0.0.1/airflow",
    "CELERY_BROKER_URL": f"redis://:{SECRET}@127.0.0.1:6379/0", "SLACK_WEBHOOK_URL": f"https://hooks/{SECRET}",
    "GITHUB_PAT": SECRET, "DB_PASS": SECRET, "SENTRY_DSN": f"https://{SECRET}@sentry.example/1",
    "MLFLOW_TRACKING_URI": f"http://mlflow:{SECRET}@127.0.0.1:5000",
}


def _request(**extra_info):
    return [{"id": "s0", "data_source": "t", "solution_str": "x", "ground_truth": "1", "extra_info": extra_info}]


def _score_in_child(function: str, isolation: str, extra_info: dict) -> dict:
    """Score one sample from a child process whose environment, from its exec on, holds the names the
    reviewer found (so they are in its ``/proc/<pid>/environ`` too), plus two ``VT_`` settings.
    Returns ``{"pid": the child's pid, "env": the worker's environment names, "scores", "failures"}``."""
    import json

    script = (
        "import json, os, sys\n"
        "from verl_tasks.rewards.sandbox import RewardSandbox\n"
        "extra = json.loads(sys.argv[3]) | {'pid': os.getpid()}\n"
        "with RewardSandbox(sys.argv[1], 10.0, 1024, isolation=sys.argv[2]) as box:\n"
        "    extra.setdefault('expected', sorted(box.started_env))\n"
        "    r = box.score([{'id': 's0', 'data_source': 't', 'solution_str': 'x', 'ground_truth': '1',\n"
        "                    'extra_info': extra}], default=-1.0)\n"
        "print(json.dumps({'pid': os.getpid(), 'env': extra['expected'], 'scores': r.scores,\n"
        "                  'failures': r.failures}))\n")
    env = {**os.environ, **ISSUE_ENV, "VT_TEST_PLAIN_SETTING": "visible", "VT_API_TOKEN": SECRET}
    done = subprocess.run([sys.executable, "-c", script, function, isolation, json.dumps(extra_info)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_the_scoring_process_is_invisible_and_no_environ_holds_a_secret():
    seen = _score_in_child(f"{PROBES}:read_environs", "namespaces", {"secret": SECRET})
    assert seen["scores"] == [0.0] and not seen["failures"], seen  # not even the scoring process's pid is there
    control = _score_in_child(f"{PROBES}:read_environs", "process", {"secret": SECRET})
    assert "the secret is in /proc/" in control["failures"]["s0"], control  # the probe finds it where it can look


@pytest.mark.parametrize("isolation", ["namespaces", "process"])
def test_the_environment_holds_only_allow_listed_names(isolation):
    seen = _score_in_child(f"{PROBES}:environment_names", isolation, {"secret": SECRET})
    assert seen["scores"] == [1.0] and not seen["failures"], seen  # exactly these names, no value holds the secret
    names = set(seen["env"])
    assert not set(ISSUE_ENV) & names and "VT_API_TOKEN" not in names
    assert "VT_TEST_PLAIN_SETTING" in names
    allowed = set(REWARD_ENV_SET) | set(REWARD_ENV_COPIED)
    assert all(n in allowed or (n.startswith("VT_") and not is_secret_name(n)) for n in names), names


def test_loopback_services_are_unreachable():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with RewardSandbox(f"{PROBES}:connect", 10.0, 1024) as box:
            result = box.score(_request(host="127.0.0.1", port=port), default=-1.0)
            metadata = box.score(_request(host="169.254.169.254", port=80), default=-1.0)  # instance metadata
        assert result.scores == [0.0] and not result.failures, result
        assert metadata.scores == [0.0] and not metadata.failures, metadata
        with RewardSandbox(f"{PROBES}:connect", 10.0, 1024, isolation="process") as box:
            assert box.score(_request(host="127.0.0.1", port=port), default=-1.0).scores == [1.0]


@pytest.fixture
def store_beside_the_code():
    """A local store in the repository's folder, next to the code the sandbox shows (not under /tmp)."""
    import shutil

    from verl_tasks.store import open_store
    from verl_tasks.store.units import UnitWriter

    root = ROOT / f".vt-test-store-{uuid.uuid4().hex[:8]}"
    store = open_store(f"file://{root}")
    writer = UnitWriter(store, "exp/epochs/00000/score/b0000")
    writer.write_jsonl("scores.jsonl", [{"sample_id": "real", "score": 0.0}])
    writer.commit({})
    try:
        yield root, store
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_the_local_store_does_not_exist_in_the_sandbox(store_beside_the_code):
    from verl_tasks.store.units import read_marker

    root, store = store_beside_the_code
    unit, witness = "exp/epochs/00000/score/b0001", "exp/epochs/00000/score/b0000/_SUCCESS"
    with RewardSandbox(f"{PROBES}:forge_commit", 10.0, 1024) as box:
        result = box.score(_request(store=str(root), unit=unit, witness=witness), default=-1.0)
    assert result.scores == [0.0] and not result.failures, result  # the store's content is not there at all
    assert read_marker(store, unit) is None and not (root / unit).exists()
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("_SUCCESS")) == [
        "exp/epochs/00000/score/b0000/_SUCCESS"]
    with RewardSandbox(f"{PROBES}:forge_commit", 10.0, 1024, isolation="process") as box:
        assert box.score(_request(store=str(root), unit=unit, witness=witness), default=-1.0).scores == [1.0]
    assert read_marker(store, unit) is not None  # what process isolation cannot prevent (hence the warning)


def _pids_with(marker: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    pids.append(int(entry))
            except OSError:
                continue
    return pids


def test_a_setsid_grandchild_is_gone_after_close():
    marker = f"vt-setsid-probe-{uuid.uuid4().hex[:8]}"
    box = RewardSandbox(f"{PROBES}:setsid_grandchild", 10.0, 1024)
    try:
        box.start()
        assert box.score(_request(marker=marker), default=-1.0).scores == [1.0]
        left = _pids_with(marker)
        assert len(left) == 1, left  # the grandchild, seen from here, in its own session
        assert os.getsid(left[0]) != os.getsid(box.proc.pid)
    finally:
        box.close()
    deadline = time.monotonic() + 5
    while _pids_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _pids_with(marker), "the setsid grandchild outlived close()"


def test_too_many_processes_get_the_default_score_and_name_the_limit():
    with RewardSandbox(f"{PROBES}:fork_bomb", 30.0, 1024, max_processes=16) as box:
        pid = box.proc.pid
        result = box.score(_request() + [{**_request()[0], "id": "s1"}], default=-1.0)
        assert box.proc is not None and box.proc.pid == pid  # the worker survived and cleaned up
    assert result.scores == [-1.0, -1.0]
    assert all("rewards.max_processes" in result.failures[s] for s in ("s0", "s1")), result


def test_cpu_time_limit_stops_a_spinning_function_and_is_named():
    started = time.monotonic()
    with RewardSandbox(f"{PROBES}:spin", 60.0, 1024, cpu_limit_s=1) as box:
        result = box.score(_request(), default=-1.0)
    assert result.scores == [-1.0] and "CPU time limit exceeded" in result.failures["s0"], result
    assert time.monotonic() - started < 30  # the CPU limit, not the 60 s wall clock


def test_a_worker_near_its_cpu_cap_is_replaced_between_samples(monkeypatch):
    monkeypatch.setattr(sandbox_mod, "CPU_CAP_S", 3)  # every process: 3 CPU s in all; each sample may use 1
    samples = [{"id": f"s{i}", "data_source": "t", "solution_str": "x", "ground_truth": "1",
                "extra_info": {"seconds": 0.4}} for i in range(6)]
    pids = set()
    with RewardSandbox(f"{PROBES}:spin", 30.0, 1024, cpu_limit_s=1) as box:
        for sample in samples:
            result = box.score([sample], default=-1.0)
            assert result.scores == [1.0] and not result.failures, result  # retiring costs no sample
            if box.proc is not None:
                pids.add(box.proc.pid)
    assert len(pids) >= 2, "the worker was never retired"


def test_a_runaway_child_is_stopped_by_the_cpu_cap_while_the_worker_stays_warm(monkeypatch):
    monkeypatch.setattr(sandbox_mod, "CPU_CAP_S", 3)
    marker = f"vt-spinning-child-{uuid.uuid4().hex[:8]}"
    with RewardSandbox(f"{PROBES}:spinning_child", 30.0, 1024, cpu_limit_s=1) as box:
        assert box.score(_request(marker=marker), default=-1.0).scores == [1.0]
        worker = box.proc.pid
        deadline = time.monotonic() + 60
        while _running(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(marker), "the spinning child was not stopped"
        assert box.proc is not None and box.proc.pid == worker and box.proc.poll() is None


def _running(marker: str) -> bool:
    """Whether a process with ``marker`` on its command line is alive (a zombie is not)."""
    for pid in _pids_with(marker):
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                return True
        except OSError:
            continue
    return False


def test_memory_limit_names_the_setting():
    with RewardSandbox("tests.reward_fixtures:memory_hog", 10.0, 300) as box:
        result = box.score(_request(), default=0.0)
    assert result.scores == [0.0]
    assert "rewards.memory_limit_mb=300" in result.failures["s0"] or "crashed" in result.failures["s0"], result


def _raw() -> dict:
    return yaml.safe_load(TINY_YAML.read_text())


def test_parsing_a_config_does_not_import_the_reward_module(tmp_path, monkeypatch):
    witness = tmp_path / "imported"
    monkeypatch.setenv("VT_SIDE_EFFECT_FILE", str(witness))
    function = "tests.reward_import_side_effect:compute_score"
    sys.modules.pop("tests.reward_import_side_effect", None)
    cfg = parse_config(_raw(), {"rewards.function": function})
    assert not witness.exists() and "tests.reward_import_side_effect" not in sys.modules
    with RewardSandbox(function, 10.0, 1024) as box:  # imported inside, where the test's folder is not
        assert box.score(_request(), default=-1.0).scores == [0.0]
    assert not witness.exists()
    with RewardSandbox(function, 10.0, 1024, isolation="process"):
        pass
    assert witness.read_text().startswith("imported by pid ") and str(os.getpid()) not in witness.read_text()
    assert cfg.rewards.function == function


def test_what_the_source_cannot_tell_is_checked_when_the_sandbox_starts():
    cfg = parse_config(_raw(), {"rewards.function": "tests.reward_fixtures:DYNAMIC_NOT_CALLABLE"})  # passes
    with pytest.raises(ConfigError, match="'DYNAMIC_NOT_CALLABLE' is a float, not a function"):
        preflight(cfg.rewards)
    with pytest.raises(ConfigError, match=r"rewards.function 'tests.reward_fixtures:two_args' cannot be loaded: "
                                          r"cannot be called as fn\(data_source"):
        RewardSandbox("tests.reward_fixtures:two_args", 5.0, 1024).start()


def test_process_isolation_works_and_warns(caplog, monkeypatch):
    monkeypatch.setattr(sandbox_mod, "_WARNED", set())
    function = {"rewards.function": "tests.reward_fixtures:misbehaving"}
    cfg = parse_config(_raw(), {"rewards.isolation": "process", **function})
    assert cfg.config_hash() == parse_config(_raw(), function).config_hash()  # not hashed: a pinned run may switch
    with caplog.at_level(logging.WARNING, logger="verl_tasks.rewards.sandbox"):
        with sandbox_mod.scoring_sandbox(cfg.rewards) as box:
            result = box.score(_request() + [{**_request()[0], "id": "s1", "solution_str": "1"}], default=-1.0)
    assert result.scores == [0.0, 1.0] and box.isolation == "process"
    assert any(r.levelno == logging.WARNING and "rewards.isolation is 'process'" in r.getMessage()
               for r in caplog.records)


def test_without_bubblewrap_the_sandbox_refuses_naming_the_setting(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no bwrap to be found
    with pytest.raises(ConfigError, match=r"rewards.isolation is 'namespaces'.*bubblewrap.*rewards.isolation: process"):
        RewardSandbox("verl_tasks.rewards.builtin:exact_answer", 5.0, 1024).start()
    with RewardSandbox("verl_tasks.rewards.builtin:exact_answer", 5.0, 1024, isolation="process") as box:
        assert box.score(_request(), default=-1.0).scores == [0.0]


def test_a_machine_without_user_namespaces_is_refused_naming_the_setting():
    """A real one: a child that runs where user namespaces are disabled tries to start a sandbox."""
    box = RewardSandbox("verl_tasks.rewards.builtin:exact_answer", 5.0, 1024)
    read_only, _ = box.code_paths()
    script = ("from verl_tasks.rewards.sandbox import RewardSandbox\n"
              "try:\n    RewardSandbox('verl_tasks.rewards.builtin:exact_answer', 5.0, 1024).start()\n"
              "except Exception as err:\n    print(type(err).__name__, err)\n")
    info_r, info_w = os.pipe()
    try:
        argv = bwrap_command(check_namespaces(), read_only, 64 << 20, info_w, [sys.executable, "-c", script])
        done = subprocess.run(argv, env=box.environment(), pass_fds=(info_w,), capture_output=True, text=True,
                              timeout=120)
    finally:
        os.close(info_r)
        os.close(info_w)
    assert done.stdout.startswith("ConfigError rewards.isolation is 'namespaces'"), (done.stdout, done.stderr)
    assert "set rewards.isolation: process" in done.stdout


@pytest.mark.parametrize("source, error", [
    ("def fn(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n", None),
    ("def fn(*args):\n    return 1.0\n", None),
    ("fn = lambda a, b, c, d: 1.0\n", None),
    ("fn = lambda a, b: 1.0\n", "cannot be called as fn(data_source, solution_str, ground_truth, extra_info) "
                                "(too many positional arguments)"),
    ("def fn(a, b, c, d, *, scale):\n    return 1.0\n", "missing a required argument: 'scale'"),
    ("fn = [1, 2]\n", "'fn' is a list, not a function"),
    ("def other(a, b, c, d):\n    return 1.0\n", "has no attribute 'fn'"),
    ("def fn(a, b, c, d)\n    return 1.0\n", "raised SyntaxError"),
    # What only running the module can tell passes the parse; the sandbox checks it when it starts.
    ("import functools\n@functools.lru_cache\ndef fn(a):\n    return 1.0\n", None),
    ("from math import *\n", None),
    ("def __getattr__(name):\n    return print\n", None),
    ("fn = float('1')\n", None),
    ("if True:\n    def fn(a, b, c, d):\n        return 1.0\n", None),
    ("try:\n    from fast import fn\nexcept ImportError:\n    fn = None\n", None),
    ("class fn:\n    def __init__(self, a, b, c, d):\n        pass\n", None),
])
def test_the_source_check_decides_what_it_can_without_importing(tmp_path, monkeypatch, source, error):
    name = f"vt_src_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    from verl_tasks.config import check_reward_function

    if error is None:
        check_reward_function(f"{name}:fn")
    else:
        with pytest.raises(ValueError) as err:
            check_reward_function(f"{name}:fn")
        assert str(err.value).startswith(f"rewards.function '{name}:fn': ") and error in str(err.value), err.value
    assert name not in sys.modules


def test_a_package_is_located_without_running_its_init(tmp_path, monkeypatch):
    package = tmp_path / f"vt_pkg_{uuid.uuid4().hex[:8]}"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "scores.py").write_text("def fn(a, b, c, d):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from verl_tasks.config import check_reward_function

    check_reward_function(f"{package.name}.sub.scores:fn")
    with pytest.raises(ValueError, match="cannot be imported"):
        check_reward_function(f"{package.name}.sub.score:fn")
    assert not (tmp_path / "ran").exists() and package.name not in sys.modules
    box = RewardSandbox(f"{package.name}.sub.scores:fn", 5.0, 1024)
    assert box.code_paths()[0][-1] == str(package) and str(tmp_path) in box.code_paths()[1]


def test_a_reward_module_that_lives_under_tmp_is_seen_in_the_sandbox(tmp_path, monkeypatch):
    """The sandbox's own /tmp is a fresh tmpfs; code under the machine's /tmp (a checkout cloned there, a
    module written there) is bound over it, not hidden by it."""
    assert str(tmp_path).startswith("/tmp/")
    name = f"vt_tmp_reward_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "def score(data_source, solution_str, ground_truth, extra_info):\n"
        "    return 1.0 if solution_str.strip() == ground_truth else 0.25\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with RewardSandbox(f"{name}:score", 10.0, 1024) as box:
        box.start()
        result = box.score([{"id": "a", "data_source": "t", "solution_str": "4", "ground_truth": "4", "extra_info": {}},
                            {"id": "b", "data_source": "t", "solution_str": "5", "ground_truth": "4",
                             "extra_info": {}}], 0.0)
    assert result.scores == [1.0, 0.25] and not result.failures, result
