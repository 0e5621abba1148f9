"""The shape of a worker pool: which actors a phase's units go to, and what each one holds.

Ray-free, so a process can size a head for an experiment's pools before it imports Ray
(``verl-tasks run --backend ray`` starts its head first and imports while it boots).
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import verl_tasks
from verl_tasks.config import ExperimentConfig, Resources
from verl_tasks.execution import store_identity

NAMESPACE = "verl-tasks"
PREFIX = "vt:"  # ":" never occurs in an experiment name, so prefixes never overlap
LIGHT = ("plan", "snapshot")
GATE_KIND = "gate"  # validate: Great Expectations, no policy
# Phases without GPUs whose resources are equal share one pool: one warm process holds the policy the
# update trained for the evaluation and the next rollout, instead of one process per phase kind each
# loading it (GPU phases keep a pool per kind: a rollout engine and a trainer do not share a device).
CPU_KIND = "cpu"
# Rollout, update and evaluate sharing GPUs (``placement.gpu_phases``): one pool whose actors run all three.
GPU_KIND = "gpu"
GPU_PHASES = ("rollout", "top_up", "critic", "update", "evaluate")


def pool_kind(phase: str) -> str:
    if phase == "validate":
        return GATE_KIND
    return "light" if phase in LIGHT else phase


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """A hash of the installed package's source: a new deploy gets new workers, never stale ones."""
    root = Path(verl_tasks.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


@dataclass(frozen=True)
class PoolShape:
    """The resources every actor of one pool holds, and how many actors the pool has."""

    experiment: str
    kind: str
    num_cpus: float
    num_gpus: float
    memory_mb: int | None
    custom: tuple[tuple[str, float], ...]
    workers: int
    idle_release_s: float
    gpu_bundles: int = 0  # > 1: each actor holds a placement group of this many 1-GPU bundles (a sharded engine)
    store: str = ""  # ``store_identity``: two deployments of one experiment name never share actors

    @classmethod
    def for_phase(cls, config: ExperimentConfig, phase: str, cluster_gpus: float | None = None) -> PoolShape:
        """The pool of ``phase``; a distributed update (or critic) is one driver actor that holds no GPUs, memory
        or custom resources: its resident workers reserve those, so the driver never holds what they wait for.
        A vLLM engine sharded over ``tensor_parallel_size`` GPUs (rollout's, evaluate's) gets them as a
        placement group. Phases that share GPUs (``gpu_sharing_phases``, given the cluster's GPU count)
        go to one ``gpu`` pool."""
        res: Resources = config.phase_resources(phase)
        sharing = gpu_sharing_phases(config, cluster_gpus)
        if phase in sharing:
            return cls.shared_gpu(config, sharing, cluster_gpus)
        if drives_a_group(config, phase):
            return cls(config.experiment, pool_kind(phase), res.num_cpus, 0, None, (), 1, res.idle_release_s,
                       store=store_identity(config))
        # A sharded vLLM engine (rollout's, and evaluate's and top_up's, which build the same engine) holds its
        # GPUs as one placement group, or vLLM would make its own beside the GPUs the actor reserved.
        bundles = config.rollout.tensor_parallel_size if phase in ("rollout", "top_up", "evaluate") else 1
        shared = res.num_gpus == 0 and bundles == 1 and pool_kind(phase) != GATE_KIND
        kind = CPU_KIND if shared else pool_kind(phase)
        return cls(config.experiment, kind, res.num_cpus, res.num_gpus, res.memory_mb,
                   tuple(sorted(res.custom.items())), res.workers, res.idle_release_s, bundles if bundles > 1 else 0,
                   store_identity(config))

    @classmethod
    def shared_gpu(cls, config: ExperimentConfig, phases: tuple[str, ...], cluster_gpus: float | None) -> PoolShape:
        """The ``gpu`` pool of the phases that share GPUs: each actor holds the largest of their GPU, CPU and
        memory settings and their custom resources; as many actors as the rollout asks for, at most one per
        GPU group the cluster has."""
        every = [config.phase_resources(phase) for phase in phases]
        gpus = max(r.num_gpus for r in every)
        memory = max((r.memory_mb for r in every if r.memory_mb), default=None)
        custom: dict[str, float] = {}
        for r in every:
            for name, amount in r.custom.items():
                custom[name] = max(custom.get(name, 0.0), amount)
        wanted = max(r.workers for r in every)
        fits = int(cluster_gpus // gpus) if cluster_gpus else 1
        tp = config.rollout.tensor_parallel_size
        return cls(config.experiment, GPU_KIND, max(r.num_cpus for r in every), gpus, memory,
                   tuple(sorted(custom.items())), max(1, min(wanted, fits)), max(r.idle_release_s for r in every),
                   tp if tp > 1 else 0, store_identity(config))

    @property
    def digest(self) -> str:
        body = json.dumps([self.num_cpus, self.num_gpus, self.memory_mb, self.custom, self.gpu_bundles, self.store],
                          sort_keys=True)
        return hashlib.sha256(body.encode()).hexdigest()[:8]

    @property
    def prefix(self) -> str:
        return f"{PREFIX}{self.experiment}:{self.kind}:"

    def actor_name(self, index: int) -> str:
        return f"{self.prefix}{code_fingerprint()}:{self.digest}:{index}"

    def actor_options(self, index: int) -> dict[str, Any]:
        options: dict[str, Any] = {
            "name": self.actor_name(index), "namespace": NAMESPACE, "lifetime": "detached",
            "get_if_exists": True, "num_cpus": self.num_cpus, "num_gpus": self.num_gpus,
        }
        if self.memory_mb:
            options["memory"] = int(self.memory_mb * 1024 * 1024)
        if self.custom:
            options["resources"] = dict(self.custom)
        if self.gpu_bundles:
            options.update(self._in_placement_group(index, options))
        return options

    def placement_bundles(self) -> list[dict[str, float]]:
        """One bundle per engine shard, on one node (STRICT_PACK): 1 GPU, its share of CPUs, memory, custom."""
        n = self.gpu_bundles
        bundle: dict[str, float] = {"GPU": 1.0, "CPU": self.num_cpus / n}
        if self.memory_mb:
            bundle["memory"] = float(int(self.memory_mb * 1024 * 1024 / n))
        bundle.update({name: amount / n for name, amount in self.custom})
        return [dict(bundle) for _ in range(n)]

    def _in_placement_group(self, index: int, options: dict[str, Any]) -> dict[str, Any]:
        """The actor holds nothing itself: it runs in bundle 0 of its own named, detached placement group,
        and what it starts (vLLM's shard workers) is placed in the group too (captured child tasks)."""
        from ray.util.placement_group import get_placement_group, placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        name = f"{self.actor_name(index)}:pg"
        try:
            group = get_placement_group(name)
        except ValueError:
            group = placement_group(self.placement_bundles(), strategy="STRICT_PACK", name=name, lifetime="detached")
        options.pop("memory", None)
        options.pop("resources", None)
        return {"num_cpus": 0, "num_gpus": 0, "scheduling_strategy": PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)}


def gpu_sharing_phases(config: ExperimentConfig, cluster_gpus: float | None) -> tuple[str, ...]:
    """The phases that go to one shared ``gpu`` pool (``placement.gpu_phases``); empty when none do.

    Candidates: rollout, top_up (it rolls out too), and a one-process critic, evaluate and update that ask for
    GPUs; a trainer puts a vLLM engine of its actor to sleep while it trains (a distributed update or critic
    keeps its own workers, and so does a sharded engine, ``tensor_parallel_size`` > 1). ``auto`` shares them
    when ``cluster_gpus`` (None: unknown, no sharing) is less than what their separate pools hold together.
    """
    from verl_tasks.phase_registry import phases_for

    runs = phases_for(config)  # top_up and the critic only where the experiment has them
    asking = tuple(phase for phase in GPU_PHASES if phase in runs and config.phase_resources(phase).num_gpus > 0
                   and not drives_a_group(config, phase))
    mode = config.placement.gpu_phases
    if len(asking) < 2 or mode == "separate" or config.rollout.tensor_parallel_size > 1:
        return ()  # a sharded engine's actor holds its GPUs as a placement group, none for a trainer
    if mode == "shared":
        return asking
    separate = sum(config.phase_resources(p).num_gpus * config.phase_resources(p).workers for p in asking)
    return asking if cluster_gpus is not None and cluster_gpus < separate else ()


def experiment_shapes(config: ExperimentConfig) -> set[PoolShape]:
    """Every pool the experiment's phases use (phases sharing a pool give one shape)."""
    from verl_tasks.phase_registry import phases_for

    return {PoolShape.for_phase(config, phase) for phase in phases_for(config)}


def drives_a_group(config: ExperimentConfig, phase: str) -> bool:
    """The phase's unit drives a resident worker group (``verl_tasks.train``): a distributed update, or a critic
    on more than one worker."""
    from verl_tasks.phase_registry import phases_for

    return phase in ("update", "critic") and phase in phases_for(config) and config.phase_resources(phase).distributed


def cpus_for(config: ExperimentConfig) -> float:
    """Logical CPUs every pool of the experiment holds when all are resident at once
    (a distributed update or critic: its driver actor plus its resident workers, each with the phase's CPUs)."""
    total = sum(shape.num_cpus * shape.workers for shape in experiment_shapes(config))
    return total + sum(config.phase_resources(phase).num_cpus * config.phase_resources(phase).workers
                       for phase in ("update", "critic") if drives_a_group(config, phase))


__all__ = ["CPU_KIND", "GATE_KIND", "GPU_KIND", "LIGHT", "NAMESPACE", "PREFIX", "PoolShape", "code_fingerprint",
           "cpus_for", "drives_a_group", "experiment_shapes", "gpu_sharing_phases", "pool_kind"]
