"""Importing verl-tasks changes nothing in the importing process: Airflow's scheduler, DAG processor
and api-server import it (DAG files, the plugin) and keep their own environment."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT

PROBE = """
import json, os
import airflow.sdk, torch, transformers, ray  # what the package imports itself: their own effects are theirs
before = dict(os.environ)
import verl_tasks, verl_tasks.config, verl_tasks.runner, verl_tasks.airflow.factory, verl_tasks.airflow.plugin
after = dict(os.environ)
print(json.dumps({k: [before.get(k), after.get(k)] for k in set(before) | set(after) if before.get(k) != after.get(k)}))
"""


def test_importing_the_package_leaves_the_environment_unchanged(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "AIRFLOW_HOME": str(tmp_path / "airflow")}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {}
