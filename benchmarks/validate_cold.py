"""The quality gate on a fresh worker: a new Python process imports, builds the GE context, validates.

    .venv/bin/python benchmarks/validate_cold.py [--repeats 5] [--json out.json] [--output BENCHMARKS.md]

Each repeat starts a fresh interpreter that validates one epoch of 16 prompts x 8 samples
(128 scored rows) with ``verl_tasks.quality.suites.validate_epoch`` and reports, from inside,
how long the imports, the context and the validation took, and from outside the wall time
until its verdict and until the process has exited (interpreter teardown of the modules GE
pulls in is part of what a process-per-task worker pays).

Variants, alternated within each repeat so machine noise hits all of them:

- ``shipped``: the code as it is.
- ``lazy-scipy-altair``: the same, but scipy and altair (imported by GE at module
  level, used only by expectations and renderers the gate does not run) are
  deferred with ``importlib.util.LazyLoader`` during the GE import. Measured as
  an option, not shipped: it changes how two libraries load for the whole process
  and LazyLoader is not thread-safe on Python 3.11.
- ``python-only``: an interpreter that imports nothing (the floor).

The section between this script's markers in ``--output`` is replaced.
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
sys.path.insert(0, str(ROOT))
OWNER = "benchmarks/validate_cold.py"
VARIANTS = {
    "shipped": "the gate as shipped",
    "lazy-scipy-altair": "scipy and altair deferred with `LazyLoader` during the GE import (an option, not shipped)",
    "python-only": "`python -c` printing the time (the floor)",
}

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
    """One fresh interpreter of ``variant``; its timings."""
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


def markdown(summary: dict[str, dict[str, float]], repeats: int, command: str) -> str:
    from benchmarks.run import provenance

    lines = [
        "## The quality gate in a fresh process",
        "",
        provenance(command),
        "",
        "A new Python process imports the gate (`verl_tasks.quality.suites`, which imports Great Expectations), "
        "builds its GE context and validates one epoch of 128 scored rows (16 prompts x 8 samples) with "
        "`suites.validate_epoch`, as a pool worker of the `gate` pool does once when it starts and an inline "
        "`verl-tasks run` does at its first validate. Times inside the process (import, context, first "
        "validation) and from the parent (to the verdict printed, to the process's exit, interpreter teardown "
        f"included). Variants alternate within each of {repeats} repeats; medians.",
        "",
        "| variant | import (s) | context (s) | first validation (s) | to verdict (s) | to process exit (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for variant, r in summary.items():
        cells = [f"{r[k]:.3f}" if k in r else "" for k in ("import_s", "context_s", "validate_s")]
        lines.append(f"| {VARIANTS[variant]} | {' | '.join(cells)} | {r['to_verdict_s']:.3f} | {r['to_exit_s']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the medians here")
    parser.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md")
    args = parser.parse_args()
    from benchmarks.run import write_section

    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for _ in range(args.repeats):
        for variant in VARIANTS:
            runs[variant].append(run_child(variant))
    summary = {}
    for variant, results in runs.items():
        summary[variant] = {key: round(statistics.median(r[key] for r in results), 3) for key in results[0]}
        parts = ", ".join(f"{k} {v:.3f}" for k, v in summary[variant].items())
        print(f"{variant:18s} medians of {args.repeats}: {parts}", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    text = markdown(summary, args.repeats, " ".join([".venv/bin/python benchmarks/validate_cold.py", *sys.argv[1:]]))
    print(text)
    write_section(args.output, text, OWNER)


if __name__ == "__main__":
    main()
