"""Render a status dict as a Markdown learning curve (for `--report`, the demo and BENCHMARKS.md)."""
from __future__ import annotations

from typing import Any


def _fmt(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) else ""


def parent_name(result: dict[str, Any]) -> str | None:
    """``tiny-arith snapshot 8`` when version 0 of a status is a copy of a parent's snapshot (a fork, a
    scheduled child), else None (it is the configured model)."""
    parent = (result.get("base") or {}).get("parent")
    return f"{parent['experiment']} snapshot {parent['version']}" if parent else None


def base_label(result: dict[str, Any]) -> str:
    """The curve's label of version 0: the parent snapshot it copies, else the configured model (the tiny
    model's supervised warm start)."""
    parent = parent_name(result)
    return f"{parent} (parent)" if parent else "base (warm start)"


def curve_markdown(result: dict[str, Any]) -> str:
    """A table: one row per epoch with reward, held-out accuracy and update diagnostics."""
    base = result["base"]["metrics"].get("eval_accuracy")
    lines = [
        f"Experiment `{result['experiment']}`: held-out accuracy (greedy) and training reward per epoch.",
        "",
        "| policy | train reward mean | held-out accuracy | clip frac | approx KL | grad norm |",
        "|---|---|---|---|---|---|",
        f"| {base_label(result)} | | {_fmt(base)} | | | |",
    ]
    for row in result["epochs"]:
        m = row["metrics"]
        lines.append(
            f"| after epoch {row['epoch']} | {_fmt(m.get('reward_mean'))} | {_fmt(m.get('eval_accuracy'))} | "
            f"{_fmt(m.get('actor/pg_clipfrac'))} | {_fmt(m.get('actor/ppo_kl'))} | {_fmt(m.get('actor/grad_norm'))} |"
        )
    accs = [r["metrics"]["eval_accuracy"] for r in result["epochs"] if "eval_accuracy" in r["metrics"]]
    if base is not None and accs:
        lines += ["", f"Held-out accuracy: {base:.1%} -> {accs[-1]:.1%} ({(accs[-1] - base) * 100:+.1f} points)."]
    return "\n".join(lines) + "\n"
