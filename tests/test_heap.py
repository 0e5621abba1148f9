"""A process that runs many units freezes its warm heap, so full garbage collections skip it."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT, TINY_YAML, small_overrides

# Runs in a fresh interpreter: the pytest process has frozen, imported and allocated for other tests.
CHILD = """
import gc, importlib, json, sys
from verl_tasks.config import load_config
from verl_tasks.execution.heap import freeze_after_imports
from verl_tasks.runner import make_context, run_in_process

ctx = make_context(load_config(sys.argv[1], json.loads(sys.argv[2])))
seen = {"before": gc.get_freeze_count()}
assert list(run_in_process(ctx, "plan", 0, [None])) == [None]
seen["after_unit"] = gc.get_freeze_count()
seen["walked_after_unit"] = len(gc.get_objects())
seen["again"] = freeze_after_imports()
seen["tabnanny_was_imported"] = "tabnanny" in sys.modules
importlib.import_module("tabnanny")
seen["after_import"] = freeze_after_imports()
print(json.dumps(seen))
"""


def test_the_inline_runner_freezes_the_heap_after_a_unit_that_imported_and_not_again(tmp_path):
    overrides = {**small_overrides(), "storage.uri": f"file://{tmp_path}/store"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(TINY_YAML), json.dumps(overrides)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["before"] == 0, seen
    # The unit imported torch and the model code: all of it is now out of the collector's walk.
    assert seen["after_unit"] > 50_000 and seen["walked_after_unit"] < seen["after_unit"] / 5, seen
    assert seen["again"] is False, seen  # nothing imported since: no freeze
    assert seen["tabnanny_was_imported"] is False and seen["after_import"] is True, seen
