"""Fault injection lives in the tests: the package only has empty hook points (verl_tasks.hooks)."""
from __future__ import annotations

import json
import re
import subprocess
import sys

from tests import faults
from tests.conftest import ROOT
from verl_tasks import hooks

# Names of the hooks that product code used to read from a run's conf or the environment, and of
# the test harness's variable: none may appear in the package.
REMOVED = re.compile(r"fail_once|fail_at_commit|FAIL_ONCE|TEST_HOLD|HOLD_ENV|VT_TEST_FAULTS|maybe_fail|InjectedFault"
                     r"|\.hold\b")

PROBE = "import json; from verl_tasks import hooks; print(json.dumps(sorted(hooks._REGISTERED)))"


def test_package_source_names_no_test_hook():
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for path in sorted((ROOT / "verl_tasks").rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if REMOVED.search(line)]
    assert not found, "\n".join(found)


def _registered(env: dict[str, str]) -> list[str]:
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120,
                          cwd="/")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_hooks_load_only_in_processes_the_harness_starts(tmp_path, monkeypatch):
    import os

    for key in ("PYTHONPATH", faults.FAULTS_ENV):
        monkeypatch.delenv(key, raising=False)
    plain = dict(os.environ)
    assert _registered(plain) == []
    assert _registered({**plain, faults.FAULTS_ENV: str(tmp_path)}) == []  # the variable alone does nothing
    registered = _registered({**plain, **faults.harness_env(tmp_path, plain)})
    assert registered == ["before_commit", "critic_step", "rollout_generate", "unit_start", "update_worker_step"]


def test_process_hooks_fire_at_unit_start_and_inside_phases(tiny_config, tmp_path):
    from verl_tasks.execution import UnitSpec
    from verl_tasks.execution.inline import InlineBackend

    cfg = tiny_config(**{"model.tiny.warm_start_steps": 20})
    seen: list[tuple[str, dict]] = []

    def recorder(name: str):
        return lambda **info: seen.append((name, info))

    handlers = {name: recorder(name) for name in ("unit_start", "before_commit")}
    for name, fn in handlers.items():
        hooks.register(name, fn)
    try:
        InlineBackend().run(cfg, UnitSpec(cfg.experiment, "plan", 0))
    finally:
        for name, fn in handlers.items():
            hooks.unregister(name, fn)
    assert seen[0] == ("unit_start", {"experiment": cfg.experiment, "phase": "plan", "epoch": 0, "batch": None})
    commits = [info for name, info in seen if name == "before_commit"]
    assert commits and commits[-1]["unit"] == f"{cfg.experiment}/epochs/00000/plan", seen
    assert all(info["experiment"] == cfg.experiment for info in commits)
