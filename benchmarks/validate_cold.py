"""The quality gate on a fresh worker: a new Python process imports, builds the GE context, validates.

    .venv/bin/python benchmarks/validate_cold.py [--repeats 5] [--json out.json]

Each repeat starts a fresh interpreter that validates one epoch of the inline
benchmark's shape (16 prompts x 8 samples = 128 scored rows) with
``verl_tasks.quality.suites.validate_epoch`` and reports, from inside, how long
the imports, the context and the validation took, and from outside the wall time
until its verdict and until the process has exited (interpreter teardown of the
~2,600 modules GE pulls in is part of what a process-per-task worker pays).

Variants, alternated within each repeat so machine noise hits all of them:

- ``shipped``: the code as it is.
- ``lazy-scipy-altair``: the same, but scipy and altair (imported by GE at module
  level, used only by expectations and renderers the gate does not run) are
  deferred with ``importlib.util.LazyLoader`` during the GE import. Measured as
  an option, not shipped: it changes how two libraries load for the whole process
  and LazyLoader is not thread-safe on Python 3.11.
- ``python-only``: an interpreter that imports nothing (the floor).
- ``before`` (with ``--before PATH``): the shipped variant run against another checkout.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import os, sys, time, json
started = time.perf_counter()
sys.path.insert(0, {root!r})
os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")
if {lazy!r}:
    import importlib.abc, importlib.util
    class Lazy(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] not in ("scipy", "altair"):
                return None
            for finder in sys.meta_path:
                if finder is not self and hasattr(finder, "find_spec"):
                    spec = finder.find_spec(name, path, target)
                    if spec is not None:
                        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                            spec.loader = importlib.util.LazyLoader(spec.loader)
                        return spec
            return None
    finder = Lazy()
    sys.meta_path.insert(0, finder)
from verl_tasks.quality import suites
suites._gx()
if {lazy!r}:
    sys.meta_path.remove(finder)
imported = time.perf_counter()
suites._batch_definition()
context = time.perf_counter()
limits = suites.Limits(rows_per_batch=128, rows_per_epoch=128, max_prompt_tokens=64, max_response_tokens=8,
                       min_score=0.0, max_score=1.0, min_nonempty_fraction=0.1)
rows = {{0: [{{"sample_id": f"e0-b0-p{{i // 8}}-s{{i % 8}}", "response": str(i % 19), "prompt_tokens": 12,
              "response_tokens": 3, "score": float(i % 2)}} for i in range(128)]}}
report = suites.validate_epoch(rows, limits)
done = time.perf_counter()
assert report["success"], report
print(json.dumps({{"import_s": imported - started, "context_s": context - imported, "validate_s": done - context,
                  "verdict_at": time.time()}}), flush=True)
"""


def run_child(variant: str, root: Path = ROOT) -> dict:
    if variant == "python-only":
        code = "import time, json; print(json.dumps({'verdict_at': time.time()}), flush=True)"
    else:
        code = CHILD.format(root=str(root), lazy=variant == "lazy-scipy-altair")
    started = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=300)
    ended = time.time()
    if out.returncode != 0:
        raise RuntimeError(f"{variant} child failed: {out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["to_verdict_s"] = result.pop("verdict_at") - started
    result["to_exit_s"] = ended - started
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--before", type=Path, help="another checkout of verl-tasks, measured as the variant 'before'")
    args = parser.parse_args()
    variants = ("shipped", "lazy-scipy-altair", "python-only") + (("before",) if args.before else ())
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(args.repeats):
        for variant in variants:
            runs[variant].append(run_child("shipped", args.before) if variant == "before" else run_child(variant))
    summary = {}
    for variant, results in runs.items():
        summary[variant] = {key: round(statistics.median(r[key] for r in results), 3) for key in results[0]}
        parts = ", ".join(f"{k} {v:.3f}" for k, v in summary[variant].items())
        print(f"{variant:18s} medians of {args.repeats}: {parts}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
