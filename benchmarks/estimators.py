"""Held-out accuracy gained by each verl recipe this project runs, on the tiny experiment.

    .venv/bin/python benchmarks/estimators.py [--epochs 8] [--only rloo,gspo] [--json out.json]
        [--output BENCHMARKS.md]

Every recipe (PPO with its critic, DAPO's dynamic sampling and ReMax included) trains
``dags/experiments/tiny_arith.yaml`` for ``--epochs`` epochs into a fresh store in this
one process (the inline runner, HF engine), with the recipe's ``algorithm``/``rewards`` overrides on top;
reported per recipe: the held-out accuracy (greedy) of the base and after the last epoch, the gain in points
and the wall time. The section between this script's markers in ``--output`` is replaced.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "dags" / "experiments" / "tiny_arith.yaml"
OWNER = "benchmarks/estimators.py"
# verl recipe -> this project's overrides (the same keys verl sets, in this project's names).
RECIPES: dict[str, dict[str, Any]] = {
    "grpo": {},
    "Dr. GRPO (no std, seq-mean-token-sum-norm)": {"algorithm.norm_adv_by_std": False,
                                                   "algorithm.loss_agg_mode": "seq-mean-token-sum-norm"},
    "grpo + DAPO clip-higher + overlong penalty": {"algorithm.clip_ratio_high": 0.28,
                                                   "rewards.overlong_buffer": {"enable": True, "len": 2,
                                                                               "penalty_factor": 0.5}},
    "gspo (seq-mean-token-mean)": {"algorithm.policy_loss": "gspo",
                                   "algorithm.loss_agg_mode": "seq-mean-token-mean",
                                   "algorithm.clip_ratio_low": 0.0003, "algorithm.clip_ratio_high": 0.0004},
    "grpo + DAPO clip-higher + dynamic sampling": {"algorithm.clip_ratio_high": 0.28,
                                                   "algorithm.filter_groups": {"enable": True, "max_batches": 12}},
    "rloo": {"algorithm.adv_estimator": "rloo"},
    "reinforce_plus_plus": {"algorithm.adv_estimator": "reinforce_plus_plus"},
    "reinforce_plus_plus_baseline": {"algorithm.adv_estimator": "reinforce_plus_plus_baseline"},
    "remax (greedy baseline)": {"algorithm.adv_estimator": "remax"},
    "gae (PPO with a critic)": {"algorithm.adv_estimator": "gae", "critic": {"lr": 1e-4}},
}


def run(name: str, epochs: int, store: Path) -> dict[str, Any]:
    from verl_tasks.config import load_config
    from verl_tasks.runner import make_context, train

    overrides = {**RECIPES[name], "storage.uri": f"file://{store}", "epochs": epochs}
    ctx = make_context(load_config(CONFIG, overrides))
    started = time.monotonic()
    status = train(ctx, epochs)
    extra = None
    if ctx.config.dynamic_sampling is not None:  # the rollout batches drawn beyond the planned ones
        from verl_tasks.store.units import read_marker

        extra = sum(read_marker(ctx.store, ctx.layout.top_up(e)).meta["extra_batches"] for e in range(epochs))
    base = status["base"]["metrics"]["eval_accuracy"]
    final = status["epochs"][-1]["metrics"]["eval_accuracy"]
    return {"recipe": name, "overrides": RECIPES[name], "base_accuracy": base, "final_accuracy": final,
            "gain_points": round(100 * (final - base), 1), "wall_s": round(time.monotonic() - started, 1),
            "extra_batches": extra, "planned_batches": ctx.config.rollout.batches_per_epoch * epochs}


def render(rows: list[dict[str, Any]], epochs: int) -> str:
    lines = [f"## verl recipes on the tiny experiment ({epochs} epochs each, inline, HF engine)", "",
             f"`.venv/bin/python benchmarks/estimators.py --epochs {epochs}`", "",
             "| recipe | overrides | held-out accuracy, base -> final | gain | wall |", "|---|---|---|---|---|"]
    for row in rows:
        shown = ", ".join(f"`{k}: {json.dumps(v)}`" for k, v in row["overrides"].items()) or "(the defaults)"
        lines.append(f"| {row['recipe']} | {shown} | {100 * row['base_accuracy']:.1f}% -> "
                     f"{100 * row['final_accuracy']:.1f}% | {row['gain_points']:+.1f} points | {row['wall_s']:.0f} s |")
    drawn = [f"{row['recipe']}: {row['extra_batches']} extra rollout batches over the {epochs} epochs "
             f"(planned: {row['planned_batches']})" for row in rows if row.get("extra_batches") is not None]
    lines += ["", "Every recipe starts from the same warm-started base and the same prompts (seed 7); GSPO's clip "
              "range is the GSPO paper's (its sequence-level ratio moves far less than a token's). Dynamic sampling "
              "trains on as many prompts per epoch as the others, drawing extra batches to get them "
              f"({'; '.join(drawn) or 'none drawn'}), so its wall time is longer. PPO's critic is a value head on "
              "the tiny base, trained at critic.lr 1e-4. Wall times are one run each on a shared 2-core machine, "
              "other jobs beside: compare gains, not times."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--only", help="comma-separated recipe names (default: all)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(RECIPES)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names):
            rows.append(run(name, args.epochs, Path(tmp) / f"store-{i}"))
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    if not args.only:
        from benchmarks.run import write_section

        write_section(args.output, render(rows, args.epochs), OWNER)


if __name__ == "__main__":
    main()
