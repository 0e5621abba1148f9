"""Render benchmarks/results/chaos.json into the matrix table of docs/fault-tolerance.md.

Run after `make chaos` (which sets VT_CHAOS_RECORD=1): `python benchmarks/chaos_table.py`.
"""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "chaos.json"
DOC = ROOT / "docs" / "fault-tolerance.md"
MARK = "<!-- CHAOS-TABLE -->"
END = "<!-- /CHAOS-TABLE -->"


def table(data: dict) -> str:
    lines = [
        "| fault (test) | recovery | recovery time (s) | units redone | notes |",
        "|---|---|---|---|---|",
    ]
    for name in sorted(data):
        row = data[name]
        notes = ", ".join(f"{k}={v}" for k, v in sorted(row.items())
                          if k not in ("recovery_s", "redone_units", "seed", "recorded_at", "recovery"))
        lines.append(f"| `{name}` | {row.get('recovery', 'automatic retry / rerun')} | {row.get('recovery_s', '')} | "
                     f"{row.get('redone_units', '')} | {notes} |")
    seeds = {str(r.get("seed")) for r in data.values()}
    stamp = max((r.get("recorded_at", "") for r in data.values()), default="")
    lines.append("")
    lines.append(f"Recorded by `make chaos` (seed {', '.join(sorted(seeds))}, {stamp}); "
                 "`units redone` counts `started` events beyond the fault-free reference run.")
    return "\n".join(lines)


def main() -> None:
    data = json.loads(RESULTS.read_text())
    doc = DOC.read_text()
    start = doc.index(MARK) + len(MARK)
    end = doc.index(END) if END in doc else start
    DOC.write_text(doc[:start] + "\n\n" + table(data) + "\n\n" + END + doc[end + (len(END) if END in doc else 0):])
    print(table(data))


if __name__ == "__main__":
    main()
