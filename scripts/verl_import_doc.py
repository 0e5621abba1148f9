"""Write docs/verl-import.md: how `verl-tasks import-verl` reads a verl trainer config, and its mapping table
(generated from ``verl_tasks.verl_import.RULES``)."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "docs" / "verl-import.md"

INTRO = """# Bringing a verl recipe: `verl-tasks import-verl`

`verl-tasks import-verl` reads a verl trainer YAML (`--config`) and/or verl's command-line overrides, the
same `key=value` words a `python -m verl.trainer.main_ppo ...` line ends with, and writes an experiment YAML:

    verl-tasks import-verl -o my-run.yaml \\
        algorithm.adv_estimator=rloo data.train_files=/data/gsm8k/train.parquet \\
        data.val_files=/data/gsm8k/test.parquet actor_rollout_ref.model.path=/models/Qwen2.5-0.5B-Instruct \\
        actor_rollout_ref.rollout.n=8 trainer.total_epochs=2
    verl-tasks run my-run.yaml

Every key the experiment does not express is listed, with why, on the terminal and at the top of the written
YAML; a value verl-tasks cannot run (unbounded dynamic sampling, a reward model, sglang, a critic warm-up)
is refused there, by key. When a key is refused, or the result does not load, the command writes the file for
you to edit and exits 2 with the reason. A reference (`${...}`) it cannot resolve, or a value of the wrong
type, is an error naming the key; nothing is written.

What carries over:

* **Units.** One verl training step (`data.train_batch_size` prompts rolled out, scored and trained on) is one
  verl-tasks epoch; `trainer.total_training_steps` is `epochs`, or `trainer.total_epochs` times the training
  file's rows over `data.train_batch_size` (the file is read to count them). verl's `ppo_mini_batch_size`
  counts prompts, `algorithm.minibatch_size` counts sequences: it is multiplied by `rollout.n`.
* **Defaults.** A key the command line and YAML leave unset takes verl 0.9.1's default, so the run trains as
  verl's would: AdamW weight decay 0.01, `adv_estimator: gae`, `rollout.n: 1`, `lr: 1e-6`, and so on.
* **References.** `${a.b}` and `${oc.select:a.b,default}` between verl's own keys are resolved; `1e-6` is a
  number, as OmegaConf reads it.
* **PPO.** `algorithm.adv_estimator=gae` (verl's default) writes a `critic` section from verl's `critic.*`
  keys and defaults (`critic.optim.lr` 1e-5, weight decay 0.01, `cliprange_value` 0.5): the value head sits on
  the policy's base when `critic.model.path` is the actor's, else on that model. The critic takes the policy's
  minibatches and PPO epochs, so a `critic.ppo_mini_batch_size` or `critic.ppo_epochs` that differs is
  refused. Without gae, verl builds no critic and its keys are listed as not needed.
* **DAPO.** `algorithm.filter_groups` becomes dynamic sampling with the same prompt budget: verl's
  `max_num_gen_batches` rounds of `data.gen_batch_size` prompts are `algorithm.filter_groups.max_batches`
  rollout batches of `rollout.prompts_per_batch`; 0 (no limit) is refused, since an epoch's possible batches
  are planned ahead. Groups are told apart by their score, whichever `metric` verl named.
* **Not carried.** Storage (`storage.uri`), tracking, resources per phase and the reward function
  (`rewards.function`, a `package.module:function` installed where the workers run) are set in the written
  YAML by hand; the Airflow DAG picks the experiment up from `dags/experiments/`.

## The mapping

"""


def render() -> str:
    from verl_tasks.verl_import import mapping_table

    return INTRO + mapping_table()


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT.relative_to(ROOT)}")
