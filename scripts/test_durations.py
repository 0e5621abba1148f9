"""Write where the test suite's time goes into docs/development.md, from pytest's JUnit XML.

    python scripts/test_durations.py --section ci --command "CI=true bash .ci/run" \\
        --junit ci-report/junit.xml --stages ci-report/stages.tsv [--wall-log ci.log]

Each ``--section`` (a name such as ``ci``) is its own block of the document, between
``<!-- test durations NAME: generated from here -->`` and ``... generated up to here -->``; a run rewrites
its block only. The block gives the command that produced the XML, each XML's wall time and test count,
the stage times of the CI run when ``--stages`` names the TSV ``.ci/run`` writes, the whole run's wall time
when ``--wall-log`` names a log that ends with bash's ``time`` output (its ``real`` line), a table per test file
(tests, summed time, slowest test) and the slowest tests. A test's time is its setup, call and teardown
together, as pytest's JUnit XML reports it; with parallel workers the summed times exceed the wall time.
"""
from __future__ import annotations

import argparse
import re
import shlex
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "development.md"


@dataclass
class Case:
    file: str
    name: str
    seconds: float
    outcome: str


@dataclass
class Suite:
    path: Path
    wall_s: float
    cases: list[Case]


def read_junit(path: Path) -> Suite:
    """The test cases of one JUnit XML (pytest's ``--junitxml``), with the suite's wall time."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    cases = []
    for case in (c for suite in suites for c in suite.iter("testcase")):
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        module = case.get("classname", "")
        # pytest's classname is the dotted module, plus the class for tests in one; the file ends at "test_*".
        parts = module.split(".")
        last = max((i for i, part in enumerate(parts) if part.startswith("test_")), default=len(parts) - 1)
        cases.append(Case("/".join(parts[: last + 1]) + ".py", case.get("name", ""), float(case.get("time", 0)),
                          outcome))
    return Suite(path, sum(float(s.get("time", 0)) for s in suites), cases)


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s ({seconds / 60:.1f} min)"


def render(invocation: str, command: str, suites: list[Suite], stages: list[tuple[str, float]],
           wall_s: float | None, top: int) -> str:
    cases = [c for s in suites for c in s.cases]
    lines = [f"Tests run by `{command}`; written by `{invocation}`.", ""]
    if wall_s is not None:
        lines += [f"Whole run (bash's `time`): {_minutes(wall_s)}.", ""]
    if stages:
        lines += ["| CI stage | wall time |", "|---|---:|"]
        lines += [f"| {stage} | {_minutes(seconds)} |" for stage, seconds in stages]
        lines += [""]
    lines += ["| JUnit XML | tests | not passed | wall time (pytest) | summed test time |", "|---|---:|---:|---:|---:|"]
    for suite in suites:
        bad = sum(c.outcome != "passed" for c in suite.cases)
        lines.append(f"| `{suite.path.name}` | {len(suite.cases)} | {bad} | {_minutes(suite.wall_s)} | "
                     f"{_minutes(sum(c.seconds for c in suite.cases))} |")
    by_file: dict[str, list[Case]] = defaultdict(list)
    for case in cases:
        by_file[case.file].append(case)
    total = sum(c.seconds for c in cases) or 1.0
    lines += ["", "| test file | tests | time (s) | share | slowest test (s) |", "|---|---:|---:|---:|---|"]
    for file, mine in sorted(by_file.items(), key=lambda kv: -sum(c.seconds for c in kv[1])):
        spent = sum(c.seconds for c in mine)
        if spent < 1.0:
            continue
        slowest = max(mine, key=lambda c: c.seconds)
        lines.append(f"| `{file}` | {len(mine)} | {spent:.1f} | {100 * spent / total:.1f}% | "
                     f"`{slowest.name}` ({slowest.seconds:.1f}) |")
    small = [f for f, mine in by_file.items() if sum(c.seconds for c in mine) < 1.0]
    if small:
        lines.append(f"| {len(small)} files under 1 s each | {sum(len(by_file[f]) for f in small)} | "
                     f"{sum(c.seconds for f in small for c in by_file[f]):.1f} | | |")
    lines += ["", f"The {top} slowest tests (setup, call and teardown):", "", "| test | time (s) |", "|---|---:|"]
    for case in sorted(cases, key=lambda c: -c.seconds)[:top]:
        lines.append(f"| `{case.file}::{case.name}` | {case.seconds:.1f} |")
    return "\n".join(lines) + "\n"


def replace_block(document: str, name: str, text: str) -> str:
    """``document`` with section ``name``'s generated block replaced (appended when it has none)."""
    start = f"<!-- test durations {name}: generated from here -->"
    end = f"<!-- test durations {name}: generated up to here -->"
    block = f"{start}\n{text.rstrip()}\n{end}"
    if start in document and end in document:
        head, rest = document.split(start, 1)
        return head + block + rest.split(end, 1)[1]
    return document.rstrip("\n") + "\n\n" + block + "\n"


def read_stages(path: Path) -> list[tuple[str, float]]:
    """``stage<TAB>seconds`` lines, as ``.ci/run`` writes them."""
    rows = [line.split("\t") for line in path.read_text().splitlines() if line.strip()]
    return [(stage, float(seconds)) for stage, seconds in rows]


def read_wall(path: Path) -> float:
    """The ``real`` line of bash's ``time`` output at the end of a log, in seconds."""
    found = re.findall(r"^real\s+(?:(\d+)m)?([\d.]+)s$", path.read_text(), re.MULTILINE)
    if not found:
        raise SystemExit(f"{path}: no `real 0m0.000s` line (bash's time output)")
    minutes, seconds = found[-1]
    return 60 * int(minutes or 0) + float(seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--junit", nargs="+", type=Path, required=True, help="pytest --junitxml files, in order")
    parser.add_argument("--section", required=True, help="the block to rewrite, e.g. ci")
    parser.add_argument("--command", required=True, help="the command that produced the XML, quoted in the text")
    parser.add_argument("--stages", type=Path, help="the stage times .ci/run wrote (stage<TAB>seconds)")
    parser.add_argument("--wall-log", type=Path, help="a log ending with bash's time output: the whole run's time")
    parser.add_argument("--top", type=int, default=15, help="how many of the slowest tests to list")
    parser.add_argument("--output", default=str(DOC), help="the document to rewrite; - prints the block only")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    suites = [read_junit(path) for path in args.junit]
    stages = read_stages(args.stages) if args.stages else []
    wall_s = read_wall(args.wall_log) if args.wall_log else None
    invocation = shlex.join(["python", "scripts/test_durations.py", *argv])
    text = render(invocation, args.command, suites, stages, wall_s, args.top)
    print(text)
    if args.output != "-":
        output = Path(args.output)
        output.write_text(replace_block(output.read_text(), args.section, text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
