"""`make bench` rewrites only its own block of BENCHMARKS.md; the sections written by hand stay."""
from __future__ import annotations

import importlib.util

from tests.conftest import ROOT


def _run_module():
    spec = importlib.util.spec_from_file_location("bench_run", ROOT / "benchmarks" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_make_bench_replaces_its_block_and_keeps_the_hand_written_sections():
    run = _run_module()
    first = run.replace_generated("", "# Benchmarks\n\nold numbers\n")
    document = first + "\n## The demo (by hand)\n\nkept\n"
    updated = run.replace_generated(document, "# Benchmarks\n\nnew numbers\n")
    assert "new numbers" in updated and "old numbers" not in updated
    assert updated.endswith("## The demo (by hand)\n\nkept\n")
    assert updated.count(run.START) == updated.count(run.END) == 1
    assert run.replace_generated(updated, "# Benchmarks\n\nnew numbers\n") == updated  # stable
    real = (ROOT / "BENCHMARKS.md").read_text()
    assert run.START in real and run.END in real  # the shipped file has the block, so `make bench` keeps the rest
