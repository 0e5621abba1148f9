"""A verl trainer config (its YAML and/or its ``key=value`` command-line overrides) as a verl-tasks experiment.

verl's key names and defaults are facts from verl 0.9.1 (``verl/trainer/config/_generated_ppo_trainer.yaml``):
a key the user did not set takes verl's default, so the experiment trains as verl would have (verl's
AdamW weight decay of 0.01, for one, differs from this project's default). What verl-tasks calls an epoch
is one verl training step: ``data.train_batch_size`` prompts rolled out, scored, gated and trained on.

:data:`RULES` is the whole mapping (``docs/verl-import.md`` is generated from it); :func:`import_verl` is
pure: it reads no file except, to count the steps of ``trainer.total_epochs``, the training data file.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from verl_tasks.errors import ConfigError

# verl 0.9.1's defaults of the keys that map (unset keys take these, as they would in verl).
VERL_DEFAULTS: dict[str, Any] = {
    "algorithm.adv_estimator": "gae",
    "algorithm.gamma": 1.0,
    "algorithm.lam": 1.0,
    "algorithm.norm_adv_by_std_in_grpo": True,
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    "data.train_batch_size": 1024,
    "actor_rollout_ref.actor.optim.lr": 1e-6,
    "actor_rollout_ref.actor.optim.weight_decay": 0.01,
    "actor_rollout_ref.actor.optim.betas": [0.9, 0.999],
    "actor_rollout_ref.actor.optim.lr_scheduler_type": "constant",
    "actor_rollout_ref.actor.optim.min_lr_ratio": 0.0,
    "actor_rollout_ref.actor.grad_clip": 1.0,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 256,
    "actor_rollout_ref.actor.ppo_epochs": 1,
    "actor_rollout_ref.actor.clip_ratio": 0.2,
    "actor_rollout_ref.actor.clip_ratio_low": 0.2,
    "actor_rollout_ref.actor.clip_ratio_high": 0.2,
    "actor_rollout_ref.actor.clip_ratio_c": 3.0,
    "actor_rollout_ref.actor.loss_agg_mode": "token-mean",
    "actor_rollout_ref.actor.entropy_coeff": 0.0,
    "actor_rollout_ref.actor.use_kl_loss": False,
    "actor_rollout_ref.actor.kl_loss_coef": 0.001,
    "actor_rollout_ref.actor.kl_loss_type": "low_var_kl",
    "actor_rollout_ref.actor.policy_loss.loss_mode": "vanilla",
    "actor_rollout_ref.rollout.n": 1,
    "actor_rollout_ref.rollout.temperature": 1.0,
    "actor_rollout_ref.rollout.top_p": 1.0,
    "critic.optim.lr": 1e-5,
    "critic.optim.weight_decay": 0.01,
    "critic.optim.betas": [0.9, 0.999],
    "critic.cliprange_value": 0.5,
    "critic.grad_clip": 1.0,
    "trainer.total_epochs": 30,
    "trainer.experiment_name": "gsm8k",
}
KL_TYPES = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "low_var_kl", "k3": "low_var_kl"}
ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "gae")


class Unmappable(Exception):
    """A value of a mapped key that verl-tasks cannot express; the message says why and what to do."""


@dataclass(frozen=True)
class Rule:
    """One verl key (or a ``*`` prefix of keys), where it goes and how (``how`` is read by people: the docs)."""

    verl: str
    target: str | None
    how: str
    convert: Callable[[Any], Any] | None = None

    def matches(self, key: str) -> bool:
        return key == self.verl or (self.verl.endswith(".*") and key.startswith(self.verl[:-1]))


def _one_of(allowed: Iterable[str], what: str) -> Callable[[Any], Any]:
    allowed = tuple(allowed)

    def check(value: Any) -> Any:
        if value not in allowed:
            raise Unmappable(f"{what} {value!r} is not one verl-tasks runs ({', '.join(allowed)})")
        return value

    return check


def _single_file(value: Any) -> str:
    files = value if isinstance(value, list) else [value]
    if len(files) != 1 or not isinstance(files[0], str):
        raise Unmappable(f"{len(files)} files; verl-tasks reads one .parquet or .jsonl file per split (merge them)")
    return files[0]


def _engine(value: Any) -> str:
    if value not in ("vllm", "hf"):
        raise Unmappable(f"rollout engine {value!r}: verl-tasks rolls out with vllm or hf")
    return value


def _model_path(value: Any) -> str:
    return str(value)


def _refuse(reason: str) -> Callable[[Any], Any]:
    def refuse(value: Any) -> Any:
        if value in (None, False, 0, "", [], {}) or value == -1:
            return None  # off: nothing to map
        raise Unmappable(reason)

    return refuse


def _kl_type(value: Any) -> str:
    if value not in KL_TYPES:
        raise Unmappable(f"kl_loss_type {value!r} (verl-tasks has k1, k2 and low_var_kl; no '+' straight-through)")
    return KL_TYPES[value]


RULES: tuple[Rule, ...] = (
    Rule("algorithm.adv_estimator", "algorithm.adv_estimator", "same name", _one_of(ESTIMATORS, "adv_estimator")),
    Rule("algorithm.norm_adv_by_std_in_grpo", "algorithm.norm_adv_by_std", "same meaning (false: Dr. GRPO)"),
    Rule("algorithm.gamma", "algorithm.gamma", "same"),
    Rule("algorithm.lam", "algorithm.lam", "same"),
    Rule("algorithm.use_kl_in_reward", None, "refused when true: verl-tasks puts KL in the loss only "
         "(use_kl_loss)", _refuse("KL in the reward is not built; use actor_rollout_ref.actor.use_kl_loss")),
    Rule("algorithm.filter_groups.enable", "algorithm.filter_groups.enable", "DAPO's dynamic sampling (the "
         "top_up task draws extra rollout batches)"),
    Rule("algorithm.filter_groups.max_num_gen_batches", "algorithm.filter_groups.max_batches", "the same prompt "
         "budget in rollout batches: times data.gen_batch_size (default train_batch_size) over "
         "rollout.prompts_per_batch; 0 (no limit) is refused: an epoch's possible batches are planned ahead"),
    Rule("algorithm.filter_groups.metric", None, "groups are told apart by their score (acc, score, seq_reward "
         "and seq_final_reward all read the outcome score here)", _one_of(
             ("acc", "score", "seq_reward", "seq_final_reward"), "filter_groups.metric")),
    Rule("data.gen_batch_size", None, "read by filter_groups.max_num_gen_batches (the prompts of one verl "
         "generation round)"),
    Rule("data.train_files", "data.train", "one .parquet or .jsonl file (verl's record format)", _single_file),
    Rule("data.val_files", "data.eval", "one .parquet or .jsonl file; greedy held-out accuracy", _single_file),
    Rule("data.max_prompt_length", "data.max_prompt_tokens", "same (a longer prompt is a data error)"),
    Rule("data.max_response_length", "rollout.max_new_tokens", "same"),
    Rule("data.train_batch_size", "rollout.prompts_per_batch", "prompts per epoch, split into "
         "rollout.batches_per_epoch mapped rollout batches (the largest of 8, 4, 2, 1 that divides it)"),
    Rule("data.seed", "seed", "same"),
    Rule("actor_rollout_ref.model.path", "model.name_or_path", "model.source: hf; a local folder (nothing is "
         "downloaded at run time)", _model_path),
    Rule("actor_rollout_ref.model.trust_remote_code", "model.trust_remote_code", "same"),
    Rule("actor_rollout_ref.model.lora_rank", "model.lora.rank", "> 0: LoRA through PEFT (0: the full model)"),
    Rule("actor_rollout_ref.model.lora_alpha", "model.lora.alpha", "same (with lora_rank > 0)"),
    Rule("actor_rollout_ref.model.target_modules", "model.lora.target_modules", "all-linear or a list of module "
         "names (with lora_rank > 0)"),
    Rule("actor_rollout_ref.actor.optim.lr", "algorithm.lr", "same"),
    Rule("actor_rollout_ref.actor.optim.weight_decay", "algorithm.weight_decay", "same (verl's default 0.01)"),
    Rule("actor_rollout_ref.actor.optim.betas", "algorithm.betas", "same"),
    Rule("actor_rollout_ref.actor.optim.clip_grad", "algorithm.grad_clip", "same"),
    Rule("actor_rollout_ref.actor.grad_clip", "algorithm.grad_clip", "same"),
    Rule("actor_rollout_ref.actor.optim.lr_warmup_steps", "algorithm.warmup_steps", "verl's training steps "
         "times the optimizer steps of one (verl steps its scheduler once per training step); -1: "
         "lr_warmup_steps_ratio decides"),
    Rule("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio", "algorithm.warmup_steps", "times the run's "
         "training steps, times the optimizer steps of one"),
    Rule("actor_rollout_ref.actor.optim.lr_scheduler_type", "algorithm.lr_schedule", "constant or cosine",
         _one_of(("constant", "cosine"), "lr_scheduler_type")),
    Rule("actor_rollout_ref.actor.optim.warmup_style", "algorithm.lr_schedule", "verl's older name of "
         "lr_scheduler_type", _one_of(("constant", "cosine"), "warmup_style")),
    Rule("actor_rollout_ref.actor.optim.min_lr_ratio", "algorithm.min_lr_ratio", "same"),
    Rule("actor_rollout_ref.actor.ppo_mini_batch_size", "algorithm.minibatch_size", "prompts -> sequences: times "
         "rollout.n"),
    Rule("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "resources.update.micro_batch_size", "same "
         "(sequences per forward/backward on each worker)"),
    Rule("actor_rollout_ref.actor.ppo_epochs", "algorithm.ppo_epochs", "same"),
    Rule("actor_rollout_ref.actor.clip_ratio", "algorithm.clip_ratio_low", "a bound that clip_ratio_low or "
         "clip_ratio_high leaves null; verl's own YAML sets both (0.2), so alone it changes nothing, as in verl"),
    Rule("actor_rollout_ref.actor.clip_ratio_low", "algorithm.clip_ratio_low", "same"),
    Rule("actor_rollout_ref.actor.clip_ratio_high", "algorithm.clip_ratio_high", "same (DAPO's clip-higher)"),
    Rule("actor_rollout_ref.actor.clip_ratio_c", "algorithm.clip_ratio_c", "same (dual clip)"),
    Rule("actor_rollout_ref.actor.loss_agg_mode", "algorithm.loss_agg_mode", "same",
         _one_of(("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
                 "loss_agg_mode")),
    Rule("actor_rollout_ref.actor.loss_scale_factor", "algorithm.loss_scale_factor", "same"),
    Rule("actor_rollout_ref.actor.policy_loss.loss_mode", "algorithm.policy_loss", "vanilla or gspo",
         _one_of(("vanilla", "gspo"), "policy_loss.loss_mode")),
    Rule("actor_rollout_ref.actor.entropy_coeff", "algorithm.entropy_coef", "same"),
    Rule("actor_rollout_ref.actor.use_kl_loss", "algorithm.kl_type", "false: none; true: kl_loss_type"),
    Rule("actor_rollout_ref.actor.kl_loss_type", "algorithm.kl_type", "kl/k1, mse/k2, low_var_kl/k3", _kl_type),
    Rule("actor_rollout_ref.actor.kl_loss_coef", "algorithm.kl_coef", "same (0 without use_kl_loss)"),
    Rule("actor_rollout_ref.actor.strategy", "resources.update.strategy", "fsdp, fsdp2 -> fsdp2 (ddp with LoRA)",
         _one_of(("fsdp", "fsdp2"), "actor strategy")),
    Rule("actor_rollout_ref.rollout.name", "rollout.engine", "vllm or hf", _engine),
    Rule("actor_rollout_ref.rollout.n", "algorithm.group_size", "same"),
    Rule("actor_rollout_ref.rollout.temperature", "rollout.temperature", "same (also the log-prob temperature)"),
    Rule("actor_rollout_ref.rollout.top_p", "rollout.top_p", "same"),
    Rule("actor_rollout_ref.rollout.tensor_model_parallel_size", "rollout.tensor_parallel_size", "same"),
    Rule("actor_rollout_ref.rollout.gpu_memory_utilization", "rollout.gpu_memory_utilization", "same"),
    Rule("actor_rollout_ref.rollout.enforce_eager", "rollout.enforce_eager", "same"),
    Rule("reward_model.overlong_buffer.enable", "rewards.overlong_buffer.enable", "DAPO's overlong penalty"),
    Rule("reward_model.overlong_buffer.len", "rewards.overlong_buffer.len", "same"),
    Rule("reward_model.overlong_buffer.penalty_factor", "rewards.overlong_buffer.penalty_factor", "same"),
    Rule("reward_model.enable", None, "refused when true: a reward model is not built (reward functions are)",
         _refuse("a reward model (reward_model.enable) is not built; score with a reward function")),
    Rule("custom_reward_function.path", None, "refused when set: rewards.function imports a module "
         "(package.module:function) installed where the workers run", _refuse(
             "a reward function file; put it in a package installed on the workers and set rewards.function: "
             "package.module:function")),
    Rule("reward.custom_reward_function.path", None, "as custom_reward_function.path", _refuse(
        "a reward function file; put it in a package installed on the workers and set rewards.function: "
        "package.module:function")),
    Rule("critic.optim.lr", "critic.lr", "same (a critic section is written with adv_estimator gae only)"),
    Rule("critic.optim.weight_decay", "critic.weight_decay", "same (verl's default 0.01)"),
    Rule("critic.optim.betas", "critic.betas", "same"),
    Rule("critic.optim.clip_grad", "critic.grad_clip", "same"),
    Rule("critic.grad_clip", "critic.grad_clip", "same"),
    Rule("critic.cliprange_value", "critic.cliprange_value", "same"),
    Rule("critic.loss_agg_mode", "critic.loss_agg_mode", "same (verl's default: the actor's)",
         _one_of(("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
                 "critic loss_agg_mode")),
    Rule("critic.model.path", "critic.name_or_path", "the actor's path: the value head sits on the policy's base "
         "(null); another: that HF model, which must share the actor's tokenizer"),
    Rule("critic.ppo_micro_batch_size_per_gpu", "resources.critic.micro_batch_size", "same"),
    Rule("critic.ppo_mini_batch_size", None, "refused when it differs from the actor's: the critic trains on "
         "the policy's minibatches", None),
    Rule("critic.ppo_epochs", None, "refused when it differs from the actor's: the critic takes the policy's PPO "
         "epochs", None),
    Rule("critic.optim.lr_warmup_steps_ratio", None, "refused when > 0: the critic's rate is constant",
         _refuse("a warm-up of the critic's learning rate is not built; its rate is constant (critic.lr)")),
    Rule("critic.optim.lr_warmup_steps", None, "refused when > 0: the critic's rate is constant",
         _refuse("a warm-up of the critic's learning rate is not built; its rate is constant (critic.lr)")),
    Rule("critic.model.lora_rank", None, "refused when > 0: LoRA is not built",
         _refuse("LoRA of the critic (lora_rank > 0) is not built in verl-tasks; train the full critic")),
    Rule("trainer.critic_warmup", None, "refused when > 0: the policy trains from the first epoch",
         _refuse("trainer.critic_warmup > 0 (training steps that update the critic only) is not built")),
    Rule("trainer.total_training_steps", "epochs", "one verl-tasks epoch per training step"),
    Rule("trainer.total_epochs", "epochs", "times the training file's steps (rows // train_batch_size), "
         "unless total_training_steps is set"),
    Rule("trainer.experiment_name", "experiment", "same, made a valid name"),
    Rule("trainer.test_freq", "evaluate.every", "same; -1: only the last epoch"),
)
# Keys that need no counterpart: what they set, verl-tasks does another way (said in the docs table too).
NOT_NEEDED: tuple[tuple[str, str], ...] = (
    ("actor_rollout_ref.actor.fsdp_config.*", "FSDP memory knobs: resources.update.strategy / cpu_offload"),
    ("actor_rollout_ref.ref.*", "the reference is the base snapshot; its micro-batch is the update's"),
    ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", "log-probs use the update's micro-batch"),
    ("actor_rollout_ref.model.use_remove_padding", "an implementation choice of verl's actor"),
    ("actor_rollout_ref.model.use_shm", "how verl loads a model; nothing is downloaded here"),
    ("actor_rollout_ref.rollout.load_format", "how verl's vLLM loads weights; a LoRA version reaches vLLM as an "
     "adapter or merged, rollout.vllm_lora"),
    ("actor_rollout_ref.rollout.layered_summon", "how verl gathers FSDP-sharded LoRA weights"),
    ("actor_rollout_ref.model.enable_gradient_checkpointing", "an implementation choice of verl's actor"),
    ("data.filter_overlong_prompts", "a prompt longer than data.max_prompt_tokens is a data error, named"),
    ("data.truncation", "a prompt longer than data.max_prompt_tokens is a data error, named"),
    ("trainer.logger", "tracking.mlflow / tracking.tensorboard, and the Airflow Training page"),
    ("trainer.project_name", "the experiment name is the project"),
    ("trainer.n_gpus_per_node", "resources.<phase>.num_gpus / workers per phase"),
    ("trainer.nnodes", "Ray places the phases' pools on the cluster's nodes"),
    ("trainer.save_freq", "every epoch commits a snapshot; storage.keep_snapshots prunes"),
    ("critic.model.fsdp_config.*", "FSDP memory knobs of verl's critic; the critic is replicated (ddp), never "
     "sharded"),
    ("critic.model.use_remove_padding", "an implementation choice of verl's critic"),
    ("critic.model.enable_gradient_checkpointing", "an implementation choice of verl's critic"),
    ("critic.model.tokenizer_path", "the critic reads the policy's token ids"),
    ("critic.strategy", "the critic trains in one process, or on resources.critic.workers replicated (ddp) "
     "workers"),
    ("critic.enable", "a critic is used exactly when adv_estimator is gae, as in verl"),
    ("trainer.use_legacy_worker_impl", "an implementation choice of verl's workers"),
    ("trainer.default_local_dir", "storage.uri"),
)


@dataclass
class Imported:
    """The experiment (nested, as its YAML) and every given key verl-tasks did not map, with why: ``refused``
    asks for what verl-tasks cannot run (the experiment would train something else), ``unmapped`` has no
    counterpart, ``not_needed`` is verl's own machinery."""

    experiment: dict[str, Any]
    refused: dict[str, str] = field(default_factory=dict)
    unmapped: dict[str, str] = field(default_factory=dict)
    not_needed: dict[str, str] = field(default_factory=dict)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if key in ("defaults", "hydra") and not prefix:
            continue  # Hydra's composition list: the keys it pulls in are verl's defaults
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def parse_overrides(overrides: Iterable[str]) -> dict[str, Any]:
    """``key=value`` as on verl's command line (Hydra: ``+key=value`` adds, ``++key=value`` forces)."""
    parsed: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.lstrip("+")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", key):
            raise ConfigError(f"override {item!r}: expected key=value, as on verl's command line")
        try:
            parsed[key] = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            parsed[key] = raw
    return parsed


_NUMBER = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)$")


def _numbers(flat: dict[str, Any]) -> dict[str, Any]:
    """``1e-6`` as a float: PyYAML reads exponents without a dot as strings, OmegaConf (verl) as floats."""
    return {k: float(v) if isinstance(v, str) and _NUMBER.match(v) else v for k, v in flat.items()}


_REFERENCE = re.compile(r"^\$\{(?:oc\.select:)?([A-Za-z0-9_.]+)(?:,([^}]*))?\}$")


def _resolve(flat: dict[str, Any]) -> dict[str, Any]:
    """Resolve ``${a.b}`` and ``${oc.select:a.b,default}`` (what verl's YAML uses between its own keys). A
    reference to a key nobody set, a relative one (``${.x}``), an interpolation function or a cycle stays as
    written; :func:`import_verl` refuses it where a mapped key uses it."""
    resolved = dict(flat)
    for _ in range(5):  # references to references
        changed = False
        for key, value in resolved.items():
            match = _REFERENCE.match(value) if isinstance(value, str) else None
            if match:
                target, default = match.groups()
                if target in resolved or target in VERL_DEFAULTS:
                    new = resolved.get(target, VERL_DEFAULTS.get(target))
                elif default is not None:
                    new = yaml.safe_load(default)
                else:
                    continue  # left as written: refused where it is used
                if new != value:
                    resolved[key], changed = new, True
        if not changed:
            break
    return resolved


def _experiment_name(value: Any) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", str(value)).strip("-._")[:128]
    return name or "imported"


def _rows(path: str) -> int | None:
    """Rows of a local .parquet / .jsonl file, None when it cannot be read here."""
    file = Path(path).expanduser()
    if not file.is_file():
        return None
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(file).metadata.num_rows
    with file.open("rb") as handle:
        return sum(1 for line in handle if line.strip())


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def _dynamic_sampling(values: dict[str, Any], out: dict[str, Any], result: Imported,
                      number: Callable[..., Any]) -> None:
    """``algorithm.filter_groups``: verl draws up to ``max_num_gen_batches`` rounds of ``gen_batch_size``
    prompts; the same budget here is counted in rollout batches of ``rollout.prompts_per_batch``."""
    key = "algorithm.filter_groups.max_num_gen_batches"
    rounds = number(key, minimum=0) if values.get(key) is not None else 0
    if rounds == 0:
        result.refused[key] = (f"{key}=0 (no limit): verl-tasks plans the batches an epoch may draw ahead; set "
                               f"a maximum (verl's DAPO recipe uses 10)")
        return
    per_round = number("data.gen_batch_size", minimum=1) if values.get("data.gen_batch_size") else \
        number("data.train_batch_size", minimum=1)
    per_batch = out["rollout"]["prompts_per_batch"]
    _set(out, "algorithm.filter_groups.enable", True)
    _set(out, "algorithm.filter_groups.max_batches", max(out["rollout"]["batches_per_epoch"] + 1,
                                                         -(-rounds * per_round // per_batch)))


def _critic(values: dict[str, Any], given: dict[str, Any], out: dict[str, Any], result: Imported,
            take: Callable[[str], Any], number: Callable[..., Any]) -> None:
    """The critic section of a gae experiment, from verl's ``critic.*`` keys (its defaults where unset)."""
    _set(out, "critic.lr", number("critic.optim.lr", float))
    _set(out, "critic.weight_decay", number("critic.optim.weight_decay", float, minimum=0))
    _set(out, "critic.betas", take("critic.optim.betas"))
    _set(out, "critic.cliprange_value", number("critic.cliprange_value", float))
    clip = "critic.optim.clip_grad" if values.get("critic.optim.clip_grad") is not None else "critic.grad_clip"
    _set(out, "critic.grad_clip", number(clip, float))
    mode = take("critic.loss_agg_mode") if "critic.loss_agg_mode" in values else out["algorithm"].get("loss_agg_mode")
    if mode is not None:
        _set(out, "critic.loss_agg_mode", mode)
    path = values.get("critic.model.path")
    if path is not None and path != values.get("actor_rollout_ref.model.path"):
        _set(out, "critic.name_or_path", str(path))
    if values.get("critic.ppo_micro_batch_size_per_gpu"):
        _set(out, "resources.critic.micro_batch_size", number("critic.ppo_micro_batch_size_per_gpu", minimum=1))
    actor = "actor_rollout_ref.actor."
    for key, what in (("ppo_mini_batch_size", "minibatches"), ("ppo_epochs", "PPO epochs")):
        if f"critic.{key}" in given and given[f"critic.{key}"] != values.get(actor + key):
            result.refused[f"critic.{key}"] = (f"critic.{key}={given[f'critic.{key}']} differs from the actor's "
                                               f"({values.get(actor + key)}); the critic trains on the policy's {what}")


def import_verl(config: dict[str, Any] | None, overrides: Iterable[str] = ()) -> Imported:
    """The experiment a verl run of ``config`` (a trainer YAML's contents) with ``overrides`` describes."""
    given = _numbers(_resolve({**flatten(config or {}), **parse_overrides(overrides)}))
    values = {**VERL_DEFAULTS, **{k: v for k, v in given.items() if v is not None}}
    out: dict[str, Any] = {}
    result = Imported(out)

    for key, value in sorted(given.items()):
        rule = next((r for r in RULES if r.matches(key)), None)
        reason = next((why for prefix, why in NOT_NEEDED if key == prefix or
                       (prefix.endswith(".*") and key.startswith(prefix[:-1]))), None)
        if rule is None and reason is not None:
            result.not_needed[key] = reason
        elif rule is None and value is not None:
            result.unmapped[key] = "no counterpart in verl-tasks"
        elif rule is not None and isinstance(value, str) and "${" in value:
            raise ConfigError(f"{key}={value}: a reference import-verl cannot resolve (a key that is not set, a "
                              f"relative reference, an interpolation function or a cycle); give the value itself")
        elif rule is not None and rule.target is None and rule.convert is not None:
            try:
                rule.convert(value)
            except Unmappable as err:
                result.refused[key] = str(err)

    def take(key: str) -> Any:
        rule = next(r for r in RULES if r.matches(key))
        value = values.get(key)
        if value is None or rule.convert is None:
            return value
        try:
            return rule.convert(value)
        except Unmappable as err:
            result.refused[key] = str(err)
            return None

    def number(key: str, kind: type = int, minimum: float | None = None) -> Any:
        """``values[key]`` as ``kind``, or a ConfigError that names the key."""
        value = values.get(key)
        try:
            if isinstance(value, bool) or isinstance(value, (list, dict)):
                raise TypeError
            converted = kind(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r}: expected {'an integer' if kind is int else 'a number'}") from None
        if minimum is not None and converted < minimum:
            raise ConfigError(f"{key}={value!r}: must be at least {minimum}")
        return converted

    def put(target: str, key: str, value: Any = ...) -> None:
        value = take(key) if value is ... else value
        if value is not None:
            _set(out, target, value)

    put("experiment", "trainer.experiment_name", _experiment_name(values["trainer.experiment_name"]))
    if "data.seed" in values:
        put("seed", "data.seed")
    path = values.get("actor_rollout_ref.model.path")
    if path is not None:
        _set(out, "model.source", "hf")
        put("model.name_or_path", "actor_rollout_ref.model.path")
    put("model.trust_remote_code", "actor_rollout_ref.model.trust_remote_code")
    for verl_key, target in (("data.train_files", "data.train"), ("data.val_files", "data.eval"),
                             ("data.max_prompt_length", "data.max_prompt_tokens")):
        put(target, verl_key)

    n = number("actor_rollout_ref.rollout.n", minimum=1)
    prompts = number("data.train_batch_size", minimum=1)
    batches = next(b for b in (8, 4, 2, 1) if prompts % b == 0)
    _set(out, "rollout.batches_per_epoch", batches)
    _set(out, "rollout.prompts_per_batch", prompts // batches)
    put("rollout.engine", "actor_rollout_ref.rollout.name")
    for verl_key, target in (("data.max_response_length", "rollout.max_new_tokens"),
                             ("actor_rollout_ref.rollout.temperature", "rollout.temperature"),
                             ("actor_rollout_ref.rollout.top_p", "rollout.top_p"),
                             ("actor_rollout_ref.rollout.tensor_model_parallel_size", "rollout.tensor_parallel_size"),
                             ("actor_rollout_ref.rollout.gpu_memory_utilization", "rollout.gpu_memory_utilization"),
                             ("actor_rollout_ref.rollout.enforce_eager", "rollout.enforce_eager")):
        if verl_key in values:
            put(target, verl_key)

    a = "actor_rollout_ref.actor."
    _set(out, "algorithm.group_size", n)
    _set(out, "algorithm.minibatch_size", number(a + "ppo_mini_batch_size", minimum=1) * n)
    for verl_key, target in (("algorithm.adv_estimator", "adv_estimator"), ("algorithm.gamma", "gamma"),
                             ("algorithm.lam", "lam"), ("algorithm.norm_adv_by_std_in_grpo", "norm_adv_by_std"),
                             (a + "optim.lr", "lr"), (a + "optim.weight_decay", "weight_decay"),
                             (a + "optim.betas", "betas"), (a + "optim.min_lr_ratio", "min_lr_ratio"),
                             (a + "ppo_epochs", "ppo_epochs"), (a + "clip_ratio_c", "clip_ratio_c"),
                             (a + "loss_agg_mode", "loss_agg_mode"), (a + "loss_scale_factor", "loss_scale_factor"),
                             (a + "policy_loss.loss_mode", "policy_loss"), (a + "entropy_coeff", "entropy_coef")):
        if verl_key in values:
            put(f"algorithm.{target}", verl_key)
    grad_clip = a + ("optim.clip_grad" if values.get(a + "optim.clip_grad") is not None else "grad_clip")
    _set(out, "algorithm.grad_clip", number(grad_clip, float))
    put("algorithm.lr_schedule", a + ("optim.warmup_style" if values.get(a + "optim.warmup_style")
                                      else "optim.lr_scheduler_type"))
    # As verl's policy losses read them: clip_ratio only where a bound is left null.
    for bound in ("low", "high"):
        key = a + f"clip_ratio_{bound}"
        left_null = key in given and given[key] is None
        _set(out, f"algorithm.clip_ratio_{bound}", number(a + "clip_ratio" if left_null else key, float, minimum=0))
    if values[a + "use_kl_loss"]:
        put("algorithm.kl_type", a + "kl_loss_type")
        _set(out, "algorithm.kl_coef", number(a + "kl_loss_coef", float, minimum=0))
    else:
        _set(out, "algorithm.kl_type", "none")
    if values.get(a + "ppo_micro_batch_size_per_gpu"):
        _set(out, "resources.update.micro_batch_size", number(a + "ppo_micro_batch_size_per_gpu", minimum=1))
    if values.get(a + "strategy") and take(a + "strategy"):
        if values.get("actor_rollout_ref.model.lora_rank"):
            result.not_needed[a + "strategy"] = ("with LoRA the adapter trains on replicated (ddp) workers, each "
                                                 "holding the frozen base")
        else:
            _set(out, "resources.update.strategy", "fsdp2")
    for part in ("enable", "len", "penalty_factor"):
        if f"reward_model.overlong_buffer.{part}" in values:
            put(f"rewards.overlong_buffer.{part}", f"reward_model.overlong_buffer.{part}")

    rank = values.get("actor_rollout_ref.model.lora_rank")
    if rank:
        _set(out, "model.lora.rank", number("actor_rollout_ref.model.lora_rank", minimum=1))
        if values.get("actor_rollout_ref.model.lora_alpha") is not None:
            _set(out, "model.lora.alpha", number("actor_rollout_ref.model.lora_alpha", float))
        modules = values.get("actor_rollout_ref.model.target_modules")
        if modules is not None:
            _set(out, "model.lora.target_modules", modules if modules == "all-linear" else list(modules))
    if values.get("algorithm.filter_groups.enable"):
        _dynamic_sampling(values, out, result, number)
    if values["algorithm.adv_estimator"] == "gae":
        _critic(values, given, out, result, take, number)
    else:  # verl builds no critic without gae either: its keys set nothing
        for key in [k for k in given if k.startswith("critic.")]:
            result.refused.pop(key, None)
            result.unmapped.pop(key, None)
            result.not_needed[key] = "no critic without adv_estimator gae (as in verl)"

    steps = values.get("trainer.total_training_steps")
    if steps is None:
        rows = _rows(str(values["data.train_files"])) if "data.train_files" in values else None
        if rows is None:
            result.unmapped["trainer.total_epochs"] = ("the training file cannot be read here to count its steps; "
                                                       "set trainer.total_training_steps (one epoch per step)")
        else:
            steps = number("trainer.total_epochs", minimum=1) * max(1, rows // prompts)
    else:
        steps = number("trainer.total_training_steps", minimum=1)
    if steps is not None:
        _set(out, "epochs", int(steps))
        # verl steps its scheduler once per training step (an epoch here); ours once per optimizer step.
        steps_per_epoch = -(-prompts * n // out["algorithm"]["minibatch_size"]) * number(a + "ppo_epochs", minimum=1)
        warmup = values.get(a + "optim.lr_warmup_steps")
        warmup = number(a + "optim.lr_warmup_steps") if warmup is not None else -1
        ratio = values.get(a + "optim.lr_warmup_steps_ratio")
        ratio = number(a + "optim.lr_warmup_steps_ratio", float, minimum=0) if ratio is not None else 0.0
        if warmup > 0:
            _set(out, "algorithm.warmup_steps", warmup * steps_per_epoch)
        elif ratio:
            _set(out, "algorithm.warmup_steps", int(ratio * steps) * steps_per_epoch)
    test_freq = values.get("trainer.test_freq")
    if test_freq is not None:
        _set(out, "evaluate.every", max(0, number("trainer.test_freq")))
    return result


def read_verl_yaml(path: Path) -> dict[str, Any]:
    """A verl trainer YAML's contents (bounded like every YAML this project reads)."""
    from verl_tasks.yaml_files import read_yaml_file

    loaded = read_yaml_file(path, "verl trainer config")
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: a verl trainer config is a mapping at the top level")
    return loaded


def mapping_table() -> str:
    """The mapping as a Markdown table (``docs/verl-import.md``)."""
    lines = ["| verl key | verl-tasks key | how |", "|---|---|---|"]
    for rule in RULES:
        lines.append(f"| `{rule.verl}` | {f'`{rule.target}`' if rule.target else '-'} | {rule.how} |")
    for key, why in NOT_NEEDED:
        lines.append(f"| `{key}` | - | not needed: {why} |")
    return "\n".join(lines) + "\n"
