"""Great Expectations stays quiet: no "Created temporary directory ... ephemeral docs site" per context."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_building_the_quality_context_logs_no_temporary_directory_line():
    code = ("import logging, sys\nlogging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
            "from verl_tasks.quality import suites\nsuites._batch_definition()\nprint('built')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "built" in out.stdout
    assert "ephemeral docs site" not in out.stdout + out.stderr, out.stdout[-2000:]
