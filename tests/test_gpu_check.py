"""The GPU check runs where the lendable GPU machine allows: no Ray, vLLM, Airflow, Great Expectations,
boto3 or MLflow importable and no bubblewrap (they are not there), nothing installed. On this CPU machine it
runs with ``--device cpu``."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT

# What the GPU machine lacks, and packages some libraries import only when present (never needed by the check).
WITHOUT = ("ray", "vllm", "airflow", "great_expectations", "boto3", "mlflow", "google", "dill", "scipy",
           "sentencepiece", "PIL")
RUN_WITHOUT = f"""
import runpy, sys
for name in {WITHOUT!r}:
    sys.modules[name] = None  # any import of them raises ImportError, as on the GPU machine
sys.argv = ["scripts/gpu_check.py", *sys.argv[1:]]
runpy.run_path("scripts/gpu_check.py", run_name="__main__")
"""


def test_the_gpu_check_needs_none_of_the_cluster_packages(tmp_path):
    report_path = tmp_path / "report.json"
    no_tools = tmp_path / "bin"  # the PATH of a machine without bubblewrap
    no_tools.mkdir()
    env = {**os.environ, "PATH": str(no_tools)}
    env.pop("VERL_TASKS_REWARD_ISOLATIONS", None)
    done = subprocess.run([sys.executable, "-c", RUN_WITHOUT, "--device", "cpu", "--cpu-layers", "2", "--out",
                           str(report_path)], cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(report_path.read_text())
    assert report["reward_isolation"] == "process"  # no bubblewrap: the built-in reward as a plain child process
    assert report["vllm_reload"]["skipped"].startswith("vllm is not importable")
    assert report["phases"]["devices"] == {"rollout": ["cpu"], "update": ["cpu"], "evaluate": ["cpu"]}
    assert report["phases"]["same_weights_on_rerun"] is True
    assert report["rollout"]["cpu"]["tokens_per_s"] > 0
    assert report["update"]["weights_dtype"] == report["update"]["adam_state_dtype"] == "torch.float32"
    assert report["update"]["weights_moved"] == "4 of 4"  # a small-lr step that bf16 weights would round away
    assert report["fsdp2"]["backend"] == "gloo" and set(report["fsdp2"]) >= {"on_device", "cpu_offload"}
    assert report["snapshot"]["mib"] > 100


def test_without_a_cuda_device_the_check_says_so():
    done = subprocess.run([sys.executable, "scripts/gpu_check.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and "no CUDA device" in done.stderr
